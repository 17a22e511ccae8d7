"""jaxdecl ops inside NIFTy's ``nifty.re``: model fields, ``@jd.primitive`` models, optimize_kl.

The sky model is a correlated-field-style log-normal field on a HEALPix sphere:
a power-law amplitude in harmonic space times white excitations, synthesised
to the sphere by a jaxdecl op, then exponentiated. Every numeric check compares
against the same model with the synthesis written as a dense ``jax.numpy``
matrix of spherical harmonics evaluated by SciPy at the HEALPix pixel centres,
independent of DUCC.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

jft = pytest.importorskip("nifty.re")
ducc0 = pytest.importorskip("ducc0")
special = pytest.importorskip("scipy.special")

from conftest import tol

import jaxdecl as jd
from jaxdecl.contrib import ducc

NSIDE, LMAX = 4, 8
NPIX = 12 * NSIDE**2
NREAL = (LMAX + 1) ** 2  # real harmonic coefficients of a real band-limited map


def real_ells(lmax: int) -> np.ndarray:
    """The multipole l of each real coefficient: m = 0 first, then a (re, im) pair per m > 0."""
    ells = list(range(lmax + 1))
    for m in range(1, lmax + 1):
        for ell in range(m, lmax + 1):
            ells += [ell, ell]
    return np.array(ells)


def pack_alm(r, lmax: int):
    """Real white coefficients -> complex a_lm in DUCC's m-major layout (isotropic variance)."""
    n0 = lmax + 1
    pairs = r[n0:].reshape(-1, 2)
    # 1/sqrt(2): each m > 0 coefficient also stands for its -m partner in a real map.
    return jnp.concatenate([r[:n0] + 0j, (pairs[:, 0] + 1j * pairs[:, 1]) / np.sqrt(2)])


def dense_harmonics(nside: int, lmax: int) -> np.ndarray:
    """(npix, nalm) matrix M with map = Re(M @ alm): Y_lm at the pixel centres, m > 0 doubled."""
    pixels = np.arange(12 * nside**2)
    theta, phi = ducc0.healpix.Healpix_Base(nside, "RING").pix2ang(pixels).T
    columns = [
        (1 if m == 0 else 2) * special.sph_harm_y(ell, m, theta, phi)
        for m in range(lmax + 1)
        for ell in range(m, lmax + 1)
    ]
    return np.stack(columns, axis=1)


DENSE = dense_harmonics(NSIDE, LMAX)


def dense_synthesis(alm):
    """The pure jax.numpy reference of ``ducc.healpix_synthesis``: (1, nalm) -> (1, npix)."""
    return jnp.real(alm @ jnp.asarray(DENSE).T)


def dense_real_synthesis(r):
    return dense_synthesis(pack_alm(r, LMAX)[None])[0]


def _sht_geometry(nside: int, lmax: int) -> dict:
    return dict(lmax=lmax, mmax=lmax, spin=0, nthreads=1,
                **ducc0.healpix.Healpix_Base(nside, "RING").sht_info())


@jd.primitive(linear=True)
class RealSynthesis(jft.Model):
    """A nifty.re model that is itself a jaxdecl op: real harmonic coefficients -> HEALPix map."""

    nside: int
    lmax: int

    def __init__(self, nside: int, lmax: int, dtype=np.float64):
        self.nside, self.lmax, self.dtype = int(nside), int(lmax), np.dtype(dtype)
        domain = jft.ShapeWithDtype(((self.lmax + 1) ** 2,), self.dtype)
        super().__init__(domain=domain, white_init=True)  # evaluates the op under eval_shape

    @jd.abstract
    def shapes(self, xi):
        return jax.ShapeDtypeStruct((12 * self.nside**2,), xi.dtype)

    @jd.forward
    def apply(self, xi):
        n0 = self.lmax + 1
        alm = np.empty(ducc.nalm(self.lmax), np.result_type(xi.dtype, np.complex64))
        alm[:n0] = xi[:n0]
        pairs = xi[n0:].reshape(-1, 2)
        alm[n0:] = (pairs[:, 0] + 1j * pairs[:, 1]) / np.sqrt(2)
        return ducc0.sht.synthesis(alm=alm[None], **_sht_geometry(self.nside, self.lmax))[0]

    @jd.transpose
    def apply_transpose(self, ct):
        n0 = self.lmax + 1
        g = ducc0.sht.adjoint_synthesis(map=ct[None], **_sht_geometry(self.nside, self.lmax))[0]
        out = np.empty((self.lmax + 1) ** 2, ct.dtype)
        out[:n0] = g[:n0].real
        # A real map holds 2 Re(a_lm Y_lm) per m > 0, so those cotangents double.
        pairs = out[n0:].reshape(-1, 2)
        pairs[:, 0] = np.sqrt(2) * g[n0:].real
        pairs[:, 1] = np.sqrt(2) * g[n0:].imag
        return out


