"""Tests of jaxdecl.contrib.ducc: DUCC transforms against NumPy/JAX references."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import subprocess_env, tol

import jaxdecl as jd

ducc0 = pytest.importorskip("ducc0")
from jaxdecl.contrib import ducc

REAL = [np.dtype("float32"), np.dtype("float64")]
COMPLEX = [np.dtype("complex64"), np.dtype("complex128")]
COMPLEX_OF = dict(zip(REAL, COMPLEX))
REAL_OF = dict(zip(COMPLEX, REAL))


def random(rng, shape, dtype):
    x = rng.standard_normal(shape)
    if np.issubdtype(dtype, np.complexfloating):
        x = x + 1j * rng.standard_normal(shape)
    return x.astype(dtype)


def assert_close(actual, expected, dtype):
    expected = np.asarray(expected)
    scale = max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=tol(dtype),
                               atol=tol(dtype) * scale)


def pairing(a, b) -> float:
    """Re Σ a·b, JAX's (non-conjugated) pairing of a cotangent with a tangent."""
    return float(np.real(np.sum(np.asarray(a, np.complex128) * np.asarray(b, np.complex128))))


def assert_transpose(op, x, ct, dtype):
    """Dot-product test ⟨ct, A x⟩ = ⟨Aᵀ ct, x⟩ through jax.linear_transpose."""
    (x_ct,) = jax.linear_transpose(op, x)(ct)
    assert x_ct.shape == x.shape and x_ct.dtype == x.dtype
    lhs, rhs = pairing(ct, op(x)), pairing(x_ct, x)
    scale = np.linalg.norm(np.asarray(ct)) * np.linalg.norm(np.asarray(x))
    assert abs(lhs - rhs) <= 10 * tol(dtype) * scale, (lhs, rhs)


def numpy_scale(inorm, n):
    return {0: 1.0, 1: 1 / np.sqrt(n), 2: 1 / n}[inorm]


# -- c2c ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", COMPLEX)
@pytest.mark.parametrize("axes", [None, (0,), (-1,), (2, 0)])
@pytest.mark.parametrize("forward,inorm", [(True, 0), (False, 1), (False, 2)])
def test_c2c_matches_numpy(dtype, axes, forward, inorm):
    rng = np.random.default_rng(0)
    x = random(rng, (4, 3, 5), dtype)
    got = ducc.c2c(axes, forward=forward, inorm=inorm)(x)
    assert got.dtype == dtype
    lengths = [x.shape[a] for a in (axes if axes is not None else range(3))]
    n = np.prod(lengths)
    if forward:
        expected = np.fft.fftn(x.astype(np.complex128), axes=axes)
    else:  # NumPy's inverse divides by n; DUCC's backward transform does not
        expected = np.fft.ifftn(x.astype(np.complex128), axes=axes) * n
    expected = expected * numpy_scale(inorm, n)
    assert_close(got, expected, dtype)
    assert_close(jax.jit(ducc.c2c(axes, forward=forward, inorm=inorm))(x), expected, dtype)


@pytest.mark.parametrize("dtype", COMPLEX)
@pytest.mark.parametrize("inorm", [0, 1, 2])
def test_c2c_transpose(dtype, inorm):
    rng = np.random.default_rng(1)
    op = ducc.c2c(axes=(1,), forward=False, inorm=inorm)
    assert_transpose(op, random(rng, (3, 8), dtype), random(rng, (3, 8), dtype), dtype)


@pytest.mark.parametrize("dtype", COMPLEX)
@pytest.mark.parametrize("in_axis", [0, 1, 2, -1])
def test_c2c_vmap_matches_loop(dtype, in_axis):
    rng = np.random.default_rng(2)
    x = random(rng, (3, 4, 5), dtype)
    op = ducc.c2c(axes=(0, -1), inorm=1)
    got = jax.vmap(op, in_axes=in_axis, out_axes=in_axis)(x)
    moved = np.moveaxis(x, in_axis, 0)
    expected = np.moveaxis(np.stack([op(element) for element in moved]), 0, in_axis)
    assert_close(got, expected, dtype)


