"""Spherical-harmonic syntheses: ``healpix_synthesis``, ``synthesis_2d``, ``nalm`` (``ducc0.sht``).

Both ops hand DUCC's general ring synthesis a ring geometry (HEALPix, or a
named 2-D grid) and differ only in that geometry; the rules, the a_lm layout
and the adjoint live in one shared base class.

Sharding: everything one synthesis needs is whole (``replicate``):
its components, its a_lm and its pixels, so a batch of maps (``vmap``) is
what splits across devices, each synthesising its own maps. The map's pixels
are a factor no input has (replicated).
"""

from __future__ import annotations

import functools
import math

import ducc0
import jax
import numpy as np

import jaxdecl as jd

from ._checks import REAL_OF, check_dtype


def nalm(lmax: int, mmax: int | None = None) -> int:
    """Number of a_lm coefficients in DUCC's (and healpy's) m-major triangular layout.

    Example:
        >>> from jaxdecl.contrib import ducc
        >>> ducc.nalm(2)
        6
    """
    mmax = lmax if mmax is None else mmax
    return ((mmax + 1) * (mmax + 2)) // 2 + (mmax + 1) * (lmax - mmax)


def _read_only(geometry: dict) -> dict:
    """Locks the arrays of a cached geometry: every op with the same settings shares them."""
    for array in geometry.values():
        array.setflags(write=False)
    return geometry


@functools.cache
def _healpix_geometry(nside: int) -> dict:
    return _read_only(ducc0.healpix.Healpix_Base(nside, "RING").sht_info())


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
    return _read_only({"theta": _ring_colatitudes(geometry, ntheta),
                       "nphi": np.full(ntheta, nphi, np.uintp),
                       "phi0": np.zeros(ntheta),
                       "ringstart": np.arange(ntheta, dtype=np.uintp) * nphi})


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
        dtype = check_dtype(name, alm.dtype, REAL_OF)
        expected = (self.ncomp, nalm(self.lmax, self.mmax))
        if tuple(alm.shape) != expected:
            raise ValueError(
                f"{name}(lmax={self.lmax}, mmax={self.mmax}, spin={self.spin}) "
                f"takes a_lm of shape {expected}, got {tuple(alm.shape)}"
            )
        return jax.ShapeDtypeStruct((self.ncomp,) + self.map_shape, REAL_OF[dtype])

    @jd.sharding
    def partition(self, alm):
        pixels = tuple(f"p{i}" for i in range(len(self.map_shape)))
        return jd.ShardingRule(f"c l -> c {' '.join(pixels)}",
                               replicate=("c", "l") + pixels)

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
