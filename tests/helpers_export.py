"""Saves programs that call jaxdecl ops, or loads and runs them, in a fresh process.

    python helpers_export.py save DIR DEVICES   # jax.export artifacts + serialized executables
                                                # (DEVICES: 1, 4, or 4e: 4 over Explicit axes)
    python helpers_export.py load DIR DEVICES   # imports ops_saved only; runs them; checks
    python helpers_export.py cache DIR DEVICES  # the persistent compilation cache
    python helpers_export.py bare DIR DEVICES   # loads without importing ops_saved: the error
    python helpers_export.py load-saved DIR 1   # load, of what another jaxdecl saved: where
                                                # this JAX can (see load_saved)
    python helpers_export.py load-saved-executables DIR 1   # its executables (same jaxlib)
    python helpers_export.py plan DIR 8         # the blocks rules run on, jit and exported

Prints ``{"checks": {...}}`` as its last line (see conftest.run_helper).
"""

import json
import os
import pickle
import sys

DEVICES = int(sys.argv[3].rstrip("e"))
EXPLICIT = sys.argv[3].endswith("e")
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.export  # noqa: E402, F401 - (older JAX does not import it with jax)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxdecl as jd  # noqa: E402
from jaxdecl._host import _dispatch  # noqa: E402

jax.config.update("jax_enable_x64", True)
MODE, DIR = sys.argv[1], sys.argv[2]


def inputs():
    x = jnp.linspace(0.1, 0.8, 8)
    m = jnp.arange(32.0).reshape(8, 4) / 40
    if DEVICES == 1:
        return (x, m), None
    shardings = (jax.NamedSharding(MESH, jax.P(None if EXPLICIT else "d")),
                 jax.NamedSharding(MESH, jax.P("d", None)))
    return tuple(jax.device_put(v, s) for v, s in zip((x, m), shardings)), shardings


def functions(ops):
    grad = jax.grad(ops.program, argnums=(0, 1))
    return {
        "forward": ops.program,
        "grad": grad,
        # vmap over a batch of x: the batch dim is the ops' own leading dim
        "vmap": lambda x, m: jax.vmap(lambda row: ops.Weighted(ops.W)(row))(
            jnp.stack([x, 2 * x])),
        # equations that carry some tangents or return some cotangents (their active leaves)
        "derivatives": ops.derivatives,
    }


def save():
    import ops_saved

    args, shardings = inputs()
    for name, f in functions(ops_saved).items():
        jitted = jax.jit(f, in_shardings=shardings)
        exported = jax.export.export(jitted, disabled_checks=jd.disabled_checks())(*args)
        with open(os.path.join(DIR, f"{name}.exported"), "wb") as file:
            file.write(exported.serialize())
        from jax.experimental import serialize_executable

        compiled = jitted.lower(*args).compile()
        with open(os.path.join(DIR, f"{name}.executable"), "wb") as file:
            pickle.dump(serialize_executable.serialize(compiled), file)
    return {"saved": True}


def reference(name, x, m):
    import ops_saved

    twin = {"forward": ops_saved.twin, "grad": jax.grad(ops_saved.twin, argnums=(0, 1)),
            "vmap": lambda x, m: jnp.asarray(ops_saved.W) * jnp.stack([x, 2 * x]) ** 2,
            "derivatives": ops_saved.derivatives_twin}[name]
    return twin(x, m)


def close(a, b) -> bool:
    return all(np.allclose(np.asarray(u), np.asarray(v), rtol=1e-10, atol=1e-12)
               for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def load():
    import ops_saved  # noqa: F401 - the user's module: the only import a saved program needs
    from jax.experimental import serialize_executable

    checks = {"kernels_before": _dispatch.kernel_count()}
    args, _ = inputs()
    for name in ("forward", "grad", "vmap", "derivatives"):
        with open(os.path.join(DIR, f"{name}.exported"), "rb") as file:
            exported = jax.export.deserialize(bytearray(file.read()))
        got = exported.call(*args)
        want = reference(name, *args)
        checks[f"exported_{name}"] = close(got, want)
        devices = {len(leaf.sharding.device_set) for leaf in jax.tree_util.tree_leaves(got)}
        checks[f"exported_{name}_devices"] = sorted(devices)
        with open(os.path.join(DIR, f"{name}.executable"), "rb") as file:
            payload, in_tree, out_tree = pickle.load(file)
        compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        checks[f"executable_{name}"] = close(compiled(*args), want)
    return checks


def load_saved():
    """`load` of the jax.export artifacts saved with jax/jaxlib 0.10.2
    (tests/data/saved_before_rooms), where this JAX reads version 11 artifacts (0.10 and
    later)."""
    import ops_saved  # noqa: F401 - the user's module: the only import a saved program needs

    checks = {}
    args, _ = inputs()
    for name in ("forward", "grad", "vmap"):
        if tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 10):
            with open(os.path.join(DIR, f"{name}.exported"), "rb") as file:
                exported = jax.export.deserialize(bytearray(file.read()))
            checks[f"exported_{name}"] = close(exported.call(*args), reference(name, *args))
    return checks


