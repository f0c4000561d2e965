"""int8 linear layers with one dynamic scale per token (CPU).

torch's dynamic int8 linears scale a whole activation matrix by one number. The BERT FFN
down-projection reads the GELU output, whose outliers move from token to token, so one scale per
tensor leaves most tokens a few levels of int8 (min cosine 0.92 to float32 on the broad corpus).
Here each row (token) gets its own symmetric scale, each output channel of the weight its own, and
the int8 x int8 -> int32 product runs in `torch._int_mm` (oneDNN's s8s8 GEMM on x86, 3.8x the
pre-packed float32 GEMM on a Zen 5 with VNNI at MiniLM shapes, one thread). The float32 result is
then int32 x token scale x channel scale + bias.

Without VNNI, oneDNN's x86 int8 kernels sum pairs of u8 x s8 products in a saturating int16
(`vpmaddubsw`; the s8 input is shifted to u8): 2 x 255 x 127 overflows it. Weights limited to 7 bits
(|w| <= 63) cannot: 2 x 255 x 63 = 32,130. hardware.int8_exact says which a host needs.

Each int8 layer allocates a few (tokens x features) buffers per call; with glibc's default
thresholds many of them are returned to the kernel on free and faulted back in on the next call
(~90k page faults, a fifth of the int8 forward's CPU time on the broad corpus). keep_freed_memory()
stops that for the process.
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

ACTIVATION_LEVELS = 127.0


class Int8Linear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Module, weight_bits: int = 8):
        super().__init__()
        weight = linear.weight.detach().float()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        levels = 2 ** (weight_bits - 1) - 1
        scale = weight.abs().amax(1).clamp(min=1e-12) / levels
        # (in, out) as a transposed view of the row-major (out, in) matrix: the layout oneDNN reads fastest.
        self.weight_t = torch.round(weight / scale[:, None]).to(torch.int8).t()
        self.weight_scale = scale
        self.bias = None if linear.bias is None else linear.bias.detach().float().clone()

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (for code that reads `linear.weight.dtype` or shapes)."""
        return self.weight_t.t().float() * self.weight_scale[:, None]

    def forward(self, x: torch.Tensor, activation: str = "none") -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        # max |x| per row from two read-only passes (x.abs() would write a copy of x)
        peak = torch.maximum(rows.amax(1, keepdim=True), rows.amin(1, keepdim=True).neg_()).clamp_(min=1e-12)
        quantized = torch.mul(rows, ACTIVATION_LEVELS / peak).round_().to(torch.int8)
        out = torch._int_mm(quantized, self.weight_t).float()
        out.mul_(peak.mul_(1 / ACTIVATION_LEVELS))
        if self.bias is None:
            out.mul_(self.weight_scale)
        else:
            torch.addcmul(self.bias, out, self.weight_scale, out=out)
        if activation == "gelu":
            out = F.gelu(out)
        elif activation == "relu":
            out.relu_()
        return out.reshape(*x.shape[:-1], self.out_features)


def quantize_linears(model: torch.nn.Module, weight_bits: int = 8) -> int:
    """Swap every exact `nn.Linear` of a CPU float32 inference model for an Int8Linear; returns how many."""
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(module, name, Int8Linear(child, weight_bits))
                swapped += 1
    return swapped


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters (malloc.h)
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
_TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Have glibc keep freed blocks up to 32 MiB in the heap (no mmap/munmap per call) and not trim
    the heap below 1 GiB of free space. Linux/glibc only; returns whether it applied."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        applied = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
        applied = libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1 and applied
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    if not applied:
        log.info("mallopt not applied: int8 layers may page-fault their buffers on each call")
    return applied
