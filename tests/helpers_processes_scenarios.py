"""Scenarios that every process of a local job runs (``helpers_processes.run_job``).

    python helpers_processes_scenarios.py SCENARIO[=ARG] [SCENARIO[=ARG] ...]

Each process joins the job, runs the scenario on global arrays over a mesh of every
device of every process, and prints ``{"process": I, "checks": {name: true | "what was
seen"}}`` as its last line. Values are compared with jax.numpy through
``process_allgather``; what each process's rules ran on is read from ``ops.SEEN``.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers_processes import join_job  # noqa: E402

PROCESS, PROCESSES = join_job()

import jax  # noqa: E402
import jax.export  # noqa: E402, F401 - (older JAX does not import it with jax)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxdecl as jd  # noqa: E402
from jaxdecl import _compat  # noqa: E402

jax.config.update("jax_enable_x64", True)

import ops  # noqa: E402  (after x64: its ops are made with 64-bit types)

DEVICES = jax.devices()
LOCAL = jax.local_device_count()
ROWS = 2 * len(DEVICES)  # two rows per device


def set_mesh(mesh):
    """``jax.set_mesh``; ``jax.sharding.use_mesh`` on JAX 0.6."""
    return (getattr(jax, "set_mesh", None) or jax.sharding.use_mesh)(mesh)


def mesh_of(devices, kind="Auto"):
    return Mesh(np.array(devices), ("d",), axis_types=(getattr(AxisType, kind),))


def global_array(value, mesh, spec):
    """`value` laid out over `mesh`, each process giving only its own blocks."""
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec),
                                        lambda index: value[index])


def whole(array) -> np.ndarray:
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def close(got, want) -> bool | str:
    got, want = whole(got), np.asarray(want)
    if got.shape == want.shape and np.allclose(got, want, rtol=1e-12, atol=1e-12):
        return True
    return f"got {got.ravel()[:4]}..., want {want.ravel()[:4]}..."


def same(got, want) -> bool | str:
    return True if got == want else f"saw {got}, want {want}"


def values(shape, seed=0):
    return np.random.default_rng(seed).uniform(0.5, 1.5, shape)


def holds_first(mesh) -> bool:
    """This process holds the mesh's first device (where an undeclared op runs once)."""
    return mesh.devices.flat[0].process_index == PROCESS


# ---------------------------------------------------------------------------------------

def eager_meshes() -> dict:
    """Eager calls under ``jax.set_mesh(A)``, then on arrays of mesh B (the same devices
    in reverse order): the kernel's slot operand must follow each call's mesh."""
    checks = {}
    x = values((ROWS, 6))
    for kind in ("Auto", "Explicit"):
        a, b = mesh_of(DEVICES, kind), mesh_of(DEVICES[::-1], kind)
        for op, ref in ((ops.Cube(), ops.cube_ref), (ops.Softsign(), ops.softsign_ref),
                        (ops.RowNorm(), ops.row_norm_ref)):
            name = f"{kind} {type(op).__name__}"
            try:
                with set_mesh(a):
                    first = op(global_array(x, a, P("d")))
                ops.SEEN.clear()
                second = op(global_array(x, b, P("d")))
                jax.block_until_ready(second)
            except Exception as error:  # noqa: BLE001 - reported to the test
                checks[name] = f"raised {type(error).__name__}: {str(error)[:300]}"
                continue
            checks[f"{name}: mesh A value"] = close(first, ref(x))
            checks[f"{name}: mesh B value"] = close(second, ref(x))
            checks[f"{name}: on mesh B"] = second.sharding.mesh == b or str(second.sharding)
            if isinstance(op, ops.Softsign):  # once, where mesh B's first device is
                want = [("Softsign", "forward", (ROWS, 6))] * holds_first(b)
            else:  # each local device its own two rows
                want = [(type(op).__name__, "forward", (2, 6))] * LOCAL
            checks[f"{name}: rules saw"] = same(sorted(ops.SEEN), want)
    return checks


