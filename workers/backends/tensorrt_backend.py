"""TensorRT engine, through ONNX Runtime's TensorRT execution provider.

Why the execution provider and not TensorRT's own Python API:
  * it consumes the same cached ONNX export as the onnx engine, so there is one
    export path to keep correct, not two;
  * nodes TensorRT cannot compile fall back to the CUDA provider instead of
    failing the build;
  * the Python `tensorrt` package is not installable from PyPI alone (its
    wheels are stubs that download from pypi.nvidia.com), while the provider
    only needs the TensorRT shared libraries (libnvinfer) at run time, which
    GPU images ship anyway.

The engine is built for one optimization profile covering batch
1..max_batch_size and length 1..max_length, so no request shape triggers a
rebuild. Engines are cached (model_cache) per ONNX export, dtype, profile, GPU
model and TensorRT version: an engine built for one GPU or TensorRT release
does not load on another.

GPU only. Without a CUDA device, onnxruntime-gpu's TensorRT provider or the
TensorRT libraries, load() (worker start-up) fails with a message that says
which one is missing. int8 is not offered: TensorRT int8 needs calibration data.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
from pathlib import Path
from typing import ClassVar

from ..contract.config import default_cache_dir
from ..model_cache import cached_build
from .base import require_family, require_text_kind
from .onnx_backend import OnnxBackend
from .onnx_export import ensure_onnx_model
from .onnx_session import check_onnxruntime_install, create_session, device_index, require_provider

log = logging.getLogger(__name__)

PROVIDER = "TensorrtExecutionProvider"
_LIBNVINFER = ("libnvinfer.so.10", "libnvinfer.so.11", "libnvinfer.so")


def tensorrt_version() -> str:
    """Load libnvinfer (RTLD_GLOBAL, so onnxruntime's later dlopen finds it) and return its version."""
    candidates = list(_LIBNVINFER)
    try:  # the tensorrt-cu1x-libs wheels put the libraries in site-packages/tensorrt_libs
        import tensorrt_libs

        candidates = [p for name in _LIBNVINFER for p in glob.glob(os.path.join(tensorrt_libs.__path__[0], name))]
        candidates += list(_LIBNVINFER)
    except ImportError:
        pass
    errors = []
    for name in candidates:
        try:
            lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            errors.append(str(exc))
            continue
        version = int(lib.getInferLibVersion())
        # TensorRT >= 10 encodes major*10000 + minor*100 + patch; older releases major*1000 + ...
        major, rest = divmod(version, 10000 if version >= 100000 else 1000)
        return f"{major}.{rest // 100}.{rest % 100}"
    raise RuntimeError(
        "the tensorrt engine needs the TensorRT libraries (libnvinfer), which were not found: "
        "install TensorRT 10 and add its lib directory to LD_LIBRARY_PATH "
        f"(tried {', '.join(candidates)}: {errors[-1] if errors else ''})"
    )


def gpu_name(index: int) -> str:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            "the tensorrt engine needs a CUDA device and torch sees none "
            "(CUDA_VISIBLE_DEVICES, driver, or a CPU-only torch build?)"
        )
    major, minor = torch.cuda.get_device_capability(index)
    return f"{torch.cuda.get_device_name(index)} sm{major}{minor}"


def profile_shapes(names: list[str], max_batch: int, max_length: int) -> dict[str, str]:
    """TensorRT EP profile options: every input is (batch, sequence)."""

    def shapes(batch: int, length: int) -> str:
        return ",".join(f"{name}:{batch}x{length}" for name in names)

    return {
        "trt_profile_min_shapes": shapes(1, 1),
        "trt_profile_opt_shapes": shapes(max_batch, min(max_length, 128)),
        "trt_profile_max_shapes": shapes(max_batch, max_length),
    }


class TensorRTBackend(OnnxBackend):
    engine = "tensorrt"
    dtypes: ClassVar[dict[str, tuple[str, ...]]] = {"cuda": ("float32", "float16")}

    def load(self) -> None:
        require_text_kind(self.spec, self.engine)
        require_family(self.spec, self.engine)
        if not self.options.device.startswith("cuda"):
            raise ValueError(
                f"the tensorrt engine runs on NVIDIA GPUs only, not {self.options.device!r}: "
                "use --device cuda, or --engine onnx on CPU"
            )
        self._check_dtype()
        check_onnxruntime_install()
        require_provider(PROVIDER, "Install onnxruntime-gpu (`pip install '<encoderd checkout>[onnx-gpu]'`).")
        index = device_index(self.options.device)
        key = {"gpu": gpu_name(index), "tensorrt": tensorrt_version()}
        # TensorRT compiles float16 itself from the float32 graph (trt_fp16_enable).
        model_file, _ = ensure_onnx_model(self.spec, "float32", self.options.cache_dir, self.options.trust_remote_code)
        names = self._input_names(model_file)
        # Provider option values as strings: that is what the provider parses ("1"/"0" for flags).
        trt_options = {
            "device_id": str(index),
            "trt_fp16_enable": "1" if self.options.dtype == "float16" else "0",
            **profile_shapes(names, self.options.max_batch_size, self.spec.max_length),
        }
        engine_dir, self.cache_hit = self._engine_dir(model_file, trt_options, key)
        providers = self._providers_with_cache(trt_options, engine_dir)
        self.session = create_session(model_file, providers, self.options.threads)
        self._check_session(providers)
        self._inputs = set(names)
        self._dim = int(self.session.get_outputs()[0].shape[-1])
        log.info("tensorrt engine on %s (TensorRT %s, %s)", key["gpu"], key["tensorrt"], engine_dir)

    @staticmethod
    def _providers_with_cache(trt_options: dict, engine_dir: Path) -> list:
        """TensorRT first; nodes it cannot compile run on the CUDA provider."""
        return [
            (
                PROVIDER,
                {
                    **trt_options,
                    "trt_engine_cache_enable": "1",
                    "trt_engine_cache_path": str(engine_dir),
                    "trt_timing_cache_enable": "1",
                    "trt_timing_cache_path": str(engine_dir),
                },
            ),
            ("CUDAExecutionProvider", {"device_id": trt_options["device_id"]}),
        ]

    @staticmethod
    def _input_names(model_file: Path) -> list[str]:
        import onnx

        graph = onnx.load(str(model_file), load_external_data=False).graph
        initializers = {i.name for i in graph.initializer}  # older opsets list weights as inputs too
        return [i.name for i in graph.input if i.name not in initializers]

    def _engine_dir(self, model_file: Path, trt_options: dict, key: dict) -> tuple[Path, bool]:
        """Build the engine into a cache entry by running one batch in a throwaway session."""

        def build(out: Path) -> None:
            providers = self._providers_with_cache(trt_options, out)
            log.info(
                "building TensorRT engine for %s (%s, batch<=%d, length<=%d); this takes minutes",
                self.spec.name,
                self.options.dtype,
                self.options.max_batch_size,
                self.spec.max_length,
            )
            self.session = create_session(model_file, providers, self.options.threads)
            self._check_session(providers)
            self._inputs = {i.name for i in self.session.get_inputs()}
            self.warmup(1)  # the provider builds (and writes) the engine on the first run
            del self.session

        full_key = {
            "onnx": str(model_file.parent.name),
            "dtype": self.options.dtype,
            "profile": {k: v for k, v in trt_options.items() if k.startswith("trt_profile")},
            **key,
        }
        entry = cached_build(
            self.options.cache_dir or default_cache_dir(),
            "tensorrt",
            f"{self.spec.name}-{self.options.dtype}",
            full_key,
            build,
        )
        return entry.path, entry.hit
