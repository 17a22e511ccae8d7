"""Tests of jaxdecl.contrib.ducc's radio gridding (dirty2vis, vis2dirty) against direct sums."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers_ducc import COMPLEX_OF, REAL, assert_close, pairing, random

ducc0 = pytest.importorskip("ducc0")
from jaxdecl.contrib import ducc

SPEED_OF_LIGHT = 299792458.0
NPIX, NROWS = 32, 50
PIXSIZE = np.radians(10.0) / NPIX  # a wide field, so the w-term matters
FREQ = np.array([1.0e9, 1.1e9])


def wgridder_inputs(rng, dtype):
    """uvw within the band the 32x32 image resolves, freq, a dirty image and visibilities."""
    uvw = (rng.random((NROWS, 3)) - 0.5) / (PIXSIZE * FREQ.max() / SPEED_OF_LIGHT)
    dirty = random(rng, (NPIX, NPIX), dtype)
    vis = random(rng, (NROWS, len(FREQ)), COMPLEX_OF[np.dtype(dtype)])
    return uvw, FREQ, dirty, vis


def wgridder_matrix(uvw, freq, do_wgridding):
    """Dense A of V = A d: exp(-2πi f/c (u l + v m - w (n-1))) / n, rows (row, chan)."""
    coords = (np.arange(NPIX) - NPIX / 2) * PIXSIZE
    l, m = (c.ravel() for c in np.meshgrid(coords, coords, indexing="ij"))  # noqa: E741
    if do_wgridding:
        nm1 = -(l**2 + m**2) / (np.sqrt(1 - l**2 - m**2) + 1)
    else:
        nm1 = np.zeros_like(l)
    scaled = uvw[:, None, :] * (freq / SPEED_OF_LIGHT)[None, :, None]  # (row, chan, 3)
    phase = (scaled[..., 0, None] * l + scaled[..., 1, None] * m
             - scaled[..., 2, None] * nm1)
    return (np.exp(-2j * np.pi * phase) / (nm1 + 1)).reshape(-1, NPIX * NPIX)


def wgridder_tol(dtype):
    return 1e-3 if np.dtype(dtype) in (np.float32, np.complex64) else 1e-8


def assert_relative(actual, expected, rel):
    error = np.linalg.norm(np.asarray(actual) - expected) / np.linalg.norm(expected)
    assert error <= rel, error


@pytest.mark.parametrize("dtype", REAL)
@pytest.mark.parametrize("do_wgridding", [False, True])
def test_wgridder_matches_ducc_and_direct_sum(dtype, do_wgridding):
    uvw, freq, dirty, vis = wgridder_inputs(np.random.default_rng(26), dtype)
    settings = {"pixsize_x": PIXSIZE, "pixsize_y": PIXSIZE, "do_wgridding": do_wgridding}
    epsilon = 1e-4 if dtype == np.float32 else 1e-10
    degrid = ducc.dirty2vis(**settings)
    grid = ducc.vis2dirty(NPIX, NPIX, **settings)

    got_vis = degrid(uvw, freq, dirty)
    assert got_vis.shape == (NROWS, 2) and got_vis.dtype == COMPLEX_OF[dtype]
    assert_close(got_vis, ducc0.wgridder.dirty2vis(uvw=uvw, freq=freq, dirty=dirty,
                                                   epsilon=epsilon, **settings), dtype)
    got_dirty = jax.jit(grid)(uvw, freq, vis)
    assert got_dirty.shape == (NPIX, NPIX) and got_dirty.dtype == dtype
    assert_close(got_dirty, ducc0.wgridder.vis2dirty(uvw=uvw, freq=freq, vis=vis, npix_x=NPIX,
                                                     npix_y=NPIX, epsilon=epsilon, **settings),
                 dtype)

    matrix = wgridder_matrix(uvw, freq, do_wgridding)
    assert_relative(got_vis.ravel(), matrix @ dirty.ravel().astype(np.float64),
                    wgridder_tol(dtype))
    assert_relative(got_dirty.ravel(), np.real(matrix.conj().T @ vis.ravel()), wgridder_tol(dtype))


@pytest.mark.parametrize("dtype", REAL)
@pytest.mark.parametrize("do_wgridding", [False, True])
def test_wgridder_transposes(dtype, do_wgridding):
    rng = np.random.default_rng(27)
    uvw, freq, dirty, vis = wgridder_inputs(rng, dtype)
    settings = {"pixsize_x": PIXSIZE, "pixsize_y": PIXSIZE, "do_wgridding": do_wgridding}
    degrid, grid = ducc.dirty2vis(**settings), ducc.vis2dirty(NPIX, NPIX, **settings)
    scale = np.linalg.norm(dirty) * np.linalg.norm(vis)

    (dirty_ct,) = jax.linear_transpose(lambda d: degrid(uvw, freq, d), dirty)(vis)
    assert dirty_ct.dtype == dtype
    lhs, rhs = pairing(vis, degrid(uvw, freq, dirty)), pairing(dirty_ct, dirty)
    assert abs(lhs - rhs) <= wgridder_tol(dtype) * scale, (lhs, rhs)

    (vis_ct,) = jax.linear_transpose(lambda v: grid(uvw, freq, v), vis)(dirty)
    assert vis_ct.dtype == COMPLEX_OF[dtype]
    lhs, rhs = pairing(dirty, grid(uvw, freq, vis)), pairing(vis_ct, vis)
    assert abs(lhs - rhs) <= wgridder_tol(dtype) * scale, (lhs, rhs)


def test_wgridder_grads_match_dense_reference():
    rng = np.random.default_rng(28)
    uvw, freq, dirty, vis = wgridder_inputs(rng, np.float64)
    settings = {"pixsize_x": PIXSIZE, "pixsize_y": PIXSIZE, "do_wgridding": True, "epsilon": 1e-12}
    degrid, grid = ducc.dirty2vis(**settings), ducc.vis2dirty(NPIX, NPIX, **settings)
    matrix = jnp.asarray(wgridder_matrix(uvw, freq, True))
    vis_weights = rng.standard_normal((NROWS, 2))
    dirty_weights = rng.standard_normal((NPIX, NPIX))

    def vis_loss(transform):
        return lambda d: jnp.sum(vis_weights * jnp.abs(transform(d)) ** 2)

    def dirty_loss(transform):
        return lambda v: jnp.sum(dirty_weights * jnp.tanh(transform(v)))

    got = jax.grad(vis_loss(lambda d: degrid(uvw, freq, d)))(dirty)
    expected = jax.grad(vis_loss(lambda d: (matrix @ d.ravel()).reshape(NROWS, 2)))(dirty)
    assert_relative(got, expected, 1e-9)
    got = jax.jit(jax.grad(dirty_loss(lambda v: grid(uvw, freq, v))))(vis)
    expected = jax.grad(dirty_loss(
        lambda v: jnp.real(matrix.conj().T @ v.ravel()).reshape(NPIX, NPIX)))(vis)
    assert got.dtype == np.complex128
    assert_relative(got, expected, 1e-9)


def test_wgridder_vmap_matches_loop():
    rng = np.random.default_rng(29)
    uvw, freq, dirty, vis = wgridder_inputs(rng, np.float64)
    degrid = ducc.dirty2vis(PIXSIZE, PIXSIZE, do_wgridding=True)
    grid = ducc.vis2dirty(NPIX, NPIX, PIXSIZE, PIXSIZE, do_wgridding=True)
    dirties = np.stack([dirty, -2 * dirty, dirty.T])
    got = jax.vmap(degrid, in_axes=(None, None, 0), out_axes=2)(uvw, freq, dirties)
    assert_close(got, np.stack([degrid(uvw, freq, d) for d in dirties], axis=2), np.float64)
    uvws = np.stack([uvw, 0.5 * uvw, -uvw])
    viss = np.stack([vis, 1j * vis, vis.conj()])
    got = jax.vmap(grid, in_axes=(0, None, 0))(uvws, freq, viss)
    assert_close(got, np.stack([grid(u, freq, v) for u, v in zip(uvws, viss)]), np.float64)


def test_wgridder_rejects_coordinate_grads_and_bad_shapes():
    uvw, freq, dirty, vis = wgridder_inputs(np.random.default_rng(30), np.float64)
    degrid = ducc.dirty2vis(PIXSIZE, PIXSIZE)
    with pytest.raises(ValueError, match="uvw"):
        jax.grad(lambda u: jnp.sum(jnp.abs(degrid(u, freq, dirty))))(uvw)
    with pytest.raises(ValueError, match="freq"):
        jax.grad(lambda f: jnp.sum(jnp.abs(degrid(uvw, f, dirty))))(freq)
    with pytest.raises(ValueError, match="even sides of at least 32"):
        degrid(uvw, freq, np.zeros((30, 32)))
    with pytest.raises(ValueError, match="even sides of at least 32"):
        ducc.vis2dirty(33, 32, PIXSIZE, PIXSIZE)
    with pytest.raises(ValueError, match=r"vis must have shape \(nrows, nchan\) = \(50, 2\)"):
        ducc.vis2dirty(NPIX, NPIX, PIXSIZE, PIXSIZE)(uvw, freq, vis[:, :1])