def undeclared_layout() -> dict:
    """Under ``jit`` over Auto axes an undeclared op's result is laid out like its input
    (rows split), so the declared op after it runs on each device's rows, no process on
    another's."""
    mesh = mesh_of(DEVICES)
    x = values((ROWS, 6))
    xs = global_array(x, mesh, P("d"))
    f = jax.jit(lambda v: ops.Cube()(ops.Softsign()(v)))
    hlo = f.lower(xs).compile().as_text()
    checks = {"value": close(f(xs), ops.cube_ref(ops.softsign_ref(x))),
              "layout": _compat.P(*f(xs).sharding.spec) == P("d") or str(f(xs).sharding.spec),
              # the undeclared op's input, gathered: nothing else
              "one all-gather": hlo.count("all-gather(") == 1 or hlo.count("all-gather(")}
    got = ops.seen(f, xs)
    want = [("Cube", "forward", (2, 6))]
    if holds_first(mesh):
        want.append(("Softsign", "forward", (ROWS, 6)))
    checks["rules saw"] = same(got, sorted(want))
    return checks


def export_plan(folder: str) -> dict:
    """``jit(grad)`` of an op with ``reduce=`` on rows split over every device: its rules
    run on each device's rows, and the same program exported in process 0 and run by
    every process runs them on the same rows."""
    mesh = mesh_of(DEVICES)
    x = values((ROWS, 2 * ROWS))  # (rows longer than the column: a vjp's own choice
    xs = global_array(x, mesh, P("d"))  # of blocks would split them)
    g = jax.jit(jax.grad(lambda v: jnp.sum(jnp.sin(ops.RowNorm()(v)))))
    want = jax.grad(lambda v: jnp.sum(jnp.sin(ops.row_norm_ref(v))))(x)
    rows = [("RowNorm", "forward", (2, 2 * ROWS)), ("RowNorm", "vjp", (2, 2 * ROWS))]
    checks = {"jit: value": close(g(xs), want), "jit: rules saw": same(ops.seen(g, xs), rows)}
    path = os.path.join(folder, "grad.exported")
    if PROCESS == 0:
        exported = jax.export.export(g, disabled_checks=jd.disabled_checks())(xs)
        with open(path + ".part", "wb") as file:
            file.write(exported.serialize())
        os.replace(path + ".part", path)
    multihost_utils.sync_global_devices("exported")
    with open(path, "rb") as file:
        loaded = jax.export.deserialize(bytearray(file.read()))
    checks["export: value"] = close(loaded.call(xs), want)
    checks["export: rules saw"] = same(ops.seen(loaded.call, xs), rows)
    checks["export: layout"] = loaded.call(xs).sharding.spec == g(xs).sharding.spec or \
        f"{loaded.call(xs).sharding.spec} != {g(xs).sharding.spec}"
    return checks


