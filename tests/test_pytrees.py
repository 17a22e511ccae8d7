"""Pytrees in and out of ops, and rule arity that follows the differentiable values.

References are pure jax.numpy functions of the same pytrees.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxdecl as jd

DTYPES = [np.float32, np.float64, np.complex128]


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if np.dtype(dtype) in (np.float32, np.complex64) \
        else dict(rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------
# An op with a dict input and a dict output: y = scale * x + shift, and its norm
# ---------------------------------------------------------------------------------------

class Affine(jd.Primitive):
    """{"y": scale * x + shift, "n": size of x} for params {"scale": (), "shift": x.shape}."""

    seen = []  # what the rules received, to check the structure they get

    @jd.abstract
    def shapes(self, x, p):
        return {"y": jax.ShapeDtypeStruct(x.shape, x.dtype),
                "n": jax.ShapeDtypeStruct((), np.int32)}

    @jd.forward
    def apply(self, x, p):
        type(self).seen.append(("forward", type(p).__name__, sorted(p)))
        return {"n": np.int32(x.size), "y": p["scale"] * x + p["shift"]}

    @jd.jvp
    def push(self, x, p, dx, dp):
        type(self).seen.append(("jvp", sorted(dp), dp["n"] if "n" in dp else "-"))
        return {"y": p["scale"] * dx + dp["scale"] * x + dp["shift"], "n": None}

    @jd.vjp
    def pull(self, x, p, ct):
        assert ct["n"] is None  # an integer output has no cotangent
        return p["scale"] * ct["y"], {"scale": np.sum(ct["y"] * x).astype(x.dtype),
                                      "shift": ct["y"]}


def affine_reference(x, p):
    return {"y": p["scale"] * x + p["shift"], "n": jnp.int32(x.size)}


def _params(dtype, n=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(dtype)
    p = {"shift": rng.standard_normal(n).astype(dtype), "scale": np.asarray(1.5, dtype)}
    if np.issubdtype(dtype, np.complexfloating):
        x = (x + 1j * rng.standard_normal(n)).astype(dtype)
    return jnp.asarray(x), jax.tree_util.tree_map(jnp.asarray, p)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("jit", [False, True])
def test_dict_in_dict_out_eager_and_jit(dtype, jit):
    x, p = _params(dtype)
    op = Affine()
    f = jax.jit(op) if jit else op
    got = f(x, p)
    assert isinstance(got, dict) and sorted(got) == ["n", "y"]
    want = affine_reference(x, p)
    np.testing.assert_allclose(got["y"], want["y"], **_tol(dtype))
    assert int(got["n"]) == 4 and got["n"].dtype == np.int32


def test_rules_get_a_dict_with_their_own_keys():
    x, p = _params(np.float64)
    Affine.seen.clear()
    unsorted = {"shift": p["shift"], "scale": p["scale"]}  # JAX flattens dicts by sorted key
    Affine()(x, unsorted)
    jax.jvp(lambda p: Affine()(x, p)["y"], (unsorted,), (unsorted,))
    assert ("forward", "dict", ["scale", "shift"]) in Affine.seen
    assert ("jvp", ["scale", "shift"], "-") in Affine.seen


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_grad_with_respect_to_a_dict(dtype):
    x, p = _params(dtype)
    op = Affine()

    def loss(f):
        return lambda x, p: jnp.sum(jnp.sin(f(x, p)["y"]))

    got = jax.jit(jax.grad(loss(op), argnums=(0, 1)))(x, p)
    want = jax.grad(loss(affine_reference), argnums=(0, 1))(x, p)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, **_tol(dtype)), got,
                           want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_jvp_vjp_and_check_grads(dtype):
    x, p = _params(dtype)
    op = Affine()
    f = lambda x, p: op(x, p)["y"]
    g = lambda x, p: affine_reference(x, p)["y"]
    tangents = _params(dtype, seed=1)
    y, t = jax.jvp(f, (x, p), tangents)
    y_ref, t_ref = jax.jvp(g, (x, p), tangents)
    np.testing.assert_allclose(t, t_ref, **_tol(dtype))
    _, pull = jax.vjp(f, x, p)
    _, pull_ref = jax.vjp(g, x, p)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, **_tol(dtype)),
                           pull(y), pull_ref(y_ref))
    if dtype == np.float64:
        check_grads(f, (x, p), order=1, modes=("fwd", "rev"))


def test_vmap_with_pytree_in_axes_and_out_axes():
    x, p = _params(np.float64)
    xs = jnp.stack([x, 2 * x, 3 * x])
    shifts = jnp.stack([p["shift"], -p["shift"], 0 * p["shift"]])
    in_axes = (0, {"scale": None, "shift": 0})
    got = jax.vmap(Affine(), in_axes=in_axes, out_axes={"y": 1, "n": 0})(
        xs, {"scale": p["scale"], "shift": shifts})
    want = jax.vmap(affine_reference, in_axes=in_axes, out_axes={"y": 1, "n": 0})(
        xs, {"scale": p["scale"], "shift": shifts})
    np.testing.assert_allclose(got["y"], want["y"], rtol=1e-12)
    np.testing.assert_array_equal(got["n"], want["n"])


def test_jd_check_accepts_pytrees():
    x, p = _params(np.float64)
    jd.check(Affine(), x, p)


def test_jd_check_finds_a_wrong_vjp_of_a_dict_input():
    class Bad(Affine):
        @jd.vjp
        def pull(self, x, p, ct):
            return p["scale"] * ct["y"], {"scale": np.sum(ct["y"] * x), "shift": 2 * ct["y"]}

    x, p = _params(np.float64)
    with pytest.raises(AssertionError, match=r"Bad\.pull \(@vjp\) disagrees with finite "
                                             r"differences for d output\['y'\] / d p\['shift'\]"):
        jd.check(Bad(), x, p)


# ---------------------------------------------------------------------------------------
# Other containers: NamedTuple, dataclass, list, nested; zero-copy out= as a pytree
# ---------------------------------------------------------------------------------------

class Pair(NamedTuple):
    a: jax.Array
    b: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Field:
    values: jax.Array
    weights: jax.Array
    label: str = dataclasses.field(default="field", metadata=dict(static=True))


class Combine(jd.Primitive):
    """Pair(a + b, a * b) of a NamedTuple; zero-copy `out` is a Pair of views."""

    @jd.abstract
    def shapes(self, pair, field):
        s = jax.ShapeDtypeStruct(pair.a.shape, pair.a.dtype)
        return Pair(s, s), [s]

    @jd.forward
    def apply(self, pair, field, *, out):
        assert type(pair) is Pair and type(field) is Field and field.label == "w"
        sums, [weighted] = out
        np.add(pair.a, pair.b, out=sums.a)
        np.multiply(pair.a, pair.b, out=sums.b)
        np.multiply(field.values, field.weights, out=weighted)

    @jd.jvp
    def push(self, pair, field, dpair, dfield):
        return (Pair(dpair.a + dpair.b, dpair.a * pair.b + pair.a * dpair.b),
                [dfield.values * field.weights + field.values * dfield.weights])

    @jd.vjp
    def pull(self, pair, field, ct_pair, ct_list):
        (c,) = ct_list
        return (Pair(ct_pair.a + ct_pair.b * pair.b, ct_pair.a + ct_pair.b * pair.a),
                Field(c * field.weights, c * field.values, field.label))


def combine_reference(pair, field):
    return Pair(pair.a + pair.b, pair.a * pair.b), [field.values * field.weights]


@pytest.mark.parametrize("dtype", DTYPES)
def test_namedtuple_dataclass_and_list_with_zero_copy_out(dtype):
    rng = np.random.default_rng(3)
    arr = lambda: jnp.asarray(rng.standard_normal(5).astype(dtype))
    pair, field = Pair(arr(), arr()), Field(arr(), arr(), "w")
    op = Combine()
    for f in (op, jax.jit(op)):
        got = f(pair, field)
        want = combine_reference(pair, field)
        assert type(got[0]) is Pair and type(got[1]) is list
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, **_tol(dtype)),
                               got, want)
    loss = lambda f: lambda pair, field: sum(jnp.sum(jnp.real(v) ** 2)
                                             for v in jax.tree_util.tree_leaves(f(pair, field)))
    if dtype != np.complex128:
        got = jax.grad(loss(op), argnums=(0, 1))(pair, field)
        want = jax.grad(loss(combine_reference), argnums=(0, 1))(pair, field)
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, **_tol(dtype)),
                               got, want)
    if dtype == np.float64:
        jd.check(op, pair, field)


def test_equinox_module_as_an_argument():
    eqx = pytest.importorskip("equinox")

    class Params(eqx.Module):
        scale: jax.Array
        shift: jax.Array
        name: str = eqx.field(static=True, default="p")

    class Apply(jd.Primitive):
        @jd.abstract
        def shapes(self, x, m):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)

        @jd.forward
        def apply(self, x, m):
            assert isinstance(m, Params) and m.name == "p"
            return m.scale * x + m.shift

        @jd.vjp
        def pull(self, x, m, ct):
            return m.scale * ct, Params(np.sum(ct * x), ct)

    x = jnp.arange(3.0)
    m = Params(jnp.asarray(2.0), jnp.ones(3))
    np.testing.assert_allclose(jax.jit(Apply())(x, m), 2 * x + 1)
    grads = jax.grad(lambda m: jnp.sum(Apply()(x, m) ** 2))(m)
    want = jax.grad(lambda m: jnp.sum((m.scale * x + m.shift) ** 2))(m)
    np.testing.assert_allclose(grads.scale, want.scale)
    np.testing.assert_allclose(grads.shift, want.shift)


# ---------------------------------------------------------------------------------------
# None as a zero cotangent subtree; nondiff= names whole pytree arguments
# ---------------------------------------------------------------------------------------

class ShiftOnly(jd.Primitive):
    """x + p["shift"] (p["unused"] does not enter); vjp returns None for the unused leaf."""

    @jd.abstract
    def shapes(self, x, p):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, p):
        return x + p["shift"]

    @jd.vjp
    def pull(self, x, p, ct):
        return None, {"shift": ct, "unused": None}


def test_none_is_a_zero_cotangent_subtree():
    x = jnp.arange(3.0)
    p = {"shift": jnp.ones(3), "unused": jnp.ones(2)}
    gx, gp = jax.jit(jax.grad(lambda x, p: jnp.sum(ShiftOnly()(x, p) ** 2), argnums=(0, 1)))(x, p)
    np.testing.assert_array_equal(gx, np.zeros(3))  # None: the rule says "zero"
    np.testing.assert_allclose(gp["shift"], 2 * (x + 1))
    np.testing.assert_array_equal(gp["unused"], np.zeros(2))


def test_nondiff_names_a_whole_pytree_argument():
    class Scaled(jd.Primitive, nondiff=("geometry",)):
        @jd.abstract
        def shapes(self, x, geometry):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)

        @jd.forward
        def apply(self, x, geometry):
            return x * geometry["w"] + geometry["b"]

        @jd.vjp
        def pull(self, x, geometry, ct):
            return ct * geometry["w"]  # one differentiable input: a bare cotangent

    x = jnp.arange(3.0)
    geometry = {"w": jnp.full(3, 2.0), "b": jnp.ones(3)}
    np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(Scaled()(x, geometry)))(x),
                               np.full(3, 2.0))
    with pytest.raises(ValueError, match=r"Scaled: input 'geometry' is declared nondiff="):
        jax.grad(lambda g: jnp.sum(Scaled()(x, g)))(geometry)


# ---------------------------------------------------------------------------------------
# Linear ops with pytrees, and traceable rules for higher order
# ---------------------------------------------------------------------------------------

class Mix(jd.Primitive, linear=True):
    """{"sum": u + v, "diff": u - v} of a pair (u, v): linear in the pair jointly."""

    @jd.abstract
    def shapes(self, uv):
        s = jax.ShapeDtypeStruct(uv[0].shape, uv[0].dtype)
        return {"sum": s, "diff": s}

    @jd.forward
    def apply(self, uv):
        u, v = uv
        return {"sum": u + v, "diff": u - v}

    @jd.transpose
    def apply_t(self, ct):
        return (ct["sum"] + ct["diff"], ct["sum"] - ct["diff"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_op_with_pytrees_transposes(dtype):
    rng = np.random.default_rng(5)
    uv = tuple(jnp.asarray(rng.standard_normal(4).astype(dtype)) for _ in range(2))
    op = Mix()
    ref = lambda uv: {"sum": uv[0] + uv[1], "diff": uv[0] - uv[1]}
    ct = {"sum": jnp.ones(4, dtype), "diff": jnp.arange(4.0).astype(dtype)}
    got = jax.linear_transpose(op, uv)(ct)
    want = jax.linear_transpose(ref, uv)(ct)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, **_tol(dtype)), got,
                           want)
    # Second order from @forward and @transpose alone.
    loss = lambda f: lambda uv: jnp.sum(jnp.abs(f(uv)["sum"] * f(uv)["diff"]) ** 2)
    if dtype == np.float64:
        got = jax.hessian(loss(op))(uv)
        want = jax.hessian(loss(ref))(uv)
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10), got,
                               want)
        jd.check(op, uv)


class Poly(jd.Primitive):
    """{"p": a * x**2, "q": b * x} with traceable rules: every order."""

    @jd.abstract
    def shapes(self, x, coef):
        s = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return {"p": s, "q": s}

    @jd.forward
    def apply(self, x, coef):
        return {"p": coef["a"] * x**2, "q": coef["b"] * x}

    @jd.jvp(traceable=True)
    def push(self, x, coef, dx, dcoef):
        return {"p": 2 * coef["a"] * x * dx + dcoef["a"] * x**2,
                "q": coef["b"] * dx + dcoef["b"] * x}


def test_traceable_pytree_rules_give_hessians():
    x = jnp.arange(1.0, 4.0)
    coef = {"a": jnp.asarray(2.0), "b": jnp.asarray(-1.0)}
    ref = lambda x, c: {"p": c["a"] * x**2, "q": c["b"] * x}
    loss = lambda f: lambda x, c: jnp.sum(jnp.sin(f(x, c)["p"]) * f(x, c)["q"])
    for argnums in (0, 1):
        got = jax.hessian(loss(Poly()), argnums=argnums)(x, coef)
        want = jax.hessian(loss(ref), argnums=argnums)(x, coef)
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-12), got,
                               want)


# ---------------------------------------------------------------------------------------
# Arity follows the differentiable values: one float and one integer output
# ---------------------------------------------------------------------------------------

POINTS = np.array([[0.0, 0.0], [3.0, 0.5], [0.5, 4.0], [5.0, 5.0]])


def _nearest(q):
    d = np.linalg.norm(q[:, None, :] - POINTS[None], axis=-1)
    index = np.argmin(d, axis=1)
    return d[np.arange(len(q)), index], index


class Nearest(jd.Primitive):
    """(distance, index) of each query's nearest point: one float and one integer output."""

    @jd.abstract
    def shapes(self, q):
        return (jax.ShapeDtypeStruct(q.shape[:1], q.dtype),
                jax.ShapeDtypeStruct(q.shape[:1], np.int64))

    @jd.forward
    def apply(self, q):
        distance, index = _nearest(q)
        return distance.astype(q.dtype), index

    @jd.jvp
    def push(self, q, dq):
        distance, index = _nearest(q)
        unit = (q - POINTS[index]) / distance[:, None]
        return np.sum(unit * dq, axis=1).astype(q.dtype)  # one float output: a bare tangent

    @jd.vjp
    def pull(self, q, ct):
        distance, index = _nearest(q)
        return ((q - POINTS[index]) / distance[:, None] * ct[:, None]).astype(q.dtype)


