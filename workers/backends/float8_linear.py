"""float8 (e4m3) linear layers for Hopper-class GPUs, one scale per token and per output channel.

`--dtype float8` on the torch engine: the model is loaded in bfloat16 and every linear whose two
sizes are multiples of 16 (what the fp8 tensor-core GEMM takes) is swapped for a Float8Linear;
embeddings, norms, attention and heads of other shapes (a reranker's one-logit output) stay
bfloat16. Per-tensor scales would repeat int8's lesson (int8_linear.py): the FFN down-projection's
outliers move from token to token, so each token (row) gets its own scale, each output channel of
the weight its own, and `torch._scaled_mm` multiplies e4m3 x e4m3 with those row-wise scales and
writes bfloat16 (the only output row-wise scaling allows on sm_90).

e4m3 keeps 3 mantissa bits: each element is within 1/16 of its value (relative), against int8's
fixed step of max/127 per row. The fidelity self-check judges it against the int8 floors
(fidelity.precision: both are 8-bit quantizations of the linears), so a model it serves too far
from float32 is refused like any other dtype.

Hardware: fp8 tensor cores start at compute capability 8.9 (Ada, Hopper); hardware.check_dtype
refuses float8 below that and on CPU (no fp8 units: torch emulates it, slower than float32).
The arithmetic itself runs on any device torch has `_scaled_mm` for, CPU included, which is how
tests/unit/test_float8.py checks it against a dequantized float32 reference without a GPU.
"""

from __future__ import annotations

import torch

from . import int8_linear

FORMAT = torch.float8_e4m3fn
LARGEST = torch.finfo(FORMAT).max  # 448
ALIGNMENT = 16  # _scaled_mm: both sizes of the weight (and the inner one of the input) multiples of 16
_TINY = 1e-12


def row_scales(matrix: torch.Tensor) -> torch.Tensor:
    """One float32 scale per row mapping the row's largest magnitude onto LARGEST, (rows, 1)."""
    return matrix.float().abs().amax(1, keepdim=True).clamp(min=_TINY) / LARGEST


def to_float8(matrix: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """matrix / scales in e4m3; the clamp keeps a rounding just past LARGEST from becoming NaN
    (e4m3fn has no infinity: a cast overflow is NaN)."""
    # contiguous: _scaled_mm takes its first operand row-major, and a view (a slice of a fused
    # projection's output) may not be
    return (matrix.float() / scales).clamp_(-LARGEST, LARGEST).to(FORMAT).contiguous()


def fits(linear: torch.nn.Linear) -> bool:
    return linear.in_features % ALIGNMENT == 0 and linear.out_features % ALIGNMENT == 0


class Float8Linear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        scales = row_scales(weight)
        # (in, out) as a transposed view of the row-major (out, in) matrix: _scaled_mm wants its second
        # operand column-major.
        self.weight_t = to_float8(weight, scales).t()
        self.weight_scale = scales.t().contiguous()  # (1, out)
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> Float8Linear:
        weight = linear.weight.detach()
        return cls(weight.to_dense() if weight.is_mkldnn else weight, linear.bias)  # a CPU PackedLinear unpacks exactly

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (out, in) in bfloat16, for code that reads `layer.weight`
        (its dtype, its device); the forward never uses it."""
        return (self.weight_t.t().float() * self.weight_scale.t()).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        scales = row_scales(rows)
        out = torch._scaled_mm(
            to_float8(rows, scales),
            self.weight_t,
            scale_a=scales,
            scale_b=self.weight_scale,
            out_dtype=torch.bfloat16,
        )
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def quantize(model: torch.nn.Module, owners: list) -> tuple[int, int]:
    """Swap every linear of `model` (and of `owners`' module lists: the packed forward's fused
    projections) whose sizes fit the fp8 GEMM; returns (swapped, kept in bfloat16)."""
    swapped = kept = 0
    for slot in int8_linear.linear_slots(model, owners):
        linear = int8_linear.slot_module(slot)
        if fits(linear):
            int8_linear.replace_slot(slot, Float8Linear.from_linear(linear))
            swapped += 1
        else:
            kept += 1
    return swapped, kept