def outputs_and_pytrees(folder: str) -> dict:
    """An op with two results and one taking and returning dicts, on rows split over
    every process: eager, jit, jit(grad), vmap, scan, shard_map, and jit(grad) exported
    in process 0 and run by every process. Each rule call sees one device's rows."""
    mesh = mesh_of(DEVICES)
    x, y, w, c = values((ROWS, 6)), values((ROWS, 6), 1), values(ROWS, 2), values(ROWS, 3)
    X, Y, W, C = (global_array(v, mesh, P("d")) for v in (x, y, w, c))
    two, rows = ops.SinProd(), ops.RowAffine()

    def loss_two(op):
        return lambda a, b: jnp.sum(jnp.prod(jnp.stack(op(a, b)), axis=0))

    def loss_rows(op):
        return lambda a, w, c: jnp.sum(op(a, {"w": w, "c": c})["y"] ** 2)

    def scanned(op):
        return lambda a, b: jax.lax.scan(lambda carry, _: (op(carry, b)[0], None), a,
                                         length=2)[0]

    mapped = jax.shard_map(two, mesh=mesh, in_specs=(P("d"), P("d")),
                           out_specs=(P("d"), P("d")))
    programs = {  # name: (the program on global arrays, its jax.numpy twin on whole ones)
        "two: eager": (lambda: two(X, Y), lambda: ops.sin_prod_ref(x, y)),
        "two: jit": (lambda: jax.jit(two)(X, Y), lambda: ops.sin_prod_ref(x, y)),
        "two: jit(grad)": (lambda: jax.jit(jax.grad(loss_two(two), (0, 1)))(X, Y),
                           lambda: jax.grad(loss_two(ops.sin_prod_ref), (0, 1))(x, y)),
        "two: vmap": (lambda: jax.jit(jax.vmap(two))(X, Y), lambda: ops.sin_prod_ref(x, y)),
        "two: scan": (lambda: jax.jit(scanned(two))(X, Y),
                      lambda: scanned(ops.sin_prod_ref)(x, y)),
        "two: shard_map": (lambda: jax.jit(mapped)(X, Y), lambda: ops.sin_prod_ref(x, y)),
        "dict: eager": (lambda: rows(X, {"w": W, "c": C}),
                        lambda: ops.row_affine_ref(x, {"w": w, "c": c})),
        "dict: jit(grad)": (lambda: jax.jit(jax.grad(loss_rows(rows), (0, 1, 2)))(X, W, C),
                            lambda: jax.grad(loss_rows(ops.row_affine_ref), (0, 1, 2))(x, w, c)),
        "dict: vmap": (  # over a new leading dim, the rows still split
            lambda: jax.jit(jax.vmap(rows, in_axes=(0, None)))(
                global_array(np.stack([x, 2 * x]), mesh, P(None, "d")), {"w": W, "c": C}),
            lambda: jax.vmap(ops.row_affine_ref, in_axes=(0, None))(
                np.stack([x, 2 * x]), {"w": w, "c": c})),
    }
    exported = {"two: exported jit(grad)": (jax.jit(jax.grad(loss_two(two), (0, 1))), (X, Y),
                                            "two: jit(grad)"),
                "dict: exported jit(grad)": (jax.jit(jax.grad(loss_rows(rows), (0, 1, 2))),
                                             (X, W, C), "dict: jit(grad)")}
    for name, (program, args, twin) in exported.items():
        path = os.path.join(folder, name.replace(" ", "_").replace(":", "") + ".exported")
        if PROCESS == 0:
            with open(path + ".part", "wb") as file:
                file.write(jax.export.export(program, disabled_checks=jd.disabled_checks())(
                    *args).serialize())
            os.replace(path + ".part", path)
        multihost_utils.sync_global_devices(name)
        with open(path, "rb") as file:
            loaded = jax.export.deserialize(bytearray(file.read()))
        programs[name] = ((lambda loaded=loaded, args=args: loaded.call(*args)),
                          programs[twin][1])
    checks = {}
    for name, (program, twin) in programs.items():
        ops.SEEN.clear()
        got = jax.block_until_ready(program())
        pairs = list(zip(jax.tree.leaves(got), jax.tree.leaves(twin())))
        checks[f"{name}: value"] = all(close(g, t) is True for g, t in pairs) and \
            bool(pairs) or [close(g, t) for g, t in pairs]
        seen = sorted({shape for _, _, shape in ops.SEEN})  # a row (vmap) or two rows
        checks[f"{name}: rules saw this process's rows"] = bool(seen) and all(
            shape in ((2, 6), (6,)) for shape in seen) or f"saw {seen}"
    return checks


