"""What this machine computes fast and exactly, and the numeric policy that follows from it.

One home for every hardware-dependent numeric decision (the backends only ask):

* int8 on x86 CPUs without VNNI (AVX2-only hosts such as AMD Zen 2/3, AVX-512 Skylake) multiplies
  u8 activations by s8 weights with `vpmaddubsw`, which sums each adjacent pair of products into a
  *saturating* int16: 2 x 255 x 127 = 64,770 > 32,767. On a Zen 3 the signed-weight onnx int8
  graph served embeddings at cosine 0.19-0.79 to float32 (an emulation of that kernel reproduces it
  on any CPU: tests/integration/test_hardware_recipes.py). VNNI (`vpdpbusd`) and AMX
  accumulate in int32 and never saturate. So: ONNX Runtime int8 without VNNI uses unsigned weights
  (U8U8), for which MLAS has no vpmaddubsw kernel: it widens both operands to int16 and sums pairs
  of products in int32 (2 x 255 x 255 fits). Measured on all-MiniLM-L6-v2, broad corpus, batches
  length-sorted: min cosine U8U8 0.9951, 7-bit signed weights (reduce_range, the other
  saturation-free option) 0.9891, 8-bit signed 0.9954. CTranslate2 has neither option, and even
  with VNNI its int8 falls under the 0.99 floor on short and non-English input (0.987): it refuses
  int8 on every CPU.
* bfloat16 / float16 on CPU run at useful speed only with native instructions (avx512_bf16 /
  amx_bf16, avx512_fp16 / amx_fp16); elsewhere torch emulates them at ~1 GFLOP/s (bfloat16 on a
  Zen 3: ~80 for float32; a 512x512 float16 matmul on a Zen 5, which has avx512_bf16 but no
  avx512_fp16: 0.7 GFLOP/s against 157 for bfloat16). On CUDA bfloat16 needs compute capability 8.0.

Policy: a dtype the hardware cannot run well or accurately is a start-up error (UnsupportedOnHardware)
naming the missing feature and the alternative; nothing falls back silently. `auto` engine/dtype
resolution only picks what passes these checks.

ENCODERD_CPU_FLAGS_MASK (comma-separated flag names or fnmatch patterns, e.g. "avx512*,avx_vnni,amx*")
removes features from what is detected: a testing and diagnosis knob that makes this host choose
recipes as an AVX2-only host would. It cannot add features.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import platform
import sys
from dataclasses import dataclass

MASK_ENV = "ENCODERD_CPU_FLAGS_MASK"
CPUINFO = "/proc/cpuinfo"
# The flags (as Linux names them in /proc/cpuinfo) the policy below reads; others are kept too.
VNNI_INT8 = ("avx512_vnni", "avx_vnni", "amx_int8")
NATIVE_BF16 = ("avx512_bf16", "amx_bf16")
NATIVE_FP16 = ("avx512_fp16", "amx_fp16")
# ONNX Runtime int8 recipes (onnx_export.quantize_int8 reads the name; it is part of the cache key).
ONNX_INT8_SIGNED = "s8-smooth"  # u8 x s8: exact only where the products accumulate in int32 (VNNI, AMX)
ONNX_INT8_UNSIGNED = "u8u8-smooth"  # u8 x u8: MLAS widens both to int16 and sums pairs in int32 (vpmaddwd)
CUDA_BF16_CAPABILITY = (8, 0)
# fp8 tensor cores (e4m3 GEMMs, torch._scaled_mm): Ada (8.9) and Hopper (9.0) onwards.
CUDA_FP8_CAPABILITY = (8, 9)
FLOAT8 = "float8"
FLOAT8_ENGINES = ("torch",)  # workers/backends/float8_linear.py


class UnsupportedOnHardware(ValueError):
    """A dtype/engine this hardware cannot run fast or accurately; the message names the missing
    feature and what to use instead."""


@dataclass(frozen=True)
class CpuInfo:
    arch: str  # platform.machine(): x86_64, aarch64, ...
    model: str  # "AMD EPYC 7763 64-Core Processor", or "" if unknown
    flags: frozenset[str]  # after ENCODERD_CPU_FLAGS_MASK
    masked: frozenset[str] = frozenset()  # what the mask removed
    known: bool = True  # False where the instruction sets could not be read (not Linux)

    @property
    def is_x86(self) -> bool:
        return self.arch.lower() in ("x86_64", "amd64", "i386", "i686")

    def has_any(self, flags: tuple[str, ...]) -> bool:
        return any(flag in self.flags for flag in flags)

    def present(self, flags: tuple[str, ...]) -> str:
        """Those of `flags` this CPU has, space-separated (for the reasons the policy logs)."""
        return " ".join(flag for flag in flags if flag in self.flags)

    @property
    def int8_exact(self) -> bool:
        """Whether u8 x s8 int8 GEMMs accumulate in int32 (VNNI / AMX) rather than saturating
        int16 pairs. Only x86 has the saturating instruction; ARM's dot products widen."""
        return not self.is_x86 or self.has_any(VNNI_INT8)

    def describe(self) -> str:
        if not self.known:
            return f"{self.arch}: instruction sets unknown (no {CPUINFO})"
        shown = [f for f in ("avx2", "avx512f", *VNNI_INT8, *NATIVE_BF16, *NATIVE_FP16) if f in self.flags]
        text = f"{self.model or self.arch}: {' '.join(shown) or 'none of ' + 'avx2 avx512 vnni bf16 fp16'}"
        return text + (f"; {len(self.masked)} flags masked by {MASK_ENV}" if self.masked else "")


