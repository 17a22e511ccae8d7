"""Errors from rules: mismatched results, exceptions, escaped buffer views."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecl as jd

JaxRuntimeError = jax.errors.JaxRuntimeError


def _same(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


class Wrong(jd.Primitive):
    """Declares two float64 outputs of x's shape; returns what `mode` says."""

    def __init__(self, mode):
        self.mode = mode

    @jd.abstract
    def shapes(self, x):
        return _same(x), _same(x)

    @jd.forward
    def apply(self, x):
        if self.mode == "shape":
            return x, x[:-1]
        if self.mode == "dtype":
            return x, x.astype(np.float32)
        return (x,)  # count


MISMATCHES = {
    "shape": r"Wrong\.apply \(@forward\) returned shape \(3,\) for output 1, but @abstract "
             r"declared \(4,\)",
    "dtype": r"Wrong\.apply \(@forward\) returned dtype float32 for output 1, but @abstract "
             r"declared float64",
    "count": r"Wrong\.apply \(@forward\) returned 1 result\(s\), but 2 were expected "
             r"\(output 0, output 1\)",
}


@pytest.mark.parametrize("mode", sorted(MISMATCHES))
def test_mismatch_eager_raises_rule_error(mode):
    with pytest.raises(jd.RuleError, match=MISMATCHES[mode]):
        Wrong(mode)(jnp.arange(4.0))


@pytest.mark.parametrize("mode", sorted(MISMATCHES))
def test_mismatch_under_jit_raises_runtime_error(mode):
    with pytest.raises(JaxRuntimeError, match=MISMATCHES[mode]) as info:
        jax.block_until_ready(jax.jit(Wrong(mode))(jnp.arange(4.0)))
    assert "RuleError" in str(info.value)


def test_single_output_mismatch_names_the_output():
    class Short(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            return _same(x)

        @jd.forward
        def apply(self, x):
            return x[1:]

    with pytest.raises(jd.RuleError, match=r"Short\.apply \(@forward\) returned shape \(2,\) "
                                           r"for output, but @abstract declared \(3,\)"):
        Short()(jnp.ones(3))


def test_return_form_never_yields_garbage():
    # A wrong-shape return that would broadcast must still fail, not fill a partial output.
    class Broadcasts(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            return jax.ShapeDtypeStruct((4, 3), x.dtype)

        @jd.forward
        def apply(self, x):
            return x  # shape (3,), broadcastable to (4, 3)

    with pytest.raises(jd.RuleError, match="returned shape"):
        Broadcasts()(jnp.ones(3))


def test_rule_error_is_a_value_error():
    assert issubclass(jd.RuleError, ValueError)


class Boom(jd.Primitive):
    """Raises when asked to, otherwise doubles."""

    def __init__(self, fail):
        self.fail = fail

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x):
        if self.fail:
            raise KeyError("boom")
        return 2 * x


def test_exception_reaches_eager_caller_as_itself():
    with pytest.raises(KeyError, match="boom"):
        Boom(True)(jnp.ones(3))
    np.testing.assert_array_equal(Boom(False)(jnp.ones(3)), np.full(3, 2.0))


def test_exception_under_jit_carries_type_message_traceback():
    f = jax.jit(lambda v: Boom(True)(v) + 1)
    with pytest.raises(JaxRuntimeError) as info:
        jax.block_until_ready(f(jnp.ones(3)))
    message = str(info.value)
    assert "Boom.apply (@forward) raised KeyError" in message
    assert "'boom'" in message
    assert "Traceback" in message and 'raise KeyError("boom")' in message
    g = jax.jit(lambda v: Boom(False)(v) + 1)
    np.testing.assert_array_equal(g(jnp.ones(3)), np.full(3, 3.0))


def test_exception_in_zero_copy_rule():
    class Half(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            return _same(x)

        @jd.forward
        def apply(self, x, *, out):
            out[: x.size // 2] = x[: x.size // 2]
            raise ZeroDivisionError("half done")

    with pytest.raises(ZeroDivisionError, match="half done"):
        Half()(jnp.ones(4))


# ---------------------------------------------------------------------------
# Escaping buffer views
# ---------------------------------------------------------------------------

_kept = []


class Keeps(jd.Primitive):
    """Keeps what `what` names on a global list."""

    def __init__(self, what):
        self.what = what

    @jd.abstract
    def shapes(self, x, y):
        return _same(x)

    @jd.forward
    def apply(self, x, y, *, out):
        np.add(x, y, out=out)
        if self.what == "y":
            _kept.append(y)
        elif self.what == "out_slice":
            _kept.append(out[1:])
        elif self.what == "x_slice":
            _kept.append(x[:2])


ESCAPES = {"y": "kept a reference to y", "x_slice": "kept a reference to x",
           "out_slice": "kept a reference to output"}


# Each failing call costs XLA about a second on CPU; jit is covered by one case.
@pytest.mark.parametrize("what,jit", [("y", False), ("x_slice", False), ("out_slice", False),
                                      ("y", True)])
def test_escaped_view_raises(what, jit):
    x, y = jnp.arange(4.0), jnp.ones(4)
    f = jax.jit(Keeps(what)) if jit else Keeps(what)
    try:
        error = jd.BufferEscapeError if not jit else JaxRuntimeError
        with pytest.raises(error, match=rf"Keeps\.apply \(@forward\) {ESCAPES[what]}"):
            jax.block_until_ready(f(x, y))
    finally:
        _kept.clear()
    np.testing.assert_array_equal(Keeps(None)(x, y), np.arange(4.0) + 1)
    np.testing.assert_array_equal(jax.jit(Keeps(None))(x, y), np.arange(4.0) + 1)


def test_copies_may_be_kept():
    kept = []

    class Copies(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            return _same(x)

        @jd.forward
        def apply(self, x):
            kept.append(np.array(x))
            kept.append(float(x[0]))
            return -x

    np.testing.assert_array_equal(Copies()(jnp.arange(3.0)), -np.arange(3.0))
    np.testing.assert_array_equal(kept[0], np.arange(3.0))
    assert kept[1] == 0.0
