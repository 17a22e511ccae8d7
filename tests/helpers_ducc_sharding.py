"""contrib.ducc ops on 4 host CPU devices, run in a fresh interpreter.

Run as ``python helpers_ducc_sharding.py``; prints one JSON line
``{"checks": {name: value}}``, a value ``true`` when the check passed and a
string saying what was seen otherwise. One process runs every check: JAX is
imported once.

DUCC's functions are wrapped to record the shape of the array each call
receives, so the checks see whether a rule ran on a device's block or on the
whole array.

Ops whose results have dims no input has (r2c, the syntheses, nu2u,
vis2dirty) declare those dims replicate and split along the others.
"""

import json
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import ducc0  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxdecl.contrib import ducc  # noqa: E402

CALLS: list = []  # (DUCC function, shape of its main array argument)


def _record(module, name, argument):
    original = getattr(module, name)

    def recorded(*args, **kwargs):
        value = kwargs[argument] if argument in kwargs else args[0]
        CALLS.append((name, tuple(np.shape(value))))
        return original(*args, **kwargs)

    setattr(module, name, recorded)


_record(ducc0.fft, "c2c", "a")
_record(ducc0.fft, "genuine_fht", "a")
_record(ducc0.fft, "r2c", "a")
_record(ducc0.sht, "synthesis", "alm")
_record(ducc0.nufft, "u2nu", "coord")
_record(ducc0.nufft, "nu2u", "coord")
_record(ducc0.wgridder.experimental, "dirty2vis", "uvw")
_record(ducc0.wgridder.experimental, "vis2dirty", "uvw")


def _rng(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    value = rng.standard_normal(shape)
    if np.issubdtype(np.dtype(dtype), np.complexfloating):
        value = value + 1j * rng.standard_normal(shape)
    return value.astype(dtype)


def _close(a, b, tol=1e-10) -> bool | str:
    a, b = np.asarray(a), np.asarray(b)
    error = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))
    return True if error <= tol else f"relative error {error:.3g}"


def _calls(function, *args) -> list:
    CALLS.clear()
    jax.block_until_ready(function(*args))
    seen = list(CALLS)
    CALLS.clear()
    return seen


def _no_gather(function, *args) -> bool | str:
    text = function.lower(*args).compile().as_text()
    found = [w for w in ("all-gather", "all-to-all") if w in text]
    return True if not found else f"found {found}"


def _shapes(calls, shape, name=None) -> bool | str:
    shapes = {s for n, s in calls if name is None or n == name}
    return True if shapes == {shape} else f"DUCC saw {sorted(shapes)} ({len(calls)} calls)"


