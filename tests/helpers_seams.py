"""The seams between sharding modes, one regression check each, in a fresh interpreter.

Run as ``python helpers_seams.py devices`` (4 host devices) or
``python helpers_seams.py processes PORT ID`` (one of two processes with 2
devices each); prints one JSON line ``{"checks": {name: true | what was seen}}``.
Every value is checked against ``jax.numpy``.
"""

import json
import os
import sys

_DEVICES = "2" if len(sys.argv) > 1 and sys.argv[1] == "processes" else "4"
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={_DEVICES}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxdecl as jd  # noqa: E402
from jaxdecl import _compat  # noqa: E402

jax.config.update("jax_enable_x64", True)

SHAPES: list = []  # what the spying rules saw


class Tanh(jd.Primitive):
    """tanh, with no sharding declaration."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, *, out):
        SHAPES.append(x.shape)
        np.tanh(x, out=out)

    @jd.jvp
    def push(self, x, dx):
        return (1 - np.tanh(x) ** 2) * dx

    @jd.vjp
    def pull(self, x, ct):
        return (1 - np.tanh(x) ** 2) * ct


class Scale(jd.Primitive, sharding="n -> n"):
    """factor * x, declared elementwise."""

    def __init__(self, factor):
        self.factor = factor

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, *, out):
        np.multiply(x, self.factor, out=out)

    @jd.jvp
    def push(self, x, dx):
        return self.factor * dx

    @jd.vjp
    def pull(self, x, ct):
        return self.factor * ct


class MulRow(jd.Primitive, sharding="b n, n -> b n"):
    """a * v[None, :]: the second input is shared by every row."""

    @jd.abstract
    def shapes(self, a, v):
        return jax.ShapeDtypeStruct(a.shape, a.dtype)

    @jd.forward
    def apply(self, a, v, *, out):
        np.multiply(a, v[None, :], out=out)

    @jd.jvp
    def push(self, a, v, da, dv):
        return da * v[None, :] + a * dv[None, :]

    @jd.vjp
    def pull(self, a, v, ct):
        return ct * v[None, :], (ct * a).sum(0)


def mul_row(a, v):
    return a * v[None, :]


def _close(got, want):
    got, want = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    if len(got) != len(want):
        return f"{len(got)} results, expected {len(want)}"
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape or not np.allclose(g, w, rtol=1e-10, atol=1e-12):
            return f"got {g!r}, expected {w!r}"
    return True


def _check(checks, name, run, reference, refusal=None):
    """`run()` against `reference()`; or, given a `refusal` text, a ShardingTypeError
    saying it (a documented refusal) passes too."""
    try:
        checks[name] = _close(run(), reference())
    except Exception as error:  # noqa: BLE001 - reported to the test
        refused = refusal is not None and isinstance(error, _compat.ShardingTypeError) and \
            refusal in str(error)
        checks[name] = refused or f"{type(error).__name__}: {str(error)[:400]}"


def _same_sharding(checks, name, got, want):
    try:
        checks[name] = got.sharding.is_equivalent_to(want.sharding, got.ndim) or \
            f"{got.sharding} vs {want.sharding}"
    except Exception as error:  # noqa: BLE001
        checks[name] = f"{type(error).__name__}: {error}"


def devices() -> dict:
    checks: dict = {}
    auto = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,))
    x = jax.device_put(jnp.linspace(-1.0, 1.0, 16), NamedSharding(auto, P("d")))
    tanh = Tanh()

    # An undeclared op's results live on the inputs' mesh: they combine with them.
    _check(checks, "auto eager undeclared + x", lambda: tanh(x) + x, lambda: jnp.tanh(x) + x)
    _same_sharding(checks, "auto eager undeclared: on the mesh", tanh(x) + x, x)
    loss = lambda f: (lambda v: jnp.sum(f(v) * v + v))  # noqa: E731
    _check(checks, "auto eager grad", lambda: jax.grad(loss(tanh))(x),
           lambda: jax.grad(loss(jnp.tanh))(x))
    _check(checks, "auto eager linearize",
           lambda: jax.linearize(lambda v: tanh(v) + v, x)[1](x),
           lambda: jax.linearize(lambda v: jnp.tanh(v) + v, x)[1](x))
    with jax.set_mesh(auto):
        _check(checks, "auto set_mesh eager grad", lambda: jax.grad(loss(tanh))(x),
               lambda: jax.grad(loss(jnp.tanh))(x))

    # vmap over a batch split across devices, without jax.set_mesh.
    rows = jax.device_put(jnp.arange(128.0).reshape(8, 16) / 100, NamedSharding(auto, P("d")))
    _check(checks, "jit vmap declared, no set_mesh",
           lambda: jax.jit(jax.vmap(lambda v: Scale(2.0)(v) + Scale(3.0)(v)))(rows),
           lambda: 5 * rows)
    _check(checks, "jit vmap undeclared, no set_mesh",
           lambda: jax.jit(jax.vmap(lambda v: tanh(v) + v))(rows),
           lambda: jnp.tanh(rows) + rows)
    # ... and the undeclared op keeps vmapped rows per device: no gather, local blocks.
    program = jax.jit(jax.vmap(tanh))
    text = program.lower(rows).compile().as_text()
    checks["jit vmap undeclared: no all-gather"] = "all-gather" not in text or "all-gather"
    SHAPES.clear()
    program(rows).block_until_ready()
    checks["jit vmap undeclared: each device its rows"] = \
        sorted(SHAPES) == [(16,)] * 8 or f"{SHAPES}"  # 2 rows a device, looped: 8 calls
    SHAPES.clear()
    jax.vmap(tanh)(rows).block_until_ready()
    checks["eager vmap undeclared: each device its rows"] = \
        sorted(SHAPES) == [(16,)] * 8 or f"{SHAPES}"
    SHAPES.clear()
    tanh(x).block_until_ready()
    checks["eager undeclared: runs once"] = SHAPES == [(16,)] or f"{SHAPES}"

    # Explicit axes, one input split along a factor and the other replicated.
    explicit = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(explicit):
        a = jax.device_put(jnp.arange(32.0).reshape(4, 8) / 10,
                           NamedSharding(explicit, P(None, "d")))
        v = jax.device_put(jnp.linspace(0.0, 1.0, 8), NamedSharding(explicit, P()))
        b = jax.device_put(jnp.arange(64.0).reshape(2, 4, 8) / 10,
                           NamedSharding(explicit, P(None, None, "d")))
        op = MulRow()
        mixed = lambda f: (lambda a, v: jnp.sum(f(a, v) * a))  # noqa: E731
        cases = {
            "eager": (lambda f: f(a, v)),
            "jit": (lambda f: jax.jit(f)(a, v)),
            "grad": (lambda f: jax.grad(mixed(f), (0, 1))(a, v)),
            "jit grad": (lambda f: jax.jit(jax.grad(mixed(f), (0, 1)))(a, v)),
            "linearize": (lambda f: jax.linearize(f, a, v)[1](a, v)),
            "vmap grad": (lambda f: jax.vmap(jax.grad(mixed(f), (0, 1)), (0, None))(b, v)),
            "scan": (lambda f: jax.lax.scan(lambda c, _: (f(c, v), None), a, None,
                                            length=3)[0]),
            "jit vmap sum": (lambda f: jax.jit(lambda b: jax.vmap(f, (0, None))(b, v).sum())(b)),
        }
        for name, run in cases.items():
            # The cotangent of v sums over the split (JAX >= 0.9): before, right or refused.
            sums = name in ("grad", "jit grad", "vmap grad") and not _compat.EXPLICIT_REDUCTIONS
            _check(checks, f"explicit mixed {name}", lambda run=run: run(op),
                   lambda run=run: run(mul_row), refusal="needs JAX >= 0.9" if sums else None)
        _check(checks, "explicit eager undeclared + x", lambda: tanh(a) + a,
               lambda: jnp.tanh(a) + a)
        _same_sharding(checks, "explicit eager undeclared: typed like jnp", tanh(a) + a,
                       jnp.tanh(a) + a)
    return checks


def processes(port: str, process_id: str) -> dict:
    process_id = int(process_id)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,))
    whole = np.linspace(-1.0, 1.0, 16)
    mine = slice(8 * process_id, 8 * process_id + 8)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), whole[mine],
                                               whole.shape)

    def local(array):
        shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)
        return np.concatenate([np.asarray(s.data) for s in shards])

    checks: dict = {}
    tanh = Tanh()
    _check(checks, "eager undeclared on a global array", lambda: local(tanh(x) + x),
           lambda: np.tanh(whole[mine]) + whole[mine])
    _check(checks, "eager grad undeclared on a global array",
           lambda: local(jax.grad(lambda v: jnp.sum(tanh(v) * v))(x)),
           lambda: np.tanh(whole[mine]) + whole[mine] * (1 - np.tanh(whole[mine]) ** 2))
    _check(checks, "eager declared on a global array",
           lambda: local(Scale(2.0)(x)),
           lambda: 2 * whole[mine])
    # Process 0 hosts the coordination service: exiting before the other process is
    # done would take it down.
    jax.distributed.shutdown()
    return checks


if __name__ == "__main__":
    scenario = {"devices": devices, "processes": processes}[sys.argv[1]]
    print(json.dumps({"checks": scenario(*sys.argv[2:])}), flush=True)
    os._exit(0)  # (a CPU client can hang joining workers at exit under load)