# ------------------------------------------------------------------ detection
def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """(model name, flags) from /proc/cpuinfo text: x86 `flags`, ARM `Features`; the first CPU's."""
    model, flags = "", None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "features") and flags is None:
            flags = frozenset(value.split())
    return model, flags or frozenset()


def apply_mask(flags: frozenset[str], mask: str) -> tuple[frozenset[str], frozenset[str]]:
    patterns = [p.strip().lower() for p in mask.split(",") if p.strip()]
    removed = frozenset(f for f in flags if any(fnmatch.fnmatchcase(f, p) for p in patterns))
    return flags - removed, removed


def read_cpu(cpuinfo_text: str | None = None, mask: str | None = None, arch: str | None = None) -> CpuInfo:
    """The CPU description; the arguments default to this machine (for tests: any text and mask)."""
    known = True
    if cpuinfo_text is None:
        try:
            with open(CPUINFO, encoding="utf-8", errors="replace") as f:
                cpuinfo_text = f.read()
        except OSError:  # not Linux, or hidden (systemd's ProcSubset=pid): the policy assumes the least
            cpuinfo_text, known = "", False
    model, flags = parse_cpuinfo(cpuinfo_text)
    flags, masked = apply_mask(flags, os.environ.get(MASK_ENV, "") if mask is None else mask)
    return CpuInfo(arch or platform.machine(), model, flags, masked, known and bool(flags | masked))


@functools.cache
def cpu() -> CpuInfo:
    """This machine's CPU, read once per process."""
    return read_cpu()


def cuda_capability(device: str) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, or None where torch or CUDA is unavailable.
    Asks torch only if something has imported it already: probing must not pull torch into an
    onnx or ctranslate2 worker."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    index = int(device.partition(":")[2] or 0)
    return tuple(torch.cuda.get_device_capability(index))


# ------------------------------------------------------------------ policy
# The engines that compute on a CPU; tensorrt runs on NVIDIA GPUs only.
CPU_ENGINES = ("torch", "onnx", "ctranslate2")

_INT8_ALTERNATIVES = {
    "ctranslate2": "use --engine onnx --dtype int8 (its weights are signed only where VNNI keeps them from "
    "saturating) or --dtype float32",
}


def _missing(features: tuple[str, ...]) -> str:
    return " / ".join(features)


def onnx_int8_recipe(info: CpuInfo | None = None) -> str:
    """Signed weights (the fast u8 x s8 kernels) where their products accumulate in int32, else unsigned."""
    info = info or cpu()
    return ONNX_INT8_SIGNED if info.int8_exact else ONNX_INT8_UNSIGNED


