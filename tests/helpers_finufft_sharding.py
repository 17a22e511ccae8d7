"""jaxdecl.contrib.finufft on several devices, run in a fresh interpreter.

``python helpers_finufft_sharding.py devices`` (4 host CPU devices) or
``... processes PORT ID`` (one of 2 processes with 2 devices each, one
``jax.distributed`` job); prints one JSON line ``{"checks": {name: value}}``,
``true`` where a check passed and what was seen otherwise.

"No gather" is read from the compiled HLO (no all-gather, no all-to-all);
"local blocks" from the shapes of the kernel's custom calls in it; values are
checked against the direct sums of ``helpers_finufft`` and, where jax-finufft
is installed, against it (which gathers: it runs the whole problem on every
device).
"""

import json
import os
import re
import sys

if sys.argv[1:2] == ["processes"]:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
else:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from helpers_finufft import random_complex, random_points, relative_error, type1, type2, type3  # noqa: E402  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxdecl.contrib.finufft import Opts, nufft1, nufft2, nufft3  # noqa: E402

try:
    import jax_finufft
except ImportError:
    jax_finufft = None

ONE = Opts(nthreads=1)
EPS = 1e-12


def _close(a, b, tol=1e-9):
    error = relative_error(a, b)
    return True if error <= tol else f"relative error {error:.3g}"


def _hlo(function, *args) -> str:
    return function.lower(*args).compile().as_text()


def _no_gather(text: str):
    found = [w for w in ("all-gather", "all-to-all") if w in text]
    return True if not found else f"found {found}"


def _kernel_shapes(text: str) -> set:
    """The result shapes of the jaxdecl kernels' custom calls in compiled HLO."""
    return {m.group(1) for m in re.finditer(r"= (\w+\[[\d,]*\])\{[\d,]*\} custom-call\(",
                                            text)
            if "jaxdecl" in text[m.end():m.end() + 2000].split("\n", 1)[0]}


def _local(text: str, shape: str):
    shapes = _kernel_shapes(text)
    return True if shape in shapes else f"kernels ran on {sorted(shapes)}, not {shape}"


def _sum1(c, xs, n_modes, iflag=1):
    return type1(tuple(jnp.asarray(x)[None] for x in xs), jnp.asarray(c)[None, None],
                 n_modes, iflag)[0, 0]


def _sum2(f, xs, iflag=-1):
    return type2(tuple(jnp.asarray(x)[None] for x in xs), jnp.asarray(f)[None, None], iflag)[0, 0]


