"""Quickstart.

Declare f(x1, x2) = x1 * x2**2 as a jaxdecl class and use it like any JAX
function: a zero-copy NumPy forward rule, eager and jitted calls, gradients and
tangents from ``@jvp``/``@vjp``, and ``vmap``. Each result is printed next to
its ``jax.numpy`` reference.
"""

import jax
import jax.numpy as jnp
import numpy as np

import jaxdecl as jd


class Mul(jd.Primitive):
    """f(x1, x2) = x1 * x2**2, computed by NumPy on XLA's own buffers."""

    @jd.abstract
    def shapes(self, x1, x2):
        return jax.ShapeDtypeStruct(x1.shape, x1.dtype)

    @jd.forward
    def apply(self, x1, x2, *, out):
        np.multiply(x1, x2**2, out=out)  # writes straight into XLA's output buffer

    @jd.jvp
    def push(self, x1, x2, dx1, dx2):
        return x2**2 * dx1 + 2 * x1 * x2 * dx2

    @jd.vjp
    def pull(self, x1, x2, ct):
        return x2**2 * ct, 2 * x1 * x2 * ct


mul = Mul()
a = jnp.arange(1.0, 5.0)
b = jnp.full(4, 3.0)

print("eager     :", mul(a, b))
print("jit       :", jax.jit(mul)(a, b))
print("reference :", a * b**2)

loss = lambda a, b: mul(a, b).sum()  # noqa: E731
grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(a, b)
print("grad      :", grads[0], grads[1])
print("reference :", b**2, 2 * a * b)

_, tangent = jax.jvp(mul, (a, b), (jnp.ones(4), jnp.zeros(4)))
print("jvp       :", tangent)
print("vmap      :", jax.vmap(mul)(jnp.stack([a, 2 * a]), jnp.stack([b, b])))
