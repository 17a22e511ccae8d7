"""The three NUFFTs as jaxdecl ops: C kernels over finufft, one call per batch.

Every op takes its settings as a first operand (``config``, 152 bytes that
:func:`._options.pack` writes: C kernels take no instance configuration),
then the coordinates as tuples of d arrays ``(T, M)``, then the values
``(T, B, ...)``: T point sets, each with B transforms sharing it (finufft's
``n_trans``). :mod:`._shapes` brings the users' shapes to that layout.

- ``Type1Op(n_modes)``: strengths ``(T, B, M)`` -> modes ``(T, B, *n_modes)``.
- ``Type2Op()``: modes ``(T, B, N1, ..., Nd)`` -> values ``(T, B, M)``.
- ``Type3Op()``: strengths ``(T, B, M)`` at the points -> ``(T, B, K)`` at the targets.
- ``MaskedType1Op(n_modes)``, ``MaskedType2Op()``: the same with a bool ``mask (T, M)``
  after the points, false for padding, which finufft never sees (the C kernels gather each
  set's kept points): padded strengths add nothing, padded values are zero, and a padded
  point's coordinates are never read.

Each is partly linear (``linear=("source",)``): linear in its values, where
``@forward`` and ``@transpose`` are C kernels (type 1's transpose is a type 2
with the same sign, and back; type 3's swaps points and targets) and every
derivative in the values follows from them; differentiable in its
coordinates through a ``@jvp(zeros=True)`` and a ``@vjp`` taking ``wanted``
(``_derivatives``) that call these ops again, so derivatives of every order
follow and a derivative in the values alone transforms nothing for the
points. ``@batch`` folds a ``vmap`` into n_trans (shared points) or
into T (points of their own). ``@sharding``: T and B split freely, type 2
splits over its points, types 1 and 3 sum over theirs (``reduce=``), type 3
splits over its targets.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxdecl as jd

from . import _derivatives
from ._library import CONFIG_SIZE, KERNELS
from ._options import NestedOpts, Opts, pack, resolved, unpack_opts

_REAL = {np.dtype(np.complex64): np.dtype(np.float32),
         np.dtype(np.complex128): np.dtype(np.float64)}


@functools.lru_cache(maxsize=256)
def _config(nufft_type: int, eps: float, iflag: int, opts) -> np.ndarray:
    return pack(nufft_type, eps, iflag, opts)


class _Transform:
    """What the three ops share: settings, checks, the config operand, ``@batch``."""

    nufft_type = 0

    def __init__(self, eps: float = 1e-6, iflag: int = 1, opts: Opts | NestedOpts | None = None):
        self.eps = float(eps)
        self.iflag = int(iflag)
        self.opts = opts

    @property
    def config(self) -> np.ndarray:
        """The kernels' first operand: these settings, packed."""
        return _config(self.nufft_type, self.eps, self.iflag, self.opts)

    @property
    def modeord(self) -> bool:
        return bool(resolved(self.opts, self.nufft_type).modeord)

    def _check(self, config, groups, values, core: int):
        """The real dtype and (T, M) counts of the coordinate groups; raises naming the input."""
        name = type(self).__name__
        if config.shape != (CONFIG_SIZE,) or config.dtype != np.uint8:
            raise TypeError(f"{name}: the first input must be the packed settings (op.config), "
                            f"got {config.shape} {config.dtype}")
        real = _REAL.get(np.dtype(values.dtype))
        if real is None:
            raise TypeError(f"{name}: values must be complex64 or complex128, got {values.dtype}")
        counts = []
        for label, group in groups:
            if not 1 <= len(group) <= 3:
                raise ValueError(f"{name}: {label} must be 1, 2 or 3 coordinate arrays")
            for x in group:
                if np.dtype(x.dtype) != real:
                    raise TypeError(f"{name}: {label} must be {real} for {values.dtype} values, "
                                    f"got {x.dtype}")
                if len(x.shape) != 2 or x.shape != group[0].shape:
                    raise ValueError(f"{name}: {label} must be arrays (T, M) of one shape, got "
                                     f"{[tuple(p.shape) for p in group]}")
            counts.append(group[0].shape[1])
        sets = groups[0][1][0].shape[0]
        if len(values.shape) != 2 + core or values.shape[0] != sets:
            raise ValueError(f"{name}: values must be (T, B, ...) with {core} trailing dims and "
                             f"T = {sets} point sets, got {tuple(values.shape)}")
        return values.dtype, counts

    @jd.batch
    def batched(self, args, axes):
        config, *coords, values = args
        config_axis, *coord_axes, values_axis = axes
        if config_axis is not None:
            return NotImplemented  # settings per element: one call per element
        # The coordinate groups are tuples; a mask is a bare array: a group of one here.
        bare = [not isinstance(group, tuple) for group in coords]
        coords = [(g,) if b else g for g, b in zip(coords, bare)]
        coord_axes = [(a,) if b else a for a, b in zip(coord_axes, bare)]
        call = self._call_with_groups(config, bare)
        leaf_axes = [a for group in coord_axes for a in group]
        if all(a is None for a in leaf_axes):  # shared points: the batch joins n_trans
            size = values.shape[values_axis]
            moved = jnp.moveaxis(values, values_axis, 1)  # (T, V, B, ...)
            sets, batch = moved.shape[0], moved.shape[2]
            out = call(coords, moved.reshape((sets, size * batch) + moved.shape[3:]))
            return out.reshape((sets, size, batch) + out.shape[2:]), 1
        size = next(x.shape[a] for group, group_axes in zip(coords, coord_axes)
                    for x, a in zip(group, group_axes) if a is not None)

        def leading(x, axis):  # (V, ...): the batch first, broadcast where unbatched
            return (jnp.broadcast_to(x, (size,) + x.shape) if axis is None
                    else jnp.moveaxis(x, axis, 0))

        def folded(x, axis):  # (V, T, M) -> (V T, M): each element's points are a set
            x = leading(x, axis)
            return x.reshape((-1, x.shape[-1]))

        coords = [tuple(folded(x, a) for x, a in zip(group, group_axes))
                  for group, group_axes in zip(coords, coord_axes)]
        values = leading(values, values_axis)  # (V, T, B, ...)
        out = call(coords, values.reshape((-1,) + values.shape[2:]))
        return out.reshape(values.shape[:2] + out.shape[1:]), 0

    def _call_with_groups(self, config, bare):
        """This op on (groups, values), a group of one given back as the bare array it was."""
        def call(groups, values):
            return self(config, *[g[0] if b else g for g, b in zip(groups, bare)], values)
        return call


