"""onnxruntime itself: the one distribution installed, its execution providers, and a session on a
graph (the onnx and tensorrt engines, and onnx_export.py's calibration run).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..model_cache import library_versions

log = logging.getLogger(__name__)

ORT_DISTRIBUTIONS = ("onnxruntime", "onnxruntime-gpu")


def check_onnxruntime_install(installed: set[str] | None = None) -> None:
    """Fail with an explanation unless exactly one onnxruntime distribution is installed.

    onnxruntime and onnxruntime-gpu both install the `onnxruntime` package;
    the last one installed wins and uninstalling either breaks the other.
    """
    if installed is None:
        installed = {name for name, version in library_versions(*ORT_DISTRIBUTIONS).items() if version != "-"}
    if set(ORT_DISTRIBUTIONS) <= installed:
        raise RuntimeError(
            "both onnxruntime and onnxruntime-gpu are installed; they overwrite each other's `onnxruntime` "
            "package, so which one runs is an accident of install order. Keep exactly one: "
            "`pip uninstall -y onnxruntime onnxruntime-gpu` then `pip install '<encoderd checkout>[onnx]'` (CPU) "
            "or `pip install '<encoderd checkout>[onnx-gpu]'` (CUDA)"
        )
    if not installed:
        raise RuntimeError(
            "the onnx engine needs onnxruntime: `pip install '<encoderd checkout>[onnx]'` (CPU) "
            "or `pip install '<encoderd checkout>[onnx-gpu]'` (CUDA)"
        )


def device_index(device: str) -> int:
    return int(device.partition(":")[2] or 0)


def cpu_threads(threads: int) -> int:
    return threads or len(os.sched_getaffinity(0))


def create_session(model_file: Path, providers: list, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = cpu_threads(threads)
    # One batch at a time per worker: parallelism inside ops, none between them.
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3  # errors only; provider load failures are checked below
    return ort.InferenceSession(str(model_file), options, providers=providers)


def require_provider(name: str, hint: str) -> None:
    import onnxruntime as ort

    available = ort.get_available_providers()
    if name not in available:
        raise RuntimeError(f"onnxruntime {ort.__version__} has no {name} (it has {', '.join(available)}). {hint}")
    if name != "CPUExecutionProvider" and hasattr(ort, "preload_dlls"):
        # CUDA and cuDNN often come from pip wheels (nvidia-*-cu12, torch's dependencies) rather than
        # the system library path; onnxruntime-gpu >= 1.21 can load them from there before a session needs them.
        try:
            ort.preload_dlls()
        except Exception as exc:  # noqa: BLE001 - the session check that follows says what is really missing
            log.warning("onnxruntime.preload_dlls() failed: %s", exc)