class SphereSky(jft.Model):
    """Log-normal sky: exp(synth(amplitude(l) * xi)), power-law amplitude with priors."""

    synth: Any  # a jaxdecl op (or its jax.numpy reference) held as a static model field
    lmax: int

    def __init__(self, synth, lmax: int):
        self.synth, self.lmax = synth, lmax
        self.fluct = jft.LogNormalPrior(0.8, 0.2, name="fluct")
        self.slope = jft.NormalPrior(1.5, 0.3, name="slope")
        xi = jft.ShapeWithDtype(((lmax + 1) ** 2,), jnp.float64)
        white = jft.Initializer({"xi": partial(jft.random_like, primals=xi)})
        super().__init__(init=self.fluct.init | self.slope.init | white)

    def __call__(self, p):
        amplitude = self.fluct(p) * (1.0 + real_ells(self.lmax)) ** (-self.slope(p))
        alm = pack_alm(amplitude * p["xi"], self.lmax)
        return jnp.exp(self.synth(alm[None])[0])


def _close(a, b, rtol):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.max(np.abs(b)))


def _tree_close(a, b, rtol):
    jax.tree.map(partial(_close, rtol=rtol), a, b)


# -- @jd.primitive on a jft.Model subclass ------------------------------------------------------


def test_primitive_model_keeps_its_metaclass_and_target():
    model = RealSynthesis(NSIDE, LMAX)
    assert type(RealSynthesis) is type(jft.Model)
    assert isinstance(model, jft.Model)
    # Model.__init__ derived the target by evaluating the op with jax.eval_shape.
    assert model.target.shape == (NPIX,)
    assert model.init(jax.random.PRNGKey(0)).shape == (NREAL,)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_primitive_model_matches_dense(dtype):
    model = RealSynthesis(NSIDE, LMAX, dtype)
    rng = np.random.default_rng(0)
    x = rng.normal(size=NREAL).astype(dtype)
    y = rng.normal(size=NPIX).astype(dtype)
    expected = dense_real_synthesis(x.astype(np.float64))
    result = model(x)
    assert result.dtype == np.dtype(dtype)
    _close(result, expected, tol(dtype))
    # The model is a pytree (static fields, no leaves): it crosses jit as an argument.
    _close(jax.jit(lambda m, v: m(v))(model, x), expected, tol(dtype))
    transpose = jax.linear_transpose(model, x)(y)[0]
    expected_t = jax.linear_transpose(dense_real_synthesis, x.astype(np.float64))(
        y.astype(np.float64))[0]
    _close(transpose, expected_t, tol(dtype))
    batch = rng.normal(size=(3, NREAL)).astype(dtype)
    _close(jax.vmap(model)(batch), jax.vmap(dense_real_synthesis)(batch.astype(np.float64)),
           tol(dtype))


def test_primitive_model_passes_check():
    jd.check(RealSynthesis(NSIDE, LMAX), np.random.default_rng(1).normal(size=NREAL))


def test_primitive_model_linear_gaussian_metric():
    model = RealSynthesis(NSIDE, LMAX)
    rng = np.random.default_rng(2)
    data = jnp.asarray(rng.normal(size=NPIX))
    position, tangent = (jnp.asarray(rng.normal(size=NREAL)) for _ in range(2))

    def likelihood(forward):
        return jft.Gaussian(data, noise_cov_inv=lambda r: 4.0 * r).amend(forward)

    lh, ref = likelihood(model), likelihood(dense_real_synthesis)
    _close(jax.jit(lh)(position), ref(position), tol(np.float64))
    _close(jax.jit(jax.grad(lh))(position), jax.grad(ref)(position), tol(np.float64))
    metric = jax.jit(lh.metric)(position, tangent)
    _close(metric, jax.jit(ref.metric)(position, tangent), tol(np.float64))
    # The metric of a linear Gaussian model is R^T N^-1 R: the dense matrix spelt out.
    matrix = jnp.asarray(jax.jacfwd(dense_real_synthesis)(position))
    _close(metric, 4.0 * matrix.T @ (matrix @ tangent), tol(np.float64))