def devices() -> dict:
    checks = {}
    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,))

    def put(x, *spec):
        return jax.device_put(x, NamedSharding(mesh, P(*spec)))

    rng = np.random.default_rng(0)
    m, n_modes = 64, (8, 6)
    x, y = random_points(rng, (2, m))
    modes = random_complex(rng, n_modes)
    strengths = random_complex(rng, m)
    xs, ys, cs = put(x, "d"), put(y, "d"), put(strengths, "d")

    # Type 2 splits over its points: each device evaluates its 16 points.
    for dtype, real, tol in ((np.complex128, np.float64, 1e-9), (np.complex64, np.float32, 1e-4)):
        eps = EPS if real == np.float64 else 1e-6
        f = jax.jit(lambda v, a, b, eps=eps: nufft2(v, a, b, eps=eps, opts=ONE))
        args = (modes.astype(dtype), put(x.astype(real), "d"), put(y.astype(real), "d"))
        text = _hlo(f, *args)
        key = f"type 2 {np.dtype(dtype).name}"
        checks[f"{key}: no gather"] = _no_gather(text)
        checks[f"{key}: local blocks"] = _local(text, f"{'c128' if real == np.float64 else 'c64'}"
                                                      f"[1,1,16]")
        out = f(*args)
        checks[f"{key}: sharding kept"] = out.sharding.spec == P("d") or str(out.sharding)
        checks[f"{key}: = direct sum"] = _close(out, _sum2(modes, (x, y)), tol)

    # Its gradient with respect to the modes: a type 1 per device, partial grids summed.
    loss2 = lambda v, a, b: jnp.sum(jnp.abs(nufft2(v, a, b, eps=EPS, opts=ONE)) ** 2)  # noqa: E731
    g = jax.jit(jax.grad(loss2))
    text = _hlo(g, modes, xs, ys)
    checks["type 2 grad: no gather"] = _no_gather(text)
    checks["type 2 grad: local blocks"] = _local(text, "c128[1,1,16]")
    expected = jax.grad(lambda v: jnp.sum(jnp.abs(_sum2(v, (x, y))) ** 2))(modes)
    checks["type 2 grad: = direct sum"] = _close(g(modes, xs, ys), expected)

    # Type 1 sums over its points: partial grids per device, then a sum.
    f = jax.jit(lambda c, a, b: nufft1(n_modes, c, a, b, eps=EPS, opts=ONE))
    text = _hlo(f, cs, xs, ys)
    checks["type 1: no gather"] = _no_gather(text)
    checks["type 1: local blocks"] = _local(text, "c128[1,1,8,6]")
    checks["type 1: partial grids summed"] = "all-reduce" in text or "no all-reduce"
    checks["type 1: = direct sum"] = _close(f(cs, xs, ys), _sum1(strengths, (x, y), n_modes))
    loss1 = lambda c, a, b: jnp.sum(jnp.abs(nufft1(n_modes, c, a, b, eps=EPS,  # noqa: E731
                                                   opts=ONE)) ** 2)
    g = jax.jit(jax.grad(loss1))
    text = _hlo(g, cs, xs, ys)
    checks["type 1 grad: no gather"] = _no_gather(text)
    grad = g(cs, xs, ys)
    checks["type 1 grad: sharding kept"] = grad.sharding.spec == P("d") or str(grad.sharding)
    expected = jax.grad(lambda c: jnp.sum(jnp.abs(_sum1(c, (x, y), n_modes)) ** 2))(strengths)
    checks["type 1 grad: = direct sum"] = _close(grad, expected)

    # A batch of transforms sharing the points, split along the batch.
    batch = random_complex(rng, (8,) + n_modes)
    f = jax.jit(lambda v, a, b: nufft2(v, a, b, eps=EPS, opts=ONE))
    text = _hlo(f, put(batch, "d"), x, y)
    checks["batch: no gather"] = _no_gather(text)
    checks["batch: local blocks"] = _local(text, "c128[1,2,64]")
    checks["batch: = direct sum"] = _close(f(put(batch, "d"), x, y),
                                           jax.vmap(lambda v: _sum2(v, (x, y)))(batch))
    v = jax.jit(jax.vmap(lambda c: nufft1(n_modes, c, x, y, eps=EPS, opts=ONE)))
    cb = random_complex(rng, (8, m))
    text = _hlo(v, put(cb, "d"))
    checks["vmap: no gather"] = _no_gather(text)
    checks["vmap: local blocks"] = _local(text, "c128[1,2,8,6]")
    checks["vmap: = direct sum"] = _close(v(put(cb, "d")),
                                          jax.vmap(lambda c: _sum1(c, (x, y), n_modes))(cb))

    # Type 3: the targets split freely; the points split with a sum.
    s, t = random_points(rng, (2, 32), scale=4.0)
    f = jax.jit(lambda c, a, b, u, w: nufft3(c, a, b, u, w, eps=EPS, opts=ONE))
    expected = type3((x[None], y[None]), (s[None], t[None]), strengths[None, None])[0, 0]
    text = _hlo(f, strengths, x, y, put(s, "d"), put(t, "d"))
    checks["type 3 targets: no gather"] = _no_gather(text)
    checks["type 3 targets: local blocks"] = _local(text, "c128[1,1,8]")
    checks["type 3 targets: = direct sum"] = _close(f(strengths, x, y, put(s, "d"),
                                                      put(t, "d")), expected)
    text = _hlo(f, cs, xs, ys, s, t)
    checks["type 3 points: no gather"] = _no_gather(text)
    checks["type 3 points: = direct sum"] = _close(f(cs, xs, ys, s, t), expected)

    # Inside shard_map the ops see each device's block.
    sm = jax.jit(jax.shard_map(lambda v, a, b: nufft2(v, a, b, eps=EPS, opts=ONE), mesh=mesh,
                               in_specs=(P(), P("d"), P("d")), out_specs=P("d")))
    checks["shard_map type 2: = direct sum"] = _close(sm(modes, xs, ys), _sum2(modes, (x, y)))
    gm = jax.jit(jax.grad(lambda v, a, b: jnp.sum(jnp.abs(sm(v, a, b)) ** 2)))
    checks["shard_map grad (replicated modes summed): = direct sum"] = _close(
        gm(modes, xs, ys), jax.grad(lambda v: jnp.sum(jnp.abs(_sum2(v, (x, y))) ** 2))(modes))

    # Derivatives in the points and the values at once, sharded like the points.
    def sum_loss(transform):
        return lambda *a: jnp.sum(jnp.abs(transform(*a)) ** 2)

    def tree_close(got, expected, tol=1e-9):
        errors = [relative_error(a, b) for a, b in zip(jax.tree_util.tree_leaves(got),
                                                       jax.tree_util.tree_leaves(expected))]
        return True if max(errors) <= tol else f"relative errors {errors}"

    gp = jax.jit(jax.grad(loss2, argnums=(0, 1, 2)))
    text = _hlo(gp, modes, xs, ys)
    checks["type 2 grad modes+points: no gather"] = _no_gather(text)
    checks["type 2 grad modes+points: local blocks"] = _local(text, "c128[1,2,16]")
    got = gp(modes, xs, ys)
    checks["type 2 grad modes+points: = direct sum"] = tree_close(
        got, jax.grad(sum_loss(lambda v, a, b: _sum2(v, (a, b))), argnums=(0, 1, 2))(modes, x, y))
    checks["type 2 grad points: sharding kept"] = got[1].sharding.spec == P("d") or \
        str(got[1].sharding)
    hvp = jax.jit(lambda a, b, da: jax.jvp(lambda u: jax.grad(loss2, argnums=1)(modes, u, b),
                                          (a,), (da,))[1])
    text = _hlo(hvp, xs, ys, xs)
    checks["type 2 hessian-vector in the points: no gather"] = _no_gather(text)
    checks["type 2 hessian-vector in the points: = direct sum"] = _close(
        hvp(xs, ys, xs), jax.jvp(lambda u: jax.grad(sum_loss(lambda a, b: _sum2(modes, (a, b))))(
            u, y), (x,), (x,))[1], 1e-8)
    g1 = jax.jit(jax.grad(loss1, argnums=(0, 1, 2)))
    text = _hlo(g1, cs, xs, ys)
    checks["type 1 grad strengths+points: no gather"] = _no_gather(text)
    checks["type 1 grad strengths+points: = direct sum"] = tree_close(
        g1(cs, xs, ys), jax.grad(sum_loss(lambda c, a, b: _sum1(c, (a, b), n_modes)),
                                 argnums=(0, 1, 2))(strengths, x, y))
    t1 = jax.jit(lambda c, a, b, da: jax.jvp(
        lambda u: nufft1(n_modes, c, u, b, eps=EPS, opts=ONE), (a,), (da,))[1])
    text = _hlo(t1, cs, xs, ys, ys)
    checks["type 1 jvp points: no gather"] = _no_gather(text)
    checks["type 1 jvp points: = direct sum"] = _close(
        t1(cs, xs, ys, ys), jax.jvp(lambda u: _sum1(strengths, (u, y), n_modes), (x,), (y,))[1])
    loss3 = lambda *a: jnp.sum(jnp.abs(nufft3(*a, eps=EPS, opts=ONE)) ** 2)  # noqa: E731
    ref3 = sum_loss(lambda c, a, b, u, w: type3((a[None], b[None]), (u[None], w[None]),
                                                c[None, None])[0, 0])
    g3 = jax.jit(jax.grad(loss3, argnums=(0, 1, 2, 3, 4)))
    expected = jax.grad(ref3, argnums=(0, 1, 2, 3, 4))(strengths, x, y, s, t)
    for label, args in (("points", (cs, xs, ys, s, t)),
                        ("targets", (strengths, x, y, put(s, "d"), put(t, "d")))):
        text = _hlo(g3, *args)
        checks[f"type 3 grad, split {label}: no gather"] = _no_gather(text)
        checks[f"type 3 grad, split {label}: = direct sum"] = tree_close(g3(*args), expected)
    # jax-finufft's gradients under shard_map were wrong in its points; these are each block's.
    gs = jax.jit(jax.grad(lambda v, a, b: jnp.sum(jnp.abs(sm(v, a, b)) ** 2), argnums=(0, 1, 2)))
    checks["shard_map grad modes+points: = direct sum"] = tree_close(
        gs(modes, xs, ys),
        jax.grad(sum_loss(lambda v, a, b: _sum2(v, (a, b))), argnums=(0, 1, 2))(modes, x, y))

    if jax_finufft is not None:  # the peer runs the whole problem on every device
        peer = jax.jit(lambda v, a, b: jax_finufft.nufft2(v, a, b, eps=EPS))
        checks["jax-finufft type 2: same values"] = _close(
            jax.jit(lambda v, a, b: nufft2(v, a, b, eps=EPS, opts=ONE))(modes, xs, ys),
            peer(modes, xs, ys), 1e-12)
        checks["jax-finufft type 1: same values"] = _close(
            jax.jit(lambda c, a, b: nufft1(n_modes, c, a, b, eps=EPS, opts=ONE))(cs, xs, ys),
            jax.jit(lambda c, a, b: jax_finufft.nufft1(n_modes, c, a, b, eps=EPS))(cs, xs, ys),
            1e-12)
    return checks


