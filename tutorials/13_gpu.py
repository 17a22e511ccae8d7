"""GPUs.

A class written for the CPU runs unchanged in a program on a GPU: its NumPy rules
receive host copies of XLA's buffers (jaxdecl stages them through pinned memory on
XLA's stream). Declaring a rule with ``platform="gpu"`` adds a *device rule*: it
receives device arrays (``__cuda_array_interface__``, ``__dlpack__``) and XLA's stream,
and runs on the GPU with no copy; here in CuPy, under ``jit``, ``grad`` and ``vmap``.
The host rules keep serving the CPU. Without a CUDA GPU (and JAX's CUDA plugin), or
without CuPy, the script runs the host rules on the CPU and says what it skipped.
"""

import jax
import jax.numpy as jnp
import numpy as np

import jaxdecl as jd

try:
    import cupy
except ImportError:  # the device rules need CuPy; the host rules do not
    cupy = None

RAN = []  # which rules ran, in order


def gpus():
    """JAX's CUDA devices ([] without a GPU or JAX's CUDA plugin)."""
    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


class Scale(jd.Primitive, linear=True):
    """y = factor * x, linear in x: a forward and a transpose, for the CPU and the GPU."""

    def __init__(self, factor):
        self.factor = factor

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    # The host rules: NumPy, on the CPU (and staged on a GPU where no device rule is).
    @jd.forward
    def apply(self, x, *, out):
        RAN.append("apply (host)")
        np.multiply(x, self.factor, out=out)

    @jd.transpose
    def apply_t(self, ct):
        RAN.append("apply_t (host)")
        return self.factor * ct

    # The device rules: device arrays and XLA's stream, on which CuPy enqueues its work.
    @jd.forward(platform="gpu")
    def apply_gpu(self, x, *, out, stream):
        RAN.append("apply_gpu (device)")
        with cupy.cuda.ExternalStream(int(stream)):
            cupy.multiply(cupy.asarray(x), self.factor, out=cupy.asarray(out))

    @jd.transpose(platform="gpu")
    def apply_t_gpu(self, ct, *, stream):
        RAN.append("apply_t_gpu (device)")
        with cupy.cuda.ExternalStream(int(stream)):
            return self.factor * cupy.asarray(ct)  # a returned array is copied on the stream


class Cube(jd.Primitive):
    """x**3 with NumPy rules only: on a GPU, staged through host memory."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        RAN.append("Cube.apply (host)")
        return x**3

    @jd.vjp
    def pull(self, x, ct):
        RAN.append("Cube.pull (host)")
        return 3 * x**2 * ct


def run(device, label: str) -> None:
    """The ops under jit, grad and vmap on `device`, each compared with jax.numpy."""
    scale, cube = Scale(3.0), Cube()
    x = jax.device_put(jnp.linspace(0.0, 1.0, 6, dtype=jnp.float32), device)
    rows = jax.device_put(jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4), device)

    def loss(v):
        return jnp.sum(scale(cube(v)) ** 2)

    def twin(v):
        return jnp.sum((3.0 * v**3) ** 2)

    checks = {
        "jit": (jax.jit(scale)(x), 3.0 * x),
        "grad": (jax.jit(jax.grad(loss))(x), jax.grad(twin)(x)),
        "vmap": (jax.jit(jax.vmap(scale))(rows), 3.0 * rows),
    }
    print(f"\n{label}:")
    for name, (got, want) in checks.items():
        RAN.clear()
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)
        where = {d.platform for d in got.devices()}
        print(f"  {name:5s} matches jax.numpy, result on {', '.join(sorted(where))}")
    RAN.clear()
    jax.block_until_ready(jax.jit(jax.grad(loss))(x))
    print(f"  rules one gradient ran: {', '.join(dict.fromkeys(RAN))}")


run(jax.devices("cpu")[0], "CPU: the host rules")
if not gpus():
    print("\nno CUDA GPU here (or no JAX CUDA plugin): the GPU part was skipped. On a GPU "
          "machine the same ops run there, Cube's rules staged, Scale's on the device.")
elif cupy is None:
    print("\nCuPy is not installed: the GPU part was skipped (pip install cupy-cuda13x).")
else:
    run(gpus()[0], f"GPU ({gpus()[0].device_kind}): Cube staged, Scale's device rules")