# -- a jaxdecl op as a field of a nifty.re model ------------------------------------------------


@pytest.fixture(scope="module")
def problem():
    sky = SphereSky(ducc.healpix_synthesis(NSIDE, LMAX), LMAX)
    reference = SphereSky(dense_synthesis, LMAX)
    key_truth, key_noise = jax.random.split(jax.random.PRNGKey(42))
    truth = sky.init(key_truth)
    noise_std = 0.1
    signal = reference(truth)
    data = signal + noise_std * jax.random.normal(key_noise, signal.shape)

    def likelihood(model):
        return jft.Gaussian(data, noise_cov_inv=lambda r: r / noise_std**2).amend(model)

    return {"sky": sky, "reference": reference, "truth": truth, "signal": signal,
                "lh": likelihood(sky), "lh_ref": likelihood(reference)}


def test_sky_model_matches_dense(problem):
    sky, reference = problem["sky"], problem["reference"]
    position = sky.init(jax.random.PRNGKey(3))
    _close(sky(position), reference(position), tol(np.float64))
    positions = jax.vmap(sky.init)(jax.random.split(jax.random.PRNGKey(4), 3))
    _close(jax.vmap(sky)(positions), jax.vmap(reference)(positions), tol(np.float64))


def test_likelihood_value_gradient_and_metric(problem):
    lh, ref = problem["lh"], problem["lh_ref"]
    position = jft.Vector(problem["sky"].init(jax.random.PRNGKey(5)))
    tangent = jft.Vector(problem["sky"].init(jax.random.PRNGKey(6)))
    # Jitted as optimize_kl runs them (eager nifty code is slow to dispatch).
    value_and_grad = [jax.jit(jax.value_and_grad(f)) for f in (lh, ref)]
    (value, grad), (ref_value, ref_grad) = (f(position) for f in value_and_grad)
    _close(value, ref_value, tol(np.float64))
    _tree_close(grad.tree, ref_grad.tree, 1e-8)
    # nifty's metric is jax.linearize of the model followed by jax.linear_transpose.
    metric, ref_metric = jax.jit(lh.metric), jax.jit(ref.metric)
    _tree_close(metric(position, tangent).tree, ref_metric(position, tangent).tree, 1e-8)
    # The same over a batch of samples, as optimize_kl maps it.
    tangents = jft.Vector(
        jax.vmap(problem["sky"].init)(jax.random.split(jax.random.PRNGKey(7), 2)))
    batched = [jax.jit(jax.vmap(m, in_axes=(None, 0))) for m in (lh.metric, ref.metric)]
    _tree_close(batched[0](position, tangents).tree, batched[1](position, tangents).tree, 1e-8)


def test_optimize_kl_moves_toward_truth(problem):
    sky, signal = problem["sky"], problem["signal"]
    start = jft.Vector(jax.tree.map(lambda v: 0.1 * v, sky.init(jax.random.PRNGKey(8))))

    def residual(skies):
        return float(jnp.linalg.norm(skies - signal) / jnp.linalg.norm(signal))

    samples, _ = jft.optimize_kl(
        problem["lh"], start, key=jax.random.PRNGKey(9), n_total_iterations=2, n_samples=2,
        draw_linear_kwargs={"cg_name": None, "cg_kwargs": {"maxiter": 20}},
        nonlinearly_update_kwargs={
            "minimize_kwargs": {
                "name": None, "xtol": 1e-4, "maxiter": 5, "cg_kwargs": {"name": None}}},
        kl_kwargs={
            "minimize_kwargs": {
                "name": None, "xtol": 1e-4, "maxiter": 10, "cg_kwargs": {"name": None}}},
    )
    skies = jax.vmap(sky)(samples.samples)
    assert skies.shape == (4, NPIX)  # 2 samples, mirrored
    assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(samples.samples))
    assert np.all(np.isfinite(skies))
    before, after = residual(sky(start)), residual(skies.mean(axis=0))
    assert after < 0.5 * before, (before, after)
    # The posterior samples evaluate identically through the dense reference model.
    _close(skies, jax.vmap(problem["reference"])(samples.samples), 1e-8)
