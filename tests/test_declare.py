"""Declaring primitives: both spellings, options, validation, call conventions, sharing."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tol

import jaxdecl as jd
from jaxdecl._declare import spec_of
from jaxdecl._op import handle_of


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
    assert calls == [2.0]  # b reuses a's layout: @abstract ran once
    np.testing.assert_array_equal(c(x), 3 * np.arange(3.0))
    assert handle_of(c) is not handle_of(a)
    assert calls == [2.0, 3.0]


def test_unhashable_configuration_falls_back_to_identity():
    Counted, calls = _counting_class()
    a = Counted(2.0, table=[1, 2])
    b = Counted(2.0, table=[1, 2])
    assert handle_of(a) is not handle_of(b)
    assert handle_of(a) is handle_of(a)
    x = jnp.ones(2)
    np.testing.assert_array_equal(a(x), [2.0, 2.0])
    np.testing.assert_array_equal(b(x), [2.0, 2.0])
    assert len(calls) == 2


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
