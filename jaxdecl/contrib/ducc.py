"""DUCC transforms (FFTs, Hartley, spherical harmonics, NUFFT, radio gridding) as jaxdecl ops.

Each transform is a short linear jaxdecl class: ``@forward`` calls ``ducc0``,
``@transpose`` or ``@adjoint`` calls ``ducc0`` again, and JAX derives every
derivative from those two. Static settings (axes, normalisation, ``nside``,
``lmax``, pixel sizes, thread count) live on the instance, so equal settings share
compiled code.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxdecl.contrib import ducc
    >>> fft = ducc.c2c(axes=(0,))
    >>> fft(jnp.ones(4, jnp.complex64)).tolist()
    [(4+0j), 0j, 0j, 0j]
"""

from __future__ import annotations

import functools
import math

import ducc0
import jax
import numpy as np

import jaxdecl as jd

__all__ = [
    "c2c",
    "c2r",
    "dirty2vis",
    "genuine_fht",
    "healpix_synthesis",
    "nalm",
    "nu2u",
    "r2c",
    "synthesis_2d",
    "u2nu",
    "vis2dirty",
]

_COMPLEX_OF = {np.dtype("float32"): np.dtype("complex64"),
               np.dtype("float64"): np.dtype("complex128")}
_REAL_OF = {c: r for r, c in _COMPLEX_OF.items()}


def _check_dtype(name: str, dtype, allowed) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in allowed:
        raise TypeError(
            f"{name} takes {' or '.join(str(d) for d in allowed)} input, got {dtype}"
        )
    return dtype


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
    is the transform in the other direction with the same ``inorm``.

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
        _check_dtype("c2c", x.dtype, _REAL_OF)
        _normalize_axes("c2c", self.axes, len(x.shape))
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

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
        dtype = _check_dtype("r2c", x.dtype, _COMPLEX_OF)
        axes = _normalize_axes("r2c", self.axes, len(x.shape))
        shape = list(x.shape)
        shape[axes[-1]] = shape[axes[-1]] // 2 + 1
        return jax.ShapeDtypeStruct(tuple(shape), _COMPLEX_OF[dtype])

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
        dtype = _check_dtype("c2r", y.dtype, _REAL_OF)
        axes = _normalize_axes("c2r", self.axes, len(y.shape))
        shape = list(y.shape)
        if shape[axes[-1]] != self.lastsize // 2 + 1:
            raise ValueError(
                f"c2r(lastsize={self.lastsize}) needs {self.lastsize // 2 + 1} entries along "
                f"axis {axes[-1]}, got input shape {tuple(y.shape)}"
            )
        shape[axes[-1]] = self.lastsize
        return jax.ShapeDtypeStruct(tuple(shape), _REAL_OF[dtype])

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
        _check_dtype("genuine_fht", x.dtype, _COMPLEX_OF)
        _normalize_axes("genuine_fht", self.axes, len(x.shape))
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, *, out):
        ducc0.fft.genuine_fht(x, axes=_normalize_axes("genuine_fht", self.axes, x.ndim),
                              inorm=self.inorm, out=out, nthreads=self.nthreads)

    @jd.transpose
    def apply_transpose(self, ct, *, out):
        self.apply(ct, out=out)


def nalm(lmax: int, mmax: int | None = None) -> int:
    """Number of a_lm coefficients in DUCC's (and healpy's) m-major triangular layout.

    Example:
        >>> from jaxdecl.contrib import ducc
        >>> ducc.nalm(2)
        6
    """
    mmax = lmax if mmax is None else mmax
    return ((mmax + 1) * (mmax + 2)) // 2 + (mmax + 1) * (lmax - mmax)


@functools.cache
def _healpix_geometry(nside: int) -> dict:
    info = ducc0.healpix.Healpix_Base(nside, "RING").sht_info()
    for array in info.values():
        array.setflags(write=False)
    return info


def _ring_colatitudes(geometry: str, ntheta: int) -> np.ndarray:
    """Ring colatitudes of ``ducc0.sht.synthesis_2d``'s named grids."""
    i = np.arange(ntheta, dtype=np.float64)
    if geometry == "GL":
        return np.asarray(ducc0.misc.GL_thetas(ntheta), np.float64)
    return {
        "CC": lambda: np.pi * i / (ntheta - 1),
        "F1": lambda: np.pi * (i + 0.5) / ntheta,
        "MW": lambda: np.pi * (2 * i + 1) / (2 * ntheta - 1),
        "MWflip": lambda: 2 * np.pi * i / (2 * ntheta - 1),
        "DH": lambda: np.pi * i / ntheta,
        "F2": lambda: np.pi * (i + 1) / (ntheta + 1),
    }[geometry]()


