"""Tests of jaxdecl.contrib.ducc's FFTs (c2c, r2c, c2r, genuine_fht) against NumPy and jax.numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers_ducc import COMPLEX, COMPLEX_OF, REAL, assert_close, assert_transpose, random

import jaxdecl as jd

ducc0 = pytest.importorskip("ducc0")
from jaxdecl.contrib import ducc


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
