"""The NUFFT sums term by term in jax.numpy: references for jaxdecl.contrib.finufft.

Written in the ops' layout, points (T, M) per coordinate and values (T, B, ...),
differentiable in everything (so their derivatives are references too), and
independent of the package: modes from NumPy's ``fftfreq``.
"""

import jax.numpy as jnp
import numpy as np


def modes(n: int, modeord: bool = False) -> np.ndarray:
    """The integer frequencies along an axis of n modes, in finufft's order."""
    k = np.rint(np.fft.fftfreq(n, 1.0 / n)).astype(np.int64)
    return k if modeord else np.fft.fftshift(k)


def _phases(points, n_modes, modeord):
    """Σ_d k_d x_d: (T, *n_modes, M)."""
    grids = np.meshgrid(*[modes(n, modeord) for n in n_modes], indexing="ij")
    total = 0
    for grid, x in zip(grids, points):
        total = total + grid[None, ..., None] * x.reshape((x.shape[0],) + (1,) * len(n_modes)
                                                          + (x.shape[1],))
    return total


def type1(points, source, n_modes, iflag=1, modeord=False):
    """f[t, b, k] = Σ_j c[t, b, j] exp(iflag i k·x_j)."""
    kernel = jnp.exp(iflag * 1j * _phases(points, n_modes, modeord)).astype(source.dtype)
    return jnp.einsum("tbj,t...j->tb...", source, kernel)


def type2(points, source, iflag=-1, modeord=False):
    """c[t, b, j] = Σ_k f[t, b, k] exp(iflag i k·x_j)."""
    n_modes = source.shape[2:]
    kernel = jnp.exp(iflag * 1j * _phases(points, n_modes, modeord)).astype(source.dtype)
    axes = "".join("klm"[: len(n_modes)])
    return jnp.einsum(f"tb{axes},t{axes}j->tbj", source, kernel)


def type3(points, targets, source, iflag=-1):
    """f[t, b, k] = Σ_j c[t, b, j] exp(iflag i s_k·x_j)."""
    phase = sum(s[:, :, None] * x[:, None, :] for x, s in zip(points, targets))
    return jnp.einsum("tbj,tkj->tbk", source, jnp.exp(iflag * 1j * phase).astype(source.dtype))


def random_complex(rng, shape, dtype=np.complex128):
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)


def random_points(rng, shape, dtype=np.float64, scale=np.pi):
    return rng.uniform(-scale, scale, shape).astype(dtype)


def relative_error(a, b) -> float:
    a, b = np.asarray(a, np.complex128), np.asarray(b, np.complex128)
    return float(np.max(np.abs(a - b), initial=0.0) / max(np.max(np.abs(b), initial=0.0), 1e-300))