@functools.cache
def _grid_geometry(geometry: str, ntheta: int, nphi: int) -> dict:
    """The 2-D grid as DUCC's general ring geometry: ring i fills pixels i*nphi .. (i+1)*nphi-1."""
    info = {"theta": _ring_colatitudes(geometry, ntheta),
            "nphi": np.full(ntheta, nphi, np.uintp),
            "phi0": np.zeros(ntheta),
            "ringstart": np.arange(ntheta, dtype=np.uintp) * nphi}
    for array in info.values():
        array.setflags(write=False)
    return info


def _m_weights(lmax: int, mmax: int, dtype) -> np.ndarray:
    """1 for m = 0 coefficients, 2 for m > 0, in DUCC's a_lm layout."""
    weights = np.full(nalm(lmax, mmax), 2, dtype)
    weights[: lmax + 1] = 1  # the m = 0 block comes first
    return weights


class _Synthesis:
    """Rules shared by the spherical-harmonic syntheses: a_lm -> maps on a ring geometry.

    A subclass sets ``lmax``, ``mmax``, ``spin``, ``nthreads`` (through
    :meth:`_set_sht`), and provides ``map_shape`` (the pixels of one
    component) and ``_geometry()`` (DUCC's ring description, pixels stored
    ring after ring, so the map is ``map_shape`` flattened).
    """

    def _set_sht(self, lmax: int, mmax, spin: int, nthreads: int) -> None:
        name = type(self).__name__
        self.lmax = int(lmax)
        self.mmax = self.lmax if mmax is None else int(mmax)
        self.spin = int(spin)
        self.nthreads = int(nthreads)
        if not 0 <= self.mmax <= self.lmax:
            raise ValueError(f"{name}: need 0 <= mmax <= lmax, got {mmax}, {lmax}")
        if self.spin < 0 or self.spin > self.lmax:
            raise ValueError(f"{name}: need 0 <= spin <= lmax, got spin={spin}")

    @property
    def ncomp(self) -> int:
        return 1 if self.spin == 0 else 2

    def _ducc_args(self) -> dict:
        return dict(lmax=self.lmax, mmax=self.mmax, spin=self.spin, nthreads=self.nthreads,
                    **self._geometry())

    @jd.abstract
    def shapes(self, alm):
        name = type(self).__name__
        dtype = _check_dtype(name, alm.dtype, _REAL_OF)
        expected = (self.ncomp, nalm(self.lmax, self.mmax))
        if tuple(alm.shape) != expected:
            raise ValueError(
                f"{name}(lmax={self.lmax}, mmax={self.mmax}, spin={self.spin}) "
                f"takes a_lm of shape {expected}, got {tuple(alm.shape)}"
            )
        return jax.ShapeDtypeStruct((self.ncomp,) + self.map_shape, _REAL_OF[dtype])

    # batch="vectorized": leading batch dimensions arrive on every operand;
    # DUCC takes one leading "ntrans" axis, so they are flattened into it.
    @jd.forward
    def apply(self, alm):
        batch = alm.shape[:-2]
        flat = np.ascontiguousarray(alm).reshape((-1,) + alm.shape[-2:])
        maps = ducc0.sht.synthesis(alm=flat, **self._ducc_args())
        return maps.reshape(batch + (self.ncomp,) + self.map_shape)

    @jd.adjoint
    def apply_adjoint(self, maps):
        batch = maps.shape[: maps.ndim - 1 - len(self.map_shape)]
        flat = np.ascontiguousarray(maps).reshape((-1, self.ncomp, math.prod(self.map_shape)))
        alm = ducc0.sht.adjoint_synthesis(map=flat, **self._ducc_args())
        alm *= _m_weights(self.lmax, self.mmax, alm.real.dtype)
        return alm.reshape(batch + alm.shape[-2:])


