"""Multi-device sharding scenarios, run in a fresh interpreter with 4 host CPU devices.

Run as ``python helpers_sharding.py SCENARIO``; prints one JSON line
``{"checks": {name: value}}``. A value is ``true`` when the check passed,
anything else (``false``, a string with what was seen) when it failed. Each
scenario batches many checks: every subprocess pays JAX's import once.
"""

import json
import os
import sys

# 4 devices in one process; 2 in each of the two processes of `processes`.
_DEVICES = os.environ.get("JAXDECL_TEST_DEVICES", "4")
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={_DEVICES}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from ops_linear import Nudft, nudft_ref  # noqa: E402

import jaxdecl as jd  # noqa: E402
from jaxdecl import _compat  # noqa: E402

CALLS: list = []  # (rule, shape of the first operand) per rule call


class RowFFT(jd.Primitive, linear=True, batch="vectorized", sharding="b n -> b n",
             replicate=("n",)):
    """A transform along the last axis: rows are independent, the row is needed whole."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        CALLS.append(("fft", x.shape))
        return np.fft.fft(x, axis=-1)

    @jd.transpose
    def apply_t(self, ct):
        CALLS.append(("fft_t", ct.shape))
        return np.fft.fft(ct, axis=-1)


class ScaleRows(jd.Primitive, sharding="b n, b -> b n"):
    """{"y": x * p["w"][:, None] + p["c"][:, None]}: a dict input and output, split by row."""

    @jd.abstract
    def shapes(self, x, p):
        return {"y": jax.ShapeDtypeStruct(x.shape, x.dtype)}

    @jd.forward
    def apply(self, x, p):
        CALLS.append(("rows", x.shape))
        return {"y": x * p["w"][:, None] + p["c"][:, None]}

    @jd.vjp
    def pull(self, x, p, ct):
        CALLS.append(("rows_vjp", x.shape))
        y = ct["y"]
        return y * p["w"][:, None], {"w": np.sum(y * x, axis=1), "c": np.sum(y, axis=1)}


class MatVec(jd.Primitive, sharding="b k, k -> b", reduce=("k",)):
    """A contraction over k: per-slice partial results are summed."""

    @jd.abstract
    def shapes(self, a, x):
        return jax.ShapeDtypeStruct(a.shape[:1], a.dtype)

    @jd.forward
    def apply(self, a, x):
        CALLS.append(("mv", a.shape))
        return a @ x

    @jd.jvp
    def push(self, a, x, da, dx):
        CALLS.append(("mv_jvp", a.shape))
        return da @ x + a @ dx

    @jd.vjp
    def pull(self, a, x, ct):
        CALLS.append(("mv_vjp", a.shape))
        return np.outer(ct, x).astype(a.dtype), (a.T @ ct).astype(x.dtype)


class Mul(jd.Primitive, multilinear=True, sharding="n, n -> n"):
    """Elementwise product, multilinear: exercises transpose_wrt."""

    @jd.abstract
    def shapes(self, x, y):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, y):
        CALLS.append(("mul", x.shape))
        return x * y

    @jd.transpose(wrt="x")
    def t_x(self, y, ct):
        CALLS.append(("mul_tx", y.shape))
        return y * ct

    @jd.transpose(wrt="y")
    def t_y(self, x, ct):
        CALLS.append(("mul_ty", x.shape))
        return x * ct


class Scaled(jd.Primitive):
    """x * x * w with a (varying) x and a (replicated) w inside shard_map."""

    @jd.abstract
    def shapes(self, x, w):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, w):
        CALLS.append(("scaled", x.shape))
        return x * x * w

    @jd.jvp
    def push(self, x, w, dx, dw):
        return 2 * x * w * dx + x * x * dw

    @jd.vjp
    def pull(self, x, w, ct):
        return 2 * x * w * ct, (x * x * ct).sum(axis=0)


class WrongShapes(jd.Primitive, sharding="n -> n"):
    """Declares n independent, but its output shape ignores the input's: fails per shard."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct((8,), x.dtype)

    @jd.forward
    def apply(self, x):
        return np.zeros(8, x.dtype)


