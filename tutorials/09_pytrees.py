# requires: scipy (pip install ".[scipy]")
"""Pytrees.

A SciPy ``cKDTree`` nearest-neighbour query whose parameters arrive as a dict
and whose outputs are (distance: float, index: int): eager, ``jit``, ``grad``
with respect to the dict, ``vmap`` over a batch of dicts, ``jd.check``, and the
error when a rule returns the wrong structure. The derivative rules read the
forward's result (``result=``), so a gradient queries the tree once. Any
argument of an op may be a pytree of arrays (dict, tuple, list, NamedTuple,
registered dataclass); every rule receives the same structure with NumPy arrays
at the leaves, and ``@abstract`` returns the output structure. Each result is
compared with a brute-force nearest-neighbour search written in pure
``jax.numpy``.
"""

import requires  # tutorials/requires.py: without line 1's package, stops with its pip command

requires.check(__file__)

import jax
import jax.numpy as jnp
import numpy as np
from scipy.spatial import cKDTree

import jaxdecl as jd

jax.config.update("jax_enable_x64", True)


class Nearest(jd.Primitive):
    """For each query q = scale * x + shift: the distance to, and index of, its nearest point.

    Inputs: `x` (n, d) and the dict `params = {"shift": (d,), "scale": ()}`.
    Outputs: the tuple `(distance (n,) float, index (n,) int32)`.

    The tree over the fixed points is configuration: built once in __init__ and
    held by the instance, never passed as an input. The index output is an
    integer, so it carries no tangent: the derivative rules see one float
    output, and a rule that produces exactly one tangent returns a bare array.
    The rules take the keyword-only `result`, the forward's `(distance, index)`:
    they know which point is nearest without querying the tree again.
    """

    queries = 0  # how many times the tree was searched, for section 7

    def __init__(self, points):
        self.tree = cKDTree(np.asarray(points, np.float64))

    @staticmethod
    def _queries(x, params):
        return params["scale"] * x + params["shift"]

    @jd.abstract
    def shapes(self, x, params):
        # `params` arrives as a dict of jax.ShapeDtypeStruct; the tuple returned here fixes
        # the structure the op returns.
        assert set(params) == {"shift", "scale"}, "a dict keeps its own keys"
        n = x.shape[0]
        return (jax.ShapeDtypeStruct((n,), x.dtype), jax.ShapeDtypeStruct((n,), np.int32))

    @jd.forward
    def apply(self, x, params, *, out):
        distance, index = out  # `out` has the output structure: a tuple of writable views
        type(self).queries += 1
        distance[...], index[...] = self.tree.query(self._queries(x, params))

    def _unit(self, x, params, result):
        """(q - p_nearest) / |q - p_nearest|: the gradient of each distance wrt its query."""
        distance, index = result  # the forward's output, integer index included: no new query
        q = self._queries(x, params)
        return (q - self.tree.data[index]) / distance[:, None]

    @jd.jvp
    def push(self, x, params, dx, dparams, *, out, result):
        # One tangent per differentiable input, mirroring it: `dparams` is a dict like `params`.
        # Only `distance` is a float output, so `out` is that one array, not a tuple.
        unit = self._unit(x, params, result)
        dq = params["scale"] * dx + dparams["shift"] + dparams["scale"] * x
        np.sum(unit * dq, axis=1, out=out)

    @jd.vjp
    def pull(self, x, params, ct, *, result):
        # One cotangent per float output (`ct` is the distance's); one returned per
        # differentiable input: x's array and a dict mirroring `params`.
        ct_q = ct[:, None] * self._unit(x, params, result)
        return params["scale"] * ct_q, {"shift": ct_q.sum(axis=0), "scale": np.sum(ct_q * x)}


def nearest_reference(points, x, params):
    """Brute force in jax.numpy: every query against every point."""
    q = params["scale"] * x + params["shift"]
    index = jnp.argmin(jnp.sum((q[:, None, :] - points[None, :, :]) ** 2, axis=-1), axis=1)
    return jnp.linalg.norm(q - points[index], axis=-1), index.astype(jnp.int32)


def show(tree):
    """A dict of arrays, six digits per number."""
    return ", ".join(f"{k}: {np.array2string(np.asarray(v), precision=6)}" for k, v in tree.items())


rng = np.random.default_rng(9)
points = jnp.asarray(rng.uniform(-1.0, 1.0, (40, 2)))  # random: in general position
x = jnp.asarray(rng.uniform(-1.0, 1.0, (6, 2)))
params = {"shift": jnp.array([0.1, -0.2]), "scale": jnp.array(0.9)}
nearest = Nearest(points)

# Nearest neighbours must be unique and distances nonzero, or the derivative does not exist.
q = params["scale"] * x + params["shift"]
gaps = np.sort(np.linalg.norm(q[:, None] - points[None], axis=-1), axis=1)
assert gaps[:, 0].min() > 1e-3 and (gaps[:, 1] - gaps[:, 0]).min() > 1e-3