class _Type1(_Transform):
    nufft_type = 1

    def __init__(self, n_modes, eps: float = 1e-6, iflag: int = 1, opts=None):
        super().__init__(eps, iflag, opts)
        self.n_modes = tuple(int(n) for n in n_modes)

    @jd.abstract
    def shapes(self, config, points, source):
        dtype, _ = self._check(config, [("points", points)], source, 1)
        if len(points) != len(self.n_modes) or source.shape[2] != points[0].shape[1]:
            raise ValueError(f"{type(self).__name__}{self.n_modes}: takes {len(self.n_modes)} "
                             f"coordinate arrays (T, M) and strengths (T, B, M), got "
                             f"{[tuple(p.shape) for p in points]} and {tuple(source.shape)}")
        return jax.ShapeDtypeStruct(tuple(source.shape[:2]) + self.n_modes, dtype)

    @jd.sharding
    def partition(self, config, points, source):
        modes = " ".join(f"n{i}" for i in range(len(self.n_modes)))
        return jd.ShardingRule(f"c, t m, t b m -> t b {modes}",
                               replicate=("c",) + tuple(modes.split()), reduce=("m",))

    apply = jd.forward(KERNELS["type1"])
    apply_t = jd.transpose(KERNELS["type1_transpose"])

    def transposed(self) -> _Type2:
        """The type 2 that is this op's transpose (same sign; the backward options)."""
        return Type2Op(self.eps, self.iflag, unpack_opts(self.opts, 1, False))