class NearestZeroCopy(Nearest):
    @jd.jvp
    def push(self, q, dq, *, out):
        assert isinstance(out, np.ndarray)  # one tangent: `out` is that array, not a 1-tuple
        distance, index = _nearest(q)
        out[...] = np.sum((q - POINTS[index]) / distance[:, None] * dq, axis=1)

    @jd.vjp
    def pull(self, q, ct, *, out):
        assert isinstance(out, np.ndarray)
        distance, index = _nearest(q)
        out[...] = (q - POINTS[index]) / distance[:, None] * ct[:, None]


def nearest_reference(q):
    d = jnp.linalg.norm(q[:, None, :] - POINTS[None], axis=-1)
    index = jnp.argmin(d, axis=1)
    return d[jnp.arange(q.shape[0]), index], index


QUERIES = jnp.array([[0.3, 0.2], [2.5, 1.0], [1.0, 3.0], [4.0, 4.5], [6.0, 5.5]])


@pytest.mark.parametrize("cls", [Nearest, NearestZeroCopy])
def test_one_float_and_one_integer_output(cls):
    op = cls()
    distance, index = jax.jit(op)(QUERIES)
    want_d, want_i = nearest_reference(QUERIES)
    np.testing.assert_allclose(distance, want_d, rtol=1e-6)
    np.testing.assert_array_equal(index, want_i)
    t = jnp.ones_like(QUERIES)
    (_, _), (dd, di) = jax.jvp(op, (QUERIES,), (t,))
    (_, _), (dd_ref, _) = jax.jvp(nearest_reference, (QUERIES,), (t,))
    np.testing.assert_allclose(dd, dd_ref, rtol=1e-6)
    assert di.dtype == jax.dtypes.float0
    loss = lambda f: lambda q: jnp.sum(f(q)[0] ** 2)
    np.testing.assert_allclose(jax.grad(loss(op))(QUERIES), jax.grad(loss(nearest_reference))(
        QUERIES), rtol=1e-6)
    check_grads(lambda q: op(q)[0], (QUERIES,), order=1, modes=("fwd", "rev"))
    jd.check(op, QUERIES)


# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------

def _affine_variant(**overrides):
    return type("Broken", (Affine,), overrides)


@pytest.mark.parametrize("jit", [False, True])
def test_forward_returning_another_structure_names_the_key_path(jit):
    def apply(self, x, p):
        return {"y": x, "count": np.int32(1)}

    op = _affine_variant(apply=jd.forward(apply))()
    x, p = _params(np.float64)
    f = jax.jit(op) if jit else op
    with pytest.raises(Exception, match=r"Broken\.apply \(@forward\) returned output with a "
                                        r"structure that differs from @abstract's at "
                                        r"\['n'\] \(missing\)"):
        jax.block_until_ready(f(x, p))


def test_jvp_and_vjp_structure_errors_name_class_method_and_path():
    def push(self, x, p, dx, dp):
        return {"y": dx, "n": None, "extra": dx}

    def pull(self, x, p, ct):
        return ct["y"], {"scale": np.sum(ct["y"]), "shfit": ct["y"]}

    x, p = _params(np.float64)
    op = _affine_variant(push=jd.jvp(push), pull=jd.vjp(pull))()
    with pytest.raises(jd.RuleError, match=r"Broken\.push \(@jvp\) returned tangent of output "
                                           r"with a structure .*at \['extra'\] \(not expected\)"):
        jax.jvp(lambda x: op(x, p)["y"], (x,), (x,))
    with pytest.raises(jd.RuleError, match=r"Broken\.pull \(@vjp\) returned cotangent of p with "
                                           r"a structure that differs from its input's at "
                                           r"\['shift'\] \(missing\)"):
        jax.grad(lambda p: jnp.sum(op(x, p)["y"]))(p)