class Boom(jd.Primitive, sharding="b n -> b n"):
    """2x, except in process 1 on a block holding a 5: there it raises (on every device of
    process 1 where JAX cannot split the call: it runs on the whole array)."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        if PROCESS == 1 and (x == 5).any():
            raise ValueError(f"boom in process {PROCESS}")
        return 2 * x


def failure(how: str) -> dict:
    """A rule raises in process 1 only: ``jit-one`` on one of its devices (after the
    program ran once, so collectives are set up), ``jit-all`` on all of them, ``eager``
    in an eager call on global arrays; ``local``: in an eager call on its own arrays,
    which must not end the job. Prints ``{"failing_at": time}`` first."""
    mesh = mesh_of(DEVICES)
    x = np.ones((ROWS, 4))
    xs = global_array(x, mesh, P("d"))
    total = jax.jit(lambda v: jnp.sum(Boom()(v)))
    checks = {"warm": float(total(xs)) == 2 * x.size}
    bad = x.copy()
    if how == "jit-one":
        bad[2 * (LOCAL + 1), 0] = 5  # a row of process 1's second device
    else:
        bad[2 * LOCAL:4 * LOCAL, 0] = 5  # every row of process 1
    print(json.dumps({"failing_at": time.time()}), flush=True)
    # Every process has printed before process 1 can fail: without this, a process still
    # finishing the warm call's collective when process 1 fails is ended before it prints.
    multihost_utils.sync_global_devices("failure")
    if how == "local":
        if PROCESS == 1:
            try:
                Boom()(jnp.asarray(bad[2 * LOCAL:2 * LOCAL + 2]))
                checks["local: raised"] = "it did not raise"
            except ValueError as error:
                checks["local: raised"] = "boom" in str(error) or str(error)
        checks["after"] = float(total(xs)) == 2 * x.size
    elif how == "eager":
        jax.block_until_ready(Boom()(global_array(bad, mesh, P("d"))))
    else:
        float(total(global_array(bad, mesh, P("d"))))
    return checks


def callback_device() -> dict:
    """``jd.pure_callback`` under ``jit`` on rows split over every device, Auto and
    Explicit axes: without ``sharding=`` the callback runs once, where the mesh's first
    device is (vmapped: each device on its own rows); with ``sharding=`` naming the last
    device, only there (its process), on every row."""
    checks = {}
    x = values((ROWS, 6))
    calls = []

    def sine(v):
        calls.append(v.shape)
        return np.sin(v)

    last = DEVICES[-1]
    for kind in ("Auto", "Explicit"):
        mesh = mesh_of(DEVICES, kind)
        xs = global_array(x, mesh, P("d"))
        for where, sharding in (("first", None), ("last", jax.sharding.SingleDeviceSharding(last))):
            for vmapped in (False, True):
                def one(v, sharding=sharding):
                    return jd.pure_callback(sine, jax.ShapeDtypeStruct(v.shape, v.dtype), v,
                                            sharding=sharding, vmap_method="sequential")

                f = jax.jit(jax.vmap(one) if vmapped else one)
                name = f"{kind} {where}{' vmap' if vmapped else ''}"
                calls.clear()
                try:
                    got = f(xs)
                    jax.block_until_ready(got)
                except Exception as error:  # noqa: BLE001 - reported to the test
                    checks[name] = f"raised {type(error).__name__}: {str(error)[:300]}"
                    continue
                checks[f"{name}: value"] = close(got, np.sin(x))
                if kind == "Explicit" and not _compat.EXPLICIT_REDUCTIONS:
                    # (before JAX 0.9 every device runs it on the gathered operands)
                    want = [(6,) if vmapped else (ROWS, 6)] * (ROWS if vmapped else 1) * LOCAL
                elif sharding is not None:
                    want = [(6,) if vmapped else (ROWS, 6)] * (ROWS if vmapped else 1)
                    want *= last.process_index == PROCESS
                elif vmapped:  # an op without a declaration splits the vmapped rows
                    want = [(6,)] * (2 * LOCAL)
                else:
                    want = [(ROWS, 6)] * holds_first(mesh)
                checks[f"{name}: calls"] = same(calls, want)
    return checks


SCENARIOS = {"eager_meshes": eager_meshes, "undeclared_layout": undeclared_layout,
             "export_plan": export_plan, "outputs_and_pytrees": outputs_and_pytrees,
             "callback_device": callback_device, "failure": failure}


def main(argv) -> None:
    checks = {}
    for item in argv:  # SCENARIO or SCENARIO=ARG, several in one job
        name, _, arg = item.partition("=")
        found = SCENARIOS[name](*([arg] if arg else []))
        checks.update({f"{name}: {k}": (v if v is True else str(v)) for k, v in found.items()})
    print(json.dumps({"process": PROCESS, "checks": checks}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
