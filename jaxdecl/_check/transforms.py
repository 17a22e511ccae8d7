"""``jit`` against eager, and ``vmap`` against a loop of calls."""

from __future__ import annotations

import jax
import numpy as np

from .tolerances import is_inexact, largest, value_error, wide


def check_jit(case) -> tuple:
    """Compares the op under ``jax.jit`` with its eager outputs; returns, per output, how
    much the two differ (a forward whose last bits vary differs a little)."""
    jitted = case.call(case.leaves, jax.jit)
    rtol = case.tolerances.values
    noise = []
    for index, (a, b) in enumerate(zip(case.eager, jitted)):
        error = value_error(a, b, rtol)
        if error is not None:
            raise AssertionError(
                f"jd.check: {case.spec.describe('forward')} gives different "
                f"{case.interface.output_names[index]} under jax.jit than eagerly (relative "
                f"difference {error:.3g}, tolerance {rtol:.2g})")
        same = is_inexact(np.asarray(a).dtype) and np.shape(a) == np.shape(b)
        noise.append(largest(np.nan_to_num(wide(a) - wide(b))) if same else 0.0)
    return tuple(noise)


def check_vmap(case) -> None:
    """Runs the op under ``jax.vmap`` over three distinct copies of every input and
    compares each batch element with a call on that copy alone."""
    batch = 3
    stacked = [np.stack([_shifted(a, k) for k in range(batch)]) for a in case.leaves]
    batched = case.call(stacked, jax.vmap)
    rtol = case.tolerances.values
    for k in range(batch):
        looped = case.call([s[k] for s in stacked])
        for index, (a, b) in enumerate(zip(batched, looped)):
            error = value_error(np.asarray(a)[k], b, rtol)
            if error is not None:
                raise AssertionError(
                    f"jd.check: vmap of {case.spec.name} disagrees with a loop of calls for "
                    f"{case.interface.output_names[index]}, batch element {k} (relative "
                    f"difference {error:.3g}, tolerance {rtol:.2g})")


def _shifted(value, k: int) -> np.ndarray:
    """The k-th copy of an input: floating ones shifted by k/8 of their largest magnitude
    (same scale and, for positive inputs, same sign), others unchanged."""
    if not is_inexact(value.dtype):
        return value
    scale = largest(wide(value)) or 1.0
    return (wide(value) + k * scale / 8).astype(value.dtype)
