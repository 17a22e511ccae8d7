# requires: nifty ducc0 (pip install ".[nifty]")
"""NIFTy.

A DUCC spherical-harmonic synthesis, declared with jaxdecl, inside a
``nifty.re`` sky model: builds a log-normal HEALPix sky, infers it from noisy
data with ``nifty.re.optimize_kl`` and plots the posterior mean.
"""

import requires  # tutorials/requires.py: without line 1's package, stops with its pip command

requires.check(__file__)

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import nifty.re as jft
import numpy as np

from jaxdecl.contrib import ducc

jax.config.update("jax_enable_x64", True)

NSIDE, LMAX = 4, 8


def real_ells(lmax):
    """Multipole of each real white coefficient: m = 0 first, then a (re, im) pair per m > 0."""
    ells = list(range(lmax + 1))
    for m in range(1, lmax + 1):
        ells += [ell for ell in range(m, lmax + 1) for _ in (0, 1)]
    return np.array(ells)


class SphereSky(jft.Model):
    """exp(synthesis(amplitude(l) * xi)) with a power-law amplitude of uncertain size and slope."""

    synth: Any  # the jaxdecl op, an ordinary static field of the model
    lmax: int

    def __init__(self, nside, lmax):
        self.synth = ducc.healpix_synthesis(nside=nside, lmax=lmax)
        self.lmax = lmax
        self.fluct = jft.LogNormalPrior(0.8, 0.2, name="fluct")
        self.slope = jft.NormalPrior(1.5, 0.3, name="slope")
        xi = jft.ShapeWithDtype(((lmax + 1) ** 2,), jnp.float64)
        white = jft.Initializer({"xi": partial(jft.random_like, primals=xi)})
        super().__init__(init=self.fluct.init | self.slope.init | white)

    def __call__(self, p):
        r = self.fluct(p) * (1.0 + real_ells(self.lmax)) ** (-self.slope(p)) * p["xi"]
        n0 = self.lmax + 1
        pairs = r[n0:].reshape(-1, 2)
        # A real map pairs each m > 0 coefficient with its -m partner: 1/sqrt(2) keeps it isotropic.
        alm = jnp.concatenate([r[:n0] + 0j, (pairs[:, 0] + 1j * pairs[:, 1]) / np.sqrt(2)])
        return jnp.exp(self.synth(alm[None])[0])


sky = SphereSky(NSIDE, LMAX)
key_truth, key_noise, key_start, key_kl = jax.random.split(jax.random.PRNGKey(42), 4)
truth = sky(sky.init(key_truth))
noise_std = 0.1
data = truth + noise_std * jax.random.normal(key_noise, truth.shape)

likelihood = jft.Gaussian(data, noise_cov_inv=lambda r: r / noise_std**2).amend(sky)
start = jft.Vector(jax.tree.map(lambda v: 0.1 * v, sky.init(key_start)))


def residual(map_):
    return float(jnp.linalg.norm(map_ - truth) / jnp.linalg.norm(truth))


# optimize_kl linearizes the model and transposes the linearization (the metric, for CG),
# and vmaps everything over the samples: all of it goes through the jaxdecl op's rules.
samples, state = jft.optimize_kl(
    likelihood, start, key=key_kl, n_total_iterations=2, n_samples=2,
    draw_linear_kwargs={"cg_name": None, "cg_kwargs": {"maxiter": 20}},
    nonlinearly_update_kwargs={
        "minimize_kwargs": {
                "name": None, "xtol": 1e-4, "maxiter": 5, "cg_kwargs": {"name": None}}},
    kl_kwargs={
        "minimize_kwargs": {
                "name": None, "xtol": 1e-4, "maxiter": 10, "cg_kwargs": {"name": None}}},
)
posterior = jax.vmap(sky)(samples.samples)
mean = posterior.mean(axis=0)
print(f"relative residual of the sky: start {residual(sky(start)):.3f}, "
      f"posterior mean {residual(mean):.3f} ({len(samples)} samples)")
print(f"posterior std / noise std, averaged over pixels: "
      f"{float(posterior.std(axis=0).mean()) / noise_std:.2f}")

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    print("matplotlib is not installed: no plot")
else:
    import ducc0

    theta, phi = ducc0.healpix.Healpix_Base(NSIDE, "RING").pix2ang(np.arange(mean.size)).T
    lon = np.where(phi > np.pi, phi - 2 * np.pi, phi)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3), subplot_kw={"projection": "mollweide"})
    for ax, values, title in zip(axes, (truth, mean), ("truth", "posterior mean")):
        points = ax.scatter(-lon, np.pi / 2 - theta, c=np.asarray(values), s=60)
        ax.set_title(title)
        ax.set_xticklabels([])
        fig.colorbar(points, ax=ax, shrink=0.6)
    fig.savefig("07_nifty_posterior_mean.png", dpi=80)
    print("saved 07_nifty_posterior_mean.png")
