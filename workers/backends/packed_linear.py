"""Linear layers with their weights pre-packed for oneDNN (CPU only).

`nn.Linear` on CPU hands MKL the plain row-major weight on every call; MKL
re-blocks it each time, which dominates small batches (a 10-token query is
bound by streaming weights). oneDNN's `_linear_pointwise` on a weight packed
once at load time measured 1.56x faster for a 10-token MiniLM query and
1.13-1.15x for 16 x 64..256-token batches (float32, one thread; bfloat16 1.46x
and 1.04-1.06x), with outputs equal to 1e-5 (float32) or bit-identical
(bfloat16). These are the same oneDNN ops `torch.compile` emits on CPU.

A bfloat16 input of up to host_kernels.few_row_limit() rows (a short query's tokens) runs instead
through host_kernels' bf16_linear, where the build targets avx512_bf16: oneDNN's fixed cost per call
(~19 us a MiniLM linear on Zen 5, one thread) outweighed its arithmetic at those sizes. Its weights are a
second copy, packed once here for that kernel (the layer's weights take twice their memory).
"""

from __future__ import annotations

import logging

import torch

from . import host_kernels

log = logging.getLogger(__name__)

# A batch-size hint for oneDNN's blocking; any input size runs correctly. A bulk batch's hundreds to
# thousands of rows gain nothing from a larger one: on avx512_core_bf16 (Zen 5, torch 2.13) oneDNN packs
# bfloat16 weights as AB16b64a2b for every hint from 1 to 8,192, and float32 ones as AB16b64a for every
# hint from 16 up (ONEDNN_VERBOSE=1, MiniLM's QKV, up and down shapes): the same GEMMs.
_PACK_HINT = 16


class PackedLinear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Named `weight` so model code that reads `layer.weight.dtype` keeps working.
        self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _PACK_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        # the same weights for the host kernel's few-row GEMM (bfloat16, where this host builds it), else None
        self.few_rows = host_kernels.pack_bf16(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor, activation: str = "none") -> torch.Tensor:
        """`activation` ("none", "gelu": exact erf GELU, "relu") is applied as the GEMM writes its
        output: no second pass over the (tokens, intermediate) matrix."""
        if self.few_rows is not None and (out := host_kernels.bf16_linear(x, self.few_rows, activation)) is not None:
            return out
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, activation, [], "none")


def available(dtype: torch.dtype) -> bool:
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linears(model: torch.nn.Module) -> int:
    """Swap every exact `nn.Linear` of a CPU inference model for a PackedLinear;
    returns how many. Subclasses (e.g. quantized or attention-owned ones) stay."""
    packed = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(module, name, PackedLinear(child))
                packed += 1
    return packed


def prepack_for_cpu(model: torch.nn.Module, dtype: torch.dtype) -> None:
    if not available(dtype):
        log.info("oneDNN packed linears unavailable for %s here; using nn.Linear", dtype)
        return
    log.info("packed %d linear layers for oneDNN", pack_linears(model))