@dataclass(frozen=True)
class TorchInt8Recipe:
    """How the torch engine quantizes a model's linears (workers/backends/int8_linear.py): int8
    activations with one dynamic scale per token, weights with one per output channel.

    SmoothQuant: an input channel whose calibrated range is large is divided by
    s = range**alpha / max|w column|**(1 - alpha) at run time and its weight column multiplied by
    it, moving outliers from activations into weights. `smooth_contracting`: also the layers that
    shrink their input (the FFN down-projections, which read the activation's output)."""

    name: str
    weight_bits: int
    alpha: float
    smooth_contracting: bool


# With VNNI, 8-bit weights; without it, 7-bit weights (the only saturation-free choice of oneDNN's
# u8 x s8 kernel). Both smooth every layer at alpha 0.5: leaving the FFN down-projections unsmoothed
# (alpha 0.7, the former VNNI recipe: 2.06x float32 against 1.98x now, one thread, Zen 4) served
# repetitive text ("}} " * 60, "." * 240) at cosine 0.985-0.989 to sentence-transformers, under the
# int8 floor; now 0.993 at worst over 140 such texts, 0.9962 on the broad corpus (session 20,
# tests/support/int8_recipes.py 1 float32,encoderd, with calibration VERSION 3).
TORCH_INT8_EXACT = TorchInt8Recipe("s8-token-smooth0.5", 8, 0.5, smooth_contracting=True)
TORCH_INT8_7BIT = TorchInt8Recipe("s7-token-smooth0.5", 7, 0.5, smooth_contracting=True)


def torch_int8_recipe(info: CpuInfo | None = None) -> TorchInt8Recipe:
    info = info or cpu()
    return TORCH_INT8_EXACT if info.int8_exact else TORCH_INT8_7BIT


def torch_int8_rest_dtype(info: CpuInfo | None = None) -> str:
    """What a torch int8 model computes outside its int8 linears (embeddings, attention, LayerNorm, the
    residual stream; the linears take and give it): bfloat16 where the CPU computes it natively, else
    float32. MiniLM, Zen 5 (avx512_bf16, VNNI), one thread: the float32 rest (attention, GELU, the
    copies between dtypes) was 60 % of the int8 forward's time; in bfloat16 the fidelity check's min
    cosine moves from 0.996 to 0.995 (tests/integration/test_torch_int8.py)."""
    info = info or cpu()
    return "bfloat16" if info.has_any(NATIVE_BF16) else "float32"


def check_dtype(
    engine: str, dtype: str, device: str, info: CpuInfo | None = None, capability: tuple[int, int] | None = None
) -> None:
    """Raise UnsupportedOnHardware where `engine` cannot run `dtype` on `device` fast and accurately.
    `capability` overrides the CUDA compute capability read from torch (tests)."""
    if dtype == FLOAT8:
        _check_float8(engine, device, capability)
    elif device.startswith("cuda"):
        _check_cuda(engine, dtype, device, capability or cuda_capability(device))
    elif device == "cpu" and engine in CPU_ENGINES:  # tensorrt refuses a CPU itself, more plainly
        _check_cpu(engine, dtype, info or cpu())


def _check_float8(engine: str, device: str, capability: tuple[int, int] | None) -> None:
    """float8 needs fp8 tensor cores, and the torch engine (the only one with fp8 linears here)."""
    if not device.startswith("cuda"):
        raise UnsupportedOnHardware(
            f"--dtype float8 needs an NVIDIA GPU with fp8 tensor cores (compute capability "
            f"{'.'.join(map(str, CUDA_FP8_CAPABILITY))}: Ada, Hopper or newer); {device} has none (torch would "
            "emulate it, slower than float32). On CPU use --dtype int8 (per-token int8 linears) or bfloat16."
        )
    if engine not in FLOAT8_ENGINES:
        raise UnsupportedOnHardware(
            f"--dtype float8 is computed by --engine {' / '.join(FLOAT8_ENGINES)} only, not {engine}; "
            "use --engine torch --dtype float8, or --dtype float16 with this engine."
        )
    capability = capability or cuda_capability(device)
    if capability is None:
        raise UnsupportedOnHardware(
            f"--dtype float8 on {device}: torch sees no CUDA device there, so its fp8 support cannot be checked."
        )
    if capability < CUDA_FP8_CAPABILITY:
        raise UnsupportedOnHardware(
            f"--dtype float8 on {device} needs fp8 tensor cores (compute capability "
            f"{'.'.join(map(str, CUDA_FP8_CAPABILITY))}: Ada, Hopper or newer); this GPU is "
            f"{capability[0]}.{capability[1]}. Use --dtype float16 (or bfloat16 from 8.0)."
        )