class _Type2(_Transform):
    nufft_type = 2

    @jd.abstract
    def shapes(self, config, points, source):
        dtype, (m,) = self._check(config, [("points", points)], source, len(points))
        return jax.ShapeDtypeStruct(tuple(source.shape[:2]) + (m,), dtype)

    @jd.sharding
    def partition(self, config, points, source):
        modes = " ".join(f"n{i}" for i in range(len(points)))
        return jd.ShardingRule(f"c, t m, t b {modes} -> t b m",
                               replicate=("c",) + tuple(modes.split()))

    apply = jd.forward(KERNELS["type2"])
    apply_t = jd.transpose(KERNELS["type2_transpose"])

    def transposed(self, n_modes) -> _Type1:
        """The type 1 (onto `n_modes`) that is this op's transpose."""
        return Type1Op(n_modes, self.eps, self.iflag, unpack_opts(self.opts, 2, False))


class _Type3(_Transform):
    nufft_type = 3

    @jd.abstract
    def shapes(self, config, points, targets, source):
        dtype, (_, k) = self._check(config, [("points", points), ("targets", targets)],
                                    source, 1)
        if len(points) != len(targets) or source.shape[2] != points[0].shape[1] or \
                targets[0].shape[0] != points[0].shape[0]:
            raise ValueError(f"{type(self).__name__}: takes d coordinate arrays (T, M), d target "
                             f"arrays (T, K) and strengths (T, B, M), got "
                             f"{[tuple(p.shape) for p in points]}, "
                             f"{[tuple(s.shape) for s in targets]} and {tuple(source.shape)}")
        return jax.ShapeDtypeStruct(tuple(source.shape[:2]) + (k,), dtype)

    @jd.sharding
    def partition(self, config, points, targets, source):
        return jd.ShardingRule("c, t m, t k, t b m -> t b k", replicate=("c",), reduce=("m",))

    apply = jd.forward(KERNELS["type3"])
    apply_t = jd.transpose(KERNELS["type3_transpose"])

    def transposed(self) -> _Type3:
        """The type 3 from the targets back to the points that is this op's transpose."""
        return Type3Op(self.eps, self.iflag, unpack_opts(self.opts, 3, False))


class Type1Op(_Type1, jd.Primitive, linear=("source",)):
    """finufft's type 1 on (T, B, M) strengths: linear in them, smooth in the points."""

    push = jd.jvp(zeros=True, traceable=True)(_derivatives.push1)
    pull = jd.vjp(traceable=True)(_derivatives.pull1)


class Type2Op(_Type2, jd.Primitive, linear=("source",)):
    """finufft's type 2 of (T, B, N1, ..., Nd) modes: linear in them, smooth in the points."""

    push = jd.jvp(zeros=True, traceable=True)(_derivatives.push2)
    pull = jd.vjp(traceable=True)(_derivatives.pull2)


class Type3Op(_Type3, jd.Primitive, linear=("source",)):
    """finufft's type 3: linear in the strengths, smooth in the points and targets."""

    push = jd.jvp(zeros=True, traceable=True)(_derivatives.push3)
    pull = jd.vjp(traceable=True)(_derivatives.pull3)


# --- masked points: types 1 and 2 with padding -------------------------------------------


def _check_mask(op, mask, points):
    if np.dtype(mask.dtype) != np.bool_ or tuple(mask.shape) != tuple(points[0].shape):
        raise TypeError(f"{type(op).__name__}: the mask must be bool {tuple(points[0].shape)} "
                        f"(T, M), as the points; got {mask.dtype} {tuple(mask.shape)}")


