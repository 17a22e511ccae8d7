"""Tests of jaxdecl.contrib.ducc's NUFFTs (u2nu, nu2u) against the direct sum."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers_ducc import COMPLEX, REAL_OF, assert_close, pairing, random

ducc0 = pytest.importorskip("ducc0")
from jaxdecl.contrib import ducc

GRID_SHAPE = (4, 6)


def nufft_matrix(coord, shape, forward=True):
    """Dense (npoints, prod(shape)) matrix of exp(∓i k·x), modes from -n/2 (not fft_order)."""
    modes = np.stack(np.meshgrid(*[np.arange(-(n // 2), n - n // 2) for n in shape],
                                 indexing="ij"), axis=-1).reshape(-1, len(shape))
    sign = -1 if forward else 1
    return np.exp(sign * 1j * np.asarray(coord, np.float64) @ modes.T)


def nufft_inputs(rng, dtype, npoints=9):
    coord = rng.uniform(-np.pi, np.pi, (npoints, len(GRID_SHAPE))).astype(REAL_OF[np.dtype(dtype)])
    return coord, random(rng, GRID_SHAPE, dtype), random(rng, (npoints,), dtype)


def nufft_tol(dtype):
    return 1e-4 if dtype == np.complex64 else 1e-10


@pytest.mark.parametrize("dtype", COMPLEX)
@pytest.mark.parametrize("forward", [True, False])
def test_nufft_matches_direct_sum(dtype, forward):
    coord, grid, points = nufft_inputs(np.random.default_rng(17), dtype)
    matrix = nufft_matrix(coord, GRID_SHAPE, forward)
    values = ducc.u2nu(forward=forward)(coord, grid)
    assert values.dtype == dtype
    np.testing.assert_allclose(values, matrix @ grid.ravel(), atol=nufft_tol(dtype) * 30)
    gridded = ducc.nu2u(GRID_SHAPE, forward=forward)(coord, points)
    assert gridded.shape == GRID_SHAPE and gridded.dtype == dtype
    np.testing.assert_allclose(gridded.ravel(), matrix.T @ points, atol=nufft_tol(dtype) * 30)


@pytest.mark.parametrize("dtype", COMPLEX)
def test_nufft_transpose(dtype):
    coord, grid, points = nufft_inputs(np.random.default_rng(18), dtype)
    forward = ducc.u2nu(forward=False)
    (grid_ct,) = jax.linear_transpose(lambda g: forward(coord, g), grid)(points)
    lhs, rhs = pairing(points, forward(coord, grid)), pairing(grid_ct, grid)
    assert abs(lhs - rhs) <= nufft_tol(dtype) * 100, (lhs, rhs)
    backward = ducc.nu2u(GRID_SHAPE)
    (points_ct,) = jax.linear_transpose(lambda p: backward(coord, p), points)(grid)
    lhs, rhs = pairing(grid, backward(coord, points)), pairing(points_ct, points)
    assert abs(lhs - rhs) <= nufft_tol(dtype) * 100, (lhs, rhs)


def test_nufft_vmap_over_grids_and_coordinates():
    rng = np.random.default_rng(19)
    coord, grid, _ = nufft_inputs(rng, np.complex128)
    op = ducc.u2nu()
    grids = np.stack([grid, 2j * grid, grid.conj()])
    coords = np.stack([coord, coord + 0.1, -coord])
    got = jax.vmap(op, in_axes=(0, 0))(coords, grids)
    expected = np.stack([op(c, g) for c, g in zip(coords, grids)])
    assert_close(got, expected, np.complex128)
    shared = jax.vmap(op, in_axes=(None, 0))(coord, grids)
    assert_close(shared, np.stack([op(coord, g) for g in grids]), np.complex128)


def test_nufft_grad_matches_dense_reference_and_rejects_coord_grad():
    rng = np.random.default_rng(20)
    coord, grid, _ = nufft_inputs(rng, np.complex128)
    matrix = jnp.asarray(nufft_matrix(coord, GRID_SHAPE))
    weights = rng.standard_normal(len(coord))
    op = ducc.u2nu()

    def loss(transform):
        return lambda g: jnp.sum(weights * jnp.abs(transform(g)) ** 2)

    np.testing.assert_allclose(jax.grad(loss(lambda g: op(coord, g)))(grid),
                               jax.grad(loss(lambda g: matrix @ g.ravel()))(grid), atol=1e-9)
    with pytest.raises(ValueError, match="coord"):
        jax.grad(lambda c: jnp.sum(jnp.abs(op(c, grid))))(coord)