def automatic(checks: dict) -> None:
    """jit over 4 devices (Auto axes): each device transforms its block."""
    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,))

    def put(x, *spec):
        return jax.device_put(x, NamedSharding(mesh, P(*spec)))

    # The c2c FFT along the last axis of rows split over the devices.
    for dtype, tol in (("complex128", 1e-12), ("complex64", 1e-5)):
        x = _rng((8, 64), dtype)
        xs = put(x, "d")
        fft = ducc.c2c(axes=(1,))
        f = jax.jit(fft)
        key = f"c2c rows {dtype}"
        checks[f"{key}: no gather"] = _no_gather(f, xs)
        checks[f"{key}: local blocks"] = _shapes(_calls(f, xs), (2, 64))
        y = f(xs)
        checks[f"{key}: sharding kept"] = y.sharding.spec == P("d") or str(y.sharding)
        checks[f"{key}: = unsharded op"] = _close(y, fft(x), tol)
        checks[f"{key}: = jnp.fft"] = _close(y, jnp.fft.fft(x, axis=1), tol)

    x = _rng((8, 64), "complex128", 1)
    xs = put(x, "d")

    def energy(transform):
        return lambda v: jnp.sum(jnp.abs(transform(v)) ** 2)

    g = jax.jit(jax.grad(energy(ducc.c2c(axes=(1,)))))
    checks["c2c grad: no gather"] = _no_gather(g, xs)
    checks["c2c grad: local blocks"] = _shapes(_calls(g, xs), (2, 64))
    reference = jax.grad(energy(lambda v: jnp.fft.fft(v, axis=1)))(x)
    checks["c2c grad: = jnp.fft"] = _close(g(xs), reference)
    fft = ducc.c2c(axes=(1,), inorm=1)
    t = jax.jit(jax.linear_transpose(fft, xs))
    checks["c2c transpose: local blocks"] = _shapes(_calls(t, xs), (2, 64))
    checks["c2c transpose: value"] = _close(t(xs)[0], fft(x))
    lin = jax.jit(lambda v: jax.jvp(fft, (v,), (2 * v,))[1])
    checks["c2c jvp: local blocks"] = _shapes(_calls(lin, xs), (2, 64))
    checks["c2c jvp: value"] = _close(lin(xs), 2 * fft(x))

    # Two transformed axes: the untransformed leading one stays split.
    cube = _rng((4, 8, 16), "complex128", 2)
    f = jax.jit(ducc.c2c(axes=(1, 2), forward=False, inorm=2))
    cs = put(cube, "d")
    checks["c2c 2-d: no gather"] = _no_gather(f, cs)
    checks["c2c 2-d: local blocks"] = _shapes(_calls(f, cs), (1, 8, 16))
    checks["c2c 2-d: value"] = _close(f(cs), np.fft.ifftn(cube, axes=(1, 2)))

    # vmap folds the batch axis into the op (its @batch rule): still per block.
    v = jax.jit(jax.vmap(ducc.c2c(axes=(0,)), in_axes=1, out_axes=1))
    checks["c2c vmap: no gather"] = _no_gather(v, put(cube, None, None, "d"))
    checks["c2c vmap: local blocks"] = _shapes(_calls(v, put(cube, None, None, "d")),
                                               (4, 8, 4))
    checks["c2c vmap: value"] = _close(v(put(cube, None, None, "d")), np.fft.fft(cube, axis=0))

    # Sharded along the transformed axis: XLA gathers, the value stays right.
    f = jax.jit(ducc.c2c(axes=(1,)))
    xn = put(x, None, "d")
    checks["c2c along the axis: gathered"] = _shapes(_calls(f, xn), (8, 64))
    checks["c2c along the axis: value"] = _close(f(xn), np.fft.fft(x, axis=1))

    r = _rng((8, 32), "float64", 3)
    h = jax.jit(jax.grad(lambda v: jnp.sum(ducc.genuine_fht(axes=(1,))(v) ** 3)))
    rs = put(r, "d")
    checks["fht grad: no gather"] = _no_gather(h, rs)
    checks["fht grad: local blocks"] = _shapes(_calls(h, rs), (2, 32))
    fht = np.fft.fft(r, axis=1)
    fht = fht.real - fht.imag
    checks["fht grad: value"] = _close(
        h(rs), np.real(np.fft.fft(3 * fht**2, axis=1)) - np.imag(np.fft.fft(3 * fht**2, axis=1)))

    # NUFFT type 2: points (with their coordinates) split, the grid whole.
    coord = np.random.default_rng(4).uniform(0, 2 * np.pi, (64, 2))
    grid = _rng((16, 12), "complex128", 5)
    u2nu = ducc.u2nu()
    f = jax.jit(u2nu)
    cs = put(coord, "d")
    checks["u2nu: no gather"] = _no_gather(f, cs, grid)
    checks["u2nu: local blocks"] = _shapes(_calls(f, cs, grid), (16, 2))
    checks["u2nu: value"] = _close(f(cs, grid), u2nu(coord, grid), 1e-9)
    ct = _rng((64,), "complex128", 6)
    pull = jax.jit(lambda c, gr, w: jax.vjp(lambda q: u2nu(c, q), gr)[1](w)[0])
    ws = put(ct, "d")
    checks["u2nu vjp: no gather"] = _no_gather(pull, cs, grid, ws)
    checks["u2nu vjp: local blocks"] = _shapes(_calls(pull, cs, grid, ws), (16, 2))
    whole = jax.vjp(lambda q: u2nu(coord, q), grid)[1](ct)[0]
    checks["u2nu vjp: partial grids summed"] = _close(pull(cs, grid, ws), whole, 1e-9)

    # Degridding: visibility rows split, the image whole.
    uvw = np.random.default_rng(7).uniform(-300, 300, (32, 3))
    uvw[:, 2] = 0
    freq = np.array([1.0e9, 1.1e9])
    dirty = _rng((32, 32), "float64", 8)
    d2v = ducc.dirty2vis(1e-5, 1e-5)
    f = jax.jit(d2v)
    us = put(uvw, "d")
    checks["dirty2vis: no gather"] = _no_gather(f, us, freq, dirty)
    checks["dirty2vis: local blocks"] = _shapes(_calls(f, us, freq, dirty), (8, 3))
    checks["dirty2vis: value"] = _close(f(us, freq, dirty), d2v(uvw, freq, dirty), 1e-9)
    g = jax.jit(jax.grad(lambda u, q: jnp.sum(jnp.abs(d2v(u, freq, q)) ** 2), argnums=1))
    checks["dirty2vis grad: no gather"] = _no_gather(g, us, dirty)
    checks["dirty2vis grad: local blocks"] = _shapes(_calls(g, us, dirty), (8, 3))
    whole = jax.grad(lambda q: jnp.sum(jnp.abs(d2v(uvw, freq, q)) ** 2))(dirty)
    checks["dirty2vis grad: value"] = _close(g(us, dirty), whole, 1e-9)

    # A batch of spherical-harmonic syntheses sharded along the batch.
    sht = ducc.healpix_synthesis(nside=4, lmax=8)
    alm = _rng((8, 1, ducc.nalm(8)), "complex128", 9)
    alm[..., :9] = alm[..., :9].real  # m = 0 coefficients are real
    batch = jax.jit(jax.vmap(sht))
    als = put(alm, "d")
    maps = batch(als)
    checks["sht batch: = unsharded"] = _close(maps, jax.vmap(sht)(alm))
    checks["sht batch: = per-map loop"] = _close(maps, np.stack([sht(a) for a in alm]))
    energy = jax.jit(jax.grad(lambda a: jnp.sum(jax.vmap(sht)(a) ** 2)))
    checks["sht batch grad: = unsharded"] = _close(
        energy(als), jax.grad(lambda a: jnp.sum(jax.vmap(sht)(a) ** 2))(alm))

    # Results with dims of their own: r2c, nu2u (points summed), vis2dirty (rows summed).
    r = _rng((8, 64), "float64", 11)
    rs = put(r, "d")
    r2c = jax.jit(ducc.r2c(axes=(1,)))
    checks["r2c: value"] = _close(r2c(rs), np.fft.rfft(r, axis=1))
    nu2u = ducc.nu2u((16, 12))
    points = _rng((64,), "complex128", 12)
    grid_of = jax.jit(nu2u)
    ps = put(points, "d")
    checks["nu2u: value"] = _close(grid_of(cs, ps), nu2u(coord, points), 1e-9)
    v2d = ducc.vis2dirty(32, 32, 1e-5, 1e-5)
    vis = _rng((32, 2), "complex128", 13)
    image = jax.jit(v2d)
    vs = put(vis, "d")
    checks["vis2dirty: value"] = _close(image(us, freq, vs), v2d(uvw, freq, vis), 1e-9)
    checks["sht batch: no gather"] = _no_gather(batch, als)
    checks["sht batch: local blocks"] = _shapes(_calls(batch, als), (2, 1, ducc.nalm(8)))
    checks["sht batch grad: no gather"] = _no_gather(energy, als)
    checks["r2c: no gather"] = _no_gather(r2c, rs)
    checks["r2c: local blocks"] = _shapes(_calls(r2c, rs), (2, 64))
    checks["nu2u: no gather"] = _no_gather(grid_of, cs, ps)
    checks["nu2u: local blocks"] = _shapes(_calls(grid_of, cs, ps), (16, 2))
    checks["vis2dirty: no gather"] = _no_gather(image, us, freq, vs)
    checks["vis2dirty: local blocks"] = _shapes(_calls(image, us, freq, vs), (8, 3))


