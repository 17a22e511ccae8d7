"""The NUFFT sums term by term in jax.numpy: references for jaxdecl.contrib.finufft.

Written in the ops' layout, points (T, M) per coordinate and values (T, B, ...),
differentiable in everything (so their derivatives are references too), and
independent of the package: modes from NumPy's ``fftfreq``. ``reference`` takes
the public functions' shapes; ``call`` runs the public function it stands for.
"""

import jax.numpy as jnp
import numpy as np
from helpers_extras import why_missing


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


MODES = {1: (10,), 2: (6, 5), 3: (4, 5, 3)}
REAL = {np.complex128: np.float64, np.complex64: np.float32}


def inputs(rng, nufft_type, dim, dtype=np.complex128, m=23, k=9, lead=(2,)):
    """(source, coordinate arrays) of the public functions: points shared by `lead`."""
    points = [random_points(rng, m, REAL[dtype]) for _ in range(dim)]
    if nufft_type == 3:
        points += [random_points(rng, k, REAL[dtype], scale=4.0) for _ in range(dim)]
    shape = lead + (MODES[dim] if nufft_type == 2 else (m,))
    return random_complex(rng, shape, dtype), points


def reference(nufft_type, source, points, iflag, modeord=False):
    """The direct sum of the public function on (..., M) or (..., N) values, shared points."""
    dim = len(points) // 2 if nufft_type == 3 else len(points)
    core = dim if nufft_type == 2 else 1
    lead = source.shape[:source.ndim - core]
    values = jnp.reshape(source, (1, -1) + source.shape[len(lead):])
    sets = tuple(jnp.asarray(p)[None] for p in points)
    if nufft_type == 1:
        out = type1(sets, values, MODES[dim], iflag, modeord)
    elif nufft_type == 2:
        out = type2(sets, values, iflag, modeord)
    else:
        out = type3(sets[:dim], sets[dim:], values, iflag)
    return jnp.reshape(out, lead + out.shape[2:])


def call(nufft_type, source, points, **kw):
    """jaxdecl.contrib.finufft's nufft1/2/3 on the inputs of :func:`inputs`."""
    from jaxdecl.contrib import finufft as nf

    if nufft_type == 1:
        return nf.nufft1(MODES[len(points)], source, *points, **kw)
    return (nf.nufft2 if nufft_type == 2 else nf.nufft3)(source, *points, **kw)


def loss(f):
    """Σ |f(...)|²: a real function of `f`'s arguments, to differentiate."""
    return lambda *args: jnp.sum(jnp.abs(f(*args)) ** 2)


def peer():
    """``(jax_finufft, None)``, or ``(None, why)`` where jax-finufft 1.3.1 cannot be imported."""
    try:
        import jax_finufft
        from jax_finufft import options  # noqa: F401
    except ImportError as error:
        return None, why_missing("jax_finufft", error)
    return jax_finufft, None