def processes(port: str, process_id: str) -> dict:
    """One of two processes (2 devices each) sharing a 4-device mesh: each its own points."""
    process_id = int(process_id)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    checks = {"devices": (jax.device_count(), jax.local_device_count()) == (4, 2) or
              f"{jax.device_count()} global, {jax.local_device_count()} local"}
    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(0)  # the same data in both processes
    m, n_modes = 64, (8, 6)
    x, y = random_points(rng, (2, m))
    modes = random_complex(rng, n_modes)
    strengths = random_complex(rng, m)
    mine = slice(32 * process_id, 32 * process_id + 32)

    def global_array(whole):
        return jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), whole[mine],
                                                      whole.shape)

    def local_part(array):
        shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)
        return np.concatenate([np.asarray(s.data) for s in shards])

    xs, ys, cs = global_array(x), global_array(y), global_array(strengths)
    f = jax.jit(lambda v, a, b: nufft2(v, a, b, eps=EPS, opts=ONE))
    text = _hlo(f, modes, xs, ys)
    checks["type 2: no gather"] = _no_gather(text)
    checks["type 2: local blocks"] = _local(text, "c128[1,1,16]")
    checks["type 2: = direct sum"] = _close(local_part(f(modes, xs, ys)),
                                            np.asarray(_sum2(modes, (x, y)))[mine])
    f = jax.jit(lambda c, a, b: nufft1(n_modes, c, a, b, eps=EPS, opts=ONE))
    out = f(cs, xs, ys)
    checks["type 1: partial grids summed across processes"] = _close(
        np.asarray(out.addressable_shards[0].data), _sum1(strengths, (x, y), n_modes))
    g = jax.jit(jax.grad(lambda v, a, b: jnp.sum(jnp.abs(nufft2(v, a, b, eps=EPS,
                                                                   opts=ONE)) ** 2)))
    expected = jax.grad(lambda v: jnp.sum(jnp.abs(_sum2(v, (x, y))) ** 2))(modes)
    checks["type 2 grad: = direct sum"] = _close(
        np.asarray(g(modes, xs, ys).addressable_shards[0].data), expected)
    gp = jax.jit(jax.grad(lambda v, a, b: jnp.sum(jnp.abs(nufft2(v, a, b, eps=EPS,
                                                                    opts=ONE)) ** 2),
                          argnums=(1, 2)))
    text = _hlo(gp, modes, xs, ys)
    checks["type 2 grad points: no gather"] = _no_gather(text)
    expected = jax.grad(lambda a, b: jnp.sum(jnp.abs(_sum2(modes, (a, b))) ** 2),
                        argnums=(0, 1))(x, y)
    got = gp(modes, xs, ys)
    checks["type 2 grad points: = direct sum, each process its own points"] = _close(
        np.stack([local_part(g) for g in got]), np.stack([np.asarray(e)[mine] for e in expected]))
    jax.distributed.shutdown()
    return checks


def main(argv) -> None:
    jax.config.update("jax_enable_x64", True)
    checks = {"devices": devices, "processes": processes}[argv[0]](*argv[1:])
    print(json.dumps({"checks": {k: (v if v is True else str(v)) for k, v in checks.items()}}))


if __name__ == "__main__":
    main(sys.argv[1:])
