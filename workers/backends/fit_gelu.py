"""The coefficient tables of host_kernels.c's AVX-512 GELU (gelu_rows), refitted and printed as C:

    python -m encoderd.workers.backends.fit_gelu

GELU(x) = x (1 - Q(x)) for x >= 0 and x Q(|x|) below, Q(a) = erfc(a / sqrt 2) / 2 the Gaussian tail.
log2 Q(a) is fitted by a quintic in u = a - k on each of 16 unit intervals |u| <= 1/2 around k = 0..15
(the last one reaching 15.25, where Q is ~1e-52, below float32's subnormals), least squares on 400
Chebyshev nodes in float64; the kernel picks interval k's six coefficients with one vpermps each. 2^R is
then 2^round(R) (vscalefps) times 2^f, |f| <= 1/2, by a quintic fitted the same way (relative error 1e-7).
Only numpy and the standard library's erfc (accurate to float64's relative precision in the whole tail).
"""

from __future__ import annotations

import math

import numpy as np

INTERVALS = 16  # one vpermps table: 16 float32 lanes
LAST = 15.25  # the kernel clamps |x| here: round-to-even of 15.5 would wrap to interval 0
DEGREE = 5
NODES = 400


def log2_tail(a: np.ndarray) -> np.ndarray:
    return np.array([math.log2(0.5 * math.erfc(value / math.sqrt(2))) for value in a])


def chebyshev_fit(function, low: float, high: float) -> np.ndarray:
    """Power-basis coefficients (constant first) of the degree-DEGREE least-squares fit at Chebyshev nodes."""
    nodes = (low + high) / 2 + (high - low) / 2 * np.cos(np.pi * (np.arange(NODES) + 0.5) / NODES)
    fit = np.polynomial.Polynomial.fit(nodes, function(nodes), DEGREE, domain=[low, high], window=[low, high])
    return fit.coef


def tail_tables() -> np.ndarray:
    """(DEGREE + 1, INTERVALS): row j holds u^j's coefficient of every interval."""
    tables = np.zeros((DEGREE + 1, INTERVALS))
    for k in range(INTERVALS):
        low = -0.5 if k else 0.0
        high = 0.5 if k < INTERVALS - 1 else LAST - k
        tables[:, k] = chebyshev_fit(lambda u, k=k: log2_tail(k + u), low, high)
    return tables


def exp2_terms() -> np.ndarray:
    return chebyshev_fit(lambda f: 2.0**f, -0.5, 0.5)


def _c_float(value: float) -> str:
    text = f"{float(np.float32(value)):.9g}"
    return f"{text}f" if any(mark in text for mark in ".e") else f"{text}.0f"


def _c_floats(values) -> str:
    return ", ".join(_c_float(v) for v in values)


def main() -> None:
    rows = ",\n".join(f"    {{{_c_floats(row)}}}" for row in tail_tables())
    print(f"static const float GELU_TAIL_TERMS[{DEGREE + 1}][LANES] __attribute__((aligned(64))) = {{\n{rows}}};")
    print(f"static const float GELU_EXP2_TERMS[] = {{{_c_floats(exp2_terms())}}};")


if __name__ == "__main__":
    main()