class Plain(jd.Primitive):
    """No declaration: stays correct under any sharding (XLA gathers)."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        CALLS.append(("plain", x.shape))
        return -x


class Tanh(jd.Primitive):
    """tanh without a sharding declaration: it runs once, on gathered inputs."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        CALLS.append(("tanh", x.shape[-2:]))
        return np.tanh(x)

    @jd.jvp
    def push(self, x, dx):
        CALLS.append(("tanh_jvp", x.shape[-2:]))
        return (1 - np.tanh(x) ** 2) * dx

    @jd.vjp
    def pull(self, x, ct):
        CALLS.append(("tanh_vjp", x.shape[-2:]))
        return (1 - np.tanh(x) ** 2) * ct


def _rng_array(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    value = rng.standard_normal(shape)
    if np.issubdtype(dtype, np.complexfloating):
        value = value + 1j * rng.standard_normal(shape)
    return value.astype(dtype)


def _close(a, b, dtype=np.float64) -> bool:
    tol = 1e-4 if np.dtype(dtype) in (np.float32, np.complex64) else 1e-10
    return bool(np.allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol))


def _calls(function, *args) -> list:
    """The rule calls made while `function(*args)` runs."""
    CALLS.clear()
    result = function(*args)
    jax.block_until_ready(result)
    seen = list(CALLS)
    CALLS.clear()
    return seen


def _no_gather(compiled_text: str):
    found = [w for w in ("all-gather", "all-to-all") if w in compiled_text]
    return True if not found else f"found {found}"


def _all_shapes(calls, shape):
    shapes = {s for _, s in calls}
    return True if calls and shapes == {shape} else f"rule saw {sorted(shapes)} ({len(calls)})"