def test_a_tuple_where_a_dict_is_expected_is_a_top_level_difference():
    def push(self, x, p, dx, dp):
        return ({"y": dx, "n": None},)

    x, p = _params(np.float64)
    op = _affine_variant(push=jd.jvp(push))()
    with pytest.raises(jd.RuleError, match=r"at the top level \(tuple where a dict is expected"):
        jax.jvp(lambda x: op(x, p)["y"], (x,), (x,))


def test_wrong_number_of_cotangents_is_a_clear_error():
    def pull(self, x, p, ct):
        return ct["y"]

    x, p = _params(np.float64)
    op = _affine_variant(pull=jd.vjp(pull))()
    with pytest.raises(jd.RuleError, match=r"Broken\.pull \(@vjp\) returned 1 result\(s\), but 2 "
                                           r"were expected \(cotangent of x, cotangent of p\)"):
        jax.grad(lambda x: jnp.sum(op(x, p)["y"]))(x)


def test_abstract_returning_a_non_struct_leaf_names_the_path():
    class BadShapes(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            return {"y": jax.ShapeDtypeStruct(x.shape, x.dtype), "z": "oops"}

        @jd.forward
        def apply(self, x):
            return {"y": x, "z": x}

    with pytest.raises(jd.RuleError, match=r"BadShapes\.shapes \(@abstract\).*output\['z'\] is "
                                           r"str"):
        BadShapes()(jnp.ones(2))


@pytest.mark.parametrize("leaf", ["fast", print])
def test_non_array_leaf_names_the_argument(leaf):
    x, p = _params(np.float64)
    with pytest.raises(TypeError, match=r"Affine: input \"p\['mode'\]\" is a .*not an array.*"
                                        r"belongs on the instance"):
        Affine()(x, {**p, "mode": leaf})


def test_plain_arrays_still_take_the_flat_path():
    """Ops over arrays only never build pytree wrappers (the fast path stays as it was)."""
    from jaxdecl._op.identity import handle_of

    op = Nearest()
    op(QUERIES)
    interface = next(iter(handle_of(op)._interfaces.values()))
    assert not interface.structured


# ---------------------------------------------------------------------------------------
# Objects that stand for an array (__jax_array__), as flax's nnx.Variable does: an op takes
# them as arrays, as jax.numpy does, even when they are also registered pytrees
# ---------------------------------------------------------------------------------------

@jax.tree_util.register_pytree_node_class
class Box:
    """An array with a label: a pytree of one leaf that also has ``__jax_array__``."""

    def __init__(self, value, label="w"):
        self.value, self.label = value, label

    def __jax_array__(self):
        return jnp.asarray(self.value)

    @property
    def shape(self):  # as nnx.Variable: the shape and dtype of the array it holds
        return np.shape(self.value)

    @property
    def dtype(self):
        return self.value.dtype

    def tree_flatten(self):
        return (self.value,), self.label

    @classmethod
    def tree_unflatten(cls, label, children):
        return cls(children[0], label)


class Sin(jd.Primitive):
    seen = []  # the types the rules received

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        type(self).seen.append(type(x))
        return np.sin(x)

    @jd.jvp
    def push(self, x, dx):
        type(self).seen.append(type(dx))
        return np.cos(x) * dx

    @jd.vjp
    def pull(self, x, ct):
        type(self).seen.append(type(x))
        return np.cos(x) * ct


class Bilinear(jd.Primitive, multilinear=True):
    """a @ x, linear in each of a and x."""

    @jd.abstract
    def shapes(self, a, x):
        return jax.ShapeDtypeStruct(a.shape[:1], x.dtype)

    @jd.forward
    def apply(self, a, x):
        return a @ x

    @jd.transpose(wrt="a")
    def transpose_a(self, x, ct):
        return np.outer(ct, x)

    @jd.transpose(wrt="x")
    def transpose_x(self, a, ct):
        return a.T @ ct


def _boxed_pair(dtype=np.float64):
    rng = np.random.default_rng(3)
    return (Box(jnp.asarray(rng.standard_normal((2, 3)).astype(dtype)), "a"),
            Box(jnp.asarray(rng.standard_normal(3).astype(dtype)), "x"))


def _assert_trees_close(got, want, dtype=np.float64):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, w, **_tol(dtype))


