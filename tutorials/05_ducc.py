# requires: ducc0 (pip install ".[ducc]")
"""DUCC transforms.

DUCC's FFT and spherical-harmonic transforms as JAX primitives: the ready-made
linear ops of ``jaxdecl.contrib.ducc`` jit, vmap and differentiate like
``jax.numpy`` (needs ``pip install ".[ducc]"``; matplotlib optional). Look at the
printed differences (all near machine precision), the two dot-product checks
⟨ct, A x⟩ = ⟨Aᵀ ct, x⟩, and ``ducc_map.png``: a random sky recovered by gradient
descent through the spherical-harmonic synthesis.
"""

import requires  # tutorials/requires.py: without line 1's package, stops with its pip command

requires.check(__file__)

import ducc0
import jax
import jax.numpy as jnp
import numpy as np

from jaxdecl.contrib import ducc

jax.config.update("jax_enable_x64", True)
rng = np.random.default_rng(42)

# --- 1. A complex FFT -----------------------------------------------------------------
# Static settings (axes, direction, normalisation) are constructor arguments; equal
# settings share compiled code.
fft = ducc.c2c(axes=(1,), forward=True, inorm=1)
x = rng.standard_normal((4, 64)) + 1j * rng.standard_normal((4, 64))
print("c2c vs jnp.fft.fft (ortho):       ",
      float(jnp.max(jnp.abs(fft(x) - jnp.fft.fft(x, axis=1, norm="ortho")))))

# vmap folds the batch axis into DUCC's own multi-axis call (the class's @batch rule):
# one DUCC call for the whole batch, not one per element.
batch = rng.standard_normal((8, 4, 64)) + 0j
print("vmap(c2c) vs per-element loop:    ",
      float(jnp.max(jnp.abs(jax.vmap(fft)(batch) - jnp.stack([fft(b) for b in batch])))))

# The op is declared linear with its adjoint (the backward FFT), so gradients come for
# free. Here: the gradient of a spectral energy, compared with jax.numpy's own FFT.
weights = jnp.linspace(0.0, 1.0, 64)


def spectral_energy(transform):
    return lambda z: jnp.sum(weights * jnp.abs(transform(z)) ** 2)


reference = jax.grad(spectral_energy(lambda z: jnp.fft.fft(z, axis=1, norm="ortho")))(x)
print("grad through c2c vs jnp.fft:      ",
      float(jnp.max(jnp.abs(jax.grad(spectral_energy(fft))(x) - reference))))

ct = rng.standard_normal(x.shape) + 1j * rng.standard_normal(x.shape)
(x_ct,) = jax.linear_transpose(fft, x)(ct)
print("c2c dot-product test:             ",
      float(jnp.real(jnp.sum(ct * fft(x)))), "==", float(jnp.real(jnp.sum(x_ct * x))))

# --- 2. HEALPix spherical-harmonic synthesis ---------------------------------------------
# a_lm (complex, m >= 0, DUCC's layout) -> a real HEALPix RING map. The geometry comes
# from nside and is static configuration.
nside, lmax = 16, 32
synthesis = ducc.healpix_synthesis(nside=nside, lmax=lmax)
n_coefficients = ducc.nalm(lmax)

# A random sky with a red power spectrum, C_l ~ 1 / (l + 1)^2.
ell = np.concatenate([np.arange(m, lmax + 1) for m in range(lmax + 1)])
amplitude = 1.0 / (ell + 1.0)
truth = amplitude * (rng.standard_normal(n_coefficients)
                     + 1j * rng.standard_normal(n_coefficients))
truth[: lmax + 1] = truth[: lmax + 1].real  # a_l0 of a real map are real
truth = truth[None, :]
sky = synthesis(truth)
print("map shape (ncomp, 12 nside^2):    ", sky.shape)

y = rng.standard_normal(sky.shape)
(alm_ct,) = jax.linear_transpose(synthesis, truth)(y)
print("synthesis dot-product test:       ",
      float(jnp.sum(y * sky)), "==", float(jnp.real(jnp.sum(alm_ct * truth))))

# Recover the a_lm from a noisy map by gradient descent on a least-squares misfit: the
# gradient runs through DUCC's adjoint synthesis, inside jit.
data = sky + 0.05 * rng.standard_normal(sky.shape)


@jax.jit
def step(alm, rate=2.0 / (12 * nside**2)):
    misfit = lambda a: 0.5 * jnp.sum((synthesis(a) - data) ** 2)  # noqa: E731
    value, grad = jax.value_and_grad(misfit)(alm)
    # JAX's gradient for complex inputs is the conjugate of ∂f/∂a; descend along its conjugate.
    return alm - rate * jnp.conj(grad), value


alm = jnp.zeros_like(truth)
for iteration in range(60):
    alm, value = step(alm)
    if iteration % 20 == 0:
        print(f"  iteration {iteration:2d}: misfit {float(value):.4f}")
relative_error = float(jnp.linalg.norm(alm - truth) / jnp.linalg.norm(truth))
print("relative a_lm error after fitting:", round(relative_error, 4), "(noise-limited)")

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Plot on a regular (theta, phi) grid by looking up the HEALPix pixel of each point.
    theta, phi = np.meshgrid(np.linspace(0.01, np.pi - 0.01, 180),
                             np.linspace(-np.pi, np.pi, 360), indexing="ij")
    base = ducc0.healpix.Healpix_Base(nside, "RING")
    pixels = base.ang2pix(np.stack([theta.ravel(), phi.ravel() % (2 * np.pi)], axis=-1))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3))
    for axis, values, title in [(axes[0], sky[0], "true sky"),
                                (axes[1], synthesis(alm)[0], "recovered")]:
        image = axis.imshow(np.asarray(values)[pixels].reshape(theta.shape),
                            extent=(-180, 180, -90, 90), cmap="RdBu_r")
        axis.set_title(title)
        fig.colorbar(image, ax=axis)
    fig.savefig("ducc_map.png", dpi=100, bbox_inches="tight")
    print("wrote ducc_map.png")
except ImportError:
    print("matplotlib not installed: no PNG written")
