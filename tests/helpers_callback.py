"""Saves a program that calls jd.pure_callback, or loads and runs it, in a fresh process.

    python helpers_callback.py save DIR   # jax.export of jit, vmap and a custom_vjp's grad
    python helpers_callback.py load DIR   # imports callbacks_saved only; runs; compares
    python helpers_callback.py bare DIR   # loads without importing it: the error

Prints ``{"checks": {...}}`` as its last line (see conftest.run_helper).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.export  # noqa: E402, F401 - (older JAX does not import it with jax)
import numpy as np  # noqa: E402

import jaxdecl as jd  # noqa: E402
from jaxdecl._host import _dispatch  # noqa: E402

jax.config.update("jax_enable_x64", True)
MODE, DIR = sys.argv[1], sys.argv[2]
X = np.linspace(0.1, 2.0, 6)
NAMES = ("forward", "vmap", "grad")


def expected():
    d = np.sin(X) * np.exp(-0.5 * X)
    derivative = (np.cos(X) - 0.5 * np.sin(X)) * np.exp(-0.5 * X)
    return {"forward": d, "vmap": np.stack([d, d]), "grad": derivative}


def functions():
    import callbacks_saved

    def call(x):
        return jd.pure_callback(callbacks_saved.damped_sin, jax.ShapeDtypeStruct(
            x.shape, x.dtype), x, rate=0.5, vmap_method="sequential")

    @jax.custom_vjp
    def smooth(x):
        return call(x)

    def derivative(x):
        return jd.pure_callback(callbacks_saved.damped_sin_derivative,
                                jax.ShapeDtypeStruct(x.shape, x.dtype), x, rate=0.5,
                                vmap_method="sequential")

    smooth.defvjp(lambda x: (call(x), x), lambda x, g: (g * derivative(x),))
    return {"forward": call, "vmap": jax.vmap(call),
            "grad": jax.grad(lambda x: smooth(x).sum())}


if MODE == "save":
    arguments = {"forward": X, "vmap": np.stack([X, X]), "grad": X}
    for name, f in functions().items():
        exported = jax.export.export(jax.jit(f), disabled_checks=jd.disabled_checks())(
            arguments[name])
        with open(os.path.join(DIR, f"{name}.bin"), "wb") as file:
            file.write(exported.serialize())
    print(json.dumps({"checks": {"saved": True}}))
else:
    if MODE == "load":
        import callbacks_saved  # noqa: F401 - what the programs call
    checks = {"kernels_before": _dispatch.kernel_count()}
    arguments = {"forward": X, "vmap": np.stack([X, X]), "grad": X}
    for name in NAMES:
        with open(os.path.join(DIR, f"{name}.bin"), "rb") as file:
            exported = jax.export.deserialize(bytearray(file.read()))
        try:
            got = np.asarray(exported.call(arguments[name]))
            checks[name] = bool(np.allclose(got, expected()[name], rtol=1e-12))
        except Exception as error:  # noqa: BLE001 - the error is the check
            checks[name] = f"{type(error).__name__}: {error}"[:600]
    print(json.dumps({"checks": checks}))