def test_c2c_nested_vmap_and_transpose_under_vmap():
    rng = np.random.default_rng(3)
    x = random(rng, (2, 3, 6), np.complex128)
    op = ducc.c2c(axes=None, forward=True)
    got = jax.vmap(jax.vmap(op, in_axes=1), in_axes=0)(x)
    expected = np.moveaxis(np.fft.fft(x, axis=1), 2, 1)
    assert_close(got, expected, np.complex128)

    def transposed(ct):
        return jax.linear_transpose(op, ct)(ct)[0]

    # Aᵀ of the forward DFT is the forward DFT itself (symmetric matrix); each
    # element is (2, 6), transformed along both of its axes.
    assert_close(jax.vmap(transposed, in_axes=1, out_axes=1)(x),
                 np.fft.fftn(x, axes=(0, 2)), np.complex128)


def test_c2c_batch_rule_folds_batch_into_one_call():
    """The @batch rule hands DUCC the whole batch: one forward call for a vmap."""
    calls = []

    class CountingC2C(ducc.c2c):
        def reconfigured(self, axes):
            return CountingC2C(axes, self.forward, self.inorm, self.nthreads)

        @jd.forward
        def apply(self, x, *, out):
            calls.append(x.shape)
            super().apply(x, out=out)

    x = random(np.random.default_rng(4), (5, 8), np.complex128)
    got = jax.vmap(CountingC2C(axes=(0,)))(x)
    assert calls == [(5, 8)]
    assert_close(got, np.fft.fft(x, axis=-1), np.complex128)


@pytest.mark.parametrize("dtype", COMPLEX)
def test_c2c_grad_matches_jnp_fft(dtype):
    rng = np.random.default_rng(5)
    x = random(rng, (4, 6), dtype)
    weights = rng.standard_normal((4, 6))
    op = ducc.c2c(axes=(1,), inorm=1)

    def loss(transform):
        return lambda z: jnp.sum(weights * jnp.abs(transform(z)) ** 2)

    reference = jax.grad(loss(lambda z: jnp.fft.fft(z, axis=1, norm="ortho")))(x)
    assert_close(jax.grad(loss(op))(x), reference, dtype)
    assert_close(jax.jit(jax.grad(loss(op)))(x), reference, dtype)


def test_c2c_rejects_real_input_and_bad_axes():
    with pytest.raises(TypeError, match="c2c takes complex64 or complex128"):
        ducc.c2c()(np.ones(4))
    with pytest.raises(ValueError, match="out of range"):
        ducc.c2c(axes=(3,))(np.ones(4, np.complex64))
    with pytest.raises(ValueError, match="inorm"):
        ducc.c2c(inorm=3)


# -- r2c / c2r / genuine_fht ------------------------------------------------------------

@pytest.mark.parametrize("dtype", REAL)
@pytest.mark.parametrize("n", [6, 7])
@pytest.mark.parametrize("axes", [None, (0,), (1, 0)])
def test_r2c_matches_numpy(dtype, n, axes):
    x = random(np.random.default_rng(6), (4, n), dtype)
    got = ducc.r2c(axes, inorm=2)(x)
    assert got.dtype == COMPLEX_OF[dtype]
    lengths = [x.shape[a] for a in (axes if axes is not None else range(2))]
    expected = np.fft.rfftn(x.astype(np.float64), axes=axes) / np.prod(lengths)
    assert_close(got, expected, dtype)


