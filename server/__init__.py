"""encoderd frontend: gRPC service, tokenization, scheduling, worker supervision.

The frontend never imports torch; models run in worker processes.
"""