@pytest.mark.parametrize("transform", ["eager", "jit", "grad", "jit-grad", "jvp", "vmap",
                                       "pytree-argument"])
def test_an_object_with_jax_array_is_an_array_input(transform):
    Sin.seen.clear()
    _, box = _boxed_pair()
    op = Sin()
    cases = {
        "eager": lambda f: f(box),
        "jit": lambda f: jax.jit(f)(box),
        "grad": lambda f: jax.grad(lambda b: jnp.sum(f(b) ** 2))(box),
        "jit-grad": lambda f: jax.jit(jax.grad(lambda b: jnp.sum(f(b) ** 2)))(box),
        "jvp": lambda f: jax.jvp(f, (box,), (Box(jnp.ones(3), "x"),)),
        "vmap": lambda f: jax.vmap(f)(Box(jnp.ones((4, 3)), "x")),
        # inside another pytree: the object is one leaf, an array to the rules
        "pytree-argument": lambda f: jax.grad(lambda t: jnp.sum(f(t["b"]) * f(t["b"])))(
            {"b": box}),
    }
    got = cases[transform](op)
    want = cases[transform](jnp.sin)  # jax.numpy takes the object as an array
    _assert_trees_close(got, want)
    assert Sin.seen and all(t is np.ndarray for t in Sin.seen), Sin.seen


