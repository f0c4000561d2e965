"""What the frontend hands a worker to start it: the model, the engine and its options.

Built by the frontend (server/models/registry.py), pickled into the spawned or forked worker
(workers/process.py), so both sides import it from here.
"""

from __future__ import annotations

import os

import msgspec

from .model_spec import ModelSpec
from .protocol import HEARTBEAT_INTERVAL

# The engines (workers/backends/: one module each) and every dtype one of them computes; each
# engine serves a subset, named in its own table. `auto` (the frontend's default) is resolved in
# the worker (workers/backends: resolve_engine, resolve_options).
ENGINES = ("torch", "onnx", "ctranslate2", "tensorrt")
DTYPES = ("float32", "float16", "bfloat16", "float8", "int8", "int8_float32", "int8_float16")


def default_cache_dir() -> str:
    """$XDG_CACHE_HOME/encoderd, else ~/.cache/encoderd: converted models (workers/model_cache.py)
    and the bundled model's files when fetched (workers/contract/bundled_model.py)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "encoderd")


class BackendOptions(msgspec.Struct, frozen=True):
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 0  # intra-op threads; 0 = the cores this process may use
    cache_dir: str = ""  # converted models (ONNX, CTranslate2, TensorRT); "" = default_cache_dir()
    max_batch_size: int = 64  # largest batch the scheduler sends; sizes TensorRT optimization profiles
    compile: bool = False  # torch engine: torch.compile the model (dynamic shapes)
    trust_remote_code: bool = False  # run model code from the model repository (config.json auto_map)


class WorkerConfig(msgspec.Struct, frozen=True):
    spec: ModelSpec
    engine: str
    options: BackendOptions
    batch_address: str  # frontend PUSH -> worker PULL
    result_address: str  # worker PUSH -> frontend PULL
    log_level: str = "INFO"
    label: str = ""
    cpu_affinity: tuple[int, ...] = ()  # pin this worker to these cores
    log_format: str = "text"  # "json": JSON lines, as the frontend's --log-format
    allow_low_fidelity: bool = False  # serve below the fidelity floors (with a warning)
    heartbeat_interval: float = HEARTBEAT_INTERVAL  # 0 = no heartbeats (stall check off)
    urgent_lane: bool = True  # urgent batches on a thread of their own where the backend allows it
    nice: int = 0  # added to the worker's nice value: the frontend keeps the CPU it needs to refuse at once