class healpix_synthesis(_Synthesis, jd.Primitive, linear=True, batch="vectorized"):
    """Spherical-harmonic synthesis a_lm -> HEALPix RING map (``ducc0.sht.synthesis``).

    Args:
        nside: HEALPix resolution; the map has ``12 * nside**2`` pixels.
        lmax: maximum multipole (inclusive).
        mmax: maximum m (inclusive); defaults to `lmax`.
        spin: 0 (one scalar map) or > 0 (two maps, e.g. Q/U from E/B for 2).
        nthreads: DUCC threads per call (0: all hardware threads).

    Input: complex a_lm of shape ``(ncomp, nalm(lmax, mmax))``, ncomp 1 for
    spin 0 and 2 otherwise, complex64 or complex128. Output: the real map,
    ``(ncomp, 12 * nside**2)``, float32 or float64 to match.

    The HEALPix geometry (ring colatitudes, pixel counts, offsets) is static
    configuration derived from `nside`, not an input: it is fixed by `nside`,
    never differentiated, and keeping it out of the inputs lets ops with equal
    settings share compiled code.

    Only m >= 0 is stored; a real map counts each m > 0 coefficient together
    with its conjugate -m partner, so the synthesis is real-linear and its
    adjoint (for the pairing Re Σ conj(a)·b) is DUCC's ``adjoint_synthesis``
    with the m > 0 coefficients doubled. The imaginary parts of the m = 0
    coefficients do not enter the map; their cotangent is zero.

    Example:
        >>> import numpy as np
        >>> from jaxdecl.contrib import ducc
        >>> op = ducc.healpix_synthesis(nside=2, lmax=2)
        >>> alm = np.zeros((1, ducc.nalm(2)), np.complex128); alm[0, 0] = np.sqrt(4 * np.pi)
        >>> np.allclose(op(alm), 1.0)
        True
    """

    def __init__(self, nside: int, lmax: int, mmax: int | None = None, spin: int = 0,
                 nthreads: int = 1):
        self.nside = int(nside)
        self._set_sht(lmax, mmax, spin, nthreads)

    @property
    def npix(self) -> int:
        return 12 * self.nside**2

    @property
    def map_shape(self) -> tuple:
        return (self.npix,)

    def _geometry(self) -> dict:
        return _healpix_geometry(self.nside)


_GRID_GEOMETRIES = ("GL", "CC", "F1", "F2", "DH", "MW", "MWflip")


class synthesis_2d(_Synthesis, jd.Primitive, linear=True, batch="vectorized"):
    """Spherical-harmonic synthesis a_lm -> 2-D (θ, φ) grid map (``ducc0.sht.synthesis_2d``).

    Args:
        geometry: ring placement in θ, as DUCC names it: "GL" (Gauss-Legendre),
            "CC" (Clenshaw-Curtis, rings on both poles), "F1"/"F2" (Fejér's
            first/second rule), "DH" (Driscoll-Healy), "MW", "MWflip"
            (McEwen-Wiaux).
        ntheta: number of rings (from the north pole down).
        nphi: pixels per ring, the first at φ = 0.
        lmax: maximum multipole (inclusive).
        mmax: maximum m (inclusive); defaults to `lmax`.
        spin: 0 (one scalar map) or > 0 (two maps).
        nthreads: DUCC threads per call (0: all hardware threads).

    Input: complex a_lm ``(ncomp, nalm(lmax, mmax))``, complex64 or
    complex128, ncomp 1 for spin 0 and 2 otherwise. Output: the real map
    ``(ncomp, ntheta, nphi)``, float32 or float64 to match.

    The grid is handed to DUCC's general ring synthesis, which takes a
    leading batch axis, so a ``vmap`` costs one DUCC call. As for
    :class:`healpix_synthesis`, the map is real-linear in the a_lm and the
    adjoint is ``adjoint_synthesis`` with the m > 0 coefficients doubled.

    Example:
        >>> import numpy as np
        >>> from jaxdecl.contrib import ducc
        >>> op = ducc.synthesis_2d("GL", ntheta=3, nphi=5, lmax=2)
        >>> alm = np.zeros((1, ducc.nalm(2)), np.complex128); alm[0, 0] = np.sqrt(4 * np.pi)
        >>> np.allclose(op(alm), 1.0)
        True
    """

    def __init__(self, geometry: str, ntheta: int, nphi: int, lmax: int,
                 mmax: int | None = None, spin: int = 0, nthreads: int = 1):
        if geometry not in _GRID_GEOMETRIES:
            raise ValueError(
                f"synthesis_2d: geometry must be one of {', '.join(_GRID_GEOMETRIES)}, "
                f"got {geometry!r}"
            )
        self.geometry = geometry
        self.ntheta = int(ntheta)
        self.nphi = int(nphi)
        if self.ntheta < (2 if geometry == "CC" else 1) or self.nphi < 1:
            raise ValueError(
                f"synthesis_2d: ntheta={ntheta}, nphi={nphi} is too small a {geometry} grid"
            )
        self._set_sht(lmax, mmax, spin, nthreads)

    @property
    def map_shape(self) -> tuple:
        return (self.ntheta, self.nphi)

    def _geometry(self) -> dict:
        return _grid_geometry(self.geometry, self.ntheta, self.nphi)