def test_an_object_with_jax_array_inside_a_pytree_argument_is_an_array_leaf():
    _, box = _boxed_pair()
    got_types = []

    class Scale(jd.Primitive):
        @jd.abstract
        def shapes(self, x, p):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)

        @jd.forward
        def apply(self, x, p):
            got_types.append(type(p["w"]))
            return p["s"] * p["w"] * x

        @jd.vjp
        def pull(self, x, p, ct):
            return p["s"] * p["w"] * ct, {"s": np.sum(p["w"] * x * ct), "w": p["s"] * x * ct}

    x = jnp.arange(3.0)
    p = {"s": jnp.asarray(2.0), "w": box}
    got = jax.grad(lambda p: jnp.sum(Scale()(x, p)), allow_int=True)(p)
    want = jax.grad(lambda p: jnp.sum(p["s"] * jnp.asarray(p["w"]) * x))(p)
    _assert_trees_close(got, want)
    assert got_types == [np.ndarray]


class Plain:
    """Stands for an array, but is no pytree."""

    def __init__(self, value):
        self.value = value

    def __jax_array__(self):
        return self.value

    shape = property(lambda self: self.value.shape)
    dtype = property(lambda self: self.value.dtype)


@jax.tree_util.register_pytree_node_class
class Sum:
    """A pytree of two leaves that stands for their sum."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    def __jax_array__(self):
        return self.a + self.b

    shape = property(lambda self: self.a.shape)
    dtype = property(lambda self: self.a.dtype)

    def tree_flatten(self):
        return (self.a, self.b), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


@pytest.mark.parametrize("make", [lambda v: Box(v), Plain, lambda v: Sum(v / 4, 3 * v / 4)],
                         ids=["pytree", "no-pytree", "pytree-of-two"])
def test_repeated_eager_calls_convert_objects_with_jax_array(make):
    """The eager path's cache, keyed by shape and dtype, does not pass the object through."""
    Sin.seen.clear()
    value = jnp.linspace(0.0, 1.0, 5)
    op = Sin()
    op(value)  # the signature is known: a later call could take the cached call directly
    for _ in range(2):
        np.testing.assert_allclose(op(make(value)), np.sin(value), **_tol(np.float64))
    assert Sin.seen == [np.ndarray] * 3