def automatic() -> dict:
    """jit over a mesh of Auto axes: forward, jvp, vjp, transpose, vmap, reduce, errors."""
    checks = {}
    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,))

    def put(x, *spec):
        return jax.device_put(x, NamedSharding(mesh, P(*spec)))

    for dtype in ("complex128", "complex64"):
        x = _rng_array((8, 16), dtype)
        expected = np.fft.fft(x, axis=-1)
        xs = put(x, "d")
        f = jax.jit(RowFFT())
        checks[f"fft {dtype}: no gather"] = _no_gather(f.lower(xs).compile().as_text())
        checks[f"fft {dtype}: local blocks"] = _all_shapes(_calls(f, xs), (2, 16))
        y = f(xs)
        checks[f"fft {dtype}: value"] = _close(y, expected, dtype)
        checks[f"fft {dtype}: result sharding"] = y.sharding.spec == P("d") or str(y.sharding)

    x = _rng_array((8, 16), "complex128")
    expected = np.fft.fft(x, axis=-1)
    f = jax.jit(RowFFT())
    xn = put(x, None, "d")
    checks["fft along n: gathered"] = _all_shapes(_calls(f, xn), (8, 16))
    checks["fft along n: value"] = _close(f(xn), expected)
    xs = put(x, "d")
    checks["fft eager sharded: local blocks"] = _all_shapes(_calls(RowFFT(), xs), (2, 16))

    def energy(op):
        return lambda v: jnp.sum(jnp.abs(op(v)) ** 2)

    g = jax.jit(jax.grad(energy(RowFFT())))
    checks["fft grad: no gather"] = _no_gather(g.lower(xs).compile().as_text())
    checks["fft grad: local blocks"] = _all_shapes(_calls(g, xs), (2, 16))
    checks["fft grad: value"] = _close(g(xs), jax.grad(energy(lambda v: jnp.fft.fft(v)))(x))
    t = jax.jit(jax.linear_transpose(RowFFT(), xs))
    checks["fft transpose: local blocks"] = _all_shapes(_calls(t, xs), (2, 16))
    checks["fft transpose: value"] = _close(t(xs)[0], np.fft.fft(x, axis=-1))
    batch = _rng_array((4, 8, 16), "complex128", 3)
    bs = put(batch, "d")
    v = jax.jit(jax.vmap(RowFFT()))
    checks["fft vmap: no gather"] = _no_gather(v.lower(bs).compile().as_text())
    checks["fft vmap: local blocks"] = _all_shapes(_calls(v, bs), (1, 8, 16))
    checks["fft vmap: value"] = _close(v(bs), np.fft.fft(batch, axis=-1))
    bs2 = put(batch, None, "d")
    checks["fft vmap, rows split: local blocks"] = _all_shapes(_calls(v, bs2), (4, 2, 16))

    for dtype in ("float64", "float32"):
        a = _rng_array((8, 12), dtype, 1)
        x = _rng_array((12,), dtype, 2)
        ct = _rng_array((8,), dtype, 4)
        ga, gx = np.outer(ct, x), a.T @ ct
        for label, sa, sx, local in (("rows", ("d",), (), (2, 12)),
                                     ("k", (None, "d"), ("d",), (8, 3))):
            A, X = put(a, *sa), put(x, *sx)
            f = jax.jit(MatVec())
            text = f.lower(A, X).compile().as_text()
            key = f"matvec {dtype} split {label}"
            checks[f"{key}: no gather"] = _no_gather(text)
            if label == "k":
                checks[f"{key}: partial sums reduced"] = "all-reduce" in text
            checks[f"{key}: local blocks"] = _all_shapes(_calls(f, A, X), local)
            checks[f"{key}: value"] = _close(f(A, X), a @ x, dtype)
            pull = jax.jit(lambda A, X, c: jax.vjp(MatVec(), A, X)[1](c))
            checks[f"{key}: vjp no gather"] = _no_gather(pull.lower(A, X, ct).compile().as_text())
            seen = [c for c in _calls(pull, A, X, ct) if c[0] == "mv_vjp"]
            checks[f"{key}: vjp local blocks"] = _all_shapes(seen, local)
            ra, rx = pull(A, X, ct)
            checks[f"{key}: vjp value"] = _close(ra, ga, dtype) and _close(rx, gx, dtype)
            push = jax.jit(lambda A, X: jax.jvp(MatVec(), (A, X), (A, X))[1])
            seen = [c for c in _calls(push, A, X) if c[0] == "mv_jvp"]
            checks[f"{key}: jvp local blocks"] = _all_shapes(seen, local)
            checks[f"{key}: jvp value"] = _close(push(A, X), 2 * a @ x, dtype)
            xb = np.stack([x, 2 * x])
            vm = jax.jit(jax.vmap(MatVec(), in_axes=(None, 0)))
            checks[f"{key}: vmap value"] = _close(vm(A, put(xb, None, *sx)), xb @ a.T, dtype)

    x, y = _rng_array((16,), "float64", 5), _rng_array((16,), "float64", 6)
    X, Y = put(x, "d"), put(y, "d")
    g = jax.jit(jax.grad(lambda u, w: jnp.sum(Mul()(u, w) ** 2), argnums=(0, 1)))
    checks["multilinear grad: no gather"] = _no_gather(g.lower(X, Y).compile().as_text())
    checks["multilinear grad: local blocks"] = _all_shapes(_calls(g, X, Y), (4,))
    gx, gy = g(X, Y)
    checks["multilinear grad: value"] = _close(gx, 2 * x * y * y) and _close(gy, 2 * x * x * y)

    # Pytrees: a dict input's leaves take its factors; grad with respect to the dict.
    x = _rng_array((8, 6), "float64", 7)
    p = {"w": _rng_array((8,), "float64", 8), "c": _rng_array((8,), "float64", 9)}
    X, Pd = put(x, "d"), {k: put(v, "d") for k, v in p.items()}
    f = jax.jit(ScaleRows())
    checks["pytree: no gather"] = _no_gather(f.lower(X, Pd).compile().as_text())
    checks["pytree: local blocks"] = _all_shapes(_calls(f, X, Pd), (2, 6))
    checks["pytree: value"] = _close(f(X, Pd)["y"], x * p["w"][:, None] + p["c"][:, None])
    loss = lambda op: lambda p: jnp.sum(jnp.sin(op(X, p)["y"]))
    g = jax.jit(jax.grad(loss(ScaleRows())))
    want = jax.grad(loss(lambda x, p: {"y": x * p["w"][:, None] + p["c"][:, None]}))(p)
    got = g(Pd)
    checks["pytree grad: no gather"] = _no_gather(g.lower(Pd).compile().as_text())
    checks["pytree grad: value"] = _close(got["w"], want["w"]) and _close(got["c"], want["c"])

    # No declaration: gathered, still right, and the rule runs once on the whole
    # array, not once per device.
    f = jax.jit(Plain())
    checks["plain: runs once on the whole array"] = _calls(f, put(x, "d")) == \
        [("plain", tuple(x.shape))] or _calls(f, put(x, "d"))
    checks["plain: value"] = _close(f(put(x, "d")), -x)

    # An error while splitting is a Python exception, and the process goes on.
    try:
        jax.jit(WrongShapes())(put(np.ones(8), "d")).block_until_ready()
        checks["wrong declaration: raises"] = "no error"
    except Exception as error:  # noqa: BLE001 - reported to the test
        text = str(error)
        checks["wrong declaration: raises"] = ("WrongShapes" in text and
                                               "sharding declaration" in text) or text[:300]
    checks["after the error: still works"] = _close(jax.jit(RowFFT())(xs), expected)
    return checks


