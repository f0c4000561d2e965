"""workers/backends/int8_linear.py: the per-token int8 linear against float32 on the same weights."""

from __future__ import annotations

import pytest
import torch

from encoderd.workers.backends import int8_linear, packed_linear
from encoderd.workers.backends.int8_linear import Int8Linear
from encoderd.workers.contract.hardware import TORCH_INT8_7BIT, TORCH_INT8_EXACT


def linear_and_inputs(outlier_rows: bool = True):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160).requires_grad_(False)
    x = torch.randn(3, 7, 96)
    if outlier_rows:  # one token 50x louder than the rest: a per-tensor scale would flatten the others
        x[0, 0] *= 50
    return linear, x


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).norm(dim=-1) / want.norm(dim=-1)).max())


@pytest.mark.parametrize("bits, bound", [(8, 0.02), (7, 0.04)])
def test_every_token_keeps_its_own_precision(bits, bound):
    linear, x = linear_and_inputs()
    got = Int8Linear.from_linear(linear, bits)(x)
    assert got.shape == (3, 7, 160) and got.dtype == torch.float32
    assert relative_error(got, linear(x)) < bound


def test_weights_stay_within_their_bits():
    linear, _ = linear_and_inputs()
    assert int(Int8Linear.from_linear(linear, 7).weight_t.abs().max()) == 63  # 2 x 255 x 63 fits int16
    assert int(Int8Linear.from_linear(linear, 8).weight_t.abs().max()) == 127


def test_smoothing_moves_a_channel_outlier_into_the_weights():
    linear, x = linear_and_inputs(outlier_rows=False)
    x[..., 5] *= 80  # one loud input channel in every token, as LayerNorm outputs have,
    linear.weight[:, 5] /= 80  # whose weights are small: it does not dominate the output
    ranges = x.reshape(-1, 96).abs().amax(0)
    plain = relative_error(Int8Linear.from_linear(linear)(x), linear(x))
    smoothed = relative_error(Int8Linear.from_linear(linear, 8, ranges, 0.5)(x), linear(x))
    assert smoothed < plain / 2, (smoothed, plain)


def test_gelu_and_a_packed_source():
    linear, x = linear_and_inputs()
    want = torch.nn.functional.gelu(linear(x))
    sources = [linear] + ([packed_linear.PackedLinear(linear)] if packed_linear.available(torch.float32) else [])
    for source in sources:
        assert relative_error(Int8Linear.from_linear(source)(x, activation="gelu"), want) < 0.03


def test_bfloat16_in_bfloat16_out():
    """Where the rest of an int8 model computes in bfloat16 (hardware.torch_int8_rest_dtype), the
    linear takes and gives bfloat16, as accurate as the float32 path but for bfloat16's rounding."""
    linear, x = linear_and_inputs()
    layer = Int8Linear.from_linear(linear)
    for activation, reference in (("none", linear(x)), ("gelu", torch.nn.functional.gelu(linear(x)))):
        got = layer(x.bfloat16(), activation=activation)
        assert got.dtype == torch.bfloat16 and got.shape == (3, 7, 160)
        assert relative_error(got.float(), reference) < 0.03


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_long_input_runs_in_passes_that_change_no_row(dtype):
    """More tokens than ROWS_PER_PASS (and not a multiple of it): each token's row is what it is alone
    (its own scale, an exact int32 product), so the passes must give exactly the rows one at a time."""
    linear, _ = linear_and_inputs()
    layer = Int8Linear.from_linear(linear, 8, torch.rand(96) + 0.5)
    count = 2 * int8_linear.ROWS_PER_PASS + 37
    x = torch.randn(count, 96).to(dtype)
    got = layer(x, activation="gelu")
    assert got.shape == (count, 160) and got.dtype == dtype
    one_by_one = torch.cat([layer(x[i : i + 1], activation="gelu") for i in range(count)])
    assert torch.equal(got, one_by_one)


@pytest.mark.parametrize("recipe", [TORCH_INT8_EXACT, TORCH_INT8_7BIT], ids=lambda r: r.name)
def test_quantize_swaps_every_linear_after_one_calibration(recipe):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)).eval()
    model.requires_grad_(False)
    held = type("Pieces", (), {})()
    held.fused = [torch.nn.Linear(16, 48)]  # a module list another object holds (packed fused projections)
    x = torch.randn(5, 16)
    want = model(x)
    runs = []
    assert int8_linear.quantize(model, [held], recipe, lambda: runs.append(model(x))) == 3
    assert len(runs) == 1 and isinstance(held.fused[0], Int8Linear)
    up, down = model[0], model[2]
    assert isinstance(up, Int8Linear) and isinstance(down, Int8Linear)
    assert up.input_scale is not None  # expanding layers are smoothed; the down-projection per recipe
    assert (down.input_scale is not None) == recipe.smooth_contracting
    assert relative_error(model(x), want) < 0.05
