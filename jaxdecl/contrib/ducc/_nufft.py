"""Non-uniform FFTs: ``u2nu`` (type 2) and ``nu2u`` (type 1) (``ducc0.nufft``).

Each is the other's adjoint, so both ops are the same two DUCC calls in
opposite roles; the point coordinates are a non-differentiable input.

Sharding: ``u2nu`` declares its points independent (the value at
a point needs the whole grid and that point's coordinates only), so points
and coordinates sharded alike are evaluated on each device without a gather;
the transpose sums the per-device grids. ``nu2u`` sums over its points
(``reduce``): each device grids its own points and the partial grids are
added up. Its grid dims are factors no input has (replicated).
"""

from __future__ import annotations

import ducc0
import jax
import numpy as np

import jaxdecl as jd

from ._checks import COMPLEX_OF, REAL_OF, check_dtype


def _default_epsilon(dtype) -> float:
    return 1e-5 if np.dtype(dtype) == np.complex64 else 1e-12


def _check_coord(name: str, coord, ndim: int) -> None:
    check_dtype(f"{name} coord", coord.dtype, COMPLEX_OF)
    if len(coord.shape) != 2 or coord.shape[1] != ndim:
        raise ValueError(
            f"{name}: coord must have shape (npoints, {ndim}) for a rank-{ndim} grid, got "
            f"{tuple(coord.shape)}"
        )


class _NUFFT:
    """Settings and DUCC calls shared by :class:`u2nu` and :class:`nu2u`."""

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

    # Each op's adjoint is the other op with the exponent's sign flipped, so both
    # ops are made of these two calls, in opposite roles.
    def _u2nu(self, coord, grid, out, forward: bool) -> None:
        ducc0.nufft.u2nu(grid=grid, coord=coord, out=out, **self._ducc_args(grid.dtype, forward))

    def _nu2u(self, coord, points, out, forward: bool) -> None:
        ducc0.nufft.nu2u(points=points, coord=coord, out=out,
                         **self._ducc_args(points.dtype, forward))


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
        check_dtype("u2nu grid", grid.dtype, REAL_OF)
        _check_coord("u2nu", coord, len(grid.shape))
        return jax.ShapeDtypeStruct((coord.shape[0],), grid.dtype)

    @jd.sharding
    def partition(self, coord, grid):
        dims = " ".join(f"g{i}" for i in range(len(grid.shape)))
        return jd.ShardingRule(f"p k, {dims} -> p",
                               replicate=("k",) + tuple(dims.split()))

    @jd.forward
    def apply(self, coord, grid, *, out):
        self._u2nu(coord, grid, out, self.forward)

    @jd.adjoint
    def apply_adjoint(self, coord, points, *, out):
        self._nu2u(coord, points, out, not self.forward)


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
        check_dtype("nu2u points", points.dtype, REAL_OF)
        _check_coord("nu2u", coord, len(self.grid_shape))
        if tuple(points.shape) != (coord.shape[0],):
            raise ValueError(
                f"nu2u: points must have shape ({coord.shape[0]},) to match coord, got "
                f"{tuple(points.shape)}"
            )
        return jax.ShapeDtypeStruct(self.grid_shape, points.dtype)

    @jd.sharding
    def partition(self, coord, points):
        grid = tuple(f"g{i}" for i in range(len(self.grid_shape)))
        return jd.ShardingRule(f"p k, p -> {' '.join(grid)}",
                               replicate=("k",) + grid, reduce=("p",))

    @jd.forward
    def apply(self, coord, points, *, out):
        self._nu2u(coord, points, out, self.forward)

    @jd.adjoint
    def apply_adjoint(self, coord, grid, *, out):
        self._u2nu(coord, grid, out, not self.forward)
