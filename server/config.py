"""Frozen server settings, built by the CLI."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    name: str
    source: str                 # local directory or Hugging Face hub id
    kind: str | None = None     # force "embedding" | "reranker" | "classifier"


@dataclass(frozen=True)
class ServerConfig:
    models: tuple[ModelConfig, ...]
    engine: str = "torch"
    device: str = "cpu"
    dtype: str = "float32"
    cpu_threads: int = 0
    max_batch_size: int = 64
    max_batch_tokens: int = 8192
    batch_delay_ms: float = 5.0
    max_queued_inputs: int = 16384
    max_inputs_per_request: int = 2048
    max_input_chars: int = 1_000_000
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    metrics_port: int = 0                # 0 = off
    log_level: str = "INFO"
    tokenizer_threads: int = 2
    worker_start_timeout: float = 900.0
    drain_timeout: float = 30.0
    extra: dict = field(default_factory=dict)