def _default_epsilon(dtype) -> float:
    return 1e-5 if np.dtype(dtype) == np.complex64 else 1e-12


def _check_coord(name: str, coord, ndim: int) -> None:
    _check_dtype(f"{name} coord", coord.dtype, _COMPLEX_OF)
    if len(coord.shape) != 2 or coord.shape[1] != ndim:
        raise ValueError(
            f"{name}: coord must have shape (npoints, {ndim}) for a rank-{ndim} grid, got "
            f"{tuple(coord.shape)}"
        )


class _NUFFT:
    """Settings shared by :class:`u2nu` and :class:`nu2u`."""

    def __init__(self, forward: bool = True, epsilon: float | None = None,
                 periodicity: float = 2 * np.pi, fft_order: bool = False, nthreads: int = 1):
        self.forward = bool(forward)
        self.epsilon = None if epsilon is None else float(epsilon)
        self.periodicity = float(periodicity)
        self.fft_order = bool(fft_order)
        self.nthreads = int(nthreads)

    def _ducc_args(self, dtype, forward: bool) -> dict:
        epsilon = _default_epsilon(dtype) if self.epsilon is None else self.epsilon
        return {"forward": forward, "epsilon": epsilon, "periodicity": self.periodicity,
                "fft_order": self.fft_order, "nthreads": self.nthreads}


class u2nu(_NUFFT, jd.Primitive, linear=True, nondiff=("coord",)):
    """Type-2 NUFFT: uniform grid -> values at non-uniform points (``ducc0.nufft.u2nu``).

    Args:
        forward: exponent -1 if True, +1 otherwise.
        epsilon: requested accuracy; default 1e-5 (complex64) or 1e-12 (complex128).
        periodicity: period of the coordinates (2π: coordinates are angles).
        fft_order: grid starts at the zero mode (True) or the most negative one.
        nthreads: DUCC threads per call.

    Inputs: ``coord`` (npoints, ndim) float32/float64, never differentiated;
    ``grid`` complex64/complex128 of rank ndim (1 to 3). Output: (npoints,) of
    the grid's dtype. The adjoint is :class:`nu2u` in the other direction; both
    are exact only to `epsilon`, so dot-product tests hold to that accuracy.

    Example:
        >>> import numpy as np
        >>> from jaxdecl.contrib import ducc
        >>> grid = np.zeros(4, np.complex128); grid[2] = 1.0  # the zero mode
        >>> np.allclose(ducc.u2nu()(np.array([[0.3]]), grid), 1.0, atol=1e-4)
        True
    """

    @jd.abstract
    def shapes(self, coord, grid):
        _check_dtype("u2nu grid", grid.dtype, _REAL_OF)
        _check_coord("u2nu", coord, len(grid.shape))
        return jax.ShapeDtypeStruct((coord.shape[0],), grid.dtype)

    @jd.forward
    def apply(self, coord, grid, *, out):
        ducc0.nufft.u2nu(grid=grid, coord=coord, out=out,
                         **self._ducc_args(grid.dtype, self.forward))

    @jd.adjoint
    def apply_adjoint(self, coord, points, *, out):
        ducc0.nufft.nu2u(points=points, coord=coord, out=out,
                         **self._ducc_args(points.dtype, not self.forward))