def _check_cpu(engine: str, dtype: str, info: CpuInfo) -> None:
    if dtype == "bfloat16" and not info.has_any(NATIVE_BF16):
        raise UnsupportedOnHardware(
            f"--dtype bfloat16 on CPU needs native bfloat16 instructions ({_missing(NATIVE_BF16)}), which this "
            f"CPU lacks ({info.describe()}): it would be emulated at ~1 GFLOP/s, dozens of times slower than float32. "
            "Use --dtype float32 (or int8 with --engine onnx)."
        )
    if dtype == "float16" and not info.has_any(NATIVE_FP16):
        raise UnsupportedOnHardware(
            f"--dtype float16 on CPU needs native float16 arithmetic ({_missing(NATIVE_FP16)}), which this CPU "
            f"lacks ({info.describe()}): it would be emulated at ~1 GFLOP/s. Use --dtype float32"
            + (", or bfloat16 (this CPU has it)." if info.has_any(NATIVE_BF16) else ".")
        )
    if dtype.startswith("int8") and engine in _INT8_ALTERNATIVES and not info.int8_exact:
        raise UnsupportedOnHardware(
            f"--engine {engine} --dtype {dtype} on this CPU ({info.describe()}) would run int8 matrix products "
            f"without VNNI ({_missing(VNNI_INT8)}), whose int16 intermediate sums saturate and corrupt the "
            f"output (measured min cosine 0.97 on an AVX2-only CPU); {_INT8_ALTERNATIVES[engine]}."
        )
    if dtype.startswith("int8") and engine == "ctranslate2":
        # Even exact (VNNI) int8 GEMMs leave CTranslate2's per-tensor activation scales too coarse for
        # short and non-Latin inputs: worst cosine 0.9869 on the fidelity calibration set and 0.9886 on
        # tests/support/broad_corpus.py (Zen 5, avx512_vnni), under the 0.99 int8 floor.
        raise UnsupportedOnHardware(
            f"--engine ctranslate2 --dtype {dtype} on CPU ({info.describe()}) falls below the int8 accuracy floor "
            f"(min cosine 0.99 to float32) on short and non-English inputs even with VNNI (measured 0.987); "
            f"{_INT8_ALTERNATIVES[engine]}."
        )


def _check_cuda(engine: str, dtype: str, device: str, capability: tuple[int, int] | None) -> None:
    if capability is None:  # unknown (torch not loaded): the engine's own checks decide
        return
    if "bfloat16" in dtype and capability < CUDA_BF16_CAPABILITY:
        raise UnsupportedOnHardware(
            f"--dtype bfloat16 on {device} needs compute capability {'.'.join(map(str, CUDA_BF16_CAPABILITY))} "
            f"(Ampere) or newer; this GPU is {capability[0]}.{capability[1]} and would emulate it. "
            "Use --dtype float16."
        )


