"""Inputs and comparisons shared by the tests of jaxdecl.contrib.ducc (test_contrib_ducc_*.py).

Tolerances come from conftest's per-dtype table; the dot-product test uses
JAX's non-conjugated pairing, the one ``jax.linear_transpose`` is defined by.
"""

import jax
import numpy as np
from conftest import tol

REAL = [np.dtype("float32"), np.dtype("float64")]
COMPLEX = [np.dtype("complex64"), np.dtype("complex128")]
COMPLEX_OF = dict(zip(REAL, COMPLEX))
REAL_OF = dict(zip(COMPLEX, REAL))


def random(rng, shape, dtype):
    x = rng.standard_normal(shape)
    if np.issubdtype(dtype, np.complexfloating):
        x = x + 1j * rng.standard_normal(shape)
    return x.astype(dtype)


def assert_close(actual, expected, dtype):
    expected = np.asarray(expected)
    scale = max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=tol(dtype),
                               atol=tol(dtype) * scale)


def pairing(a, b) -> float:
    """Re Σ a·b, JAX's (non-conjugated) pairing of a cotangent with a tangent."""
    return float(np.real(np.sum(np.asarray(a, np.complex128) * np.asarray(b, np.complex128))))


def assert_transpose(op, x, ct, dtype):
    """Dot-product test ⟨ct, A x⟩ = ⟨Aᵀ ct, x⟩ through jax.linear_transpose."""
    (x_ct,) = jax.linear_transpose(op, x)(ct)
    assert x_ct.shape == x.shape and x_ct.dtype == x.dtype
    lhs, rhs = pairing(ct, op(x)), pairing(x_ct, x)
    scale = np.linalg.norm(np.asarray(ct)) * np.linalg.norm(np.asarray(x))
    assert abs(lhs - rhs) <= 10 * tol(dtype) * scale, (lhs, rhs)
