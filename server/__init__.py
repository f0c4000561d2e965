"""encoderd frontend: gRPC service, tokenization, scheduling, worker supervision.

Models run in worker processes: for text models the frontend never imports torch
(media models import their image / audio processors from transformers).
"""
