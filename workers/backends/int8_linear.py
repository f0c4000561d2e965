"""int8 linear layers with one dynamic scale per token (CPU).

torch's dynamic int8 linears scale a whole activation matrix by one number. The BERT FFN
down-projection reads the GELU output, whose outliers move from token to token, so one scale per
tensor leaves most tokens a few levels of int8 (min cosine 0.92 to float32 on the broad corpus).
Here each row (token) gets its own symmetric scale, each output channel of the weight its own, and
the int8 x int8 -> int32 product runs in `torch._int_mm` (oneDNN's s8s8 GEMM on x86, 3.8x the
pre-packed float32 GEMM on a Zen 5 with VNNI at MiniLM shapes, one thread). The result is then
int32 x token scale x channel scale + bias (+ the FFN's GELU). SmoothQuant (hardware.TorchInt8Recipe)
moves the remaining per-channel outliers of LayerNorm outputs into the weights: the model then stays
at min cosine 0.997 to float32 at 1.65x its tokens/s (the table in hardware.py).

On one thread on a CPU with avx512_vnni, the GEMM and the rescale are one host-built kernel instead
(host_kernels.int8_linear: the input quantized to q + 128 as uint8, vpdpbusd's unsigned operand, the
weights packed at load with their column sums to take the shift back out, so the int32 products equal
torch._int_mm's; rescaled, biased and activated in registers, never stored): MiniLM's int8 forward
1.16-1.21x the _int_mm path's tokens per CPU-second (Zen 5, one thread).

Where the CPU has AMX (amx_int8: Sapphire/Emerald Rapids) the same kernel computes 32 x 32 blocks by AMX
tiles (host_kernels.c's amx_block; the VNNI tiles take the rows and panel left over), chosen in C at build
time and by Linux's permission (host_kernels.Kernels.int8_products says which). Emerald Rapids (2 vCPU,
shared), one thread, bfloat16, 512 rows, medians of 7 rounds alternated in one process, GOPS, AMX tiles /
VNNI tiles / _int_mm + rescale_rows: qkv 1,391 / 529 / 474, attention out 1,249 / 525 / 494, up + GELU
703 / 428 / 351, down 1,912 / 604 / 1,069. MiniLM's whole int8 forward (bench corpus, 23,305 tokens,
medians of 5 rounds alternated): 14,632 tokens per CPU-second, against 11,309 by the VNNI tiles (this
source built -mno-amx-tile -mno-amx-int8: what this host ran before, what a Zen 4/5 builds) and 11,527 by
_int_mm + rescale_rows: 1.29x and 1.27x. `python -m encoderd.bench.int8_linear --forward --compare-ref
main --int-mm` times the three (fastest of --rounds, not medians). torch._int_mm (oneDNN, which uses AMX
here) alone is not the answer: the separate pass over its int32 products loses what its GEMM gains (it led
only on the down-projection).

The layer takes and gives float32 or bfloat16 (hardware.torch_int8_rest_dtype: bfloat16 where the
CPU computes it natively, so that attention, LayerNorm and the residual stream run as in a bfloat16
model). The passes around the GEMM (input scale, per-token absmax and quantization; rescale, bias,
GELU) run as one pass each in host_kernels.c on one thread: as torch operators they took over twice
the int8 GEMMs' own time. Elsewhere (several threads, no C compiler) torch's operators compute the same.

Without VNNI, oneDNN's x86 int8 kernels sum pairs of u8 x s8 products in a saturating int16
(`vpmaddubsw`; the s8 input is shifted to u8): 2 x 255 x 127 overflows it. Weights limited to 7 bits
(|w| <= 63) cannot: 2 x 255 x 63 = 32,130. hardware.int8_exact says which a host needs.

Each int8 layer allocates a few (tokens x features) buffers per call; with glibc's default
thresholds many of them are returned to the kernel on free and faulted back in on the next call
(~90k page faults, a fifth of the int8 forward's CPU time on the broad corpus). quantize() stops that
for the process (memory.keep_freed_memory, which a CPU worker also sets before it loads any model).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .. import memory
from ..contract.hardware import TorchInt8Recipe
from . import host_kernels, packed_linear

log = logging.getLogger(__name__)

# Tokens per quantize / GEMM / rescale pass. A whole 8,192-token batch makes the int32 products
# (8,192 x 1,536 x 4 bytes: 50 MB for an FFN up-projection) miss every cache between the GEMM that
# writes them and the rescale that reads them; 512 rows keep them within L2/L3. MiniLM's qkv, up and
# down projections in bfloat16 on one thread (Zen 5, CPU time, shared host, three rounds each):
# whole batch 0.47-0.55 s, 768 rows 0.27-0.29, 512 0.25-0.31, 384 0.27-0.29, 128 0.29-0.32. The whole
# int8 forward (bench corpus, 8,192-token batches, three rounds alternated): 12.5k -> 14.0k tokens per CPU-second.
ROWS_PER_PASS = 512


class Int8Linear(torch.nn.Module):
    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        weight_bits: int = 8,
        input_range: torch.Tensor | None = None,
        alpha: float = 0.5,
    ):
        super().__init__()
        weight = weight.detach().float()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.input_scale = None
        if input_range is not None:
            smooth = input_range.clamp(min=1e-5) ** alpha / weight.abs().amax(0).clamp(min=1e-5) ** (1 - alpha)
            weight = weight * smooth[None, :]
            self.input_scale = 1 / smooth
        levels = 2 ** (weight_bits - 1) - 1
        scale = weight.abs().amax(1).clamp(min=1e-12) / levels
        # (in, out) as a transposed view of the row-major (out, in) matrix: the layout oneDNN reads fastest.
        self.weight_t = torch.round(weight / scale[:, None]).to(torch.int8).t()
        self.weight_scale = scale
        self.bias = None if bias is None else bias.detach().float().clone()
        # the same weights for host_kernels' VNNI GEMM with its epilogue, where this host builds it
        self.packed = host_kernels.pack_int8(self.weight_t.t(), self.weight_scale, self.bias)

    @classmethod
    def from_linear(
        cls,
        linear: torch.nn.Linear | packed_linear.PackedLinear,
        weight_bits: int = 8,
        input_range: torch.Tensor | None = None,
        alpha: float = 0.5,
    ) -> Int8Linear:
        """From an nn.Linear or a packed_linear.PackedLinear (whose oneDNN-blocked weight unpacks exactly)."""
        weight: torch.Tensor = linear.weight
        bias: torch.Tensor | None = linear.bias
        return cls(weight.to_dense() if weight.is_mkldnn else weight, bias, weight_bits, input_range, alpha)

    def forward(self, x: torch.Tensor, activation: str = "none") -> torch.Tensor:
        """x in float32 or bfloat16, the result in x's dtype. `activation` ("none", "gelu": exact erf
        GELU, "relu") is applied as the int32 products are rescaled: no second pass over the output.
        A long input runs ROWS_PER_PASS tokens at a time (see there)."""
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype)
        if self.packed is not None and host_kernels.int8_linear_serves(rows, activation):
            for start in range(0, rows.shape[0], ROWS_PER_PASS):
                part = slice(start, start + ROWS_PER_PASS)
                quantized, token_scale = host_kernels.quantize_rows(rows[part], self.input_scale, to_unsigned=True)
                host_kernels.int8_linear(quantized, token_scale, self.packed, activation, out[part])
            return out.reshape(*x.shape[:-1], self.out_features)
        for start in range(0, rows.shape[0], ROWS_PER_PASS):
            part = slice(start, start + ROWS_PER_PASS)
            quantized, token_scale = host_kernels.quantize_rows(rows[part], self.input_scale)
            products = torch._int_mm(quantized, self.weight_t)
            host_kernels.rescale_rows(products, token_scale, self.weight_scale, self.bias, activation, out[part])
        return out.reshape(*x.shape[:-1], self.out_features)


def _is_linear(module) -> bool:
    return type(module) in (torch.nn.Linear, packed_linear.PackedLinear)


def linear_slots(model: torch.nn.Module, owners: list) -> list[tuple[object, object]]:
    """(owner, key) of every float linear: model attributes, and items of the lists of modules that
    other objects hold (the packed forward's fused projections)."""
    slots: list[tuple[object, object]] = [
        (module, name) for module in model.modules() for name, child in module.named_children() if _is_linear(child)
    ]
    for owner in owners:
        for value in vars(owner).values():
            if isinstance(value, list):
                slots += [(value, i) for i, item in enumerate(value) if _is_linear(item)]
    return slots


def slot_module(slot):
    owner, key = slot
    return owner[key] if isinstance(owner, list) else getattr(owner, key)


def replace_slot(slot, value) -> None:
    owner, key = slot
    if isinstance(owner, list):
        owner[key] = value
    else:
        setattr(owner, key, value)


def input_ranges(linears: list[torch.nn.Module], calibrate: Callable[[], None]) -> dict[int, torch.Tensor]:
    """max |input| per input channel of each linear (by id) over what `calibrate` runs."""
    ranges: dict[int, torch.Tensor] = {}

    def record(module, args):
        seen = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0)
        key = id(module)
        ranges[key] = torch.maximum(ranges[key], seen) if key in ranges else seen

    hooks = [linear.register_forward_pre_hook(record) for linear in linears]
    try:
        calibrate()
    finally:
        for hook in hooks:
            hook.remove()
    return ranges


def quantize(model: torch.nn.Module, owners: list, recipe: TorchInt8Recipe, calibrate: Callable[[], None]) -> int:
    """Swap every float linear of a CPU float32 model (and of `owners`' module lists) for an
    Int8Linear per `recipe`, smoothing from the ranges seen while `calibrate` runs; returns how many."""
    slots = linear_slots(model, owners)
    ranges = input_ranges([slot_module(slot) for slot in slots], calibrate) if recipe.alpha > 0 else {}
    for slot in slots:
        linear = slot_module(slot)
        smooth = recipe.smooth_contracting or linear.in_features <= linear.out_features
        input_range = ranges.get(id(linear)) if smooth else None
        replace_slot(slot, Int8Linear.from_linear(linear, recipe.weight_bits, input_range, recipe.alpha))
    if not memory.keep_freed_memory():  # in-process users (calibration, benches) as well as workers
        log.info("mallopt not applied: int8 layers may page-fault their buffers on each call")
    return len(slots)
