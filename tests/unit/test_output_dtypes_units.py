"""The integer output dtypes follow the proto's formulas exactly (server/models/postprocess.py)."""

from fractions import Fraction

import numpy as np

from encoderd.server.models.postprocess import quantize

# float32 values whose scaled value float32 arithmetic rounds across a .5 boundary (found by search):
# the served byte was one step off the formula for each.
UINT8_EDGES = np.array([0.737254798412323, 0.5333333015441895, 0.16470590233802795], np.float32)
INT8_EDGES = np.array([-0.9488189220428467, 0.9803149700164795, 0.712598443031311], np.float32)


def _exact(x: np.float32, scale: Fraction, offset: Fraction) -> int:
    value = (Fraction(float(x)) + offset) * scale
    return round(value)  # Python's round: half to even, as np.round


def test_int8_and_uint8_are_the_formulas_computed_exactly():
    uint8 = quantize(UINT8_EDGES[None, :], "uint8")[0]
    assert [int(b) for b in uint8] == [_exact(x, Fraction(255, 2), Fraction(1)) for x in UINT8_EDGES]
    int8 = quantize(INT8_EDGES[None, :], "int8")[0]
    assert [int(b) for b in int8] == [_exact(x, Fraction(127), Fraction(0)) for x in INT8_EDGES]


def test_the_ends_are_clipped():
    ends = np.array([[-3.0, -1.0, 0.0, 1.0, 3.0]], np.float32)
    assert quantize(ends, "int8").tolist() == [[-127, -127, 0, 127, 127]]
    assert quantize(ends, "uint8").tolist() == [[0, 0, 128, 255, 255]]