class nu2u(_NUFFT, jd.Primitive, linear=True, nondiff=("coord",)):
    """Type-1 NUFFT: values at non-uniform points -> uniform grid (``ducc0.nufft.nu2u``).

    Args:
        grid_shape: shape of the output grid (rank 1 to 3).
        forward, epsilon, periodicity, fft_order, nthreads: as :class:`u2nu`.

    Inputs: ``coord`` (npoints, ndim), never differentiated, and ``points``
    (npoints,) complex64/complex128. The adjoint is :class:`u2nu` in the other
    direction.

    Example:
        >>> import numpy as np
        >>> from jaxdecl.contrib import ducc
        >>> grid = ducc.nu2u((4,))(np.array([[0.0]]), np.array([1.0 + 0j]))
        >>> np.allclose(grid, 1.0, atol=1e-4)
        True
    """

    def __init__(self, grid_shape, forward: bool = True, epsilon: float | None = None,
                 periodicity: float = 2 * np.pi, fft_order: bool = False, nthreads: int = 1):
        super().__init__(forward, epsilon, periodicity, fft_order, nthreads)
        self.grid_shape = tuple(int(n) for n in grid_shape)

    @jd.abstract
    def shapes(self, coord, points):
        _check_dtype("nu2u points", points.dtype, _REAL_OF)
        _check_coord("nu2u", coord, len(self.grid_shape))
        if tuple(points.shape) != (coord.shape[0],):
            raise ValueError(
                f"nu2u: points must have shape ({coord.shape[0]},) to match coord, got "
                f"{tuple(points.shape)}"
            )
        return jax.ShapeDtypeStruct(self.grid_shape, points.dtype)

    @jd.forward
    def apply(self, coord, points, *, out):
        ducc0.nufft.nu2u(points=points, coord=coord, out=out,
                         **self._ducc_args(points.dtype, self.forward))

    @jd.adjoint
    def apply_adjoint(self, coord, grid, *, out):
        ducc0.nufft.u2nu(grid=grid, coord=coord, out=out,
                         **self._ducc_args(grid.dtype, not self.forward))


def _check_visibility_coords(name: str, uvw, freq) -> None:
    for label, array in (("uvw", uvw), ("freq", freq)):
        _check_dtype(f"{name} {label}", array.dtype, _COMPLEX_OF)
    if len(uvw.shape) != 2 or uvw.shape[1] != 3:
        raise ValueError(f"{name}: uvw must have shape (nrows, 3), got {tuple(uvw.shape)}")
    if len(freq.shape) != 1:
        raise ValueError(f"{name}: freq must have shape (nchan,), got {tuple(freq.shape)}")


def _check_image_shape(name: str, shape) -> None:
    if len(shape) != 2 or any(n < 32 or n % 2 for n in shape):
        raise ValueError(
            f"{name}: the dirty image must be 2-D with even sides of at least 32 pixels "
            f"(a DUCC requirement), got {tuple(shape)}"
        )


class _WGridder:
    """Settings shared by :class:`dirty2vis` and :class:`vis2dirty`."""

    def __init__(self, pixsize_x: float, pixsize_y: float, epsilon: float | None = None,
                 do_wgridding: bool = False, nthreads: int = 1):
        self.pixsize_x = float(pixsize_x)
        self.pixsize_y = float(pixsize_y)
        self.epsilon = None if epsilon is None else float(epsilon)
        self.do_wgridding = bool(do_wgridding)
        self.nthreads = int(nthreads)

    def _ducc_args(self, uvw, freq, real_dtype) -> dict:
        if self.epsilon is not None:
            epsilon = self.epsilon
        else:  # DUCC needs epsilon > 1e-5 in single and > 2e-13 in double precision
            epsilon = 1e-4 if np.dtype(real_dtype) == np.float32 else 1e-10
        # DUCC takes coordinates in double precision only; without jax_enable_x64
        # they arrive as float32 and are widened here (a small copy).
        return {"uvw": np.asarray(uvw, np.float64), "freq": np.asarray(freq, np.float64),
                "pixsize_x": self.pixsize_x, "pixsize_y": self.pixsize_y, "epsilon": epsilon,
                "do_wgridding": self.do_wgridding, "nthreads": self.nthreads}


