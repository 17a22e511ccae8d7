"""Property-based tests: random shapes, dtypes, batch axes, error messages and escaping views.

Every result is compared with NumPy; every error with what the rule raised.
"""

import gc
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tol

pytest.importorskip("hypothesis")
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from hypothesis.extra import numpy as hnp
from ops import Offset, Scale

import jaxdecl as jd

JaxRuntimeError = jax.errors.JaxRuntimeError

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128"]


# Deterministic examples, no example database in the working tree and no shrinking: a
# failing example is reported as drawn, which keeps a failing run short (each example
# compiles for its own shapes and dtypes).
set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "jaxdecl_hypothesis"))  # not the tree
PROPERTIES = settings(deadline=None, derandomize=True, database=None,
                      phases=(Phase.explicit, Phase.generate))


def _same(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


@st.composite
def arrays(draw, dtypes=DTYPES, min_side=0, max_dims=3, elements=None):
    """A NumPy array of a random dtype and shape (0-d and zero-size included)."""
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=max_dims, min_side=min_side, max_side=4))
    return draw(hnp.arrays(dtype, shape, elements=elements))


# ---------------------------------------------------------------------------
# Every dtype and shape, zero-copy and return form, eager and jit
# ---------------------------------------------------------------------------


class FlipInto(jd.Primitive):
    """Zero-copy: out = x flipped along every axis."""

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x, *, out):
        out[...] = np.flip(x)


class Transposed(jd.Primitive):
    """Return form: returns x.T, a (non-contiguous) view of its own input."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape[::-1], x.dtype)

    @jd.forward
    def apply(self, x):
        return x.T


ROUND_TRIPS = {"out": (FlipInto(), np.flip), "return": (Transposed(), np.transpose)}


@pytest.mark.parametrize("form", sorted(ROUND_TRIPS))
@settings(PROPERTIES, max_examples=40)
@given(x=arrays(), jit=st.booleans(), as_jax=st.booleans())
@example(x=np.float32(2.5) * np.ones((), np.float32), jit=True, as_jax=False)
@example(x=np.zeros((3, 0), np.complex128), jit=False, as_jax=True)
def test_any_dtype_and_shape_round_trips(form, x, jit, as_jax):
    op, reference = ROUND_TRIPS[form]
    f = jax.jit(op) if jit else op
    y = f(jnp.asarray(x) if as_jax else x)
    expected = reference(x)
    assert y.dtype == x.dtype and y.shape == expected.shape
    np.testing.assert_array_equal(np.asarray(y), expected)


# ---------------------------------------------------------------------------
# vmap: random batch sizes, in_axes and out_axes
# ---------------------------------------------------------------------------


def _axpy_classes():
    """2x + y in the four combinations of (zero-copy, return form) x (loop, vectorized)."""

    class IntoLoop(jd.Primitive, batch="loop"):
        @jd.abstract
        def shapes(self, x, y):
            return _same(x)

        @jd.forward
        def apply(self, x, y, *, out):
            out[...] = 2 * x + y

    class ReturnLoop(jd.Primitive, batch="loop"):
        @jd.abstract
        def shapes(self, x, y):
            return _same(x)

        @jd.forward
        def apply(self, x, y):
            return (2 * x + y).astype(x.dtype)

    class IntoVectorized(jd.Primitive, batch="vectorized"):
        @jd.abstract
        def shapes(self, x, y):
            return _same(x)

        @jd.forward
        def apply(self, x, y, *, out):
            out[...] = 2 * x + y

    class ReturnVectorized(jd.Primitive, batch="vectorized"):
        @jd.abstract
        def shapes(self, x, y):
            return _same(x)

        @jd.forward
        def apply(self, x, y):
            return np.broadcast_to(2 * x + y, np.broadcast_shapes(x.shape, y.shape)).astype(
                x.dtype)

    return {"out-loop": IntoLoop(), "return-loop": ReturnLoop(),
            "out-vectorized": IntoVectorized(), "return-vectorized": ReturnVectorized()}


AXPY = _axpy_classes()


@st.composite
def vmap_cases(draw):
    dtype = np.dtype(draw(st.sampled_from(["int32", "float32", "float64", "complex64"])))
    element = draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=3))
    size = draw(st.integers(0, 4))
    ndim = len(element) + 1
    axis = st.integers(-ndim, ndim - 1)
    in_axes = draw(st.tuples(st.one_of(st.none(), axis), st.one_of(st.none(), axis))
                   .filter(lambda axes: axes != (None, None)))
    out_axis = draw(axis)
    values = st.integers(-100, 100)
    args = []
    for ax in in_axes:
        shape = element if ax is None else (
            element[:ax % ndim] + (size,) + element[ax % ndim:])
        args.append(draw(hnp.arrays(dtype, shape, elements=values)))
    return tuple(args), in_axes, out_axis


def _numpy_vmap(args, in_axes, out_axis):
    """2x + y per batch element, with NumPy: batch axes moved to the front and broadcast."""
    x, y = (a[None] if ax is None else np.moveaxis(a, ax, 0) for a, ax in zip(args, in_axes))
    return np.moveaxis((2 * x + y).astype(x.dtype), 0, out_axis)


@pytest.mark.parametrize("form", sorted(AXPY))
@settings(PROPERTIES, max_examples=25)
@given(case=vmap_cases(), jit=st.booleans())
@example(case=((np.zeros((0, 2)), np.ones(2)), (0, None), 1), jit=False)
def test_vmap_random_axes_and_sizes(form, case, jit):
    args, in_axes, out_axis = case
    f = jax.vmap(AXPY[form], in_axes=in_axes, out_axes=out_axis)
    y = (jax.jit(f) if jit else f)(*args)
    expected = _numpy_vmap(args, in_axes, out_axis)
    assert y.shape == expected.shape and y.dtype == expected.dtype
    np.testing.assert_allclose(np.asarray(y), expected, rtol=tol(expected.dtype))


# ---------------------------------------------------------------------------
# Exceptions from rules
# ---------------------------------------------------------------------------


class RuleFailure(Exception):
    """A user's own exception class."""


