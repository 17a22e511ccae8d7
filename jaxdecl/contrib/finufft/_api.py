"""``nufft1``, ``nufft2``, ``nufft3``: jax-finufft 1.3.1's functions, over the ops of ``_ops``.

Same arguments, defaults, shapes, broadcasting and dtypes as jax-finufft's:
each call brings the inputs to the ops' (T, B, ...) layout (``_shapes``),
runs one op and brings the result back. Like jax-finufft's, the functions are
jitted with the settings static, so eager calls are cached too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _shapes
from ._ops import MaskedType1Op, MaskedType2Op, Type1Op, Type2Op, Type3Op
from ._options import as_opts

_COMPLEX_OF = {np.dtype(np.float32): np.dtype(np.complex64),
               np.dtype(np.float64): np.dtype(np.complex128)}


def _check_inputs(name: str, source, coordinates, dims: int):
    """The source as complex (a real one is promoted); raises naming the argument."""
    if not 1 <= dims <= 3:
        raise ValueError(f"{name}: transforms in 1, 2 or 3 dimensions, got {dims} coordinate "
                         f"arrays" + (" (then as many targets)" if name == "nufft3" else ""))
    dtype = np.dtype(source.dtype)
    if dtype in _COMPLEX_OF:  # real strengths: the transform of their complex embedding
        source = source.astype(_COMPLEX_OF[dtype])
        dtype = np.dtype(source.dtype)
    real = {c: r for r, c in _COMPLEX_OF.items()}.get(dtype)
    if real is None:
        raise TypeError(f"{name}: source must be complex64 or complex128 (or float32/float64), "
                        f"got {dtype}")
    for x in coordinates:
        if np.dtype(x.dtype) != real:
            raise TypeError(
                f"{name}: the point coordinates must be {real} for {dtype} source, got {x.dtype}; "
                f"cast them (x.astype(jnp.{real})) or the source to the other precision")
    return source


def _prepare(iflag, eps, opts):
    return int(iflag), float(eps), as_opts(opts)


def _check_mask(name: str, mask):
    """The mask as a bool array; raises naming it."""
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(f"{name}: mask must be a bool array (True for a point, False for "
                        f"padding), got {mask.dtype}; compare it, e.g. mask=(index < count)")
    return mask


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("iflag", "eps", "opts"))
def _nufft1(output_shape, source, *points, mask, iflag, eps, opts):
    source = _check_inputs("nufft1", source, points, len(points))
    if mask is None:
        layout, points, _, values = _shapes.flatten(1, source, points, ())
        op = Type1Op(output_shape, eps, iflag, opts)
        return layout.unflatten(op(op.config, points, values))
    layout, points, _, values, mask = _shapes.flatten(1, source, points, (), mask)
    op = MaskedType1Op(output_shape, eps, iflag, opts)
    return layout.unflatten(op(op.config, points, mask, values))


@functools.partial(jax.jit, static_argnames=("iflag", "eps", "opts"))
def _nufft2(source, *points, mask, iflag, eps, opts):
    source = _check_inputs("nufft2", source, points, len(points))
    if mask is None:
        layout, points, _, values = _shapes.flatten(2, source, points, ())
        op = Type2Op(eps, iflag, opts)
        return layout.unflatten(op(op.config, points, values))
    layout, points, _, values, mask = _shapes.flatten(2, source, points, (), mask)
    op = MaskedType2Op(eps, iflag, opts)
    return layout.unflatten(op(op.config, points, mask, values))


@functools.partial(jax.jit, static_argnames=("iflag", "eps", "opts"))
def _nufft3(source, *points, iflag, eps, opts):
    if len(points) % 2:
        raise ValueError(f"nufft3: takes as many target arrays as point arrays (x, y, z, then "
                         f"s, t, u), got {len(points)} arrays")
    d = len(points) // 2
    source = _check_inputs("nufft3", source, points, d)
    layout, xs, ss, values = _shapes.flatten(3, source, points[:d], points[d:])
    op = Type3Op(eps, iflag, opts)
    return layout.unflatten(op(op.config, xs, ss, values))


def nufft1(output_shape, source, *points, iflag=1, eps=1e-6, opts=None, mask=None):
    """Type-1 NUFFT: strengths at non-uniform points -> Fourier modes (jax-finufft's ``nufft1``).

    f[k] = Σ_j c[j] exp(iflag · i k·x_j) for k in [-N/2, N/2) per axis (or FFT
    order with ``Opts(modeord=True)``). Linear in ``source``, differentiable
    in the points.

    Args:
        output_shape: the number of modes per dimension: an int (1-D) or a tuple.
        source: strengths ``(..., M)`` complex64/complex128 (float32/float64 are
            promoted); leading dims the points lack are a batch of transforms.
        *points: 1 to 3 coordinate arrays ``(..., M)`` (x, y, z), float32 for
            complex64, float64 for complex128; their leading dims broadcast
            against the source's.
        iflag: the sign of the exponent (+1 or -1).
        eps: the requested relative accuracy.
        opts: an :class:`Opts` or :class:`NestedOpts` (or jax-finufft's own).
        mask: (not in jax-finufft) a bool array that broadcasts with the points,
            False for padding: a padded point and its strength are never read
            (NaN is fine there) and cost nothing. The result is the unpadded
            call's, and so are the derivatives (zero for padded inputs).

    Returns:
        ``(..., *output_shape)``, the dtype of ``source``.

    Example:
        >>> import numpy as np
        >>> from jaxdecl.contrib.finufft import nufft1
        >>> x = np.array([0.0, 1.0]); c = np.array([1.0 + 0j, 2.0])
        >>> f = nufft1(4, c, x, eps=1e-9)
        >>> bool(np.allclose(f, [c @ np.exp(1j * k * x) for k in range(-2, 2)]))
        True
    """
    shape = np.atleast_1d(np.asarray(output_shape))
    if shape.ndim != 1 or shape.shape[0] != len(points) or not np.issubdtype(shape.dtype,
                                                                              np.integer):
        raise ValueError(f"nufft1: output_shape must be {len(points)} integers (one per "
                         f"coordinate array), got {output_shape!r}")
    return _nufft1(tuple(int(n) for n in shape), jnp.asarray(source), *points,
                   mask=None if mask is None else _check_mask("nufft1", mask),
                   **dict(zip(("iflag", "eps", "opts"), _prepare(iflag, eps, opts))))


def nufft2(source, *points, iflag=-1, eps=1e-6, opts=None, mask=None):
    """Type-2 NUFFT: Fourier modes -> values at non-uniform points (jax-finufft's ``nufft2``).

    c[j] = Σ_k f[k] exp(iflag · i k·x_j). Linear in ``source``,
    differentiable in the points.

    Args:
        source: modes ``(..., N1[, N2[, N3]])`` complex64/complex128 (float32/
            float64 promoted); leading dims the points lack are a batch.
        *points: 1 to 3 coordinate arrays ``(..., M)``, float32/float64 to match.
        iflag, eps, opts: as :func:`nufft1` (``iflag`` defaults to -1).
        mask: (not in jax-finufft) a bool array that broadcasts with the points,
            False for padding: finufft never sees a padded point, whose value
            is 0 (its coordinates are never read; NaN is fine there).

    Returns:
        ``(..., M)``, the dtype of ``source``.

    Example:
        >>> import numpy as np
        >>> from jaxdecl.contrib.finufft import nufft2
        >>> f = np.array([0, 0, 1.0 + 0j, 0])          # mode 0 of 4 (order -2, -1, 0, 1)
        >>> np.round(nufft2(f, np.array([0.3, 2.0]), eps=1e-9), 6).tolist()
        [(1+0j), (1+0j)]
    """
    return _nufft2(jnp.asarray(source), *points,
                   mask=None if mask is None else _check_mask("nufft2", mask),
                   **dict(zip(("iflag", "eps", "opts"), _prepare(iflag, eps, opts))))


def nufft3(source, *points, iflag=-1, eps=1e-6, opts=None):
    """Type-3 NUFFT: non-uniform points -> non-uniform frequencies (jax-finufft's ``nufft3``).

    f[k] = Σ_j c[j] exp(iflag · i s_k·x_j). Linear in ``source``,
    differentiable in the points and the targets.

    Args:
        source: strengths ``(..., M)`` complex64/complex128 (float32/float64
            promoted).
        *points: the coordinates (x[, y[, z]]) ``(..., M)`` then as many target
            frequencies (s[, t[, u]]) ``(..., K)``.
        iflag, eps, opts: as :func:`nufft1` (``iflag`` defaults to -1).

    Returns:
        ``(..., K)``, the dtype of ``source``.

    Example:
        >>> import numpy as np
        >>> from jaxdecl.contrib.finufft import nufft3
        >>> x, s = np.array([0.1, 0.7]), np.array([3.5, -1.25, 0.0])
        >>> c = np.array([1.0 + 0j, 1j])
        >>> f = nufft3(c, x, s, eps=1e-9)
        >>> bool(np.allclose(f, np.exp(-1j * np.outer(s, x)) @ c))
        True
    """
    return _nufft3(jnp.asarray(source), *points,
                   **dict(zip(("iflag", "eps", "opts"), _prepare(iflag, eps, opts))))
