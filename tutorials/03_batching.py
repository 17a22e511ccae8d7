"""Batching.

How ``jax.vmap`` reaches your NumPy rules: ``batch="loop"`` (the default),
``batch="vectorized"``, or your own ``@jd.batch`` rule that folds the batch into
a native axis. Each op counts its rule calls, to show what each mode costs.
"""

import collections
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

import jaxdecl as jd

jax.config.update("jax_enable_x64", True)

rng = np.random.default_rng(0)
x1 = rng.standard_normal((8, 3))  # a batch of 8 vectors of length 3
x2 = rng.standard_normal(3)  # one vector, shared by the whole batch


# Every op below counts its rule calls in a class attribute, to show what each mode costs.
def loop(f, *args):
    """The reference: one unbatched call per element of x1, stacked."""
    return np.stack([f(a, *args) for a in x1])


# 1. batch="loop" (default): the rule always sees ONE element, never the batch.
#    jax.vmap still compiles to a single XLA custom call; the loop runs inside it.
class MulLoop(jd.Primitive):
    calls: ClassVar[collections.Counter] = collections.Counter()

    @jd.abstract
    def shapes(self, x1, x2):
        return jax.ShapeDtypeStruct(x1.shape, x1.dtype)

    @jd.forward
    def apply(self, x1, x2):
        type(self).calls[x1.shape] += 1
        return x1 * x2**2

    @jd.vjp
    def pull(self, x1, x2, ct):
        return x2**2 * ct, 2 * x1 * x2 * ct


mul = MulLoop()
batched = jax.jit(jax.vmap(mul, in_axes=(0, None)))
y = batched(x1, x2)
hlo = batched.lower(x1, x2).as_text()
print("loop:       rule calls by input shape", dict(MulLoop.calls),
      "| custom calls in HLO:", hlo.count("jaxdecl_dispatch"),
      "| matches loop:", np.allclose(y, loop(mul, x2)))


# 2. batch="vectorized": the rule sees the whole batch in one call. Batch dims lead;
#    an unbatched input arrives with a size-1 leading dim, so NumPy broadcasting just
#    works. Writing into `out` (zero-copy form) broadcasts to the full batch shape.
class MulVectorized(jd.Primitive, batch="vectorized"):
    calls: ClassVar[collections.Counter] = collections.Counter()

    @jd.abstract
    def shapes(self, x1, x2):  # always per-element shapes, whatever the batch
        return jax.ShapeDtypeStruct(x1.shape, x1.dtype)

    @jd.forward
    def apply(self, x1, x2, *, out):
        type(self).calls[(x1.shape, x2.shape)] += 1
        out[...] = x1 * x2**2

    @jd.vjp
    def pull(self, x1, x2, ct, *, out):
        out[0][...] = x2**2 * ct
        out[1][...] = 2 * x1 * x2 * ct


mul = MulVectorized()
y = jax.vmap(mul, in_axes=(0, None))(x1, x2)
print("vectorized: rule calls by input shapes", dict(MulVectorized.calls),
      "| matches loop:", np.allclose(y, loop(mul, x2)))

# Derivatives batch the same way, with no extra code: vmap of grad is one vjp call.
grads = jax.vmap(jax.grad(lambda a, b: jnp.sum(mul(a, b))), in_axes=(0, None))(x1, x2)
print("            vmap(grad) matches jax.numpy:", np.allclose(grads, x2**2))


# 3. @jd.batch: a trace-time rule that receives JAX values and their batch axes and may
#    call any op. An FFT folds the batch into its own axes by calling a reconfigured
#    instance. For a linear op the same rule also batches the transpose (and so grad).
class FFT(jd.Primitive, linear=True):
    calls: ClassVar[collections.Counter] = collections.Counter()

    def __init__(self, axis=-1):
        self.axis = axis

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, np.result_type(x.dtype, np.complex64))

    @jd.forward
    def apply(self, x):
        type(self).calls["forward", x.shape] += 1
        return np.fft.fft(x, axis=self.axis)

    @jd.transpose
    def apply_t(self, ct):  # the DFT matrix is symmetric
        type(self).calls["transpose", ct.shape] += 1
        return np.fft.fft(ct, axis=self.axis)

    @jd.batch
    def batched(self, args, axes):
        type(self).calls["batch"] += 1
        (x,), (axis,) = args, axes
        x = jnp.moveaxis(x, axis, 0)
        return FFT(axis=self.axis + 1 if self.axis >= 0 else self.axis)(x), 0


fft = FFT(axis=0)
signals = rng.standard_normal((3, 5)) + 1j * rng.standard_normal((3, 5))  # batch on axis 1
y = jax.vmap(fft, in_axes=1)(signals)
print("@batch:     rule calls", dict(FFT.calls),
      "| matches loop:", np.allclose(y, np.stack([fft(s) for s in signals.T])))

FFT.calls.clear()
g = jax.vmap(jax.grad(lambda s: jnp.sum(jnp.abs(fft(s)) ** 2)), in_axes=1)(signals.real)
reference = jax.vmap(jax.grad(lambda s: jnp.sum(jnp.abs(jnp.fft.fft(s)) ** 2)), in_axes=1)
print("            vmap(grad) rule calls", dict(FFT.calls),
      "| matches jax.numpy:", np.allclose(g, reference(signals.real)))