print("== 1. A dict goes in, a tuple (float, int) comes out")
distance, index = nearest(x, params)
jit_distance, jit_index = jax.jit(nearest)(x, params)
ref_distance, ref_index = nearest_reference(points, x, params)
print("eager distance :", np.round(distance, 6))
print("jit distance   :", np.round(jit_distance, 6))
print("jnp reference  :", np.round(ref_distance, 6))
print("eager index    :", index, index.dtype)
print("jit index      :", jit_index)
print("jnp reference  :", ref_index)
np.testing.assert_allclose(distance, ref_distance, rtol=1e-12)
np.testing.assert_allclose(jit_distance, ref_distance, rtol=1e-12)
np.testing.assert_array_equal(index, ref_index)
np.testing.assert_array_equal(jit_index, ref_index)

print("\n== 2. grad wrt the dict of parameters is a dict (@vjp)")
weights = jnp.linspace(1.0, 2.0, x.shape[0])
loss = lambda p: jnp.sum(weights * nearest(x, p)[0] ** 2)  # noqa: E731
ref_loss = lambda p: jnp.sum(weights * nearest_reference(points, x, p)[0] ** 2)  # noqa: E731
grad = jax.jit(jax.grad(loss))(params)
ref_grad = jax.grad(ref_loss)(params)
print("grad           :", show(grad))
print("jnp reference  :", show(ref_grad))
assert set(grad) == {"shift", "scale"}
for key in grad:
    np.testing.assert_allclose(grad[key], ref_grad[key], rtol=1e-10)
grad_x = jax.grad(lambda x: jnp.sum(nearest(x, params)[0]))(x)
ref_grad_x = jax.grad(lambda x: jnp.sum(nearest_reference(points, x, params)[0]))(x)
np.testing.assert_allclose(grad_x, ref_grad_x, rtol=1e-10)
print("grad wrt x agrees with the reference too")

print("\n== 3. jvp with a dict tangent returns the distance tangent (@jvp)")
tangents = (jnp.ones_like(x), {"shift": jnp.array([1.0, 0.0]), "scale": jnp.array(0.5)})
(_, _), (d_distance, d_index) = jax.jvp(nearest, (x, params), tangents)
(_, _), (ref_d_distance, _) = jax.jvp(lambda *a: nearest_reference(points, *a),
                                      (x, params), tangents)
print("d distance     :", np.round(d_distance, 6))
print("jnp reference  :", np.round(ref_d_distance, 6))
print("d index is float0:", d_index.dtype == jax.dtypes.float0,
      "(JAX's tangent type of integers; @jvp returned only the distance's)")
assert d_index.dtype == jax.dtypes.float0
np.testing.assert_allclose(d_distance, ref_d_distance, rtol=1e-10)

print("\n== 4. vmap over a batch of dicts: shifts batched, scale shared")
shifts = jnp.array([[0.0, 0.0], [0.1, -0.2], [-0.3, 0.25]])
batch = {"shift": shifts, "scale": jnp.array(0.9)}
in_axes = (None, {"shift": 0, "scale": None})
b_distance, b_index = jax.vmap(nearest, in_axes=in_axes)(x, batch)
ref_b_distance, ref_b_index = jax.vmap(lambda *a: nearest_reference(points, *a),
                                       in_axes=in_axes)(x, batch)
print("batched index  :\n", b_index)
print("jnp reference  :\n", ref_b_index)
np.testing.assert_allclose(b_distance, ref_b_distance, rtol=1e-12)
np.testing.assert_array_equal(b_index, ref_b_index)

print("\n== 5. jd.check reviews every rule on pytree arguments")
jd.check(nearest, x, params)
print("jd.check passed for Nearest")

print("\n== 6. A rule that returns the wrong structure is named, with the key path")


class MisspeltNearest(Nearest):
    """The same op, but its @vjp returns the dict with a misspelt key."""

    @jd.vjp
    def pull(self, x, params, ct, *, result):
        ct_x, ct_params = super().pull(x, params, ct, result=result)
        return ct_x, {"shift": ct_params["shift"], "scael": ct_params["scale"]}


try:
    jax.grad(lambda p: jnp.sum(MisspeltNearest(points)(x, p)[0]))(params)
except jd.RuleError as error:
    print("jd.RuleError:", error)
    assert "structure" in str(error)
else:
    raise SystemExit("a misspelt key should have been reported")

# Leaves must be arrays (or numbers); settings such as a mode string belong on the instance.
try:
    nearest(x, {"shift": params["shift"], "scale": params["scale"], "mode": "fast"})
except TypeError as error:
    print("TypeError:", error)
else:
    raise SystemExit("a string leaf should have been reported")

print("\n== 7. The derivative rules reuse the forward's result: one tree query per gradient")
Nearest.queries = 0
jax.block_until_ready(jax.jit(jax.value_and_grad(loss))(params))
print("tree queries for value_and_grad:", Nearest.queries)
assert Nearest.queries == 1
Nearest.queries = 0
jax.block_until_ready(jax.jvp(nearest, (x, params), tangents))
print("tree queries for jvp            :", Nearest.queries)
assert Nearest.queries == 1