class dirty2vis(_WGridder, jd.Primitive, linear=True, nondiff=("uvw", "freq")):
    """Radio-interferometric degridding: dirty image -> visibilities (``ducc0.wgridder``).

    Args:
        pixsize_x, pixsize_y: angular pixel size of the image (projected radians).
        epsilon: requested accuracy; default 1e-4 (float32) or 1e-10 (float64).
        do_wgridding: apply the full w-term; otherwise w is taken as zero.
        nthreads: DUCC threads per call.

    Inputs: ``uvw`` (nrows, 3) in metres and ``freq`` (nchan,) in Hz, never
    differentiated; ``dirty`` (npix_x, npix_y), float32/float64, both sides
    even and at least 32. Output: visibilities (nrows, nchan), complex64 or
    complex128 to match, V = A d with A = exp(-2πi f/c (u l + v m + w (n-1))) / n.

    The map d ↦ A d is real-linear from real images to complex visibilities;
    its adjoint is :class:`vis2dirty`, d = Re(Aᴴ V), so JAX's transpose of a
    cotangent ct is ``vis2dirty(conj(ct))``. Both directions are exact only to
    `epsilon`, so dot-product tests hold to that accuracy.

    Example:
        >>> import numpy as np
        >>> from jaxdecl.contrib import ducc
        >>> dirty = np.zeros((32, 32)); dirty[16, 16] = 1.0  # a source at the phase centre
        >>> vis = ducc.dirty2vis(1e-5, 1e-5)(np.array([[100.0, 50.0, 0.0]]), np.array([1e9]), dirty)
        >>> np.allclose(vis, 1.0)
        True
    """

    @jd.abstract
    def shapes(self, uvw, freq, dirty):
        dtype = _check_dtype("dirty2vis dirty", dirty.dtype, _COMPLEX_OF)
        _check_visibility_coords("dirty2vis", uvw, freq)
        _check_image_shape("dirty2vis", dirty.shape)
        return jax.ShapeDtypeStruct((uvw.shape[0], freq.shape[0]), _COMPLEX_OF[dtype])

    @jd.forward
    def apply(self, uvw, freq, dirty, *, out):
        ducc0.wgridder.experimental.dirty2vis(dirty=dirty, vis=out,
                                              **self._ducc_args(uvw, freq, dirty.dtype))

    @jd.adjoint
    def apply_adjoint(self, uvw, freq, vis, *, out):
        ducc0.wgridder.experimental.vis2dirty(vis=vis, dirty=out,
                                              **self._ducc_args(uvw, freq, out.dtype))


class vis2dirty(_WGridder, jd.Primitive, linear=True, nondiff=("uvw", "freq")):
    """Radio-interferometric gridding: visibilities -> dirty image (``ducc0.wgridder``).

    Args:
        npix_x, npix_y: image size, both even and at least 32.
        pixsize_x, pixsize_y, epsilon, do_wgridding, nthreads: as :class:`dirty2vis`.

    Inputs: ``uvw`` (nrows, 3) and ``freq`` (nchan,), never differentiated;
    ``vis`` (nrows, nchan), complex64/complex128. Output: the dirty image
    (npix_x, npix_y), float32 or float64 to match, d = Re(Aᴴ V) with A as in
    :class:`dirty2vis`.

    The map is real-linear; JAX's transpose of a (real) image cotangent ct is
    ``conj(dirty2vis(ct))``: Re Σ ct·Re(Aᴴ V) = Re Σ conj(A ct)·V.

    Example:
        >>> import numpy as np
        >>> from jaxdecl.contrib import ducc
        >>> op = ducc.vis2dirty(32, 32, 1e-5, 1e-5)
        >>> dirty = op(np.array([[100.0, 50.0, 0.0]]), np.array([1e9]), np.array([[1.0 + 0j]]))
        >>> bool(np.isclose(dirty[16, 16], 1.0))
        True
    """

    def __init__(self, npix_x: int, npix_y: int, pixsize_x: float, pixsize_y: float,
                 epsilon: float | None = None, do_wgridding: bool = False, nthreads: int = 1):
        super().__init__(pixsize_x, pixsize_y, epsilon, do_wgridding, nthreads)
        self.npix_x = int(npix_x)
        self.npix_y = int(npix_y)
        _check_image_shape("vis2dirty", (self.npix_x, self.npix_y))

    @jd.abstract
    def shapes(self, uvw, freq, vis):
        dtype = _check_dtype("vis2dirty vis", vis.dtype, _REAL_OF)
        _check_visibility_coords("vis2dirty", uvw, freq)
        expected = (uvw.shape[0], freq.shape[0])
        if tuple(vis.shape) != expected:
            raise ValueError(
                f"vis2dirty: vis must have shape (nrows, nchan) = {expected} to match uvw and "
                f"freq, got {tuple(vis.shape)}"
            )
        return jax.ShapeDtypeStruct((self.npix_x, self.npix_y), _REAL_OF[dtype])

    @jd.forward
    def apply(self, uvw, freq, vis, *, out):
        ducc0.wgridder.experimental.vis2dirty(vis=vis, dirty=out,
                                              **self._ducc_args(uvw, freq, out.dtype))

    @jd.adjoint
    def apply_adjoint(self, uvw, freq, dirty, *, out):
        ducc0.wgridder.experimental.dirty2vis(dirty=dirty, vis=out,
                                              **self._ducc_args(uvw, freq, dirty.dtype))
