"""Wrapping your own C++.

Compile ``tutorials/cpp/saxpy.cpp`` into a shared library, load it with
``ctypes``, and call it from jaxdecl rules on XLA's buffers (zero copy) under
``jit``, ``grad`` and ``vmap``. The rules stay Python methods that hand data
pointers to C++; a rule can also be a C function that XLA calls without Python
(``jd.cfunction``).
"""

import ctypes
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import jaxdecl as jd

SOURCE = pathlib.Path(__file__).resolve().parent / "cpp" / "saxpy.cpp"


def build_library(source: pathlib.Path, directory: pathlib.Path):
    """Compiles `source` with the system C++ compiler; returns (ctypes library, note)."""
    compiler = os.environ.get("CXX") or next(
        (shutil.which(c) for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    if compiler is None:
        return None, "no C++ compiler found (install g++ or clang++, or set CXX)"
    suffix = ".dylib" if sys.platform == "darwin" else ".so"
    library = directory / ("libsaxpy" + suffix)
    command = [compiler, "-O2", "-std=c++11", "-shared", "-fPIC", "-o", str(library), str(source)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"running {compiler} failed: {error}"
    if result.returncode != 0:
        return None, f"{' '.join(command)} failed:\n{result.stderr}"
    return ctypes.CDLL(str(library)), " ".join(command)


def declare_signatures(lib) -> dict:
    """Sets the C signatures (ctypes otherwise guesses int) and groups them by dtype."""
    size, ptr = ctypes.c_size_t, ctypes.c_void_p
    kernels = {}
    for dtype, scalar, tag in ((np.float32, ctypes.c_float, "f32"),
                               (np.float64, ctypes.c_double, "f64")):
        saxpy, scale, dot = (getattr(lib, f"{name}_{tag}") for name in ("saxpy", "scale", "dot"))
        saxpy.argtypes, saxpy.restype = [size, scalar, ptr, ptr, ptr], None
        scale.argtypes, scale.restype = [size, scalar, ptr, ptr], None
        dot.argtypes, dot.restype = [size, ptr, ptr], ctypes.c_double
        kernels[np.dtype(dtype)] = (saxpy, scale, dot)
    return kernels


def pointer(array: np.ndarray) -> int:
    """The address of an array's data; the C++ code expects one dense block."""
    if not array.flags.c_contiguous:
        raise ValueError("the C++ kernels need C-contiguous arrays")
    return array.ctypes.data


directory = tempfile.TemporaryDirectory(prefix="jaxdecl_cpp_")  # removed when the script ends
lib, note = build_library(SOURCE, pathlib.Path(directory.name))
if lib is None:
    print("Could not compile the C++ example, so this tutorial stops here.")
    print("Reason:", note)
    print("Note: jaxdecl itself needs no compiler; only this example builds its own kernel.")
    sys.exit(0)
print("compiled with:", note)
KERNELS = declare_signatures(lib)


class Saxpy(jd.Primitive):
    """out = a * x + y, computed by C++ on the NumPy views of XLA's buffers.

    Every rule passes raw data pointers (`x.ctypes.data`) to C++, which reads
    the inputs in place and writes straight into `out`: nothing is copied.
    """

    @jd.abstract
    def shapes(self, a, x, y):
        if a.shape != () or x.shape != y.shape or not a.dtype == x.dtype == y.dtype:
            raise ValueError(f"Saxpy wants a scalar a and x, y of one shape and dtype; got "
                             f"a: {a.dtype}{a.shape}, x: {x.dtype}{x.shape}, y: {y.dtype}{y.shape}")
        if x.dtype not in KERNELS:
            raise TypeError(f"the C++ kernels exist for float32 and float64, not {x.dtype}")
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, a, x, y, *, out):
        saxpy, _, _ = KERNELS[x.dtype]
        saxpy(x.size, a.item(), pointer(x), pointer(y), pointer(out))

    @jd.jvp
    def push(self, a, x, y, da, dx, dy, *, out):
        # d(a x + y) = da x + (a dx + dy): two saxpy calls, the second one in place on `out`.
        saxpy, _, _ = KERNELS[x.dtype]
        saxpy(x.size, a.item(), pointer(dx), pointer(dy), pointer(out))
        saxpy(x.size, da.item(), pointer(x), pointer(out), pointer(out))

    @jd.vjp
    def pull(self, a, x, y, ct, *, out):
        # One output per differentiable input: (ct_a, ct_x, ct_y) = (<x, ct>, a ct, ct).
        _, scale, dot = KERNELS[x.dtype]
        ct_a, ct_x, ct_y = out
        ct_a[...] = dot(x.size, pointer(x), pointer(ct))
        scale(x.size, a.item(), pointer(ct), pointer(ct_x))
        ct_y[...] = ct


saxpy = Saxpy()
rng = np.random.default_rng(0)
a = jnp.float32(2.5)
x = jnp.asarray(rng.standard_normal(5), jnp.float32)
y = jnp.asarray(rng.standard_normal(5), jnp.float32)
reference = lambda a, x, y: a * x + y  # noqa: E731

print("\n== forward: eager and jit, against jax.numpy")
print("eager         :", saxpy(a, x, y))
print("jit           :", jax.jit(saxpy)(a, x, y))
print("jnp reference :", reference(a, x, y))

print("\n== grad through the C++ @vjp")
loss = lambda a, x, y: jnp.sum(jnp.sin(saxpy(a, x, y)))  # noqa: E731
ref_loss = lambda a, x, y: jnp.sum(jnp.sin(reference(a, x, y)))  # noqa: E731
for name, got, want in zip(("a", "x", "y"), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(a, x, y),
                           jax.grad(ref_loss, argnums=(0, 1, 2))(a, x, y)):
    print(f"d/d{name}  C++ : {np.asarray(got)}\n       jnp : {np.asarray(want)}")

print("\n== forward mode through the C++ @jvp")
tangents = (jnp.float32(1.0), jnp.ones(5, jnp.float32), jnp.zeros(5, jnp.float32))
print("jvp C++       :", jax.jvp(saxpy, (a, x, y), tangents)[1])
print("jvp jnp       :", jax.jvp(reference, (a, x, y), tangents)[1])

print("\n== vmap: a batch of 3 (x, y) pairs sharing one a, and a batch of a's")
xs = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)
ys = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)
batched = jax.vmap(saxpy, in_axes=(None, 0, 0))(a, xs, ys)
print("max |C++ - jnp| :", float(jnp.max(jnp.abs(batched - reference(a, xs, ys)))))
scales = jnp.array([0.0, 1.0, -2.0], jnp.float32)
per_a = jax.vmap(saxpy, in_axes=(0, None, None))(scales, x, y)
print("max |C++ - jnp| :", float(jnp.max(jnp.abs(per_a - scales[:, None] * x - y))))

print("\n== float64 uses the double kernels; jd.check reviews every rule")
jax.config.update("jax_enable_x64", True)
a64, x64, y64 = jnp.float64(-1.5), jnp.asarray(np.asarray(x), jnp.float64), \
    jnp.asarray(np.asarray(y), jnp.float64)
print("float64 result:", saxpy(a64, x64, y64).dtype, "max |C++ - jnp| =",
      float(jnp.max(jnp.abs(saxpy(a64, x64, y64) - reference(a64, x64, y64)))))
jd.check(saxpy, a64, x64, y64)
print("jd.check(saxpy, ...) passed: abstract, jvp, vjp, vmap and jit agree")
