"""Programs exported for CPU and CUDA at once, saved and run in fresh processes; and what a
CPU-only process maps.

    python helpers_gpu_export.py save DIR DEVICES  # runs ops, lowers them for CUDA, saves
                                                   # jax.export(platforms=["cpu", "cuda"])
    python helpers_gpu_export.py load DIR DEVICES  # imports ops_saved only; runs them on CPU

Both report the CUDA libraries the process mapped.

Prints ``{"checks": {...}}`` as its last line (see conftest.run_helper).
"""

import json
import os
import sys

DEVICES = int(sys.argv[3])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.export  # noqa: E402, F401 - (older JAX does not import it with jax)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxdecl as jd  # noqa: E402

jax.config.update("jax_enable_x64", True)
MODE, DIR = sys.argv[1], sys.argv[2]
PLATFORMS = ["cpu", "cuda"]


def inputs():
    cpu = jax.devices("cpu")[0]
    x = jax.device_put(jnp.linspace(0.1, 0.8, 8), cpu)
    m = jax.device_put(jnp.arange(32.0).reshape(8, 4) / 40, cpu)
    if DEVICES == 1:
        return (x, m), None
    mesh = jax.make_mesh((DEVICES,), ("d",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices("cpu"))  # (host devices, even beside a GPU)
    P = jax.sharding.PartitionSpec  # (jax.P from JAX 0.7)
    shardings = (jax.NamedSharding(mesh, P("d")), jax.NamedSharding(mesh, P("d", None)))
    return tuple(jax.device_put(v, s) for v, s in zip((x, m), shardings)), shardings


def functions(ops):
    return {
        "forward": ops.program,
        "grad": jax.grad(ops.program, argnums=(0, 1)),
        "vmap": lambda x, m: jax.vmap(lambda row: ops.Weighted(ops.W)(row))(
            jnp.stack([x, 2 * x])),
    }


def references(ops):
    return {
        "forward": ops.twin,
        "grad": jax.grad(ops.twin, argnums=(0, 1)),
        "vmap": lambda x, m: jnp.asarray(ops.W) * jnp.stack([x, 2 * x]) ** 2,
    }


def cuda_libraries() -> list:
    """The CUDA libraries this process has mapped (libcudart, libcuda)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if len(line.split()) >= 6}
    return sorted(p for p in paths
                  if os.path.basename(p).startswith(("libcudart", "libcuda.", "libcuda-")))


def save():
    import ops_saved

    args, shardings = inputs()
    checks = {"ran": bool(np.isfinite(float(jax.jit(ops_saved.program)(*args))))}
    eager = ops_saved.Scale(2.0)(args[0])
    checks["ran"] &= bool(np.allclose(np.asarray(eager), 2 * np.asarray(args[0])))
    checks["lowered"] = "jaxdecl_dispatch" in jax.jit(jax.grad(ops_saved.program)).trace(
        *args).lower(lowering_platforms=("cuda",)).as_text()
    platforms = set()
    for name, f in functions(ops_saved).items():
        exported = jax.export.export(jax.jit(f, in_shardings=shardings), platforms=PLATFORMS,
                                     disabled_checks=jd.disabled_checks())(*args)
        platforms.add(tuple(exported.platforms))
        with open(os.path.join(DIR, f"{name}.exported"), "wb") as file:
            file.write(exported.serialize())
    (platforms,) = platforms
    return dict(checks, platforms=list(platforms), cuda_libraries=cuda_libraries())


def load():
    import ops_saved  # the user's module: the only import a saved program needs

    args, _ = inputs()
    checks = {}
    for name, reference in references(ops_saved).items():
        with open(os.path.join(DIR, f"{name}.exported"), "rb") as file:
            exported = jax.export.deserialize(bytearray(file.read()))
        checks["platforms"] = list(exported.platforms)
        got, want = exported.call(*args), reference(*args)
        checks[name] = all(
            np.allclose(np.asarray(u), np.asarray(v), rtol=1e-10, atol=1e-12)
            for u, v in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)))
    checks["cuda_libraries"] = cuda_libraries()
    return checks


if __name__ == "__main__":
    print(json.dumps({"checks": {"save": save, "load": load}[MODE]()}))
