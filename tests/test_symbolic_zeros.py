"""Symbolic zeros end to end: ``@jd.jvp(zeros=True)`` and ``wanted`` on ``@vjp``.

A tangent that is symbolically zero reaches a ``zeros=True`` rule as None (never an
array of zeros), a rule may return None for a zero output tangent, and a ``@vjp`` that
takes ``wanted`` is asked only for the cotangents a derivative needs. Each set of
present tangents (wanted cotangents) is an equation of its own: proven with call
counters and with the calls and operands of the compiled program.
"""

from __future__ import annotations

import collections
import re
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tol
from ops import random_array
from ops_linear import MulZ, SplitZ, SplitZTraceable, mul_ref, split_ref

import jaxdecl as jd

DTYPES = ["float32", "float64", "complex64", "complex128"]


def _close(actual, expected, dtype):
    rtol = tol(dtype)
    for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, a.dtype, e.shape, e.dtype)
        scale = max(1.0, float(np.max(np.abs(e)))) if e.size else 1.0
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale)


def _args(dtype, n=2, shape=(3, 4)):
    rng = np.random.default_rng(len(dtype))
    return tuple(random_array(rng, shape, np.dtype(dtype)) for _ in range(n))


def _counted(f, *args):
    MulZ.calls.clear()
    MulZ.seen.clear()
    result = jax.block_until_ready(f(*args))
    return dict(MulZ.calls), result


def _custom_calls(f, *args) -> list:
    """``(rule name, operand count, result count)`` of each jaxdecl call f compiles to."""
    calls = []
    for line in jax.jit(f).lower(*args).as_text().splitlines():
        found = re.search(r"custom_call @jaxdecl_dispatch\((.*?)\).*name = \"([^\"]+)\".*"
                          r"-> (.*)$", line)
        if found:
            operands = len([o for o in found.group(1).split(",") if o.strip()])
            results = found.group(3)
            calls.append((found.group(2), operands,
                          results.count("tensor<") if results.startswith("(") else 1))
    return sorted(calls)


def _sum(f):
    return lambda a, b: jnp.sum(jnp.real(f(a, b)))


# ---------------------------------------------------------------------------
# Which tangents a @jvp(zeros=True) receives, which cotangents a @vjp is asked for
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_jvp_in_one_input_passes_none_for_the_other(dtype):
    a, b = _args(dtype)
    op = MulZ()
    for jit in (False, True):
        f = lambda a, b, t: jax.jvp(lambda x: op(x, b), (a,), (t,))  # noqa: E731
        calls, out = _counted(jax.jit(f) if jit else f, a, b, b)
        _close(out, jax.jvp(lambda x: mul_ref(x, b), (a,), (b,)), dtype)
        assert calls == {"forward": 1, "jvp (True, False)": 1}
        assert MulZ.seen == [("jvp", np.ndarray, type(None))]
    f = lambda a, b, t: jax.jvp(lambda y: op(a, y), (b,), (t,))  # noqa: E731
    calls, out = _counted(jax.jit(f), a, b, a)
    _close(out, jax.jvp(lambda y: mul_ref(a, y), (b,), (a,)), dtype)
    assert calls == {"forward": 1, "jvp (False, True)": 1}
    calls, _ = _counted(jax.jit(lambda a, b: jax.jvp(op, (a, b), (b, a))), a, b)
    assert calls == {"forward": 1, "jvp (True, True)": 1}


@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_in_one_input_asks_the_vjp_for_it_alone(dtype):
    a, b = _args(dtype)
    op = MulZ()
    holo = dtype.startswith("complex")
    loss = (lambda f: lambda a, b: jnp.sum(f(a, b))) if holo else _sum
    for argnums, wanted in ((0, (True, False)), (1, (False, True)), ((0, 1), (True, True))):
        calls, g = _counted(jax.jit(jax.grad(loss(op), argnums, holomorphic=holo)), a, b)
        _close(g, jax.grad(loss(mul_ref), argnums, holomorphic=holo)(a, b), dtype)
        assert calls == {f"vjp {wanted}": 1}, argnums
    # the call takes the inputs and the cotangent, and returns only what is asked for
    assert _custom_calls(jax.grad(_sum(op), 0), a, b) == [("MulZ.pull (@vjp)", 3, 1)]
    assert _custom_calls(jax.grad(_sum(op), (0, 1)), a, b) == [("MulZ.pull (@vjp)", 3, 2)]


