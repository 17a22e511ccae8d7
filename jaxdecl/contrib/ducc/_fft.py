"""FFTs and the Hartley transform: ``c2c``, ``r2c``, ``c2r``, ``genuine_fht`` (``ducc0.fft``).

All four transform any subset of the axes of an n-d array in one DUCC call.
They share how the axes are stored and checked, and one ``@batch`` rule that
folds a ``vmap`` axis into that call instead of looping over the batch.

Sharding: ``c2c`` and ``genuine_fht`` declare every axis they do
not transform independent and the transformed axes ``replicate``, so under
``jax.jit`` an array sharded along an untransformed axis is transformed block
by block on each device, with no gather. ``r2c`` and ``c2r`` change the length
of their last transformed axis: the result has a factor of its own there
(``"d0 d1 -> d0 m"``, ``m`` replicated), so they split along the axes they
do not transform in the same way.
"""

from __future__ import annotations

import ducc0
import jax
import numpy as np

import jaxdecl as jd

from ._checks import COMPLEX_OF, REAL_OF, check_dtype


def _normalize_axes(name: str, axes, ndim: int) -> tuple:
    """`axes` (None = all) as non-negative ints for an array of rank `ndim`."""
    if axes is None:
        return tuple(range(ndim))
    out = []
    for axis in axes:
        if not -ndim <= axis < ndim:
            raise ValueError(f"{name}: axis {axis} is out of range for a rank-{ndim} input")
        out.append(axis % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"{name}: repeated axes {tuple(axes)}")
    return tuple(out)


def _as_axes(axes):
    """Stores axes hashably: None (all axes) or a tuple of ints."""
    if axes is None:
        return None
    if isinstance(axes, int):
        return (axes,)
    return tuple(int(a) for a in axes)


def _check_inorm(inorm: int) -> int:
    if inorm not in (0, 1, 2):
        raise ValueError(f"inorm must be 0, 1 or 2, got {inorm}")
    return int(inorm)


def _fold_batch_axis(axes, ndim: int, batch_axis: int) -> tuple:
    """The transform axes of the per-element op, as axes of the batched array.

    `ndim` is the per-element rank; the batch axis sits at `batch_axis` of the
    batched array, so element axes at or after it move up by one.
    """
    element_axes = _normalize_axes("batch", axes, ndim)
    return tuple(a + (a >= batch_axis) for a in element_axes)


def _per_axis_rule(name: str, axes, ndim: int) -> jd.ShardingRule:
    """One factor per axis, ``"d0 d1 -> d0 d1"``; the transformed axes are needed whole."""
    dims = [f"d{i}" for i in range(ndim)]
    value = " ".join(dims)
    return jd.ShardingRule(f"{value} -> {value}",
                           replicate=tuple(dims[a] for a in _normalize_axes(name, axes, ndim)))


def _resized_rule(name: str, axes, ndim: int) -> jd.ShardingRule:
    """As :func:`_per_axis_rule`, the last transformed axis resized: a result factor ``m``."""
    axes = _normalize_axes(name, axes, ndim)
    dims = [f"d{i}" for i in range(ndim)]
    out = dims[: axes[-1]] + ["m"] + dims[axes[-1] + 1:]
    return jd.ShardingRule(f"{' '.join(dims)} -> {' '.join(out)}",
                           replicate=tuple(dims[a] for a in axes) + ("m",))


class _FFTBatch:
    """Shared ``@batch`` rule: fold the vmap axis into DUCC's own multi-axis call.

    DUCC transforms any subset of axes of an n-d array in one call, so a batch
    costs one call with the transform axes shifted past the batch axis, not a
    Python loop over elements.
    """

    @jd.batch
    def batched(self, args, axes):
        (x,), (axis,) = args, axes
        if axis is None:
            return self(x), None
        folded = self.reconfigured(_fold_batch_axis(self.axes, x.ndim - 1, axis))
        return folded(x), axis


