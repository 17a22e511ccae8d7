"""Declaring primitives: both spellings, options, validation, call conventions, sharing."""

import functools
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tol

import jaxdecl as jd
from jaxdecl._op.identity import handle_of, spec_of


def _same(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


# ---------------------------------------------------------------------------
# Spellings
# ---------------------------------------------------------------------------


class ScaleBase(jd.Primitive):
    """y = factor * x, through the base class."""

    def __init__(self, factor=2.0):
        self.factor = factor

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x):
        return self.factor * x


@jd.primitive
class ScalePlain:
    """y = factor * x, a plain class with the decorator."""

    def __init__(self, factor=2.0):
        self.factor = factor

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x, *, out):
        np.multiply(x, self.factor, out=out)


@jd.primitive
class ScaleModule(eqx.Module):
    """y = factor * x, an equinox.Module with the decorator."""

    factor: float = 2.0

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x):
        return (self.factor * x).astype(x.dtype)



SPELLINGS = [ScaleBase, ScalePlain, ScaleModule]


@pytest.mark.parametrize("cls", SPELLINGS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", ["float32", "float64", "complex64", "complex128"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_spellings_agree(cls, dtype, jit):
    x = (np.arange(6.0) - 2.5).astype(dtype).reshape(2, 3)
    op = cls(3.0) if cls is not ScaleModule else cls(factor=3.0)
    f = jax.jit(op) if jit else op
    y = f(jnp.asarray(x))
    assert isinstance(y, jax.Array)
    assert y.dtype == np.dtype(dtype) and y.shape == (2, 3)
    np.testing.assert_allclose(np.asarray(y), 3.0 * x, rtol=tol(dtype))


def test_decorator_keeps_metaclass():
    assert type(ScaleModule) is type(eqx.Module)
    assert type(ScalePlain) is type
    assert isinstance(ScaleModule(), eqx.Module)
    assert type(ScaleBase) is jd.PrimitiveMeta


def test_calling_a_module_op_keeps_its_pytree_structure():
    op = ScaleModule(factor=1.25)
    before = jax.tree_util.tree_structure(op)
    op(jnp.ones(2))
    assert jax.tree_util.tree_structure(op) == before


def test_module_op_is_a_pytree_and_works_inside_jit():
    op = ScaleModule(factor=1.5)
    leaves = jax.tree_util.tree_leaves(op)
    assert leaves == [1.5]
    x = jnp.linspace(-1.0, 1.0, 5)
    np.testing.assert_allclose(jax.jit(lambda v: op(v))(x), 1.5 * np.asarray(x), rtol=1e-12)


# ---------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------


class LinearByKeyword(jd.Primitive, linear=True, nondiff=("w",)):
    @jd.abstract
    def shapes(self, w, x):
        return _same(x)

    @jd.forward
    def apply(self, w, x):
        return w * x

    @jd.transpose
    def apply_t(self, w, ct):
        return w * ct


@jd.primitive(linear=True, nondiff=("w",))
class LinearByDecorator:
    @jd.abstract
    def shapes(self, w, x):
        return _same(x)

    @jd.forward
    def apply(self, w, x):
        return w * x

    @jd.transpose
    def apply_t(self, w, ct):
        return w * ct


@pytest.mark.parametrize("cls", [LinearByKeyword, LinearByDecorator], ids=lambda c: c.__name__)
def test_options_reach_the_spec(cls):
    spec = spec_of(cls)
    assert spec.linear and not spec.multilinear
    assert spec.nondiff == frozenset({"w"})
    assert spec.batch_mode == "loop"
    assert spec.params == ("w", "x")


@pytest.mark.parametrize("cls", [LinearByKeyword, LinearByDecorator], ids=lambda c: c.__name__)
def test_options_take_effect(cls):
    w = jnp.array([1.0, -2.0, 3.0])
    x = jnp.array([0.5, 0.25, 2.0])
    grad = jax.grad(lambda v: jnp.sum(cls()(w, v) ** 2))(x)
    np.testing.assert_allclose(grad, 2 * np.asarray(w) ** 2 * np.asarray(x), rtol=1e-12)
    with pytest.raises(Exception, match="w"):
        jax.grad(lambda v: jnp.sum(cls()(v, x)))(w)


def test_batch_option_by_keyword_and_decorator():
    class Vec(jd.Primitive, batch="vectorized"):
        @jd.abstract
        def shapes(self, x):
            return _same(x)

        @jd.forward
        def apply(self, x):
            return -x

    @jd.primitive(batch="vectorized")
    class Vec2:
        @jd.abstract
        def shapes(self, x):
            return _same(x)

        @jd.forward
        def apply(self, x):
            return -x

    assert spec_of(Vec).batch_mode == spec_of(Vec2).batch_mode == "vectorized"


# ---------------------------------------------------------------------------
# Misdeclared classes
# ---------------------------------------------------------------------------


def _declare(body, *, decorated=False, **options):
    """Creates a class from `body` (a dict of methods) in either spelling."""
    if decorated:
        return jd.primitive(**options)(type("Bad", (), dict(body)))
    return jd.PrimitiveMeta("Bad", (jd.Primitive,), dict(body), **options)


def shapes(self, x):
    return _same(x)


def apply(self, x):
    return x


def apply2(self, x):
    return x


def apply_t(self, ct):
    return ct


def shapes_of_a(self, a):
    return _same(a)


def shapes2(self, x1, x2):
    return _same(x1)


def apply2_inputs(self, x1, x2):
    return x1 * x2


def shapes_wx(self, w, x):
    return _same(x)


def apply_wx(self, w, x):
    return w * x


def _fn(source):
    """A function from its source: signatures that Python would flag in a class body."""
    namespace = {}
    exec(source, namespace)
    return next(v for k, v in namespace.items() if k != "__builtins__")


BAD_DECLARATIONS = {
    "two_forward": (
        {"shapes": jd.abstract(shapes), "apply": jd.forward(apply),
         "apply2": jd.forward(apply2)},
        {}, ["two @forward", "apply", "apply2"]),
    "missing_forward": (
        {"shapes": jd.abstract(shapes)}, {}, ["no @jd.forward"]),
    "missing_abstract": (
        {"apply": jd.forward(apply)}, {}, ["no @jd.abstract"]),
    "transpose_without_linear": (
        {"shapes": jd.abstract(shapes), "apply": jd.forward(apply),
         "apply_t": jd.transpose(apply_t)},
        {}, ["Bad.apply_t", "linear=True"]),
    "linear_without_transpose": (
        {"shapes": jd.abstract(shapes), "apply": jd.forward(apply)},
        {"linear": True}, ["linear=True", "@jd.transpose"]),
    "parameter_mismatch": (
        {"shapes": jd.abstract(shapes_of_a), "apply": jd.forward(apply)},
        {}, ["Bad.shapes_of_a (@abstract)", "('a',)", "Bad.apply (@forward)", "('x',)"]),
    "nondiff_unknown": (
        {"shapes": jd.abstract(shapes), "apply": jd.forward(apply)},
        {"nondiff": ("theta",)}, ["'theta'", "Bad.apply"]),
    # Rules' signatures, checked against @abstract's inputs when the class is created.
    "vjp_missing_input": (
        {"shapes": jd.abstract(shapes2), "apply": jd.forward(apply2_inputs),
         "pull": jd.vjp(_fn("def pull(self, x1, ct): return ct"))},
        {}, ["Bad.pull (@vjp) takes (self, x1, ct)", "`def pull(self, x1, x2, ct)`",
             "x2 is missing"]),
    "vjp_missing_cotangent": (
        {"shapes": jd.abstract(shapes2), "apply": jd.forward(apply2_inputs),
         "pull": jd.vjp(_fn("def pull(self, x1, x2): return x1"))},
        {}, ["Bad.pull (@vjp)", "`def pull(self, x1, x2, ct)`", "a cotangent is missing"]),
    "jvp_without_tangents": (
        {"shapes": jd.abstract(shapes2), "apply": jd.forward(apply2_inputs),
         "push": jd.jvp(_fn("def push(self, x1, x2): return x1"))},
        {}, ["Bad.push (@jvp)", "`def push(self, x1, x2, dx1, dx2)`", "a tangent is missing"]),
    "jvp_too_many_tangents": (
        {"shapes": jd.abstract(shapes), "apply": jd.forward(apply),
         "push": jd.jvp(_fn("def push(self, x, dx, dy): return dx"))},
        {}, ["Bad.push (@jvp)", "`def push(self, x, dx)`", "at most 2"]),
    "jvp_of_nondiff_inputs_only": (
        {"shapes": jd.abstract(shapes), "apply": jd.forward(apply),
         "push": jd.jvp(_fn("def push(self, x, dx): return dx"))},
        {"nondiff": ("x",)}, ["Bad.push (@jvp)", "nondiff=", "never run"]),
    "out_positional": (
        {"shapes": jd.abstract(shapes),
         "apply": jd.forward(_fn("def apply(self, x, out): out[...] = x"))},
        {}, ["Bad.apply (@forward)", "`out` is a positional parameter",
             "`def apply(self, x, *, out)`"]),
    "out_positional_in_vjp": (
        {"shapes": jd.abstract(shapes), "apply": jd.forward(apply),
         "pull": jd.vjp(_fn("def pull(self, x, ct, out): out[...] = ct"))},
        {}, ["Bad.pull (@vjp)", "`def pull(self, x, ct, *, out)`"]),
    "forward_without_self": (
        {"shapes": jd.abstract(shapes),
         "apply": jd.forward(_fn("def apply(x, *, out): out[...] = x"))},
        {}, ["Bad.apply (@forward) has no `self`", "`def apply(self, x, *, out)`"]),
    "abstract_without_self": (
        {"shapes": jd.abstract(_fn("def shapes(x): return x")), "apply": jd.forward(apply)},
        {}, ["Bad.shapes (@abstract) has no `self`", "`def shapes(self, x)`"]),
    "vjp_without_self": (
        {"shapes": jd.abstract(shapes), "apply": jd.forward(apply),
         "pull": jd.vjp(_fn("def pull(x, ct): return ct"))},
        {}, ["Bad.pull (@vjp) has no `self`", "`def pull(self, x, ct)`"]),
    "transpose_without_self": (
        {"shapes": jd.abstract(shapes), "apply": jd.forward(apply),
         "apply_t": jd.transpose(_fn("def apply_t(ct): return ct"))},
        {"linear": True}, ["Bad.apply_t (@transpose)", "`def apply_t(self, ct)`", "no `self`?"]),
    "rule_without_parameters": (
        {"shapes": jd.abstract(shapes), "apply": jd.forward(_fn("def apply(): pass"))},
        {}, ["Bad.apply (@forward) takes no parameters", "add `self`"]),
    "transpose_missing_nondiff_input": (
        {"shapes": jd.abstract(shapes_wx), "apply": jd.forward(apply_wx),
         "apply_t": jd.transpose(_fn("def apply_t(self, ct): return ct"))},
        {"linear": True, "nondiff": ("w",)},
        ["Bad.apply_t (@transpose)", "`def apply_t(self, w, ct)`"]),
    "multilinear_transpose_missing_input": (
        {"shapes": jd.abstract(shapes2), "apply": jd.forward(apply2_inputs),
         "t1": jd.transpose(wrt="x1")(_fn("def t1(self, ct): return ct")),
         "t2": jd.transpose(wrt="x2")(_fn("def t2(self, x1, ct): return ct"))},
        {"multilinear": True}, ["Bad.t1 (@transpose(wrt='x1'))", "`def t1(self, x2, ct)`"]),
    "batch_missing_axes": (
        {"shapes": jd.abstract(shapes), "apply": jd.forward(apply),
         "batched": jd.batch(_fn("def batched(self, args): return args"))},
        {}, ["Bad.batched (@batch)", "`def batched(self, args, axes)`"]),
    "unknown_required_keyword": (
        {"shapes": jd.abstract(shapes),
         "apply": jd.forward(_fn("def apply(self, x, *, scale): return x"))},
        {}, ["Bad.apply (@forward)", "['scale']", "give a default"]),
}


@pytest.mark.parametrize("decorated", [False, True], ids=["base", "decorator"])
@pytest.mark.parametrize("case", sorted(BAD_DECLARATIONS))
def test_misdeclared_class_rejected(case, decorated):
    body, options, fragments = BAD_DECLARATIONS[case]
    with pytest.raises(jd.DeclarationError) as info:
        _declare(body, decorated=decorated, **options)
    message = str(info.value)
    assert "Bad" in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_misdeclaration_is_raised_by_class_statement():
    with pytest.raises(jd.DeclarationError, match=r"Missing.*@jd.forward"):

        class Missing(jd.Primitive):
            @jd.abstract
            def shapes(self, x):
                return _same(x)

    with pytest.raises(jd.DeclarationError, match=r"Twice: two @forward methods, f1 and f2"):

        @jd.primitive
        class Twice:
            @jd.abstract
            def shapes(self, x):
                return _same(x)

            @jd.forward
            def f1(self, x):
                return x

            @jd.forward
            def f2(self, x):
                return x


def test_declaration_error_is_a_type_error():
    assert issubclass(jd.DeclarationError, TypeError)


# ---------------------------------------------------------------------------
# Call conventions
# ---------------------------------------------------------------------------


class AddMul(jd.Primitive):
    """Two inputs, two outputs: (x1 + x2, x1 * x2)."""

    @jd.abstract
    def shapes(self, x1, x2):
        out = jax.ShapeDtypeStruct(np.broadcast_shapes(x1.shape, x2.shape),
                                   jnp.result_type(x1.dtype, x2.dtype))
        return out, out

    @jd.forward
    def apply(self, x1, x2):
        return x1 + x2, x1 * x2


class Sub(jd.Primitive):
    """One output: x1 - x2."""

    @jd.abstract
    def shapes(self, x1, x2):
        return jax.ShapeDtypeStruct(x1.shape, x1.dtype)

    @jd.forward
    def apply(self, x1, x2):
        return (x1 - x2).astype(x1.dtype)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_keyword_arguments(jit):
    a = jnp.array([5.0, 7.0])
    b = jnp.array([1.0, 2.0])
    op = Sub()
    call = (lambda **kw: jax.jit(lambda p, q: op(x1=p, x2=q))(kw["x1"], kw["x2"])) if jit \
        else op
    expected = np.array([4.0, 5.0])
    np.testing.assert_array_equal(call(x1=a, x2=b), expected)
    np.testing.assert_array_equal(call(x2=b, x1=a), expected)
    if not jit:
        np.testing.assert_array_equal(op(a, x2=b), expected)


def test_bad_keyword_arguments():
    a = jnp.ones(2)
    with pytest.raises(TypeError, match="no input named 'y'"):
        Sub()(x1=a, y=a)
    with pytest.raises(TypeError, match="twice"):
        Sub()(a, x1=a)
    with pytest.raises(TypeError, match="missing"):
        Sub()(x1=a)
    with pytest.raises(TypeError, match="takes 2 input"):
        Sub()(a)


def test_numpy_and_scalar_inputs():
    x = np.array([1.0, 2.0, 3.0])
    np.testing.assert_array_equal(Sub()(x, x[::-1].copy()), x - x[::-1])
    y = Sub()(4.5, 1.0)
    assert isinstance(y, jax.Array) and y.shape == ()
    assert float(y) == 3.5
    z = Sub()(np.int32(7), 2)
    assert z.dtype == np.int32 and int(z) == 5


def test_single_output_is_an_array_multiple_a_tuple():
    x = jnp.array([1.0, 2.0])
    y = Sub()(x, x)
    assert isinstance(y, jax.Array)
    s, p = result = AddMul()(x, jnp.array([3.0, 4.0]))
    assert isinstance(result, tuple) and len(result) == 2
    np.testing.assert_array_equal(s, [4.0, 6.0])
    np.testing.assert_array_equal(p, [3.0, 8.0])
    s2, p2 = jax.jit(AddMul())(x, jnp.array([3.0, 4.0]))
    np.testing.assert_array_equal(s2, s)
    np.testing.assert_array_equal(p2, p)


def test_single_output_in_a_tuple_is_a_tuple():
    class OneTuple(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            return (_same(x),)

        @jd.forward
        def apply(self, x):
            return (x + 1,)

    result = OneTuple()(jnp.zeros(2))
    assert isinstance(result, tuple) and len(result) == 1
    np.testing.assert_array_equal(result[0], [1.0, 1.0])


# ---------------------------------------------------------------------------
# Sharing compiled code between equal instances
# ---------------------------------------------------------------------------


def _counting_class(**extra):
    calls = []

    class Counted(jd.Primitive):
        def __init__(self, factor, **kw):
            self.factor = factor
            for name, value in kw.items():
                setattr(self, name, value)

        @jd.abstract
        def shapes(self, x):
            calls.append(self.factor)
            return _same(x)

        @jd.forward
        def apply(self, x):
            return self.factor * x

    return Counted, calls


def test_equal_configuration_shares_handle_and_abstract():
    Counted, calls = _counting_class()
    a, b, c = Counted(2.0), Counted(2.0), Counted(3.0)
    x = jnp.arange(3.0)
    np.testing.assert_array_equal(a(x), 2 * np.arange(3.0))
    np.testing.assert_array_equal(b(x), 2 * np.arange(3.0))
    assert handle_of(a) is handle_of(b)
    assert calls == [2.0]  # b reuses a's interface: @abstract ran once
    np.testing.assert_array_equal(c(x), 3 * np.arange(3.0))
    assert handle_of(c) is not handle_of(a)
    assert calls == [2.0, 3.0]


def test_unhashable_configuration_falls_back_to_identity():
    Counted, calls = _counting_class()
    a = Counted(2.0, table=[1, 2])
    b = Counted(2.0, table=[1, 2])
    with pytest.warns(UserWarning, match="every new instance is a configuration of its own"):
        assert handle_of(a) is not handle_of(b)
    assert handle_of(a) is handle_of(a)
    x = jnp.ones(2)
    np.testing.assert_array_equal(a(x), [2.0, 2.0])
    np.testing.assert_array_equal(b(x), [2.0, 2.0])
    assert len(calls) == 2


@functools.cache
def _equal_without_hash(cls):
    """`cls` with an ``__eq__`` of its own (Python then sets ``__hash__`` to None)."""
    def __eq__(self, other):
        return type(other) is type(self) and other.factor == self.factor

    return type("EqualWithoutHash", (cls,), {"__eq__": __eq__})


def _csr():
    sparse = pytest.importorskip("scipy.sparse")
    return sparse.eye(2, format="csr")


UNHASHABLE = {  # how an op is made: what the warning says of it
    "list": (lambda cls: cls(2.0, table=[1, 2]),
             "its configuration attribute 'table' (a list) cannot be hashed"),
    "array": (lambda cls: cls(2.0, weights=np.ones(2), table={}),
              "its configuration attributes 'weights' (a ndarray), 'table' (a dict) cannot be "
              "hashed"),
    "csr": (lambda cls: cls(2.0, matrix=_csr()),
            "its configuration attribute 'matrix' (a csr_matrix) cannot be hashed"),
    "eq": (lambda cls: _equal_without_hash(cls)(2.0),
           "EqualWithoutHash defines __eq__ but no __hash__"),
}


@pytest.mark.parametrize("kind", sorted(UNHASHABLE))
def test_a_second_instance_of_an_unhashable_configuration_warns_once_per_class(kind):
    make, cause = UNHASHABLE[kind]
    Counted, _ = _counting_class()
    first = make(Counted)
    name = type(first).__name__
    x = jnp.ones(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the first instance, reused: nothing to say
        first(x), first(x)
    with pytest.warns(UserWarning) as caught:
        make(Counted)(x)  # a new instance: its own kernels
    [warning] = caught
    message = str(warning.message)
    assert message == (
        f"{name}: {cause}, so jaxdecl tells its instances apart by identity: every new "
        f"instance is a configuration of its own, whose kernels are built again (an eager "
        f"call of a new instance takes several times as long as one of a reused instance) "
        f"and whose jitted programs compile again. Define __eq__ and __hash__ on {name} "
        f"(over what the rules read), or create the op once and reuse the instance"
        + (" (an array can also be an input of the op, listed in nondiff=)"
           if kind == "array" else "")), message
    assert warning.filename == __file__  # the line that made the instance's call
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per class
        make(Counted)(x), jax.jit(lambda x: make(Counted)(x))(x)


def test_hashable_configurations_and_ops_keyed_by_identity_by_design_do_not_warn():
    Counted, _ = _counting_class()
    x = jnp.ones(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for factor in (1.0, 2.0, 3.0):  # each a configuration: it says so by its attributes
            Counted(factor, table=(1, 2))(x)
        for _ in range(3):  # a bound method of the op itself: by identity, hashable
            op = Counted(2.0)
            op.method = op.__repr__
            op(x)


def test_class_equality_decides_sharing():
    class ByName(jd.Primitive):
        def __init__(self, name, scratch):
            self.name = name
            self.scratch = scratch  # ignored by __eq__

        def __eq__(self, other):
            return type(other) is ByName and other.name == self.name

        def __hash__(self):
            return hash(self.name)

        @jd.abstract
        def shapes(self, x):
            return _same(x)

        @jd.forward
        def apply(self, x):
            return -x

    assert handle_of(ByName("a", [1])) is handle_of(ByName("a", [2]))
    assert handle_of(ByName("a", [1])) is not handle_of(ByName("b", [1]))


def test_equal_equinox_modules_share_handle():
    assert handle_of(ScaleModule(factor=4.0)) is handle_of(ScaleModule(factor=4.0))
    assert handle_of(ScaleModule(factor=4.0)) is not handle_of(ScaleModule(factor=5.0))


def test_same_attributes_different_classes_do_not_share():
    Counted1, _ = _counting_class()
    Counted2, _ = _counting_class()
    assert handle_of(Counted1(2.0)) is not handle_of(Counted2(2.0))


def test_one_method_cannot_take_two_roles():
    with pytest.raises(jd.DeclarationError, match=r"push is already marked @jd.jvp; a method "
                                                   r"has one role, so @jd.vjp"):
        class Both(jd.Primitive):
            @jd.abstract
            def shapes(self, x):
                return _same(x)

            @jd.forward
            def apply(self, x):
                return x

            @jd.vjp
            @jd.jvp
            def push(self, x, t):
                return t


def test_negative_dimension_in_abstract_names_the_rule():
    class Dynamic(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            return jax.ShapeDtypeStruct((-1,), x.dtype)

        @jd.forward
        def apply(self, x):
            return x

    with pytest.raises(jd.RuleError, match=r"Dynamic\.shapes \(@abstract\) returned shape "
                                           r"\(-1,\) for output;.*non-negative int"):
        Dynamic()(jnp.ones(3))


@pytest.mark.parametrize("value", [None, "fast", print, {"a": object()}])
@pytest.mark.parametrize("jit", [False, True])
def test_non_array_input_names_the_op_and_input(value, jit):
    class Same(jd.Primitive):
        @jd.abstract
        def shapes(self, x, flag):
            return _same(x)

        @jd.forward
        def apply(self, x, flag):
            return x

    f = jax.jit(lambda x: Same()(x, value)) if jit else (lambda x: Same()(x, value))
    # Inside a pytree the leaf is named by its key path.
    name = r"\"flag\['a'\]\"" if isinstance(value, dict) else "'flag'"
    with pytest.raises(TypeError, match=rf"Same: input {name} is a .*not an array.*belongs on "
                                        r"the instance"):
        f(jnp.ones(2))


# ---------------------------------------------------------------------------
# Signatures whose arity depends on the dtypes: checked when first traced
# ---------------------------------------------------------------------------


class Gather(jd.Primitive):
    """y = x[i]: an integer input, which takes no tangent. Counts its rule calls."""

    calls = 0

    @jd.abstract
    def shapes(self, x, i):
        return jax.ShapeDtypeStruct(i.shape, x.dtype)

    @jd.forward
    def apply(self, x, i):
        type(self).calls += 1
        return x[i]

    @jd.jvp
    def push(self, x, i, dx, di):  # wrong: `i` is an integer input, it has no tangent
        type(self).calls += 1
        return dx[i]


def test_jvp_given_a_tangent_for_an_integer_input_fails_when_traced():
    # Accepted when the class is created: `i` could have been a float input.
    x, i = jnp.arange(4.0), jnp.array([3, 0])
    Gather.calls = 0
    with pytest.raises(jd.DeclarationError) as info:
        jax.jit(lambda x, t: jax.jvp(lambda v: Gather()(v, i), (x,), (t,)))(x, jnp.ones(4))
    message = str(info.value)
    for fragment in ["Gather.push (@jvp) takes (self, x, i, dx, di)",
                     "i is an integer input here, which takes no tangent",
                     "`def push(self, x, i, dx)`"]:
        assert fragment in message, (fragment, message)
    assert Gather.calls == 0  # fails while tracing: no rule ran


class TwoOutputs(jd.Primitive):
    """(2x, 3x): two float outputs, so a @vjp takes two cotangents."""

    @jd.abstract
    def shapes(self, x):
        return _same(x), _same(x)

    @jd.forward
    def apply(self, x):
        return 2 * x, 3 * x

    @jd.vjp
    def pull(self, x, ct):  # wrong: one cotangent per float output
        return 2 * ct


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_vjp_with_too_few_cotangents_fails_when_traced(jit):
    f = jax.grad(lambda x: sum(o.sum() for o in TwoOutputs()(x)))
    with pytest.raises(jd.DeclarationError,
                       match=r"TwoOutputs\.pull \(@vjp\) takes \(self, x, ct\), but at these "
                             r"input types.*\(2 here\): `def pull\(self, x, ct0, ct1\)`"):
        (jax.jit(f) if jit else f)(jnp.ones(3))


class Pick(jd.Primitive, linear=True):
    """c[idx(points)] * 2: linear in `c`, with floating `points` that lack nondiff=."""

    @jd.abstract
    def shapes(self, points, c):
        return jax.ShapeDtypeStruct(points.shape, c.dtype)

    @jd.forward
    def apply(self, points, c):
        return 2 * c[(points * (c.shape[0] - 1)).astype(int)]

    @jd.transpose
    def back(self, points, ct):
        return None  # never reached: the declaration is refused first


@pytest.mark.parametrize("how", ["grad", "linear_transpose"])
def test_transpose_taking_a_floating_input_names_nondiff(how):
    # The fix is nondiff=, not a shorter signature: the error says so.
    points, c = jnp.linspace(0.0, 1.0, 4), jnp.arange(5.0)
    f = (jax.grad(lambda c: Pick()(points, c).sum()) if how == "grad" else
         lambda c: jax.linear_transpose(lambda v: Pick()(points, v), c)(jnp.ones(4)))
    with pytest.raises(jd.DeclarationError,
                       match=r"Pick\.back \(@transpose\) takes 'points', a floating input of "
                             r"Pick that jaxdecl differentiates.*"
                             r"nondiff=\('points',\)"):
        f(c)

    class Fixed(Pick, nondiff=("points",)):
        @jd.transpose
        def back(self, points, ct):
            out = np.zeros(5)
            np.add.at(out, (points * 4).astype(int), 2 * ct)
            return out

    grad = jax.grad(lambda c: Fixed()(points, c).sum())(c)
    index = (np.asarray(points) * 4).astype(int)  # [0, 1, 2, 4]
    np.testing.assert_allclose(grad, 2.0 * np.bincount(index, minlength=5))


class IntegerSecondOutput(jd.Primitive):
    """(x**2, argsort(x)): the integer output takes no cotangent, so (self, x, ct) is right."""

    @jd.abstract
    def shapes(self, x):
        return _same(x), jax.ShapeDtypeStruct(x.shape, np.int32)

    @jd.forward
    def apply(self, x):
        return x**2, np.argsort(x).astype(np.int32)

    @jd.vjp
    def pull(self, x, ct):
        return 2 * x * ct


class VarargsRules(jd.Primitive):
    """x1 * x2 with rules that take *args: their arity is not checked."""

    @jd.abstract
    def shapes(self, x1, x2):
        return _same(x1)

    @jd.forward
    def apply(self, x1, x2):
        return x1 * x2

    @jd.jvp
    def push(self, *args):
        x1, x2, dx1, dx2 = args
        return dx1 * x2 + x1 * dx2

    @jd.vjp
    def pull(self, *args):
        x1, x2, ct = args
        return ct * x2, ct * x1


def test_right_signatures_pass_the_traced_check():
    x = jnp.array([3.0, 1.0, 2.0])
    np.testing.assert_allclose(jax.grad(lambda v: IntegerSecondOutput()(v)[0].sum())(x), 2 * x)
    a, b = jnp.array([1.0, 2.0]), jnp.array([3.0, 5.0])
    grads = jax.grad(lambda p, q: VarargsRules()(p, q).sum(), argnums=(0, 1))(a, b)
    np.testing.assert_allclose(grads[0], b)
    np.testing.assert_allclose(grads[1], a)
    _, tangent = jax.jvp(VarargsRules(), (a, b), (jnp.ones(2), jnp.zeros(2)))
    np.testing.assert_allclose(tangent, b)


# ---------------------------------------------------------------------------
# Configuration is static: a traced value there fails at trace time, named
# ---------------------------------------------------------------------------


@jd.primitive
class TableModule(eqx.Module):
    """y = x * sum(table): an equinox op holding an array field."""

    table: jax.Array

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x):
        return (x * np.sum(self.table)).astype(x.dtype)


@jd.primitive
class StaticTableModule(eqx.Module):
    """The first fix: the field marked static (a hashable tuple)."""

    table: tuple = eqx.field(static=True)

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x):
        return (x * sum(self.table)).astype(x.dtype)


@jd.primitive
class TableInput(eqx.Module):
    """The second fix: the table is an input of the op."""

    @jd.abstract
    def shapes(self, x, table):
        return _same(x)

    @jd.forward
    def apply(self, x, table):
        return (x * np.sum(table)).astype(x.dtype)


def test_array_field_traced_by_filter_jit_names_attribute_and_fixes():
    op, x = TableModule(jnp.array([1.0, 2.0])), jnp.arange(3.0)
    np.testing.assert_allclose(op(x), 3 * np.arange(3.0))  # eagerly the field is an array
    with pytest.raises(TypeError) as info:
        eqx.filter_jit(lambda op, x: op(x))(op, x)
    message = str(info.value)
    for fragment in ["TableModule", "attribute 'table' is a JAX tracer",
                     "pass 'table' as an input", "eqx.field(static=True)"]:
        assert fragment in message, (fragment, message)
    # Both fixes work under eqx.filter_jit, against NumPy.
    table = np.array([1.0, 2.0])
    got = eqx.filter_jit(lambda op, x: op(x))(StaticTableModule((1.0, 2.0)), x)
    np.testing.assert_allclose(got, x * table.sum())
    got = eqx.filter_jit(lambda op, x, t: op(x, t))(TableInput(), x, jnp.asarray(table))
    np.testing.assert_allclose(got, x * table.sum())


def test_op_built_from_a_traced_value_names_attribute():
    with pytest.raises(TypeError, match=r"ScaleBase: the op's configuration attribute "
                                        r"'factor' is a JAX tracer.*as an input.*static"):
        jax.jit(lambda s, x: ScaleBase(s)(x))(2.0, jnp.ones(2))
    with pytest.raises(TypeError, match="'factor' is a JAX tracer"):
        jax.grad(lambda s: ScaleBase(s)(jnp.ones(2)).sum())(2.0)


def test_rule_closing_over_a_traced_value_names_variable():
    def f(s, x):
        class Closure(jd.Primitive):
            @jd.abstract
            def shapes(self, x):
                return _same(x)

            @jd.forward
            def apply(self, x):
                return x * s

        return Closure()(x)

    with pytest.raises(TypeError, match=r"Closure\.apply \(@forward\) closes over 's', a JAX "
                                        r"tracer.*pass 's' as an input.*static"):
        jax.jit(f)(2.0, jnp.ones(2))
    np.testing.assert_allclose(f(2.0, jnp.ones(2)), 2 * np.ones(2))  # a number is static
