# requires: flatbuffers (pip install ".[saving]")
"""Saving and loading programs.

Save a jitted gradient that calls jaxdecl ops with ``jax.export`` and as a
serialized executable, then load and run both in a fresh Python process that
imports only ``jaxdecl`` and the ops' module, ``tutorials/saving_ops.py``:
an op holding a NumPy array and a dataclass, and one holding a NumPy
polynomial, saved through ``__getstate__``/``__setstate__``. Every compiled
call carries its op's class (by module and name) and configuration (by value),
and the loading process rebuilds the op from them. The loaded results are
compared with this process's and with ``jax.numpy``; then the errors: a
process that has not imported the ops' module, configuration with no saved
form, an op defined in a script. ``jax.export``'s ``Exported.serialize``
needs the ``flatbuffers`` package (``pip install ".[saving]"``).
"""

import requires  # tutorials/requires.py: without line 1's package, stops with its pip command

requires.check(__file__)

import os
import pathlib
import pickle
import subprocess
import sys
import tempfile
import types

import jax
import jax.export  # (older JAX does not import it with jax)
import jax.numpy as jnp
import numpy as np
from jax.experimental import serialize_executable

import jaxdecl as jd

HERE = pathlib.Path(__file__).resolve().parent
# The ops live in a module beside this script, not in it: another process must find their
# classes. (Python puts this script's folder on sys.path, so the import finds it.)
import saving_ops

workdir = tempfile.TemporaryDirectory(prefix="jaxdecl-saving-")  # removed when the script ends
folder = pathlib.Path(workdir.name)

weights = np.linspace(0.5, 2.0, 5)
coef = [1.0, -0.5, 0.25]  # p(x) = 1 - x/2 + x²/4
weighted = saving_ops.Weighted(weights, saving_ops.Options(power=2, scale=3.0))
poly = saving_ops.Poly(coef)


def loss(x):
    return jnp.sum(weighted(poly(x)))


def loss_reference(x):
    return jnp.sum(3.0 * weights * jnp.polyval(jnp.asarray(coef[::-1]), x) ** 2)


x = jnp.linspace(-1.0, 1.0, 5, dtype=jnp.float32)
program = jax.jit(jax.value_and_grad(loss))

print("== 1. The program, run in this process")
value, grad = program(x)
ref_value, ref_grad = jax.value_and_grad(loss_reference)(x)
print("value         :", value, "  jnp reference:", ref_value)
print("grad          :", grad)
print("jnp reference :", ref_grad)
np.testing.assert_allclose(value, ref_value, rtol=1e-5)
np.testing.assert_allclose(grad, ref_grad, rtol=1e-5)

print("\n== 2. jax.export: pass jd.disabled_checks(), write the bytes")
exported = jax.export.export(program, disabled_checks=jd.disabled_checks())(x)
(folder / "loss.exported").write_bytes(exported.serialize())
print("exported program:", (folder / "loss.exported").stat().st_size, "bytes, calls",
      exported.mlir_module().count("jaxdecl_dispatch"), "jaxdecl kernels")
try:  # JAX exports a call to foreign code only when told that it may
    jax.export.export(program)(x)
except ValueError as error:
    print("without disabled_checks, ValueError:", str(error).split(".")[0])

print("\n== 3. serialize_executable: the compiled program, pickled")
compiled = program.lower(x).compile()
payload, in_tree, out_tree = serialize_executable.serialize(compiled)
(folder / "loss.executable").write_bytes(pickle.dumps((payload, in_tree, out_tree)))
np.save(folder / "x.npy", np.asarray(x))
print("executable    :", (folder / "loss.executable").stat().st_size, "bytes")

# What the loading process runs: jaxdecl and the ops' module are its only imports of ours.
LOAD = """
import pathlib, pickle, sys
import jax, jax.export, numpy as np
from jax.experimental import serialize_executable
import jaxdecl      # registers jaxdecl's handlers with XLA (starts no backend)
import saving_ops   # the ops' module: importing it is what lets its ops be rebuilt

folder = pathlib.Path(sys.argv[1])
x = np.load(folder / "x.npy")

exported = jax.export.deserialize(bytearray((folder / "loss.exported").read_bytes()))
value, grad = exported.call(x)
print("exported      : value", value, "grad", grad)

payload, in_tree, out_tree = pickle.loads((folder / "loss.executable").read_bytes())
compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
value2, grad2 = compiled(x)
print("executable    : value", value2, "grad", grad2)
print("Poly.__setstate__ ran", saving_ops.Poly.rebuilt, "time(s) in this process")
np.savez(folder / "loaded.npz", value=value, grad=grad, value2=value2, grad2=grad2)
"""

# The loading process finds saving_ops where this one did: on its path.
env = dict(os.environ)
env["PYTHONPATH"] = os.pathsep.join([str(HERE)] + [p for p in [env.get("PYTHONPATH")] if p])


def run(code):
    """Runs `code` in a fresh Python process; returns what it printed.

    It runs in the saved files' folder: `python -c` puts its working folder first on the
    path, and from a checkout of jaxdecl (where these tutorials are run) that would import
    the source tree instead of the installed jaxdecl."""
    done = subprocess.run([sys.executable, "-c", code, str(folder)], env=env, cwd=folder,
                          capture_output=True, text=True, timeout=240)
    if done.returncode != 0:
        raise SystemExit(f"the loading process failed:\n{done.stderr[-3000:]}")
    return done.stdout.rstrip()


print("\n== 4. A fresh process loads both and runs them")
print(run(LOAD))
loaded = np.load(folder / "loaded.npz")
for name in ("value", "grad", "value2", "grad2"):
    np.testing.assert_allclose(loaded[name], (value, grad)[name.startswith("grad")], rtol=1e-6)
print("both agree with this process's results")

print("\n== 5. A process that has not imported the ops' module is told which to import")
BARE = """
import pathlib, sys
import jax, jax.export, numpy as np
import jaxdecl      # but no `import saving_ops`: jaxdecl never imports a module itself

folder = pathlib.Path(sys.argv[1])
exported = jax.export.deserialize(bytearray((folder / "loss.exported").read_bytes()))
try:
    exported.call(np.load(folder / "x.npy"))
except jax.errors.JaxRuntimeError as error:
    print(type(error).__name__ + ":", str(error).splitlines()[0])
"""
message = run(BARE)
print(message)
assert "import saving_ops" in message, message

print("\n== 6. What cannot be saved is refused when exporting (jd.ExportError)")
# Configuration with no saved form: a SimpleNamespace instead of the Options dataclass.
loose = saving_ops.Weighted(weights, types.SimpleNamespace(power=2, scale=3.0))
try:
    jax.export.export(jax.jit(loose), disabled_checks=jd.disabled_checks())(x)
except jd.ExportError as error:
    print("jd.ExportError:", error)
else:
    raise SystemExit("configuration with no saved form should have been refused")


class Cube(jd.Primitive):
    """Defined in this script (__main__): another process cannot import it."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        return x**3


try:
    jax.export.export(jax.jit(Cube()), disabled_checks=jd.disabled_checks())(x)
except jd.ExportError as error:
    print("\njd.ExportError:", error)
else:
    raise SystemExit("an op defined in a script should have been refused")

# Outside jax.export nothing changes: both ops run, their programs stay in this process.
print("\nloose op, jit  :", jax.jit(loose)(x))
print("Cube(), jit    :", jax.jit(Cube())(x))