@pytest.mark.parametrize("transform", ["eager", "jit", "grad", "jvp", "vmap"])
def test_multilinear_op_takes_objects_with_jax_array(transform):
    a, x = _boxed_pair()
    op = Bilinear()
    cases = {
        "eager": lambda f: f(a, x),
        "jit": lambda f: jax.jit(f)(a, x),
        "grad": lambda f: jax.grad(lambda a, x: jnp.sum(f(a, x) ** 2), argnums=(0, 1))(a, x),
        "jvp": lambda f: jax.jvp(f, (a, x), (a, x)),
        "vmap": lambda f: jax.vmap(f, in_axes=(None, 0))(a, Box(jnp.ones((4, 3)), "x")),
    }
    _assert_trees_close(cases[transform](op), cases[transform](jnp.matmul))


@pytest.mark.parametrize("zero_copy", [False, True])
def test_nested_builtin_containers_reach_the_rule_as_given(zero_copy):
    # Dicts, tuples, lists, None and empty containers are rebuilt for the rule as the
    # caller built them (the kernel writes them out as literals: see _structure).
    seen = []

    class Weigh(jd.Primitive, nondiff=("spec",)):
        @jd.abstract
        def shapes(self, spec, c):
            return jax.ShapeDtypeStruct(c.shape, c.dtype)

        if zero_copy:
            @jd.forward
            def apply(self, spec, c, *, out):
                seen.append(jax.tree_util.tree_structure(spec))
                out[...] = c * spec["w"][0] + spec["shift"][1][0]
        else:
            @jd.forward
            def apply(self, spec, c):
                seen.append(jax.tree_util.tree_structure(spec))
                return c * spec["w"][0] + spec["shift"][1][0]

    spec = {"w": (jnp.float64(2.0),), "shift": [None, [jnp.float64(0.5)]], "empty": {},
            "nothing": ()}
    c = jnp.arange(3.0)
    for f in (Weigh(), jax.jit(Weigh())):
        np.testing.assert_array_equal(f(spec, c), 2.0 * np.arange(3.0) + 0.5)
    assert seen and all(s == jax.tree_util.tree_structure(spec) for s in seen)
