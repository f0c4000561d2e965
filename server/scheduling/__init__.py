"""Scheduling and workers: per-model queues and batching, the worker and zygote clients, the child-process
supervisor, placement of replicas on devices and CPU cores."""