def explicit(checks: dict) -> None:
    """Explicit mesh axes (the result type carries the sharding) and shard_map."""
    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Explicit,))
    x = _rng((8, 64), "complex128", 10)
    fft = ducc.c2c(axes=(1,))
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, P("d"))
        y = jax.jit(fft)(xs)
        checks["explicit: type"] = str(jax.typeof(y)) == "complex128[8@d,64]" or \
            str(jax.typeof(y))
        checks["explicit: value"] = _close(y, np.fft.fft(x, axis=1))
        try:
            jax.jit(fft)(jax.device_put(x, P(None, "d")))
            checks["explicit: transformed axis sharded raises"] = "no error"
        except Exception as error:  # noqa: BLE001 - reported to the test
            text = str(error)
            checks["explicit: transformed axis sharded raises"] = (
                type(error).__name__ == "ShardingTypeError" and "c2c" in text
                and "dim 1" in text) or text[:300]

    mesh = jax.make_mesh((4,), ("d",))
    mapped = jax.jit(jax.shard_map(fft, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    xs = jax.device_put(x, NamedSharding(mesh, P("d")))
    checks["shard_map: local blocks"] = _shapes(_calls(mapped, xs), (2, 64))
    checks["shard_map: value"] = _close(mapped(xs), np.fft.fft(x, axis=1))
    g = jax.jit(jax.grad(lambda v: jnp.sum(jnp.abs(mapped(v)) ** 2)))
    checks["shard_map grad: value"] = _close(g(xs), 2 * 64 * np.conj(x))


def main() -> None:
    jax.config.update("jax_enable_x64", True)
    checks: dict = {}
    for scenario in (automatic, explicit):
        try:
            scenario(checks)
        except Exception as error:  # noqa: BLE001 - one failure must not hide the rest
            checks[f"{scenario.__name__}: ran"] = f"{type(error).__name__}: {error}"[:2000]
    print(json.dumps({"checks": {k: (v if v is True else str(v)) for k, v in checks.items()}}))


if __name__ == "__main__":
    main()
