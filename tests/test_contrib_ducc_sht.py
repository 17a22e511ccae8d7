"""Tests of jaxdecl.contrib.ducc's spherical-harmonic syntheses against DUCC and analytic maps."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import subprocess_env
from helpers_ducc import COMPLEX, REAL_OF, assert_close, assert_transpose, random

ducc0 = pytest.importorskip("ducc0")
from jaxdecl.contrib import ducc

# -- HEALPix synthesis -------------------------------------------------------------------

NSIDE, LMAX = 8, 16


def direct_synthesis(alm, spin, nside=NSIDE, lmax=LMAX):
    geometry = ducc0.healpix.Healpix_Base(nside, "RING").sht_info()
    return ducc0.sht.synthesis(alm=alm, lmax=lmax, spin=spin, nthreads=1, **geometry)


def random_alm(rng, ncomp, dtype, lmax=LMAX):
    alm = random(rng, (ncomp, ducc.nalm(lmax)), dtype)
    alm[:, : lmax + 1] = alm[:, : lmax + 1].real  # a_l0 of a real map are real
    return alm


@pytest.mark.parametrize("dtype", COMPLEX)
@pytest.mark.parametrize("spin", [0, 2])
def test_synthesis_matches_ducc(dtype, spin):
    op = ducc.healpix_synthesis(NSIDE, LMAX, spin=spin)
    alm = random_alm(np.random.default_rng(13), op.ncomp, dtype)
    got = op(alm)
    assert got.shape == (op.ncomp, 12 * NSIDE**2)
    assert got.dtype == REAL_OF[dtype]
    assert_close(got, direct_synthesis(alm, spin), dtype)
    assert_close(jax.jit(op)(alm), direct_synthesis(alm, spin), dtype)


def test_synthesis_low_multipoles_analytic():
    """Y_00 = 1/sqrt(4π), Y_10 = sqrt(3/4π) cos θ: independent of DUCC."""
    op = ducc.healpix_synthesis(NSIDE, 4)
    alm = np.zeros((1, ducc.nalm(4)), np.complex128)
    alm[0, 0], alm[0, 1] = 2.0, 3.0  # (l, m) = (0, 0) and (1, 0)
    theta, _ = np.asarray(
        ducc0.healpix.Healpix_Base(NSIDE, "RING").pix2ang(np.arange(12 * NSIDE**2))).T
    expected = 2.0 / np.sqrt(4 * np.pi) + 3.0 * np.sqrt(3 / (4 * np.pi)) * np.cos(theta)
    np.testing.assert_allclose(op(alm)[0], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", COMPLEX)
@pytest.mark.parametrize("spin", [0, 2])
def test_synthesis_transpose(dtype, spin):
    rng = np.random.default_rng(14)
    op = ducc.healpix_synthesis(NSIDE, LMAX, mmax=LMAX - 3, spin=spin)
    # Imaginary parts of a_l0 included: they do not enter the map, and the
    # transpose must give them a zero cotangent for the pairing to hold.
    alm = random(rng, (op.ncomp, ducc.nalm(LMAX, LMAX - 3)), dtype)
    ct = random(rng, (op.ncomp, op.npix), REAL_OF[dtype])
    assert_transpose(op, alm, ct, dtype)


def dense_reference(synthesize, spin, lmax):
    """A jax.numpy reference of a synthesis, as two real matrices on Re and Im of the a_lm.

    The matrices are built column by column from `synthesize` (DUCC's routine,
    called directly); the reference maps (ncomp, nalm) a_lm to maps of the
    shape `synthesize` returns.
    """
    ncomp = 1 if spin == 0 else 2
    size = ncomp * ducc.nalm(lmax)
    columns = []
    for unit in (1.0, 1j):
        for k in range(size):
            alm = np.zeros(size, np.complex128)
            alm[k] = unit
            columns.append(synthesize(alm.reshape(ncomp, -1)))
    map_shape = columns[0].shape
    matrix = np.stack([column.ravel() for column in columns], axis=1)
    on_real, on_imag = matrix[:, :size], matrix[:, size:]

    def reference(a):
        flat = a.ravel()
        return (on_real @ flat.real + on_imag @ flat.imag).reshape(map_shape)

    return reference


@pytest.mark.parametrize("spin", [0, 2])
def test_synthesis_grad_matches_dense_reference(spin):
    rng = np.random.default_rng(15)
    op = ducc.healpix_synthesis(4, 6, spin=spin)
    reference = dense_reference(lambda a: direct_synthesis(a, spin, 4, 6), spin, 6)
    alm = random(rng, (op.ncomp, ducc.nalm(6)), np.complex128)
    weights = rng.standard_normal((op.ncomp, op.npix))

    def loss(synthesis):
        return lambda a: jnp.sum(weights * jnp.tanh(synthesis(a)))

    assert_close(op(alm), reference(alm), np.float64)
    assert_close(jax.grad(loss(op))(alm), jax.grad(loss(reference))(alm), np.float64)
    tangent = random(rng, alm.shape, np.complex128)
    assert_close(jax.jvp(op, (alm,), (tangent,))[1], reference(tangent), np.float64)


@pytest.mark.parametrize("spin", [0, 2])
def test_synthesis_vmap_matches_loop(spin):
    rng = np.random.default_rng(16)
    op = ducc.healpix_synthesis(NSIDE, LMAX, spin=spin)
    alms = random(rng, (op.ncomp, 3, ducc.nalm(LMAX)), np.complex128)
    got = jax.vmap(op, in_axes=1, out_axes=2)(alms)
    expected = np.stack([op(alms[:, b]) for b in range(3)], axis=2)
    assert_close(got, expected, np.float64)
    nested = jax.vmap(jax.vmap(op))(alms.transpose(1, 0, 2)[None].repeat(2, 0))
    assert_close(nested[1], np.moveaxis(expected, 2, 0), np.float64)


def test_synthesis_rejects_wrong_shape_and_dtype():
    op = ducc.healpix_synthesis(NSIDE, LMAX, spin=2)
    with pytest.raises(ValueError, match=r"takes a_lm of shape \(2, 153\)"):
        op(np.zeros((1, ducc.nalm(LMAX)), np.complex128))
    with pytest.raises(TypeError, match="complex64 or complex128"):
        op(np.zeros((2, ducc.nalm(LMAX))))


def test_synthesis_without_x64():
    """With jax_enable_x64 off (a fresh process) a_lm are complex64, maps float32."""
    script = textwrap.dedent(f"""
        import jax, jax.numpy as jnp, numpy as np, ducc0
        assert not jax.config.jax_enable_x64
        from jaxdecl.contrib import ducc
        op = ducc.healpix_synthesis({NSIDE}, {LMAX}, spin=2)
        rng = np.random.default_rng(0)
        alm = (rng.standard_normal((2, ducc.nalm({LMAX})))
               + 1j * rng.standard_normal((2, ducc.nalm({LMAX})))).astype(np.complex64)
        alm[:, :{LMAX} + 1] = alm[:, :{LMAX} + 1].real
        out = op(jnp.asarray(alm))
        assert out.dtype == jnp.float32, out.dtype
        geometry = ducc0.healpix.Healpix_Base({NSIDE}, "RING").sht_info()
        ref = ducc0.sht.synthesis(alm=alm.astype(np.complex128), lmax={LMAX}, spin=2,
                                  **geometry)
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
        g = jax.jit(jax.grad(lambda a: jnp.sum(op(a) ** 2)))(jnp.asarray(alm))
        assert g.dtype == jnp.complex64, g.dtype
        (t,) = jax.linear_transpose(op, alm)(out)
        lhs = float(jnp.sum(out * out)); rhs = float(jnp.real(jnp.sum(t * alm)))
        assert abs(lhs - rhs) <= 1e-4 * abs(lhs), (lhs, rhs)
        x = jnp.ones((4, 8), jnp.complex64)
        assert ducc.c2c(axes=(1,))(x).dtype == jnp.complex64
        print("ok")
    """)
    env = subprocess_env()
    env.pop("JAX_ENABLE_X64", None)
    # `python -c` puts the working folder first on sys.path: not the source tree.
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            cwd=os.path.dirname(os.path.abspath(__file__)),
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


# -- 2-D grid synthesis --------------------------------------------------------------------

GRID_GEOMETRIES = ["GL", "CC", "F1", "F2", "DH", "MW", "MWflip"]
LMAX_2D, NTHETA, NPHI = 10, 13, 23


def direct_synthesis_2d(alm, spin, geometry, lmax=LMAX_2D, mmax=None, ntheta=NTHETA, nphi=NPHI):
    return ducc0.sht.synthesis_2d(alm=alm, spin=spin, lmax=lmax, mmax=mmax, geometry=geometry,
                                  ntheta=ntheta, nphi=nphi)


@pytest.mark.parametrize("dtype", COMPLEX)
@pytest.mark.parametrize("geometry", ["GL", "CC", "F1", "F2"])
@pytest.mark.parametrize("spin", [0, 2])
def test_synthesis_2d_matches_ducc(dtype, geometry, spin):
    op = ducc.synthesis_2d(geometry, NTHETA, NPHI, LMAX_2D, spin=spin)
    alm = random_alm(np.random.default_rng(21), op.ncomp, dtype, LMAX_2D)
    got = op(alm)
    assert got.shape == (op.ncomp, NTHETA, NPHI) and got.dtype == REAL_OF[dtype]
    expected = direct_synthesis_2d(alm, spin, geometry)
    assert_close(got, expected, dtype)
    assert_close(jax.jit(op)(alm), expected, dtype)


@pytest.mark.parametrize("geometry", GRID_GEOMETRIES)
def test_synthesis_2d_every_geometry_and_mmax(geometry):
    op = ducc.synthesis_2d(geometry, 9, 16, 7, mmax=4, spin=1)
    alm = random(np.random.default_rng(22), (2, ducc.nalm(7, 4)), np.complex128)
    alm[:, :8] = alm[:, :8].real
    assert_close(op(alm), direct_synthesis_2d(alm, 1, geometry, 7, 4, 9, 16), np.float64)


def test_synthesis_2d_low_multipoles_analytic():
    """Y_00, Y_10 and the m = 1 pair Y_11 + Y_1-1 on Gauss-Legendre rings, independent of DUCC."""
    ntheta, nphi, lmax = 6, 8, 3
    nodes, _ = np.polynomial.legendre.leggauss(ntheta)
    cos_theta = nodes[::-1]  # DUCC's rings run from the north pole: cos θ decreasing
    sin_theta = np.sqrt(1 - cos_theta**2)
    phi = 2 * np.pi * np.arange(nphi) / nphi
    alm = np.zeros((1, ducc.nalm(lmax)), np.complex128)
    alm[0, 0], alm[0, 1] = 2.0, 3.0  # (l, m) = (0, 0), (1, 0)
    alm[0, lmax + 1] = 0.5 - 1.5j  # (1, 1): the m = 1 block follows the lmax + 1 of m = 0
    # a_11 Y_11 + conj(a_11 Y_11) with Y_11 = -sqrt(3/8π) sin θ e^{iφ}
    y11 = -np.sqrt(3 / (8 * np.pi)) * sin_theta[:, None] * np.exp(1j * phi)[None, :]
    expected = (2.0 / np.sqrt(4 * np.pi)
                + 3.0 * np.sqrt(3 / (4 * np.pi)) * cos_theta[:, None]
                + 2 * np.real(alm[0, lmax + 1] * y11))
    got = ducc.synthesis_2d("GL", ntheta, nphi, lmax)(alm)[0]
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", COMPLEX)
@pytest.mark.parametrize("spin", [0, 2])
@pytest.mark.parametrize("geometry", ["GL", "CC"])
def test_synthesis_2d_transpose(dtype, spin, geometry):
    rng = np.random.default_rng(23)
    op = ducc.synthesis_2d(geometry, NTHETA, NPHI, LMAX_2D, mmax=LMAX_2D - 2, spin=spin)
    # Imaginary parts of a_l0 included: their cotangent must be zero for the pairing to hold.
    alm = random(rng, (op.ncomp, ducc.nalm(LMAX_2D, LMAX_2D - 2)), dtype)
    ct = random(rng, (op.ncomp, NTHETA, NPHI), REAL_OF[dtype])
    assert_transpose(op, alm, ct, dtype)


@pytest.mark.parametrize("spin", [0, 2])
def test_synthesis_2d_grad_matches_dense_reference(spin):
    rng = np.random.default_rng(24)
    lmax, ntheta, nphi = 5, 7, 11
    op = ducc.synthesis_2d("F1", ntheta, nphi, lmax, spin=spin)
    reference = dense_reference(
        lambda a: direct_synthesis_2d(a, spin, "F1", lmax, None, ntheta, nphi), spin, lmax)
    alm = random(rng, (op.ncomp, ducc.nalm(lmax)), np.complex128)
    weights = rng.standard_normal((op.ncomp, ntheta, nphi))

    def loss(synthesis):
        return lambda a: jnp.sum(weights * jnp.tanh(synthesis(a)))

    assert_close(op(alm), reference(alm), np.float64)
    assert_close(jax.grad(loss(op))(alm), jax.grad(loss(reference))(alm), np.float64)
    assert_close(jax.jit(jax.grad(loss(op)))(alm), jax.grad(loss(reference))(alm), np.float64)


@pytest.mark.parametrize("dtype", COMPLEX)
def test_synthesis_2d_vmap_is_one_ducc_call(dtype, monkeypatch):
    rng = np.random.default_rng(25)
    op = ducc.synthesis_2d("GL", NTHETA, NPHI, LMAX_2D, spin=2)
    alms = random(rng, (3, op.ncomp, ducc.nalm(LMAX_2D)), dtype)
    expected = np.stack([direct_synthesis_2d(a, 2, "GL") for a in alms], axis=-1)

    calls = []
    synthesis = ducc0.sht.synthesis

    def counting(**kwargs):
        calls.append(kwargs["alm"].shape)
        return synthesis(**kwargs)

    monkeypatch.setattr(ducc0.sht, "synthesis", counting)
    got = jax.vmap(op, out_axes=-1)(alms)
    assert calls == [(3, 2, ducc.nalm(LMAX_2D))]
    assert_close(got, expected, dtype)
    maps = np.moveaxis(expected, -1, 0).astype(REAL_OF[dtype])
    transpose = jax.linear_transpose(op, alms[0])
    (alm_ct,) = jax.vmap(transpose)(maps)
    assert_close(alm_ct, np.stack([transpose(m)[0] for m in maps]), dtype)


def test_synthesis_2d_rejects_bad_configuration():
    with pytest.raises(ValueError, match="geometry must be one of"):
        ducc.synthesis_2d("HEALPIX", 8, 8, 4)
    with pytest.raises(ValueError, match="mmax"):
        ducc.synthesis_2d("GL", 8, 8, 4, mmax=5)
    with pytest.raises(ValueError, match=r"takes a_lm of shape \(1, 15\)"):
        ducc.synthesis_2d("GL", 8, 8, 4)(np.zeros((1, 14), np.complex128))