@pytest.mark.parametrize("dtype", REAL)
@pytest.mark.parametrize("n", [6, 7])
@pytest.mark.parametrize("axes", [None, (0,)])
def test_c2r_matches_numpy(dtype, n, axes):
    rng = np.random.default_rng(7)
    last = 1 if axes is None else axes[-1]
    shape = [4, n] if last == 1 else [n, 3]
    shape[last] = n // 2 + 1
    y = random(rng, tuple(shape), COMPLEX_OF[dtype])
    got = ducc.c2r(n, axes, forward=False, inorm=2)(y)
    assert got.dtype == dtype
    lengths = [4, n] if axes is None else [n]
    expected = np.fft.irfftn(y.astype(np.complex128), s=lengths, axes=axes or (0, 1))
    assert_close(got, expected, dtype)


@pytest.mark.parametrize("dtype", REAL)
@pytest.mark.parametrize("axes", [None, (1,)])
def test_genuine_fht_matches_fft(dtype, axes):
    x = random(np.random.default_rng(8), (3, 5), dtype)
    spectrum = np.fft.fftn(x.astype(np.float64), axes=axes)
    # cas(t) = cos(t) + sin(t): the Hartley transform is Re F - Im F of the forward DFT.
    assert_close(ducc.genuine_fht(axes)(x), spectrum.real - spectrum.imag, dtype)