def explicit() -> dict:
    """Explicit mesh axes (types carry shardings) and shard_map."""
    checks = {}
    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Explicit,))
    x = _rng_array((8, 16), "complex128")
    expected = np.fft.fft(x, axis=-1)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, P("d"))
        y = RowFFT()(xs)
        checks["eager: type"] = str(jax.typeof(y)) == "complex128[8@d,16]" or str(jax.typeof(y))
        checks["eager: value"] = _close(y, expected)
        f = jax.jit(RowFFT())
        checks["jit: type"] = str(jax.typeof(f(xs))) == "complex128[8@d,16]" or \
            str(jax.typeof(f(xs)))
        checks["jit: local blocks"] = _all_shapes(_calls(f, xs), (2, 16))
        try:
            f(jax.device_put(x, P(None, "d")))
            checks["replicate factor sharded: raises"] = "no error"
        except Exception as error:  # noqa: BLE001
            text = str(error)
            checks["replicate factor sharded: raises"] = (
                type(error).__name__ == "ShardingTypeError" and "RowFFT" in text and
                "'x'" in text and "dim 1" in text and "eshard" in text) or text
        g = jax.jit(jax.grad(lambda v: jnp.sum(jnp.abs(RowFFT()(v)) ** 2)))
        checks["grad: type"] = str(jax.typeof(g(xs))) == "complex128[8@d,16]" or \
            str(jax.typeof(g(xs)))
        a, v = _rng_array((8, 12), "float64", 1), _rng_array((12,), "float64", 2)
        A, V = jax.device_put(a, P(None, "d")), jax.device_put(v, P("d"))
        try:
            r = jax.jit(MatVec())(A, V)
            checks["reduce: type"] = str(jax.typeof(r)) == "float64[8]" or str(jax.typeof(r))
            checks["reduce: value"] = _close(r, a @ v)
        except jax.errors.JaxRuntimeError:
            raise
        except Exception as error:  # noqa: BLE001 - JAX < 0.9 cannot sum over Explicit axes
            checks["reduce: needs JAX >= 0.9"] = (
                not _compat.EXPLICIT_REDUCTIONS and type(error).__name__ == "ShardingTypeError"
                and "MatVec" in str(error) and "JAX >= 0.9" in str(error)) or str(error)

    # shard_map: rules see blocks; grad w.r.t. varying and replicated inputs.
    mesh = jax.make_mesh((4,), ("d",))
    x = _rng_array((8, 16), "float64")
    w = _rng_array((16,), "float64", 7)
    xs = jax.device_put(x, NamedSharding(mesh, P("d")))
    mapped = jax.shard_map(lambda a, b: Scaled()(a, b), mesh=mesh, in_specs=(P("d"), P()),
                           out_specs=P("d"))
    checks["shard_map: local blocks"] = _all_shapes(_calls(lambda: jax.jit(mapped)(xs, w)),
                                                    (2, 16))
    checks["shard_map: value"] = _close(jax.jit(mapped)(xs, w), x * x * w)
    gx, gw = jax.jit(jax.grad(lambda a, b: jnp.sum(mapped(a, b)), argnums=(0, 1)))(xs, w)
    checks["shard_map grad varying"] = _close(gx, 2 * x * w)
    checks["shard_map grad replicated"] = _close(gw, (x * x).sum(axis=0))
    tangent = jax.jvp(lambda a: mapped(a, w), (xs,), (xs,))[1]
    checks["shard_map jvp"] = _close(tangent, 2 * x * x * w)
    vm = jax.shard_map(jax.vmap(lambda a, b: Scaled()(a, b), in_axes=(0, None)), mesh=mesh,
                       in_specs=(P("d"), P()), out_specs=P("d"))
    checks["shard_map vmap"] = _close(jax.jit(vm)(xs, w), x * x * w)
    fft = jax.jit(jax.shard_map(RowFFT(), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    checks["shard_map declared op: local blocks"] = _all_shapes(
        _calls(lambda: fft(jax.device_put(x + 0j, NamedSharding(mesh, P("d"))))), (2, 16))
    return checks


def _same_types(got, want):
    """Each result's sharding type is the jax.numpy twin's."""
    def spec(leaf):
        entries = tuple(jax.typeof(leaf).sharding.spec)
        return entries + (None,) * (leaf.ndim - len(entries))

    pairs = list(zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    same = all(spec(g) == spec(w) for g, w in pairs)
    return same or "; ".join(f"{jax.typeof(g)}, the twin's {jax.typeof(w)}" for g, w in pairs)


def undeclared_scan() -> dict:
    """An op without a declaration on a lax.scan carry split over Explicit mesh axes: its
    result, the next carry, is typed like the carry, as jnp.tanh's (or JAX refuses the
    scan); eager and jitted, its jvp, gradient and vmap. Its rule still sees the whole
    carry (under vmap, each batch element's)."""
    checks = {}
    mesh = jax.make_mesh((2, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    set_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh  # (JAX 0.6)
    x = _rng_array((8, 16), "float64")

    def scanned(tanh):
        def step(carry, _):
            out = tanh(carry)
            return out, 2 * out

        return lambda v: jax.lax.scan(step, v, length=3)

    def loss(f):
        return jax.grad(lambda v: jnp.sum(f(v)[1] ** 2))

    runs = {"eager call": lambda f: f,
            "eager scan": scanned,
            "jit scan": lambda f: jax.jit(scanned(f)),
            "jvp": lambda f: lambda v: jax.jvp(scanned(f), (v,), (jnp.cos(v),)),
            "grad": lambda f: loss(scanned(f)),
            "jit grad": lambda f: jax.jit(loss(scanned(f))),
            "jit vmap": lambda f: jax.jit(jax.vmap(scanned(f)))}
    with set_mesh(mesh):
        for spec in (P("x"), P("x", "y"), P(None, ("x", "y"))):
            for how, make in runs.items():
                name = f"{spec} {how}"
                value, lead = x, ()
                if "vmap" in how:  # the batch split over the mesh axis the rows leave free
                    free = [a for a in ("x", "y") if a not in str(spec)]
                    value, lead = np.stack([x, 2 * x]), (free[0] if free else None,)
                xs = jax.device_put(value, NamedSharding(mesh, P(*lead, *spec)))
                try:
                    want = make(jnp.tanh)(xs)
                    CALLS.clear()
                    got = make(Tanh())(xs)
                    jax.block_until_ready(got)
                except Exception as error:  # noqa: BLE001 - reported to the test
                    checks[name] = f"raised {type(error).__name__}: {str(error)[:400]}"
                    continue
                pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want))
                checks[f"{name}: value"] = all(_close(g, w) for g, w in pairs)
                checks[f"{name}: type"] = _same_types(got, want)
                checks[f"{name}: the rule saw whole inputs"] = _all_shapes(list(CALLS), (8, 16))
    return checks


def undeclared_auto() -> dict:
    """jit over Auto axes, 8 devices: an undeclared op's result is laid out like its input
    (as eagerly and over Explicit axes), so the declared op after it runs per shard; the
    compiled program gathers the undeclared op's input and nothing else."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import ops

    checks = {}
    n = jax.device_count()
    x = _rng_array((2 * n, 6), "float64")
    meshes = {"1d": (jax.make_mesh((n,), ("d",), axis_types=(AxisType.Auto,)), P("d")),
              "2d": (jax.make_mesh((n // 2, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2),
                     P(("x", "y")))}
    for mesh_name, (mesh, spec) in meshes.items():
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        programs = {
            "alone": (lambda v: ops.Softsign()(v), ops.softsign_ref, 1),
            "then declared": (lambda v: ops.Cube()(ops.Softsign()(v)),
                              lambda v: ops.cube_ref(ops.softsign_ref(v)), 1),
            "plus its input": (lambda v: ops.Softsign()(v) + v,
                               lambda v: ops.softsign_ref(v) + v, 1),
            "vmapped": (jax.vmap(ops.Softsign()), ops.softsign_ref, 0),
        }
        for name, (program, ref, gathers) in programs.items():
            key = f"{mesh_name} {name}"
            f = jax.jit(program)
            hlo = f.lower(xs).compile().as_text()
            y = f(xs)
            checks[f"{key}: value"] = _close(y, ref(x))
            got = tuple(y.sharding.spec) + (None,) * (2 - len(y.sharding.spec))
            checks[f"{key}: laid out like its input"] = \
                got == tuple(spec) + (None,) or f"result {y.sharding.spec}"
            checks[f"{key}: gathers"] = hlo.count("all-gather(") == gathers or \
                f"{hlo.count('all-gather(')} all-gathers"
            seen = ops.seen(f, xs)
            if name == "then declared":
                checks[f"{key}: the declared op ran per shard"] = \
                    ("Cube", "forward", (2, 6)) in seen and \
                    ("Cube", "forward", (2 * n, 6)) not in seen or f"rules saw {seen}"
    return checks


def processes(port: str, process_id: str) -> dict:
    """One of two processes (2 devices each) sharing a 4-device mesh via jax.distributed."""
    process_id = int(process_id)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    checks = {"devices": (jax.device_count(), jax.local_device_count()) == (4, 2) or
              f"{jax.device_count()} global, {jax.local_device_count()} local"}
    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,))
    rows = slice(4 * process_id, 4 * process_id + 4)

    def global_array(whole, spec, local):
        return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), local,
                                                      whole.shape)

    def local_part(array):
        shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)
        return np.concatenate([np.asarray(s.data) for s in shards])

    x = _rng_array((8, 16), "complex128")
    xs = global_array(x, P("d"), x[rows])
    f = jax.jit(RowFFT())
    checks["fft: no gather"] = _no_gather(f.lower(xs).compile().as_text())
    checks["fft: local blocks"] = _all_shapes(_calls(f, xs), (2, 16))
    checks["fft: value"] = _close(local_part(f(xs)), np.fft.fft(x[rows], axis=-1))
    g = jax.jit(jax.grad(lambda v: jnp.sum(jnp.abs(RowFFT()(v)) ** 2)))
    checks["fft grad: local blocks"] = _all_shapes(_calls(g, xs), (2, 16))
    checks["fft grad: value"] = _close(local_part(g(xs)), 2 * 16 * np.conj(x[rows]))
    # A contraction split across the processes: the partial sums cross them.
    a, v = _rng_array((8, 12), "float64", 1), _rng_array((12,), "float64", 2)
    cols = slice(6 * process_id, 6 * process_id + 6)
    A = global_array(a, P(None, "d"), a[:, cols])
    V = global_array(v, P("d"), v[cols])
    m = jax.jit(MatVec())
    checks["matvec: local blocks"] = _all_shapes(_calls(m, A, V), (8, 3))
    result = m(A, V)
    checks["matvec: value"] = _close(np.asarray(result.addressable_shards[0].data), a @ v)
    jax.distributed.shutdown()
    return checks


class ShardedNudft(Nudft, sharding="m, m -> k", reduce=("m",), replicate=("k",)):
    """The non-uniform DFT split over its points, a sum over them (type 1 of a NUFFT);
    linear in the strengths, differentiable in the points."""

    def apply(self, x, c):
        CALLS.append(("nudft", x.shape))
        return super().apply(x, c)

    def apply_t(self, x, ct):
        CALLS.append(("nudft_t", x.shape))
        return super().apply_t(x, ct)

    def push(self, x, c, dx, dc):
        CALLS.append((f"nudft_jvp {dx is not None, dc is not None}", x.shape))
        return super().push(x, c, dx, dc)

    def pull(self, x, c, ct, *, wanted):
        CALLS.append((f"nudft_vjp {wanted}", x.shape))
        return super().pull(x, c, ct, wanted=wanted)


def partly_linear(axis_type="Auto") -> dict:
    """A partly linear op split over its points: every derivative runs on local blocks,
    each rule the one the derivative needs."""
    checks = {}
    devices = len(jax.devices())
    mesh = jax.make_mesh((devices,), ("d",), axis_types=(getattr(AxisType, axis_type),))
    m = 4 * devices
    x = np.linspace(0.1, 6.0, m)
    c = _rng_array((m,), "complex128", 8)
    X, C = (jax.device_put(v, NamedSharding(mesh, P("d"))) for v in (x, c))
    op = ShardedNudft()
    local = (m // devices,)

    def loss(f):
        return lambda x, c: jnp.sum(jnp.abs(f(x, c)) ** 2)

    cases = {
        "grad c": (jax.grad(loss(op), 1), jax.grad(loss(nudft_ref), 1), {"nudft", "nudft_t"}),
        "grad x": (jax.grad(loss(op), 0), jax.grad(loss(nudft_ref), 0),
                   {"nudft", "nudft_vjp (True, False)"}),
        "grad both": (jax.grad(loss(op), (0, 1)), jax.grad(loss(nudft_ref), (0, 1)),
                      {"nudft", "nudft_vjp (True, True)"}),
        "jvp c": (lambda x, c: jax.jvp(lambda c: op(x, c), (c,), (c,)),
                  lambda x, c: jax.jvp(lambda c: nudft_ref(x, c), (c,), (c,)), {"nudft"}),
        "jvp x": (lambda x, c: jax.jvp(lambda x: op(x, c), (x,), (x,)),
                  lambda x, c: jax.jvp(lambda x: nudft_ref(x, c), (x,), (x,)),
                  {"nudft", "nudft_jvp (True, False)"}),
    }
    with (jax.set_mesh(mesh) if axis_type == "Explicit" else _nothing()):
        if axis_type == "Explicit" and not _compat.EXPLICIT_REDUCTIONS:
            return _refused_below_0_9(cases, X, C, op="ShardedNudft")
        for name, (f, ref, rules) in cases.items():
            g = jax.jit(f)
            checks[f"{name}: no gather"] = _no_gather(g.lower(X, C).compile().as_text())
            seen = _calls(g, X, C)
            checks[f"{name}: local blocks"] = _all_shapes(seen, local)
            checks[f"{name}: rules"] = {r for r, _ in seen} == rules or sorted(seen)
            got, want = jax.tree.leaves(g(X, C)), jax.tree.leaves(ref(x, c))
            checks[f"{name}: value"] = all(_close(a, b) for a, b in zip(got, want))
    return checks


def _refused_below_0_9(cases, *args, op: str) -> dict:
    """JAX < 0.9 cannot sum partial results over Explicit axes: each case, all of which
    sum over the split points, is refused with the documented error naming the op and the
    version it needs, never run wrong."""
    checks = {}
    for name, (f, _, _) in cases.items():
        try:
            jax.jit(f)(*args)
            checks[f"{name}: needs JAX >= 0.9"] = "ran on a JAX that cannot sum over Explicit axes"
        except Exception as error:  # noqa: BLE001 - the type is the check
            checks[f"{name}: needs JAX >= 0.9"] = (
                type(error).__name__ == "ShardingTypeError" and op in str(error)
                and "JAX >= 0.9" in str(error)) or f"{type(error).__name__}: {error}"
    return checks


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


SCENARIOS = {"automatic": automatic, "explicit": explicit, "undeclared_scan": undeclared_scan,
             "undeclared_auto": undeclared_auto, "processes": processes,
             "partly_linear": partly_linear}


def main(argv) -> None:
    jax.config.update("jax_enable_x64", True)
    checks = SCENARIOS[argv[0]](*argv[1:])
    print(json.dumps({"checks": {k: (v if v is True else str(v)) for k, v in checks.items()}}))


if __name__ == "__main__":
    main(sys.argv[1:])
