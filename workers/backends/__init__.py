"""Inference engines behind one small interface (see base.Backend)."""

from __future__ import annotations

import importlib
import importlib.util
import logging

import msgspec

from ..contract import hardware
from .base import ENGINE_FAMILIES, TEXT_KINDS, Backend, BackendOptions

log = logging.getLogger(__name__)

# engine -> (module, class); modules are imported only when asked for: each pulls in a heavy library.
ENGINES = {
    "torch": ("torch_backend", "TorchBackend"),
    "onnx": ("onnx_backend", "OnnxBackend"),
    "ctranslate2": ("ct2_backend", "CT2Backend"),
    "tensorrt": ("tensorrt_backend", "TensorRTBackend"),
}
# What `auto` may hand to onnxruntime on CPU: not int8, which torch computes 1.65x float32 and onnx
# ~1.1x (hardware.py, the table above INT8_NOT_AUTO); `--engine onnx --dtype int8` still runs.
ONNX_CPU_DTYPES = ("float32",)
# The kinds every engine serves; the others are torch-only.
TEXT_ENGINE_KINDS = TEXT_KINDS


def _on_gpu(device: str) -> bool:
    return device.startswith("cuda")


def resolve_engine(engine: str, options: BackendOptions, kind: str = "embedding", model_type: str | None = None) -> str:
    """`auto`: torch on CUDA (ctranslate2 for int8 there), onnx on CPU for float32 when onnxruntime
    is installed; torch for int8 on CPU (per-token int8 linears), for the kinds only it computes
    (multi-modal, multi-vector, sparse), other CPU dtypes, and model
    families the other engine does not serve (base.ENGINE_FAMILIES)."""
    if engine != "auto":
        return engine
    chosen, why = _auto_engine(options, kind)
    if chosen != "torch" and model_type is not None and kind not in ENGINE_FAMILIES[chosen].get(model_type, ()):
        chosen, why = "torch", f"{chosen} does not serve {model_type or 'unknown-family'} {kind} models"
    log.info("--engine auto: using %s (%s)", chosen, why)
    return chosen


def _auto_engine(options: BackendOptions, kind: str) -> tuple[str, str]:
    if kind not in TEXT_KINDS:
        chosen, why = "torch", f"only torch computes {kind} models"
    elif _on_gpu(options.device):
        int8 = options.dtype.startswith("int8") and importlib.util.find_spec("ctranslate2") is not None
        chosen, why = ("ctranslate2", "int8 on CUDA") if int8 else ("torch", "CUDA device")
    elif options.dtype not in ONNX_CPU_DTYPES:
        chosen, why = "torch", f"onnxruntime computes no {options.dtype} on CPU"
    elif importlib.util.find_spec("onnxruntime") is not None:
        chosen, why = "onnx", "CPU device and onnxruntime is installed"
    else:
        chosen, why = "torch", "CPU device and onnxruntime is not installed"
    return chosen, why


def resolve_options(options: BackendOptions, engine: str = "auto") -> BackendOptions:
    """`--dtype auto`: float16 on CUDA; on CPU bfloat16 where the CPU runs it natively and `engine`
    computes it, int8 where int8 dot products are, else float32 (hardware.choose_cpu_dtype)."""
    if options.dtype != "auto":
        return options
    if _on_gpu(options.device):
        dtype, why = "float16", "CUDA device"
    else:
        dtype, why = hardware.choose_cpu_dtype(engine)
    log.info("--dtype auto: using %s on %s (%s)", dtype, options.device, why)
    return msgspec.structs.replace(options, dtype=dtype)


def create_backend(engine: str, spec, options: BackendOptions) -> Backend:
    """The backend for `engine` with `auto` engine and dtype resolved; its
    `engine` and `options` say what actually runs."""
    resolved = resolve_options(options, engine)
    if options.dtype == "auto" and resolved.dtype != "float32" and spec.kind.value not in TEXT_KINDS:
        # The fidelity self-check measures embedding, reranker and classifier models only: an
        # automatic lossy dtype elsewhere would be served unchecked (bfloat16 moved a SPLADE model's
        # top-20 terms by 15%). An explicit --dtype is the operator's choice.
        log.info(
            "--dtype auto: float32 for %s, not %s: an automatic lower precision only where the fidelity "
            "self-check measures it (embedding, reranker, classifier); --dtype %s serves it as asked",
            spec.kind.value,
            resolved.dtype,
            resolved.dtype,
        )
        resolved = msgspec.structs.replace(resolved, dtype="float32")
    options = resolved
    engine = resolve_engine(engine, options, spec.kind.value, spec.model_type)
    if spec.kind.value not in TEXT_ENGINE_KINDS and engine != "torch":
        # Multi-modal, multi-vector and sparse heads exist for torch only (workers/backends/torch_heads.py).
        log.warning("%s: %s models run on the torch engine, not %s", spec.name, spec.kind.value, engine)
        engine = "torch"
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of auto, {', '.join(ENGINES)}")
    module_name, class_name = ENGINES[engine]
    module = importlib.import_module(f"{__name__}.{module_name}")
    # After the import: the torch engine's module brings torch, which reads a GPU's compute capability.
    if options.device == "cpu":
        log.info("CPU %s", hardware.cpu().describe())
    hardware.check_dtype(engine, options.dtype, options.device)
    return getattr(module, class_name)(spec, options)


__all__ = ["ENGINES", "Backend", "BackendOptions", "create_backend", "resolve_engine", "resolve_options"]
