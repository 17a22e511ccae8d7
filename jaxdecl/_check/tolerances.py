"""How close is close enough: ``jd.check``'s tolerances, keyed by precision, and its comparisons.

Every comparison is relative to the magnitude of what it compares, never to a fixed
scale, so an op is checked the same way at any amplitude. The defaults follow the
lowest precision among the op's inputs and outputs; ``jd.check(..., rtol=)`` replaces
all three relative tolerances at once. Comparisons against finite differences add the
finite differences' own error, which :mod:`.differences` estimates.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

#: Per precision (machine epsilon at least): the relative tolerance of values (jit, vmap,
#: sharding, saved=) and dot-product tests, and of derivatives against finite differences.
_DEFAULTS = ((1e-3, 3e-2, 1e-1),    # float16, bfloat16
             (1e-7, 2e-4, 1e-3),    # float32, complex64
             (0.0, 1e-8, 1e-5))     # float64, complex128


@dataclasses.dataclass(frozen=True)
class Tolerances:
    """The relative tolerances of one check, and the precision they were chosen for."""

    eps: float  # machine epsilon of the lowest precision among the op's inputs and outputs
    values: float  # same values two ways: max |a - b| <= values * max(|a|, |b|), per output
    dot: float  # a dot-product test: |p - q| <= dot * (sum of the magnitudes of the terms)
    derivative: float  # a derivative rule against finite differences, plus their own error

    @property
    def step(self) -> float:
        """The finite differences' first step, relative to each input element: eps^(1/4)
        balances a fourth-order truncation error against rounding (a power of two)."""
        return float(2.0 ** np.round(np.log2(self.eps ** 0.25)))


def tolerances_for(dtypes, rtol: float | None = None) -> Tolerances:
    """The tolerances for an op whose inputs and outputs have `dtypes`."""
    inexact = [np.dtype(d) for d in dtypes if is_inexact(d)]
    eps = max([float(ml_dtypes.finfo(d).eps) for d in inexact] or [float(np.finfo(float).eps)])
    dot, derivative = next(row[1:] for row in _DEFAULTS if eps >= row[0])
    values = dot
    if rtol is not None:
        values = dot = derivative = float(rtol)
    return Tolerances(eps, values, dot, derivative)


def is_inexact(dtype) -> bool:
    dtype = np.dtype(dtype)
    return dtype == ml_dtypes.bfloat16 or np.issubdtype(dtype, np.inexact)


def wide(value) -> np.ndarray:
    """`value` in float64 or complex128: where ``jd.check`` does its arithmetic."""
    value = np.asarray(value)
    if np.issubdtype(value.dtype, np.complexfloating):
        return value.astype(np.complex128)
    return value.astype(np.float64)


def largest(value) -> float:
    return float(np.max(np.abs(value), initial=0.0))


def pairing(a, b) -> float:
    """The real pairing Re Σ a·b (no conjugation), JAX's transpose convention."""
    return float(np.real(np.sum(wide(a) * wide(b))))


def magnitude(a, b) -> float:
    """Σ |a|·|b|: the size of the terms of a pairing, what its rounding is relative to."""
    return float(np.sum(np.abs(wide(a)) * np.abs(wide(b))))


def value_error(a, b, rtol: float, scale: float | None = None):
    """``None`` when `a` and `b` agree, else their relative difference (max |a - b| over
    `scale`, by default max(|a|, |b|)). Integers and bools must be equal; NaNs must be
    NaN in both."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return float("inf")
    if not (is_inexact(a.dtype) or is_inexact(b.dtype)):
        return None if np.array_equal(a, b) else 1.0
    a, b = wide(a), wide(b)
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    if np.any(nan_a != nan_b):
        return float("inf")
    a, b = np.where(nan_a, 0, a), np.where(nan_b, 0, b)
    error = largest(np.where(a == b, 0, a - b))  # equal infinities agree
    scale = max(largest(a), largest(b)) if scale is None else scale
    if not np.isfinite(error) or error > rtol * scale:
        return error / scale if scale > 0 else float("inf")
    return None
