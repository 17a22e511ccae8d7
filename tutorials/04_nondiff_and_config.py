"""Non-differentiable inputs and configuration.

Coordinates as ``nondiff=`` inputs, integer indices, and settings (order,
thread count, axis) stored on the instance, where equal settings share compiled
code.
"""

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np

import jaxdecl as jd


def _interp_weights(coords, n, order):
    """Left grid index and weight of the left neighbour for each coordinate."""
    if order == 0:  # nearest neighbour: all weight on one grid point
        return np.clip(np.rint(coords), 0, n - 1).astype(np.intp), np.ones_like(coords)
    left = np.clip(np.floor(coords), 0, n - 2).astype(np.intp)
    return left, 1 - (coords - left)


class Interp(jd.Primitive, linear=True, nondiff=("coords",)):
    """Samples `values` on the grid 0, 1, ..., n-1 at the points `coords`.

    The result is linear in `values` for fixed `coords`, so the op is declared
    linear=True and its transpose (a scatter-add) gives every derivative with
    respect to `values`. `coords` are geometry, listed in nondiff=: jaxdecl
    hands them to every rule but never differentiates with respect to them.
    """

    abstract_calls = 0  # jaxdecl asks for shapes once per configuration and input shape

    def __init__(self, order=1, nthreads=1):
        # Static configuration: part of the primitive's compile-time parameter.
        self.order = order
        self.nthreads = nthreads

    @jd.abstract
    def shapes(self, values, coords):
        type(self).abstract_calls += 1
        return jax.ShapeDtypeStruct(coords.shape, values.dtype)

    def _chunks(self, size):
        """Splits range(size) into `nthreads` slices, one per worker thread."""
        bounds = np.linspace(0, size, self.nthreads + 1).astype(int)
        return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]

    @jd.forward
    def apply(self, values, coords, *, out):
        left, weight = _interp_weights(coords, values.shape[0], self.order)

        def work(part):
            result = weight[part] * values[left[part]]
            if self.order == 1:
                result += (1 - weight[part]) * values[left[part] + 1]
            out[part] = result

        # NumPy releases the GIL in its loops, so chunks of a large input run in parallel.
        with concurrent.futures.ThreadPoolExecutor(self.nthreads) as pool:
            list(pool.map(work, self._chunks(coords.shape[0])))

    @jd.transpose
    def apply_t(self, coords, ct, *, out):
        # Only the nondiff input and the cotangent arrive; `out` has the shape of `values`.
        left, weight = _interp_weights(coords, out.shape[0], self.order)
        out[...] = 0
        np.add.at(out, left, weight * ct)
        if self.order == 1:
            np.add.at(out, left + 1, (1 - weight) * ct)


class Take(jd.Primitive):
    """x.take(index, axis=self.axis); `index` is an integer array, so never differentiated."""

    def __init__(self, axis=0):
        self.axis = axis

    @jd.abstract
    def shapes(self, x, index):
        shape = list(x.shape)
        shape[self.axis:self.axis + 1] = index.shape
        return jax.ShapeDtypeStruct(tuple(shape), x.dtype)

    @jd.forward
    def apply(self, x, index):
        return np.take(x, index, axis=self.axis)

    @jd.vjp
    def pull(self, x, index, ct):
        # One cotangent is returned: integer inputs get none (jaxdecl supplies JAX's float0).
        grad = np.zeros(x.shape, ct.dtype)
        moved = np.moveaxis(grad, self.axis, 0)  # a view: scatter along the first axis
        np.add.at(moved, index, np.moveaxis(ct, list(range(self.axis, self.axis + index.ndim)),
                                            list(range(index.ndim))))
        return grad


values = jnp.array([0.0, 1.0, 4.0, 9.0, 16.0, 25.0])
coords = jnp.array([0.25, 1.5, 2.75, 4.2, 4.9])
grid = jnp.arange(values.shape[0], dtype=values.dtype)

print("== 1. Static configuration lives on the instance")
linear, nearest = Interp(order=1), Interp(order=0)
print("order=1             :", linear(values, coords))
print("jnp.interp          :", jnp.interp(coords, grid, values))
print("order=0             :", nearest(values, coords))
print("nearest reference   :", values[jnp.round(coords).astype(int)])

print("\n== 2. Equal configuration shares compiled code (look at the @abstract count)")
points = jnp.linspace(0.0, 5.0, 7)  # a shape not seen yet, so the count starts afresh
Interp.abstract_calls = 0
Interp(order=1)(values, points)
print("first  Interp(order=1)          : @abstract has run", Interp.abstract_calls, "time(s)")
Interp(order=1)(values, points)  # a new but equal instance: its compiled code is reused
jax.jit(lambda v, c: Interp(order=1)(v, c))(values, points)  # also inside another jit
print("two more equal instances        : @abstract has run", Interp.abstract_calls, "time(s)")
Interp(order=1, nthreads=2)(values, points)  # any differing setting is a new configuration
print("Interp(order=1, nthreads=2)     : @abstract has run", Interp.abstract_calls, "time(s)")
print("2 threads give the same numbers :",
      bool(jnp.allclose(Interp(order=1, nthreads=2)(values, points), linear(values, points))))

print("\n== 3. Derivatives: values yes, coords never")
loss = lambda v, c: jnp.sum(linear(v, c) ** 2)  # noqa: E731
ref_loss = lambda v, c: jnp.sum(jnp.interp(c, grid, v) ** 2)  # noqa: E731
print("grad wrt values     :", jax.grad(loss)(values, coords))
print("jnp reference       :", jax.grad(ref_loss)(values, coords))
try:
    jax.grad(loss, argnums=1)(values, coords)
except ValueError as error:
    print("grad wrt coords raises ValueError:\n   ", error)
else:
    raise SystemExit("differentiating with respect to a nondiff input should have failed")
# Where the derivative through coords is meant to be zero, say so explicitly:
frozen = jax.grad(lambda c: loss(values, jax.lax.stop_gradient(c)))(coords)
print("with stop_gradient  :", frozen)

print("\n== 4. Integer inputs are non-differentiable without being listed")
x = jnp.arange(12.0).reshape(3, 4)
index = jnp.array([3, 0, 3])
take_cols = Take(axis=1)
print("Take(axis=1)        :\n", take_cols(x, index))
print("jnp.take            :\n", jnp.take(x, index, axis=1))
weights = jnp.arange(9.0).reshape(3, 3)
take_loss = lambda x: jnp.sum(weights * take_cols(x, index))  # noqa: E731
print("grad wrt x          :\n", jax.grad(take_loss)(x))
ref_take_loss = lambda x: jnp.sum(weights * jnp.take(x, index, axis=1))  # noqa: E731
print("jnp reference       :\n", jax.grad(ref_take_loss)(x))
print("Take(axis=0) rows   :\n", Take(axis=0)(x, jnp.array([2, 2])))

print("\n== 5. jd.check reviews the rules, leaving nondiff and integer inputs alone")
for label, op, args in (("Interp(order=1)", Interp(order=1), (values, coords)),
                        ("Interp(order=0, nthreads=2)", Interp(order=0, nthreads=2),
                         (values, coords)),
                        ("Take(axis=1)", Take(axis=1), (x, index))):
    jd.check(op, *args)
    print("jd.check passed for", label)