_message = [""]


class Raises(jd.Primitive):
    """Raises RuleFailure(_message[0]) from its zero-copy forward."""

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x, *, out):
        raise RuleFailure(_message[0])


RAISES, DOUBLES = Raises(), Scale(2)
RAISES_JIT, DOUBLES_JIT = jax.jit(lambda v: RAISES(v) + 1), jax.jit(DOUBLES)


def _still_works():
    """The process keeps working after a failed call."""
    np.testing.assert_array_equal(DOUBLES(np.arange(3.0)), [0.0, 2.0, 4.0])
    np.testing.assert_array_equal(DOUBLES_JIT(np.arange(3.0)), [0.0, 2.0, 4.0])


_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                max_size=20)
_marks = st.builds(lambda n: f"[jaxdecl error #{n}]", st.integers(0, 64))
# Text that contains what looks like jaxdecl's own error marks, mixed with plain text.
marked = st.lists(st.one_of(_text, _marks), min_size=1, max_size=4).map("".join).filter(
    lambda m: "[jaxdecl error #" in m)


def _raises_eagerly(message):
    _message[0] = message
    with pytest.raises(RuleFailure) as info:
        RAISES(np.ones(3))
    assert type(info.value) is RuleFailure
    assert info.value.args == (message,)
    assert str(info.value) == message
    _still_works()


def _raises_under_jit(message):
    _message[0] = message
    with pytest.raises(JaxRuntimeError) as info:
        jax.block_until_ready(RAISES_JIT(np.ones(3)))
    text = str(info.value)
    assert "RuleFailure" in text
    # XLA carries messages as C strings: a NUL arrives escaped.
    assert message.replace("\x00", "\\x00") in text
    _still_works()


@settings(PROPERTIES, max_examples=25)
@given(message=_text)
@example(message="")
@example(message="ünï 😀 tail")
def test_exception_reaches_eager_caller(message):
    _raises_eagerly(message)


@settings(PROPERTIES, max_examples=15)
@given(message=marked)
@example(message="[jaxdecl error #3]")
def test_exception_with_mark_like_text_reaches_eager_caller(message):
    _raises_eagerly(message)


@settings(PROPERTIES, max_examples=15)
@given(message=_text)
def test_exception_under_jit_carries_type_and_message(message):
    _raises_under_jit(message)


@settings(PROPERTIES, max_examples=10)
@given(message=marked)
@example(message="[jaxdecl error #3]")
def test_exception_with_mark_like_text_under_jit(message):
    _raises_under_jit(message)


CONTROL_MESSAGES = ["before\x00after", "\x00", "tab\tcr\rlf\n", "\x1b[31mred\x1b[0m \x7f"]