# ------------------------------------------------------------------ --dtype auto on CPU
# What the server picks when the operator leaves --dtype to it (an explicit --dtype wins), with the
# reason that is logged; the worker and thread counts are cpu_cores.py's.
# int8 under --dtype auto (issue 19.3: >= 1.5x float32 bulk tokens/s at min cosine >= 0.99 to
# float32 sentence-transformers vectors on the broad corpus). tests/support/int8_recipes.py, Zen 5
# (avx512_vnni), 1 thread, CPU time, padding-free MiniLM-L6 vs its float32 (oneDNN-packed, ~8,600
# tok/s); 2-core host shared with other work, so ratios only, from one run each:
#   torch dynamic int8 (one scale per tensor), every linear, per-channel   1.81-1.89x  min cos 0.918
#     + SmoothQuant a=0.7                                                1.67x           0.976
#     FFN down-projection kept float32                                   1.35x           0.995
#   per-token int8 (int8_linear.py, torch._int_mm), every linear         1.65x           0.9900
#     + SmoothQuant a=0.5, every linear                                  1.56x           0.9962
#     + SmoothQuant a=0.7, down-projections unsmoothed (TORCH_INT8_EXACT) 1.65-1.69x     0.9968
#     7-bit weights, SmoothQuant a=0.5 (TORCH_INT8_7BIT)                 1.57-1.63x      0.9941
#   the same with oneDNN held to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
#   MKL_ENABLE_INSTRUCTIONS=AVX2; emulated on the Zen 5, float32 then ~4,900 tok/s):
#     per-token, 8-bit weights (its int16 pair sums saturate)           1.58x           0.9866
#     TORCH_INT8_7BIT                                                   1.54x           0.9940
#   TORCH_INT8_EXACT with 2 threads (CPU time, both cores shared): 1.49x; bge-base-sized BERT
#   (12 x 768, random weights), 1 thread: 1.78x; AVX-VNNI emulated (ONEDNN_MAX_CPU_ISA=AVX2_VNNI): 2.28x.
#   Xeon with AMX (amx_int8, amx_bf16), same command: TORCH_INT8_EXACT 1.53x at 0.9968, bfloat16 3.01x at
#   0.9997; through the server 1.31x and 2.6x (_BF16_OVER_INT8 below).
# The FFN down-projection reads the GELU output, whose outliers move from token to token: one scale
# per tensor cannot cover them, one per token can. ONNX Runtime int8 (ONNX_INT8_*) reaches 1.28x
# (s8) / 1.59x (u8u8) of onnx float32, itself ~0.8x torch float32: ~1.1x the default.
# So `auto` picks torch int8 where the CPU has int8 dot products (VNNI / AMX int8) but no native
# bfloat16 (Ice Lake, Cascade Lake, Alder Lake): there it is both goals with margin. Where bfloat16
# is native it stays (about 2x float32 and closer to it: min cosine ~0.9999). Without VNNI the 7-bit
# recipe passes, but only just (1.54x emulated, never measured on a real AVX2 host): `--dtype int8`
# there is the operator's choice, float32 the default. The fidelity self-check judges int8 against
# the int8 floor (0.99) either way, and an automatic int8 that fails it falls back to float32.
INT8_NOT_AUTO = "int8 not chosen: measured >= 1.5x float32 at min cosine 0.99 only with VNNI / AMX int8"
INT8_AUTO_ENGINES = ("torch", "auto")

# Engines that compute bfloat16 on CPU (onnxruntime and CTranslate2 do not there).
CPU_BF16_ENGINES = ("torch", "auto")