def _fft_ops(n):
    """(op, input shape, input dtype kind) for the real-FFT family with last length n."""
    return [
        (ducc.r2c(inorm=0), (3, n), "real"),
        (ducc.r2c(axes=(0,), forward=False, inorm=1), (n, 3), "real"),
        (ducc.c2r(n, inorm=2), (3, n // 2 + 1), "complex"),
        (ducc.c2r(n, axes=(1, 0), forward=True), (n // 2 + 1, 3), "complex"),
        (ducc.genuine_fht(inorm=1), (3, n), "real"),
    ]


@pytest.mark.parametrize("dtype", REAL)
@pytest.mark.parametrize("n", [6, 7])
@pytest.mark.parametrize("case", range(5))
def test_real_ffts_transpose(dtype, n, case):
    rng = np.random.default_rng(9)
    op, shape, kind = _fft_ops(n)[case]
    in_dtype = dtype if kind == "real" else COMPLEX_OF[dtype]
    x = random(rng, shape, in_dtype)
    out = jax.eval_shape(op, x)
    assert_transpose(op, x, random(rng, out.shape, out.dtype), dtype)


def test_r2c_transpose_is_not_c2r():
    """Guards the derivation: c2r would double-count interior frequencies."""
    rng = np.random.default_rng(10)
    x, ct = random(rng, (8,), np.float64), random(rng, (5,), np.complex128)
    (x_ct,) = jax.linear_transpose(ducc.r2c(), x)(ct)
    assert not np.allclose(x_ct, ducc.c2r(8, forward=True)(ct))
    padded = np.concatenate([ct, np.zeros(3)])
    np.testing.assert_allclose(x_ct, np.fft.fft(padded).real, rtol=1e-12)


@pytest.mark.parametrize("case", range(5))
@pytest.mark.parametrize("in_axis", [0, 2])
def test_real_ffts_vmap_matches_loop(case, in_axis):
    rng = np.random.default_rng(11)
    op, shape, kind = _fft_ops(6)[case]
    dtype = np.float64 if kind == "real" else np.complex128
    x = random(rng, (2,) + shape, dtype)
    x = np.moveaxis(x, 0, in_axis)
    got = jax.vmap(op, in_axes=in_axis)(x)
    expected = np.stack([op(element) for element in np.moveaxis(x, in_axis, 0)])
    assert_close(got, expected, np.float64)


@pytest.mark.parametrize("dtype", REAL)
def test_real_ffts_grad_match_jnp_fft(dtype):
    rng = np.random.default_rng(12)
    x = random(rng, (3, 8), dtype)
    w = rng.standard_normal((3, 5))

    def loss_r2c(transform):
        return lambda z: jnp.sum(w * jnp.abs(transform(z)) ** 2)

    assert_close(jax.grad(loss_r2c(ducc.r2c(axes=(1,))))(x),
                 jax.grad(loss_r2c(lambda z: jnp.fft.rfft(z, axis=1)))(x), dtype)

    y = random(rng, (3, 5), COMPLEX_OF[dtype])
    v = rng.standard_normal((3, 8))

    def loss_c2r(transform):
        return lambda z: jnp.sum(v * jnp.sin(transform(z)))

    reference = jax.grad(loss_c2r(lambda z: jnp.fft.irfft(z, n=8, axis=1, norm="backward")))(y)
    assert_close(jax.grad(loss_c2r(ducc.c2r(8, axes=(1,), inorm=2)))(y), reference, dtype)

    def loss_fht(transform):
        return lambda z: jnp.sum(v * transform(z) ** 3)

    def hartley(z):
        spectrum = jnp.fft.fft(z, axis=1)
        return spectrum.real - spectrum.imag

    assert_close(jax.grad(loss_fht(ducc.genuine_fht(axes=(1,))))(x),
                 jax.grad(loss_fht(hartley))(x), dtype)


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


def dense_synthesis(spin, lmax=6, nside=4):
    """The synthesis as two real matrices (on Re and Im of a_lm), built from DUCC's forward."""
    ncomp = 1 if spin == 0 else 2
    size = ncomp * ducc.nalm(lmax)
    columns = []
    for unit in (1.0, 1j):
        for k in range(size):
            alm = np.zeros(size, np.complex128)
            alm[k] = unit
            columns.append(direct_synthesis(alm.reshape(ncomp, -1), spin, nside, lmax).ravel())
    matrix = np.stack(columns, axis=1)
    return matrix[:, :size], matrix[:, size:]


@pytest.mark.parametrize("spin", [0, 2])
def test_synthesis_grad_matches_dense_reference(spin):
    rng = np.random.default_rng(15)
    op = ducc.healpix_synthesis(4, 6, spin=spin)
    on_real, on_imag = dense_synthesis(spin)
    alm = random(rng, (op.ncomp, ducc.nalm(6)), np.complex128)
    weights = rng.standard_normal((op.ncomp, op.npix))

    def reference(a):
        flat = a.ravel()
        return (on_real @ flat.real + on_imag @ flat.imag).reshape(op.ncomp, op.npix)

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


# -- NUFFT ---------------------------------------------------------------------------------

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


def dense_synthesis_2d(spin, lmax, ntheta, nphi, geometry="F1"):
    """The synthesis as two real matrices (on Re and Im of a_lm), from DUCC's synthesis_2d."""
    ncomp = 1 if spin == 0 else 2
    size = ncomp * ducc.nalm(lmax)
    columns = []
    for unit in (1.0, 1j):
        for k in range(size):
            alm = np.zeros(size, np.complex128)
            alm[k] = unit
            columns.append(direct_synthesis_2d(alm.reshape(ncomp, -1), spin, geometry, lmax,
                                               None, ntheta, nphi).ravel())
    matrix = np.stack(columns, axis=1)
    return matrix[:, :size], matrix[:, size:]


@pytest.mark.parametrize("spin", [0, 2])
def test_synthesis_2d_grad_matches_dense_reference(spin):
    rng = np.random.default_rng(24)
    lmax, ntheta, nphi = 5, 7, 11
    op = ducc.synthesis_2d("F1", ntheta, nphi, lmax, spin=spin)
    on_real, on_imag = dense_synthesis_2d(spin, lmax, ntheta, nphi)
    alm = random(rng, (op.ncomp, ducc.nalm(lmax)), np.complex128)
    weights = rng.standard_normal((op.ncomp, ntheta, nphi))

    def reference(a):
        flat = a.ravel()
        return (on_real @ flat.real + on_imag @ flat.imag).reshape(op.ncomp, ntheta, nphi)

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


# -- radio-interferometric (w-)gridding ---------------------------------------------------

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