@pytest.mark.parametrize("message", CONTROL_MESSAGES, ids=["nul-inside", "nul", "whitespace",
                                                           "escapes"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_exception_message_with_control_characters(message, jit):
    (_raises_under_jit if jit else _raises_eagerly)(message)


class RaisesFrom(jd.Primitive):
    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x):
        try:
            int(_message[0])
        except ValueError as error:
            raise RuleFailure("wrapped") from error
        return x


def test_exception_keeps_its_cause():
    _message[0] = "not a number"
    with pytest.raises(RuleFailure) as info:
        RaisesFrom()(np.ones(2))
    assert info.value.args == ("wrapped",)
    assert isinstance(info.value.__cause__, ValueError)
    assert "not a number" in str(info.value.__cause__)


# ---------------------------------------------------------------------------
# Views that escape the rule
# ---------------------------------------------------------------------------

_kept = []


class _Holder:
    pass


_holder = _Holder()

# Ways an ordinary rule might keep an array beyond the call.
KEEPERS = {
    "itself": lambda a: _kept.append(a),
    "ellipsis": lambda a: _kept.append(a[...]),
    "transpose": lambda a: _kept.append(a.T),
    "reshape": lambda a: _kept.append(a.reshape(-1)),
    "view": lambda a: _kept.append(a.view()),
    "asarray": lambda a: _kept.append(np.asarray(a)),
    "memoryview": lambda a: _kept.append(memoryview(a)),
    "nested": lambda a: _kept.append({"key": [(a,)]}),
    "attribute": lambda a: setattr(_holder, "array", a),
}

_keep = ["itself", "x"]


class Keeps(jd.Primitive):
    """Copies x into out, then keeps `_keep[1]` ("x" or "out") the way `_keep[0]` says."""

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x, *, out):
        out[...] = x
        KEEPERS[_keep[0]](x if _keep[1] == "x" else out)


KEEPS = Keeps()
KEEPS_JIT = jax.jit(KEEPS)


def _forget():
    _kept.clear()
    _holder.__dict__.clear()


@pytest.mark.parametrize("how", sorted(KEEPERS))
@settings(PROPERTIES, max_examples=3)
@given(x=arrays(min_side=1), which=st.sampled_from(["x", "out"]), jit=st.booleans())
def test_kept_view_is_detected(how, x, which, jit):
    _keep[:] = [how, which]
    name = "x" if which == "x" else "output"
    try:
        if jit:
            with pytest.raises(JaxRuntimeError, match="BufferEscapeError") as info:
                jax.block_until_ready(KEEPS_JIT(x))
        else:
            with pytest.raises(jd.BufferEscapeError) as info:
                KEEPS(x)
        assert f"Keeps.apply (@forward) kept a reference to {name}" in str(info.value)
    finally:
        _forget()
    _still_works()


class CarriedError(Exception):
    """An exception that carries an array."""


_carry = ["out"]


class Carries(jd.Primitive):
    """Writes out = x + 1, then raises CarriedError holding what `_carry[0]` names."""

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x, *, out):
        np.add(x, 1, out=out)
        if _carry[0] == "x":
            raise CarriedError(x)
        if _carry[0] == "out_slice":
            raise CarriedError(out[..., :1])
        if _carry[0] == "in_tuple":
            raise CarriedError((out,))
        raise CarriedError(out)


CARRIES, ADD_ONE = Carries(), Offset(1)


@pytest.mark.parametrize("what", ["out", "x", "out_slice", "in_tuple"])
@settings(PROPERTIES, max_examples=4)
@given(x=arrays(dtypes=["int32", "float64", "complex64"], min_side=1, max_dims=2,
                elements=st.integers(-1000, 1000)))
def test_exception_carrying_a_view_is_safe(what, x):
    if what == "out_slice" and x.ndim == 0:
        what = "out"
    _carry[0] = what
    written = x if what == "x" else np.asarray(x + 1)
    if what == "out_slice":
        written = written[..., :1]
    try:
        CARRIES(x)
    except jd.BufferEscapeError:
        return  # refusing the view is an acceptable answer
    except CarriedError as error:
        carried = error.args[0][0] if what == "in_tuple" else error.args[0]
    else:
        raise AssertionError("Carries did not raise")
    # Calls of the same shape reuse XLA's memory; the carried data must not change.
    for k in range(4):
        ADD_ONE(np.full_like(x, 7 + k))
        jax.block_until_ready(jnp.full(x.shape, -5, x.dtype) * 3)
    gc.collect()
    assert np.asarray(carried).shape == written.shape
    np.testing.assert_array_equal(np.asarray(carried), written)