class c2c(_FFTBatch, jd.Primitive, linear=True):
    """Complex-to-complex FFT over `axes` (``ducc0.fft.c2c``).

    Args:
        axes: axes to transform; None transforms all of them.
        forward: negative exponent if True, positive otherwise.
        inorm: 0 no normalisation, 1 divide by sqrt(N), 2 divide by N, where N
            is the product of the transformed lengths.
        nthreads: DUCC threads per call (0: all hardware threads).

    Input and output are complex64 or complex128 of the same shape. The adjoint
    is the transform in the other direction with the same ``inorm``. Axes not
    in `axes` are independent: under ``jax.jit`` each device transforms its own
    block of an input sharded along them.

    Example:
        >>> import numpy as np
        >>> from jaxdecl.contrib import ducc
        >>> ducc.c2c(forward=False, inorm=2)(np.array([4.0 + 0j, 0, 0, 0])).tolist()
        [(1+0j), (1+0j), (1+0j), (1+0j)]
    """

    def __init__(self, axes=None, forward: bool = True, inorm: int = 0, nthreads: int = 1):
        self.axes = _as_axes(axes)
        self.forward = bool(forward)
        self.inorm = _check_inorm(inorm)
        self.nthreads = int(nthreads)

    def reconfigured(self, axes) -> c2c:
        return c2c(axes, self.forward, self.inorm, self.nthreads)

    @jd.abstract
    def shapes(self, x):
        check_dtype("c2c", x.dtype, REAL_OF)
        _normalize_axes("c2c", self.axes, len(x.shape))
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.sharding
    def partition(self, x):
        return _per_axis_rule("c2c", self.axes, len(x.shape))

    @jd.forward
    def apply(self, x, *, out):
        ducc0.fft.c2c(x, axes=_normalize_axes("c2c", self.axes, x.ndim), forward=self.forward,
                      inorm=self.inorm, out=out, nthreads=self.nthreads)

    @jd.adjoint
    def apply_adjoint(self, y, *, out):
        ducc0.fft.c2c(y, axes=_normalize_axes("c2c", self.axes, y.ndim),
                      forward=not self.forward, inorm=self.inorm, out=out,
                      nthreads=self.nthreads)


class r2c(_FFTBatch, jd.Primitive, linear=True):
    """Real-to-complex FFT over `axes` (``ducc0.fft.r2c``).

    The last of `axes` keeps its non-negative frequencies only: length n becomes
    ``n // 2 + 1``. Arguments as :class:`c2c`; input float32/float64, output
    the matching complex type.

    The transpose (non-conjugated, as JAX's) is *not* :class:`c2r`: with the
    pairing Re Σ ct·r2c(x), the cotangent of ``x`` is the real part of the
    same-direction c2c of ``ct`` zero-padded to full length n. c2r instead
    assumes Hermitian symmetry and counts the interior frequencies twice.

    Example:
        >>> import numpy as np
        >>> from jaxdecl.contrib import ducc
        >>> ducc.r2c()(np.ones(4)).tolist()
        [(4+0j), 0j, 0j]
    """

    def __init__(self, axes=None, forward: bool = True, inorm: int = 0, nthreads: int = 1):
        self.axes = _as_axes(axes)
        self.forward = bool(forward)
        self.inorm = _check_inorm(inorm)
        self.nthreads = int(nthreads)

    def reconfigured(self, axes) -> r2c:
        return r2c(axes, self.forward, self.inorm, self.nthreads)

    @jd.abstract
    def shapes(self, x):
        dtype = check_dtype("r2c", x.dtype, COMPLEX_OF)
        axes = _normalize_axes("r2c", self.axes, len(x.shape))
        shape = list(x.shape)
        shape[axes[-1]] = shape[axes[-1]] // 2 + 1
        return jax.ShapeDtypeStruct(tuple(shape), COMPLEX_OF[dtype])

    @jd.sharding
    def partition(self, x):
        return _resized_rule("r2c", self.axes, len(x.shape))

    @jd.forward
    def apply(self, x, *, out):
        ducc0.fft.r2c(x, axes=_normalize_axes("r2c", self.axes, x.ndim), forward=self.forward,
                      inorm=self.inorm, out=out, nthreads=self.nthreads)

    @jd.transpose
    def apply_transpose(self, ct, *, out):
        axes = _normalize_axes("r2c", self.axes, ct.ndim)
        last = axes[-1]
        padded = np.zeros(out.shape, ct.dtype)
        padded[(slice(None),) * last + (slice(0, ct.shape[last]),)] = ct
        full = ducc0.fft.c2c(padded, axes=axes, forward=self.forward, inorm=self.inorm,
                             nthreads=self.nthreads)
        out[...] = full.real