# Where bfloat16 is native it is closer to float32 than torch int8 (MiniLM's fidelity check: min
# cosine 0.9998 vs 0.996); without AMX int8 is the faster of the two. Through the server (`encoderd bench --modes
# bulk --no-st --corpus-size 2048 --serve-args "--dtype X"`, MiniLM, 2 workers x 1 thread, dtypes
# alternated), float32 / int8 / bfloat16 tokens/s:
#   Xeon with AMX (amx_bf16, amx_int8), two rounds: 10,058-10,315 / 13,008-13,795 / 26,676-27,050:
#     int8 1.31x float32, bfloat16 2.6x;
#   Zen 4 (avx512_bf16, VNNI, no AMX), two or three runs: 6,164-6,248 / 10,489-11,081 / 9,651-10,731:
#     int8 1.72x, bfloat16 1.66x (int8 1.04x bfloat16, within the runs' spread; before the int8 kernels below).
# Since int8 computes the rest of the model in bfloat16 (torch_int8_rest_dtype) with its passes in
# host_kernels.c, Zen 5 (avx512_bf16, VNNI), int8 / bfloat16 alternated in three rounds on a shared host:
# through the server 1.05-1.51x the tokens/s (1.03-1.29x per worker CPU-second), and in-process on one
# thread (bench.breakdown) 1.11-1.28x the tokens per CPU-second; its fidelity check min cosine 0.9937.
# Zen 4 with the same int8 kernels (`encoderd bench --modes bulk --openvino --no-st --serve-args "--dtype X"`,
# separate runs within the hour, quiet host): MiniLM int8 24,974 against bfloat16 14,661-14,897 tokens/s (1.68x),
# the bge-base-sized BERT 3,424 against 2,028 (1.69x); there bfloat16 already runs at 79-86 % of the
# bfloat16 matmul peak, and VNNI's int8 products are twice bfloat16's per instruction.
# So `auto` keeps bfloat16 there for its fidelity; `--dtype int8` is served as asked, with a note that
# says what it trades.
_BF16_OVER_INT8 = {
    "amx_bf16": "closer to float32 than int8 and measured faster (Xeon with AMX: bfloat16 2.6x float32 "
    "tokens/s, int8 1.3x); --dtype auto picks it",
    "avx512_bf16": "closer to float32 than int8 (min cosine 0.9998 against 0.994 on MiniLM), which is faster "
    "here (int8 1.1-1.5x bfloat16's tokens/s on Zen 5, 1.7x on Zen 4); --dtype auto picks bfloat16 for its "
    "fidelity, --dtype int8 trades it for speed",
}
# avx512_fp16 without amx_fp16 (Sapphire Rapids): torch's float16 matrix products run at float32 speed
# (2048x768x3072, one thread, two runs: float16 160-164, float32 168-179, bfloat16 1,235-1,319 GFLOP/s);
# MiniLM's padding-free forward, one thread, CPU time: float16 0.92x float32 tokens/s, bfloat16 2.9x.
_BF16_OVER_FP16 = (
    "float16 runs at float32 speed without amx_fp16 (Xeon with AMX, MiniLM: 0.92x float32 tokens/s, "
    "bfloat16 2.9x); --dtype auto picks bfloat16"
)


def choose_cpu_dtype(engine: str, info: CpuInfo | None = None) -> tuple[str, str]:
    """(dtype, why) for `--dtype auto` on CPU: bfloat16 where the CPU runs it natively and the
    engine computes it, else int8 where it has int8 dot products and the engine is torch, else
    float32. The worker's fidelity self-check still has to pass: an automatic bfloat16 or int8
    that fails it falls back to float32 (workers/process.py)."""
    info = info or cpu()
    if engine not in CPU_BF16_ENGINES:
        return "float32", f"--engine {engine} computes no bfloat16 on CPU; {INT8_NOT_AUTO} and --engine torch"
    if not info.known:  # e.g. a sandbox that hides /proc/cpuinfo: say so rather than blame the CPU
        return "float32", f"instruction sets unknown ({CPUINFO} unreadable): float32, which every CPU computes"
    if not info.has_any(NATIVE_BF16):
        if info.is_x86 and info.has_any(VNNI_INT8) and engine in INT8_AUTO_ENGINES:
            vnni = info.present(VNNI_INT8)
            return "int8", (
                f"no native bfloat16 but int8 dot products ({vnni}): torch per-token int8 measured 1.65x "
                "float32 at min cosine 0.997, if the fidelity check passes"
            )
        return "float32", f"no native bfloat16 ({_missing(NATIVE_BF16)}) on this CPU; {INT8_NOT_AUTO}"
    native = info.present(NATIVE_BF16)
    return "bfloat16", f"native bfloat16 ({native}): ~2x float32 matmul throughput, if the fidelity check passes"


def explicit_dtype_note(engine: str, dtype: str, info: CpuInfo | None = None) -> str | None:
    """What to tell an operator whose explicit CPU `dtype` this host has a better answer to (served
    as asked all the same), else None."""
    info = info or cpu()
    if engine not in CPU_BF16_ENGINES or not info.has_any(NATIVE_BF16):
        return None
    native = info.present(NATIVE_BF16)
    if dtype.startswith("int8"):
        measured = "amx_bf16" if "amx_bf16" in info.flags else "avx512_bf16"
        return f"this CPU computes bfloat16 natively ({native}): {_BF16_OVER_INT8[measured]}"
    if dtype == "float16" and "amx_fp16" not in info.flags:
        return f"this CPU computes bfloat16 natively ({native}): {_BF16_OVER_FP16}"
    return None