def load_saved_executables():
    """`load` of the serialized executables saved with jaxlib 0.10.2 on Python 3.11, run
    only by that very jaxlib. They hold XLA:CPU machine code compiled for the saving
    host's CPU: a host without its instruction set extensions dies of SIGILL running them
    (XLA logs which feature is missing first), which the test tells apart."""
    import ops_saved  # noqa: F401
    from jax.experimental import serialize_executable

    checks = {}
    args, _ = inputs()
    for name in ("forward", "grad", "vmap"):
        with open(os.path.join(DIR, f"{name}.executable"), "rb") as file:
            payload, in_tree, out_tree = pickle.load(file)
        compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        checks[f"executable_{name}"] = close(compiled(*args), reference(name, *args))
    return checks


def bare():
    """No `import ops_saved`: the program names the module to import."""
    args, _ = inputs()
    with open(os.path.join(DIR, "grad.exported"), "rb") as file:
        exported = jax.export.deserialize(bytearray(file.read()))
    try:
        exported.call(*args)
    except Exception as error:  # noqa: BLE001 - the message is what is checked
        return {"type": type(error).__name__, "message": str(error).splitlines()[0]}
    return {"type": None, "message": ""}


def cache():
    import ops_saved

    hits = []
    jax.monitoring.register_event_listener(
        lambda event, **kwargs: hits.append(event) if "cache_hits" in event else None)
    jax.config.update("jax_compilation_cache_dir", DIR)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    args, shardings = inputs()
    f = jax.jit(jax.grad(ops_saved.program, argnums=(0, 1)), in_shardings=shardings)
    got = f(*args)
    return {"hits": len(hits), "right": close(got, reference("grad", *args))}


def plan():
    """jit(grad) of an op with reduce= on rows split over every device, and the same
    program exported and called again: what each of its rules ran on, and the layout of
    the gradient."""
    import ops

    x = np.linspace(0.5, 1.5, 16 * DEVICES).reshape(DEVICES, 16)
    xs = jax.device_put(x, jax.NamedSharding(MESH, jax.P("d")))
    g = jax.jit(jax.grad(lambda v: jnp.sum(jnp.sin(ops.RowNorm()(v)))))
    want = jax.grad(lambda v: jnp.sum(jnp.sin(ops.row_norm_ref(v))))(x)
    exported = jax.export.export(g, disabled_checks=jd.disabled_checks())(xs)
    loaded = jax.export.deserialize(exported.serialize())
    checks = {}
    for name, f in (("jit", g), ("exported", loaded.call)):
        checks[f"{name}: value"] = close(f(xs), want)
        checks[f"{name}: rules saw"] = [list(c) for c in ops.seen(f, xs)]
        # (as a tuple: JAX 0.7 prints a spec as PartitionSpec('d',), later ones as P('d',))
        checks[f"{name}: layout"] = str(tuple(f(xs).sharding.spec))
    return checks


if __name__ == "__main__":
    MESH = None
    if DEVICES > 1:
        kind = jax.sharding.AxisType.Explicit if EXPLICIT else jax.sharding.AxisType.Auto
        MESH = jax.make_mesh((DEVICES,), ("d",), axis_types=(kind,))
    run = {"save": save, "load": load, "load-saved": load_saved,
           "load-saved-executables": load_saved_executables, "bare": bare,
           "cache": cache, "plan": plan}[MODE]
    if EXPLICIT:  # Explicit axes: the types carry the shardings, under the mesh
        with jax.set_mesh(MESH):
            result = run()
    else:
        result = run()
    print(json.dumps({"checks": result}))