def test_jvp_of_one_input_compiles_to_one_tangent_operand():
    a, b = _args("float64")
    op = MulZ()
    assert _custom_calls(lambda a, b, t: jax.jvp(lambda x: op(x, b), (a,), (t,)), a, b, b) == [
        ("MulZ.apply (@forward)", 2, 1), ("MulZ.push (@jvp)", 3, 1)]
    assert _custom_calls(lambda a, b, s, t: jax.jvp(op, (a, b), (s, t)), a, b, a, b) == [
        ("MulZ.apply (@forward)", 2, 1), ("MulZ.push (@jvp)", 4, 1)]


def test_linearize_and_its_transpose_keep_the_zeros_out():
    a, b = _args("float64")
    op = MulZ()
    y, lin = jax.linearize(lambda x: op(x, b), a)
    calls, t = _counted(jax.jit(lin), b)
    _close(t, jax.jvp(lambda x: mul_ref(x, b), (a,), (b,))[1], "float64")
    assert calls == {"jvp (True, False)": 1}
    calls, ct = _counted(jax.jit(jax.linear_transpose(lin, a)), b)
    _close(ct, jax.vjp(lambda x: mul_ref(x, b), a)[1](b), "float64")
    assert calls == {"vjp (True, False)": 1}


def test_vmap_keeps_the_zeros_out():
    a, b = _args("float64", shape=(5, 3))
    op = MulZ()
    f = jax.vmap(lambda a, b: jax.grad(_sum(op), 0)(a, b), in_axes=(0, None))
    calls, g = _counted(jax.jit(f), a, b[0])
    _close(g, jax.vmap(lambda a, b: jax.grad(_sum(mul_ref), 0)(a, b), in_axes=(0, None))(
        a, b[0]), "float64")
    assert calls == {"vjp (True, False)": 5}  # batch="loop": the rule once per element
    f = jax.vmap(lambda a, t: jax.jvp(lambda x: op(x, b[0]), (a,), (t,))[1])
    calls, t = _counted(jax.jit(f), a, a)
    _close(t, jax.vmap(lambda a, t: jax.jvp(lambda x: mul_ref(x, b[0]), (a,), (t,))[1])(a, a),
           "float64")
    assert calls == {"jvp (True, False)": 5}


@pytest.mark.parametrize("dtype", ["float64", "complex128"])
def test_second_order_transposes_keep_their_active_sets(dtype):
    """grad of a jvp: the jvp's transpose is the vjp asked for one cotangent, and back."""
    a, b = _args(dtype)
    op = MulZ()
    holo = dtype == "complex128"

    def f(op):
        return lambda a, b: jnp.sum(jax.jvp(lambda x: op(x, b), (a,), (b,))[1])

    g = jax.jit(jax.grad(f(op), 0, holomorphic=holo))
    with pytest.raises(jd.MissingRuleError, match="MulZ.push \\(@jvp\\) is a NumPy rule"):
        g(a, b)  # the jvp's own derivative in b needs a second derivative
    g = jax.jit(jax.linear_transpose(lambda t: jax.jvp(lambda x: op(x, b), (a,), (t,))[1], a))
    calls, ct = _counted(g, b)
    _close(ct, jax.linear_transpose(lambda t: jax.jvp(lambda x: mul_ref(x, b), (a,), (t,))[1],
                                    a)(b), dtype)
    assert calls == {"vjp (True, False)": 1}
    h = jax.jit(jax.linear_transpose(lambda c: jax.vjp(lambda x: op(x, b), a)[1](c)[0], a))
    calls, t = _counted(h, b)
    _close(t, jax.linear_transpose(lambda c: jax.vjp(lambda x: mul_ref(x, b), a)[1](c)[0], a)(
        b), dtype)
    assert calls == {"jvp (True, False)": 1}


# ---------------------------------------------------------------------------
# Output tangents that are zero
# ---------------------------------------------------------------------------

class Sink(jd.Primitive):
    """2 * z, recording which tangent its @jvp(zeros=True) receives."""

    seen: ClassVar[list] = []

    @jd.abstract
    def shapes(self, z):
        return jax.ShapeDtypeStruct(z.shape, z.dtype)

    @jd.forward
    def apply(self, z):
        return 2 * z

    @jd.jvp(zeros=True)
    def push(self, z, dz):
        type(self).seen.append(dz is None)
        return None if dz is None else 2 * dz