class _Masked:
    """An op and its mask, called as the unmasked op is: what the derivatives call."""

    def __init__(self, op, mask):
        self.op, self.mask = op, mask
        self.iflag, self.modeord = op.iflag, op.modeord
        self.n_modes = getattr(op, "n_modes", None)

    @property
    def config(self):
        return self.op.config

    def __call__(self, config, points, values):
        return self.op(config, points, self.mask, values)

    def transposed(self, *n_modes):
        return _Masked(self.op.transposed(*n_modes), self.mask)


def _masked_points(mask, ct_points):
    """A padded point's cotangent is zero, whatever its strength held (NaN included)."""
    if ct_points is None:
        return None
    return tuple(jnp.where(mask, c, 0) for c in ct_points)


def _push1_masked(op, config, points, mask, source, dpoints, dsource):
    return _derivatives.push1(_Masked(op, mask), config, points, source, dpoints, dsource)


def _pull1_masked(op, config, points, mask, source, ct, *, wanted=(True, True)):
    ct_points, ct_source = _derivatives.pull1(_Masked(op, mask), config, points, source, ct,
                                              wanted=wanted)
    return _masked_points(mask, ct_points), ct_source


def _push2_masked(op, config, points, mask, source, dpoints, dsource):
    tangent = _derivatives.push2(_Masked(op, mask), config, points, source, dpoints, dsource)
    return None if tangent is None else jnp.where(mask[:, None, :], tangent, 0)


def _pull2_masked(op, config, points, mask, source, ct, *, wanted=(True, True)):
    ct_points, ct_source = _derivatives.pull2(_Masked(op, mask), config, points, source, ct,
                                              wanted=wanted)
    return _masked_points(mask, ct_points), ct_source


class MaskedType1Op(_Type1, jd.Primitive, linear=("source",)):
    """Type 1 of the kept points only: ``mask (T, M)`` false for padding, never transformed."""

    @jd.abstract
    def shapes(self, config, points, mask, source):
        _check_mask(self, mask, points)
        return _Type1.shapes(self, config, points, source)

    @jd.sharding
    def partition(self, config, points, mask, source):
        modes = " ".join(f"n{i}" for i in range(len(self.n_modes)))
        return jd.ShardingRule(f"c, t m, t m, t b m -> t b {modes}",
                               replicate=("c",) + tuple(modes.split()), reduce=("m",))

    apply = jd.forward(KERNELS["type1_masked"])
    apply_t = jd.transpose(KERNELS["type1_masked_transpose"])
    push = jd.jvp(zeros=True, traceable=True)(_push1_masked)
    pull = jd.vjp(traceable=True)(_pull1_masked)

    def transposed(self) -> MaskedType2Op:
        return MaskedType2Op(self.eps, self.iflag, unpack_opts(self.opts, 1, False))


class MaskedType2Op(_Type2, jd.Primitive, linear=("source",)):
    """Type 2 at the kept points only: ``mask (T, M)`` false for padding, whose values are 0."""

    @jd.abstract
    def shapes(self, config, points, mask, source):
        _check_mask(self, mask, points)
        return _Type2.shapes(self, config, points, source)

    @jd.sharding
    def partition(self, config, points, mask, source):
        modes = " ".join(f"n{i}" for i in range(len(points)))
        return jd.ShardingRule(f"c, t m, t m, t b {modes} -> t b m",
                               replicate=("c",) + tuple(modes.split()))

    apply = jd.forward(KERNELS["type2_masked"])
    apply_t = jd.transpose(KERNELS["type2_masked_transpose"])
    push = jd.jvp(zeros=True, traceable=True)(_push2_masked)
    pull = jd.vjp(traceable=True)(_pull2_masked)

    def transposed(self, n_modes) -> MaskedType1Op:
        return MaskedType1Op(n_modes, self.eps, self.iflag, unpack_opts(self.opts, 2, False))