class c2r(_FFTBatch, jd.Primitive, linear=True):
    """Complex-to-real FFT over `axes` (``ducc0.fft.c2r``), the inverse layout of :class:`r2c`.

    Args:
        lastsize: output length n of the last of `axes`; the input has
            ``n // 2 + 1`` entries there.
        axes, forward, inorm, nthreads: as :class:`c2c`.

    DUCC reads the input as the non-negative half of a Hermitian spectrum, so
    the imaginary parts of the zero (and, n even, Nyquist) frequency do not
    contribute. The transpose is the same-direction :class:`r2c` with the
    interior frequencies (counted twice in the forward) doubled.

    Example:
        >>> import numpy as np
        >>> from jaxdecl.contrib import ducc
        >>> ducc.c2r(lastsize=4, forward=False)(np.array([4.0 + 0j, 0, 0])).tolist()
        [4.0, 4.0, 4.0, 4.0]
    """

    def __init__(self, lastsize: int, axes=None, forward: bool = False, inorm: int = 0,
                 nthreads: int = 1):
        self.lastsize = int(lastsize)
        self.axes = _as_axes(axes)
        self.forward = bool(forward)
        self.inorm = _check_inorm(inorm)
        self.nthreads = int(nthreads)

    def reconfigured(self, axes) -> c2r:
        return c2r(self.lastsize, axes, self.forward, self.inorm, self.nthreads)

    @jd.abstract
    def shapes(self, y):
        dtype = check_dtype("c2r", y.dtype, REAL_OF)
        axes = _normalize_axes("c2r", self.axes, len(y.shape))
        shape = list(y.shape)
        if shape[axes[-1]] != self.lastsize // 2 + 1:
            raise ValueError(
                f"c2r(lastsize={self.lastsize}) needs {self.lastsize // 2 + 1} entries along "
                f"axis {axes[-1]}, got input shape {tuple(y.shape)}"
            )
        shape[axes[-1]] = self.lastsize
        return jax.ShapeDtypeStruct(tuple(shape), REAL_OF[dtype])

    @jd.sharding
    def partition(self, y):
        return _resized_rule("c2r", self.axes, len(y.shape))

    @jd.forward
    def apply(self, y, *, out):
        ducc0.fft.c2r(y, axes=_normalize_axes("c2r", self.axes, y.ndim),
                      lastsize=self.lastsize, forward=self.forward, inorm=self.inorm, out=out,
                      nthreads=self.nthreads)

    @jd.transpose
    def apply_transpose(self, ct, *, out):
        axes = _normalize_axes("c2r", self.axes, ct.ndim)
        ducc0.fft.r2c(ct, axes=axes, forward=self.forward, inorm=self.inorm, out=out,
                      nthreads=self.nthreads)
        last, n = axes[-1], self.lastsize
        # Frequencies 1 .. ceil(n/2)-1 appear twice in the Hermitian extension.
        interior = (slice(None),) * last + (slice(1, (n + 1) // 2),)
        out[interior] *= 2


class genuine_fht(_FFTBatch, jd.Primitive, linear=True):
    """Genuine (non-separable) Hartley transform over `axes` (``ducc0.fft.genuine_fht``).

    Real in, real out (float32/float64). Its matrix cas(2π Σ jₐkₐ/nₐ) is
    symmetric, so the transpose is the same transform.

    Example:
        >>> import numpy as np
        >>> from jaxdecl.contrib import ducc
        >>> ducc.genuine_fht()(np.array([1.0, 0.0, 0.0, 0.0])).tolist()
        [1.0, 1.0, 1.0, 1.0]
    """

    def __init__(self, axes=None, inorm: int = 0, nthreads: int = 1):
        self.axes = _as_axes(axes)
        self.inorm = _check_inorm(inorm)
        self.nthreads = int(nthreads)

    def reconfigured(self, axes) -> genuine_fht:
        return genuine_fht(axes, self.inorm, self.nthreads)

    @jd.abstract
    def shapes(self, x):
        check_dtype("genuine_fht", x.dtype, COMPLEX_OF)
        _normalize_axes("genuine_fht", self.axes, len(x.shape))
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.sharding
    def partition(self, x):
        return _per_axis_rule("genuine_fht", self.axes, len(x.shape))

    @jd.forward
    def apply(self, x, *, out):
        ducc0.fft.genuine_fht(x, axes=_normalize_axes("genuine_fht", self.axes, x.ndim),
                              inorm=self.inorm, out=out, nthreads=self.nthreads)

    @jd.transpose
    def apply_transpose(self, ct, *, out):
        self.apply(ct, out=out)
