"""Partly linear ops and ops with symbolic zeros, shared by several tests.

- ``Nudft``: a non-uniform DFT ``y_k = sum_j c_j exp(-i k x_j)``, linear in the strengths
  ``c``, smooth in the points ``x`` (``linear=("c",)``), NumPy rules throughout: a
  ``@transpose``, a ``@jvp(zeros=True)`` and a ``@vjp`` taking ``wanted``, counting
  their calls; ``batch="vectorized"`` (leading batch dims on every operand).
- ``NudftTraceable``: the same with a traceable ``@jvp`` that calls the op itself (every
  order of derivative) and no ``@vjp`` (JAX transposes the jvp);
- ``NudftPull``: the same with a traceable ``@vjp`` only (reverse mode, and second
  derivatives through it);
- ``MulZ``: ``x1 * x2**2`` with a ``@jvp(zeros=True)`` and a ``@vjp`` taking ``wanted``,
  recording what each call receives;
- ``SplitZ``: two outputs ``(x * y, exp(y))`` whose ``@jvp(zeros=True)`` returns None for
  the second output's tangent when ``dy`` is None (NumPy and traceable forms).

Every op has a ``jax.numpy`` reference (``*_ref``).
"""

from __future__ import annotations

import collections
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

import jaxdecl as jd

MODES = np.arange(-3, 4)  # the frequencies k of the non-uniform DFT


def _out_dtype(c_dtype):
    return np.result_type(c_dtype, np.complex64)


def _phases(x):
    """exp(-i k x_j) as (..., k, j), for points with any leading batch dims."""
    return np.exp(-1j * MODES[:, None] * np.asarray(x)[..., None, :])


class Nudft(jd.Primitive, linear=("c",), batch="vectorized"):
    """y_k = sum_j c_j exp(-i k x_j): linear in c, differentiable in x."""

    calls: ClassVar[collections.Counter] = collections.Counter()
    seen: ClassVar[list] = []  # (rule, which arguments are None)

    @jd.abstract
    def shapes(self, x, c):
        return jax.ShapeDtypeStruct(c.shape[:-1] + (MODES.size,), _out_dtype(c.dtype))

    @jd.forward
    def apply(self, x, c):
        type(self).calls["forward"] += 1
        out = np.einsum("...kj,...j->...k", _phases(x), c)
        return out.astype(_out_dtype(c.dtype))

    @jd.transpose
    def apply_t(self, x, ct):
        type(self).calls["transpose"] += 1
        return np.einsum("...kj,...k->...j", _phases(x), ct).astype(ct.dtype)

    @jd.jvp(zeros=True)
    def push(self, x, c, dx, dc):
        type(self).calls["jvp"] += 1
        type(self).seen.append(("jvp", dx is None, dc is None))
        e = _phases(x)
        out = 0
        if dx is not None:
            out = out + np.einsum("...kj,...j->...k", -1j * MODES[:, None] * e, c * dx)
        if dc is not None:
            out = out + np.einsum("...kj,...j->...k", e, dc)
        return np.asarray(out).astype(_out_dtype(c.dtype))

    @jd.vjp
    def pull(self, x, c, ct, *, wanted):
        type(self).calls[f"vjp {wanted}"] += 1
        e = _phases(x)
        dx = dc = None
        if wanted[0]:
            dx = np.real(c * np.einsum("...kj,...k->...j", -1j * MODES[:, None] * e, ct))
            dx = dx.astype(np.asarray(x).dtype)
        if wanted[1]:
            dc = np.einsum("...kj,...k->...j", e, ct).astype(ct.dtype)
        return dx, dc


class NudftTraceable(Nudft):
    """Nudft whose @jvp is traceable and calls the op itself: every order."""

    @jd.jvp(zeros=True, traceable=True)
    def push(self, x, c, dx, dc):
        out = None
        if dx is not None:  # d/dx_j: the op applied to c_j dx_j, times -i k
            out = (-1j * MODES).astype(_out_dtype(c.dtype)) * self(x, c * dx)
        if dc is not None:  # the linear part: the op itself
            out = self(x, dc) if out is None else out + self(x, dc)
        return out

    pull = None


class NudftPull(Nudft):
    """Nudft with a traceable @vjp only (taking `wanted`), written with jax.numpy."""

    push = None

    @jd.vjp(traceable=True)
    def pull(self, x, c, ct, *, wanted):
        e = jnp.exp(-1j * MODES[:, None] * x[None, :])
        dx = jnp.real(c * ((-1j * MODES[:, None] * e).T @ ct)).astype(x.dtype) \
            if wanted[0] else None
        dc = (e.T @ ct).astype(ct.dtype) if wanted[1] else None
        return dx, dc


def nudft_ref(x, c):
    e = jnp.exp(-1j * jnp.asarray(MODES)[:, None] * x[..., None, :])
    return jnp.einsum("...kj,...j->...k", e, c).astype(_out_dtype(c.dtype))


class MulZ(jd.Primitive):
    """x1 * x2**2 whose rules see symbolic zeros and which cotangents are wanted."""

    calls: ClassVar[collections.Counter] = collections.Counter()
    seen: ClassVar[list] = []

    @jd.abstract
    def shapes(self, x1, x2):
        return jax.ShapeDtypeStruct(x1.shape, x1.dtype)

    @jd.forward
    def apply(self, x1, x2):
        type(self).calls["forward"] += 1
        return x1 * x2**2

    @jd.jvp(zeros=True)
    def push(self, x1, x2, dx1, dx2):
        type(self).calls[f"jvp {(dx1 is not None, dx2 is not None)}"] += 1
        type(self).seen.append(("jvp", type(dx1), type(dx2)))
        out = np.zeros_like(x1)
        if dx1 is not None:
            out = out + x2**2 * dx1
        if dx2 is not None:
            out = out + 2 * x1 * x2 * dx2
        return out

    @jd.vjp
    def pull(self, x1, x2, ct, *, wanted):
        type(self).calls[f"vjp {wanted}"] += 1
        return (x2**2 * ct if wanted[0] else None), (2 * x1 * x2 * ct if wanted[1] else None)


def mul_ref(x1, x2):
    return x1 * x2**2


class SplitZ(jd.Primitive):
    """(x * y, exp(y)): the second output does not depend on x."""

    @jd.abstract
    def shapes(self, x, y):
        return jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(y.shape, y.dtype)

    @jd.forward
    def apply(self, x, y):
        return x * y, np.exp(y)

    @jd.jvp(zeros=True)
    def push(self, x, y, dx, dy):
        first = (0 if dx is None else y * dx) + (0 if dy is None else x * dy)
        return np.asarray(first, x.dtype), None if dy is None else np.exp(y) * dy

    @jd.vjp
    def pull(self, x, y, ct0, ct1):
        return y * ct0, x * ct0 + np.exp(y) * ct1


class SplitZTraceable(SplitZ):
    @jd.jvp(zeros=True, traceable=True)
    def push(self, x, y, dx, dy):
        first = (0 if dx is None else y * dx) + (0 if dy is None else x * dy)
        return first, None if dy is None else jnp.exp(y) * dy


def split_ref(x, y):
    return x * y, jnp.exp(y)