@pytest.mark.parametrize("op_class", [SplitZ, SplitZTraceable])
def test_a_zero_output_tangent(op_class):
    x, y = _args("float64")
    op = op_class()
    t = jax.jit(lambda x, y, t: jax.jvp(lambda x: op(x, y), (x,), (t,)))(x, y, y)
    _close(t, jax.jvp(lambda x: split_ref(x, y), (x,), (y,)), "float64")
    Sink.seen.clear()
    # downstream: a NumPy rule's None is written as zeros (the next op's @jvp runs on
    # them); a traceable rule's is a symbolic zero, so the next op's @jvp never runs
    t = jax.jit(lambda x, y, t: jax.jvp(lambda x: Sink()(op(x, y)[1]), (x,), (t,))[1])(x, y, y)
    _close(t, np.zeros_like(y), "float64")
    assert Sink.seen == ([] if op_class is SplitZTraceable else [False])


# ---------------------------------------------------------------------------
# A @vjp that takes wanted without a @jvp, and traceable forms
# ---------------------------------------------------------------------------

class PullOnly(jd.Primitive):
    calls: ClassVar[collections.Counter] = collections.Counter()

    @jd.abstract
    def shapes(self, x1, x2):
        return jax.ShapeDtypeStruct(x1.shape, x1.dtype)

    @jd.forward
    def apply(self, x1, x2):
        return x1 * x2**2

    @jd.vjp(traceable=True)
    def pull(self, x1, x2, ct, *, wanted):
        type(self).calls[wanted] += 1
        return (x2**2 * ct if wanted[0] else None), (2 * x1 * x2 * ct if wanted[1] else None)


class PushZTraceable(jd.Primitive):
    @jd.abstract
    def shapes(self, x1, x2):
        return jax.ShapeDtypeStruct(x1.shape, x1.dtype)

    @jd.forward
    def apply(self, x1, x2):
        return x1 * x2**2

    @jd.jvp(zeros=True, traceable=True)
    def push(self, x1, x2, dx1, dx2):
        assert dx1 is not None or dx2 is not None
        return (0 if dx1 is None else x2**2 * dx1) + (0 if dx2 is None else 2 * x1 * x2 * dx2)


@pytest.mark.parametrize("op_class", [PullOnly, PushZTraceable])
def test_traceable_rules_with_zeros_at_every_order(op_class):
    a, b = _args("float64")
    op = op_class()
    PullOnly.calls.clear()
    for argnums in (0, 1, (0, 1)):
        _close(jax.jit(jax.grad(_sum(op), argnums))(a, b), jax.grad(_sum(mul_ref), argnums)(
            a, b), "float64")
        _close(jax.jit(jax.jacrev(jax.grad(_sum(op), argnums), argnums))(a, b),
               jax.jacrev(jax.grad(_sum(mul_ref), argnums), argnums)(a, b), "float64")
    if op_class is PullOnly:  # traced: one call per trace of each wanted set
        assert set(PullOnly.calls) == {(True, False), (False, True), (True, True)}
    else:
        _close(jax.hessian(_sum(op), (0, 1))(a, b), jax.hessian(_sum(mul_ref), (0, 1))(a, b),
               "float64")


# ---------------------------------------------------------------------------
# jd.check runs each input alone through such rules
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("op_class", [MulZ, SplitZ, SplitZTraceable, PullOnly, PushZTraceable])
def test_check_passes(op_class):
    jd.check(op_class(), *_args("float64"))


class DropsX1(MulZ):
    @jd.jvp(zeros=True)
    def push(self, x1, x2, dx1, dx2):  # forgets x1's tangent when x2's is zero
        return np.zeros_like(x1) if dx2 is None else super().push(x1, x2, dx1, dx2)


class WrongWhenAlone(MulZ):
    def pull(self, x1, x2, ct, *, wanted):  # x2's cotangent, asked alone, is off by a sign
        return (x2**2 * ct if wanted[0] else None), \
            ((2 if wanted[0] else -2) * x1 * x2 * ct if wanted[1] else None)


@pytest.mark.parametrize("op_class, message, alone", [
    (DropsX1, "jd.check: DropsX1.push (@jvp) disagrees with finite differences for "
              "d output / d x1: ", "x1"),
    (WrongWhenAlone, "jd.check: WrongWhenAlone.pull (@vjp) disagrees with finite differences "
                     "for d output / d x2: ", "x2"),
])
def test_check_names_a_rule_wrong_with_part_of_the_inputs(op_class, message, alone):
    with pytest.raises(AssertionError, match=re.escape(message)) as raised:
        jd.check(op_class(), *_args("float64"))
    assert f"(differentiating in {alone!r} alone: " in str(raised.value)
