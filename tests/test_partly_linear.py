"""Partly linear ops (``linear=("c",)``): linear in some inputs, differentiable in the others.

The worked example is a non-uniform DFT (``ops_linear.Nudft``), linear in its strengths
``c`` and smooth in its points ``x``: every transformation against its ``jax.numpy``
reference and ``jax.test_util.check_grads``, which rules run for which derivative (call
counters and the compiled program's calls), every order where the rules are traceable,
and the declarations that cannot hold.
"""

from __future__ import annotations

import collections
import re
import zlib
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tol
from jax.test_util import check_grads
from ops import random_array
from ops_linear import MODES, Nudft, NudftPull, NudftTraceable, nudft_ref

import jaxdecl as jd

#: (points dtype, strengths dtype): the output is complex64 or complex128.
DTYPES = [("float32", "complex64"), ("float64", "complex128"), ("float64", "float64")]
DTYPE_IDS = ["f32-c64", "f64-c128", "f64-f64"]


def _inputs(dtypes, batch=()):
    rng = np.random.default_rng(zlib.crc32(repr((dtypes, batch)).encode()))
    x = rng.uniform(0.0, 2 * np.pi, batch + (5,)).astype(dtypes[0])
    c = random_array(rng, batch + (5,), np.dtype(dtypes[1]))
    return x, c


def _close(actual, expected, dtype):
    rtol = tol(dtype)
    for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, a.dtype, e.shape, e.dtype)
        scale = max(1.0, float(np.max(np.abs(e)))) if e.size else 1.0
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale)


def _loss(f):
    return lambda x, c: jnp.sum(jnp.abs(f(x, c)) ** 2)


def _counted(op_class, f, *args):
    op_class.calls.clear()
    result = jax.block_until_ready(f(*args))
    return dict(op_class.calls), result


# ---------------------------------------------------------------------------
# First order, every transformation, against jax.numpy
# ---------------------------------------------------------------------------

OPS = {"numpy": Nudft, "traceable_jvp": NudftTraceable, "traceable_vjp": NudftPull}


def _linearized(f, x, c, tx, tc):
    y, lin = jax.linearize(f, x, c)
    return y, lin(tx, tc)


#: name -> a transformation of f at (x, c) with tangents (tx, tc) and cotangent ct
FIRST_ORDER = {
    "call": lambda f, x, c, tx, tc, ct: f(x, c),
    "jvp_x": lambda f, x, c, tx, tc, ct: jax.jvp(lambda x: f(x, c), (x,), (tx,)),
    "jvp_c": lambda f, x, c, tx, tc, ct: jax.jvp(lambda c: f(x, c), (c,), (tc,)),
    "jvp_both": lambda f, x, c, tx, tc, ct: jax.jvp(f, (x, c), (tx, tc)),
    "vjp": lambda f, x, c, tx, tc, ct: jax.vjp(f, x, c)[1](ct),
    "grad_x": lambda f, x, c, tx, tc, ct: jax.grad(_loss(f), 0)(x, c),
    "grad_c": lambda f, x, c, tx, tc, ct: jax.grad(_loss(f), 1)(x, c),
    "grad_both": lambda f, x, c, tx, tc, ct: jax.grad(_loss(f), (0, 1))(x, c),
    "linearize": lambda f, x, c, tx, tc, ct: _linearized(f, x, c, tx, tc),
    "linear_transpose_c": lambda f, x, c, tx, tc, ct: jax.linear_transpose(
        lambda v: f(x, v), c)(ct),
    "jacrev_x": lambda f, x, c, tx, tc, ct: jax.jacrev(lambda x: jnp.abs(f(x, c)))(x),
    "jacfwd_c": lambda f, x, c, tx, tc, ct: jax.jacfwd(lambda c: f(x, c), holomorphic=True)(
        c) if jnp.iscomplexobj(c) else jax.jacfwd(lambda c: jnp.real(f(x, c)))(c),
}
#: A traceable @vjp alone gives no forward mode in the points (nothing to transpose).
FORWARD_MODE_IN_X = ("jvp_x", "jvp_both", "linearize")


@pytest.mark.parametrize("dtypes", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", list(OPS))
def test_first_order_against_jnp(kind, dtypes):
    op = OPS[kind]()
    x, c = _inputs(dtypes)
    rng = np.random.default_rng(1)
    tx, tc = random_array(rng, x.shape, x.dtype), random_array(rng, c.shape, c.dtype)
    ct = random_array(rng, (7,), np.result_type(c.dtype, np.complex64))
    names = [n for n in FIRST_ORDER if kind != "traceable_vjp" or n not in FORWARD_MODE_IN_X]

    def every(f, *args):
        return {name: FIRST_ORDER[name](f, *args) for name in names}

    expected = every(nudft_ref, x, c, tx, tc, ct)
    jitted = jax.jit(lambda *a: every(op, *a))(x, c, tx, tc, ct)
    for name in names:
        for label, got in (("jit", jitted[name]), ("eager", FIRST_ORDER[name](
                op, x, c, tx, tc, ct))):
            try:
                _close(got, expected[name], dtypes[1])
            except AssertionError as error:
                raise AssertionError(f"{name} ({label}): {error}") from None


def test_forward_mode_in_the_points_without_a_jvp_names_it():
    op = NudftPull()
    x, c = _inputs(("float64", "complex128"))
    with pytest.raises(jd.MissingRuleError, match="NudftPull has no @jvp"):
        jax.jvp(lambda x: op(x, c), (x,), (x,))


@pytest.mark.parametrize("dtypes", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", ["numpy", "traceable_jvp"])
def test_check_grads_first_order(kind, dtypes):
    op = OPS[kind]()
    x, c = _inputs(dtypes)
    eps = 1e-3 if dtypes[0] == "float32" else 1e-6
    rtol = 5e-2 if dtypes[0] == "float32" else 1e-5
    check_grads(op, (x, c), 1, modes=("fwd", "rev"), eps=eps, rtol=rtol)


# ---------------------------------------------------------------------------
# Higher orders: traceable rules, the op inside its own jvp
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtypes", DTYPES[1:], ids=DTYPE_IDS[1:])
@pytest.mark.parametrize("kind", ["traceable_jvp", "traceable_vjp"])
def test_check_grads_second_order(kind, dtypes):
    op = OPS[kind]()
    x, c = _inputs(dtypes)
    modes = ("fwd", "rev") if kind == "traceable_jvp" else ("rev",)
    check_grads(lambda x: op(x, c), (x,), 2, modes=modes, eps=1e-6, rtol=1e-5)
    check_grads(lambda c: op(x, c), (c,), 2, modes=modes, eps=1e-6, rtol=1e-5)
    check_grads(op, (x, c), 2, modes=modes, eps=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtypes", DTYPES, ids=DTYPE_IDS)
def test_every_order_in_the_linear_inputs_with_numpy_rules(dtypes):
    """In the strengths alone the derivatives are the forward and the transpose: every
    order, with NumPy rules, and no @jvp or @vjp runs."""
    op = Nudft()
    x, c = _inputs(dtypes)
    eps, rtol = (1e-3, 5e-2) if dtypes[0] == "float32" else (1e-6, 1e-5)
    check_grads(lambda c: op(x, c), (c,), 3, modes=("fwd", "rev"), eps=eps, rtol=rtol)
    calls, h = _counted(Nudft, jax.jit(jax.hessian(lambda c: jnp.sum(jnp.abs(op(x, c)) ** 2))),
                        c.real)
    _close(h, jax.hessian(lambda c: jnp.sum(jnp.abs(nudft_ref(x, c)) ** 2))(c.real), "float64"
           if dtypes[0] == "float64" else "float32")
    assert set(calls) <= {"forward", "transpose"}, calls


@pytest.mark.parametrize("kind", ["traceable_jvp", "traceable_vjp"])
def test_hessians_mixing_linear_and_other_inputs(kind):
    """Second derivatives in x, in c and mixed (which differentiate the transpose in x)."""
    op = OPS[kind]()
    x, c = _inputs(("float64", "complex128"))
    f, ref = _loss(op), _loss(nudft_ref)
    # (a traceable @vjp alone gives reverse mode: reverse over reverse only)
    reverse = ("jacrev_x_of_grad_c", "grad_of_grad")
    cases = {
        "hessian_x": lambda f: jax.hessian(f, 0)(x, c),
        "jacfwd_x_of_grad_c": lambda f: jax.jacfwd(lambda x: jax.grad(f, 1)(x, c))(x),
        "jacrev_x_of_grad_c": lambda f: jax.jacrev(
            lambda x: jnp.real(jax.grad(f, 1)(x, c)))(x),
        "jvp_c_of_grad_x": lambda f: jax.jvp(lambda c: jax.grad(f, 0)(x, c), (c,),
                                             (jnp.sin(c),))[1],
        "jvp_of_grad_both": lambda f: jax.jvp(lambda x, c: jax.grad(f, (0, 1))(x, c), (x, c),
                                              (jnp.cos(x), jnp.sin(c)))[1],
        "grad_of_grad": lambda f: jax.grad(lambda x, c: jnp.sum(jnp.abs(jax.grad(f, (0, 1))(
            x, c)[1]) ** 2), (0, 1))(x, c),
    }
    for name, case in cases.items():
        if kind == "traceable_vjp" and name not in reverse:
            continue
        try:
            _close(jax.jit(lambda case=case: case(f))(), case(ref), "complex128")
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None


def test_third_order_in_the_points():
    op = NudftTraceable()
    x, c = _inputs(("float64", "complex128"))
    third = jax.jit(jax.jacfwd(jax.hessian(lambda x: _loss(op)(x, c))))(x)
    _close(third, jax.jacfwd(jax.hessian(lambda x: _loss(nudft_ref)(x, c)))(x), "complex128")


class Outer(jd.Primitive):
    """sum_k |Nudft(x, c)_k|² as one op, its traceable @jvp calling the partly linear op."""

    @jd.abstract
    def shapes(self, x, c):
        return jax.ShapeDtypeStruct((), x.dtype)

    @jd.forward
    def apply(self, x, c):
        y = np.exp(-1j * np.outer(np.arange(-3, 4), x)) @ c
        return np.asarray(np.sum(np.abs(y) ** 2), x.dtype)

    @jd.jvp(traceable=True)
    def push(self, x, c, dx, dc):
        inner = NudftTraceable()
        y = inner(x, c)
        dy = jax.jvp(inner, (x, c), (dx, dc))[1]
        return 2 * jnp.real(jnp.sum(jnp.conj(y) * dy))


def test_linear_inner_op_inside_a_traceable_jvp_at_second_order():
    """The inner op is linear in c and differentiable in x: a second derivative reaches x
    through it (an op declared linear=True, nondiff=("x",) refuses that)."""
    x, c = _inputs(("float64", "complex128"))
    op = Outer()
    h = jax.jit(jax.hessian(lambda x: op(x, c)))(x)
    _close(h, jax.hessian(lambda x: _loss(nudft_ref)(x, c))(x), "float64")
    g = jax.jit(jax.jacfwd(jax.grad(lambda x, c: op(x, c), 1), 0))(x, c)
    _close(g, jax.jacfwd(jax.grad(_loss(nudft_ref), 1), 0)(x, c), "complex128")


@pytest.mark.parametrize("transform", ["hessian_x", "mixed"])
def test_second_order_of_numpy_rules_names_the_rule_to_make_traceable(transform):
    op = Nudft()
    x, c = _inputs(("float64", "complex128"))
    if transform == "hessian_x":
        run = lambda: jax.hessian(lambda x: _loss(op)(x, c))(x)  # noqa: E731
        expected = r"Nudft.pull \(@vjp\) is a NumPy rule, so JAX cannot differentiate it again"
    else:  # the transpose (grad in c) differentiated in x
        run = lambda: jax.jacfwd(lambda x: jax.grad(_loss(op), 1)(x, c))(x)  # noqa: E731
        expected = (r"Nudft: a second derivative that mixes its linear inputs \('c'\) with "
                    r"the others \('x'\) .* Nudft.push is a NumPy rule: declare it "
                    r"`@jd.jvp\(traceable=True\)`")
    with pytest.raises(jd.MissingRuleError, match=expected):
        run()


# ---------------------------------------------------------------------------
# Which rules run
# ---------------------------------------------------------------------------

def _custom_calls(f, *args) -> list:
    """``(rule name, operand count, result count)`` of each jaxdecl call f compiles to."""
    calls = []
    for line in jax.jit(f).lower(*args).as_text().splitlines():
        found = re.search(r"custom_call @jaxdecl_dispatch\((.*?)\).*name = \"([^\"]+)\".*"
                          r"-> (.*)$", line)
        if found:
            operands = len([o for o in found.group(1).split(",") if o.strip()])
            results = found.group(3)
            count = results.count("tensor<") if results.startswith("(") else 1
            calls.append((found.group(2), operands, count))
    return calls


def test_derivatives_in_the_linear_inputs_run_forward_and_transpose_only():
    op = Nudft()
    x, c = _inputs(("float64", "complex128"))
    calls, _ = _counted(Nudft, jax.jit(jax.grad(_loss(op), 1)), x, c)
    assert calls == {"forward": 1, "transpose": 1}
    calls, _ = _counted(Nudft, jax.jit(lambda c, t: jax.jvp(lambda c: op(x, c), (c,), (t,))),
                        c, c)
    assert calls == {"forward": 2}  # the value, and the forward of the tangent
    calls, _ = _counted(Nudft, jax.jit(lambda v: jax.linear_transpose(
        lambda c: op(x, c), c)(v)), np.ones(7, complex))
    assert calls == {"transpose": 1}
    assert sorted(_custom_calls(jax.grad(_loss(op), 1), x, c)) == [
        ("Nudft.apply (@forward)", 2, 1), ("Nudft.apply_t (@transpose)", 2, 1)]


def test_derivatives_in_the_other_inputs_run_the_rules_asked():
    op = Nudft()
    x, c = _inputs(("float64", "complex128"))
    calls, _ = _counted(Nudft, jax.jit(jax.grad(_loss(op), 0)), x, c)
    assert calls == {"forward": 1, "vjp (True, False)": 1}
    calls, _ = _counted(Nudft, jax.jit(jax.grad(_loss(op), (0, 1))), x, c)
    assert calls == {"forward": 1, "vjp (True, True)": 1}
    Nudft.seen.clear()
    calls, _ = _counted(Nudft, jax.jit(lambda x, t: jax.jvp(lambda x: op(x, c), (x,), (t,))),
                        x, x)
    assert calls == {"forward": 1, "jvp": 1} and Nudft.seen == [("jvp", False, True)]
    # the vjp's call returns the one cotangent asked for
    assert sorted(_custom_calls(jax.grad(_loss(op), 0), x, c)) == [
        ("Nudft.apply (@forward)", 2, 1), ("Nudft.pull (@vjp)", 3, 1)]
    assert sorted(_custom_calls(lambda x, t: jax.jvp(lambda x: op(x, c), (x,), (t,)), x, x)) \
        == [("Nudft.apply (@forward)", 2, 1), ("Nudft.push (@jvp)", 3, 1)]


# ---------------------------------------------------------------------------
# vmap
# ---------------------------------------------------------------------------

VMAPPED = {
    "grad_both": lambda op, x, c: jax.grad(_loss(op), (0, 1))(x, c),
    "grad_c": lambda op, x, c: jax.grad(_loss(op), 1)(x, c),
    "jvp_both": lambda op, x, c: jax.jvp(op, (x, c), (jnp.cos(x), c))[1],
    "jvp_c": lambda op, x, c: jax.jvp(lambda c: op(x, c), (c,), (c,))[1],
    "transpose_c": lambda op, x, c: jax.linear_transpose(lambda v: op(x, v), c)(
        jnp.ones(7, complex))[0],
}


class NudftLoop(Nudft, batch="loop"):
    """Nudft under vmap: the rules once per batch element, inside one call."""


@pytest.mark.parametrize("in_axes", [(0, 0), (None, 0), (0, None), (1, 0)],
                         ids=["both", "c", "x", "moved"])
@pytest.mark.parametrize("kind", ["numpy", "numpy_loop", "traceable_jvp"])
def test_vmap_of_derivatives(kind, in_axes):
    op = NudftLoop() if kind == "numpy_loop" else OPS[kind]()
    x, c = _inputs(("float64", "complex128"), (3,))
    x = x.T.copy() if in_axes[0] == 1 else x
    args = tuple(a if axis is not None else a[0] for a, axis in zip((x, c), in_axes))
    for name, transform in VMAPPED.items():
        got = jax.jit(jax.vmap(lambda x, c, t=transform: t(op, x, c), in_axes=in_axes))(*args)
        expected = jax.vmap(lambda x, c, t=transform: t(nudft_ref, x, c), in_axes=in_axes)(
            *args)
        try:
            _close(got, expected, "complex128")
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None


# ---------------------------------------------------------------------------
# A @batch rule: the forward of a tangent and the transpose go through it
# ---------------------------------------------------------------------------

class BatchedNudft(Nudft):
    """Nudft with a @batch rule that folds a batch of strengths into one call (the points
    shared) and declines a batch of points."""

    batches: ClassVar[collections.Counter] = collections.Counter()

    @jd.batch
    def batched(self, args, axes):
        (x, c), (x_axis, c_axis) = args, axes
        type(self).batches[(x_axis, c_axis)] += 1
        if x_axis is not None:
            return NotImplemented
        return self(x, jnp.moveaxis(c, c_axis, 0)), 0


def test_batch_rule_serves_the_linear_derivatives():
    op = BatchedNudft()
    x, c = _inputs(("float64", "complex128"), (3,))
    BatchedNudft.batches.clear()
    Nudft.calls.clear()
    grads = jax.jit(jax.vmap(jax.grad(_loss(op), 1), in_axes=(None, 0)))(x[0], c)
    _close(grads, jax.vmap(jax.grad(_loss(nudft_ref), 1), in_axes=(None, 0))(x[0], c),
           "complex128")
    # the forward once (folded), its transpose once (the transpose of the batched forward)
    assert dict(Nudft.calls) == {"forward": 1, "transpose": 1}
    assert set(BatchedNudft.batches) == {(None, 0)}
    tangents = jax.jit(jax.vmap(lambda c: jax.jvp(lambda c: op(x[0], c), (c,), (c,))[1]))(c)
    _close(tangents, jax.vmap(lambda c: jax.jvp(lambda c: nudft_ref(x[0], c), (c,), (c,))[1])(
        c), "complex128")
    # points batched: declined, then batched as without the rule (every derivative)
    grads = jax.jit(jax.vmap(jax.grad(_loss(op), (0, 1))))(x, c)
    _close(grads, jax.vmap(jax.grad(_loss(nudft_ref), (0, 1)))(x, c), "complex128")


# ---------------------------------------------------------------------------
# Pytrees, residuals, linear=True
# ---------------------------------------------------------------------------

class Waves(jd.Primitive, linear=("s",), nondiff=("w",)):
    """s["a"] sin(x) + s["b"] cos(w x): linear in the dict s, smooth in x; w is nondiff."""

    @jd.abstract
    def shapes(self, x, s, w):
        return jax.ShapeDtypeStruct(x.shape, s["a"].dtype)

    @jd.forward
    def apply(self, x, s, w):
        return s["a"] * np.sin(x) + s["b"] * np.cos(w * x)

    @jd.transpose
    def apply_t(self, x, w, ct, *, wanted):
        type(self).wanted = wanted
        return {"a": np.sin(x) * ct, "b": np.cos(w * x) * ct}

    @jd.jvp(zeros=True)
    def push(self, x, s, w, dx, ds):
        type(self).tangents = (dx is None, None if ds is None else
                               {k: v is None for k, v in ds.items()})
        out = np.zeros(x.shape, s["a"].dtype)
        if dx is not None:
            out = out + (s["a"] * np.cos(x) - s["b"] * w * np.sin(w * x)) * dx
        if ds is not None:
            out = out + sum(v * f for v, f in ((ds["a"], np.sin(x)), (ds["b"], np.cos(w * x)))
                            if v is not None)
        return out

    @jd.vjp
    def pull(self, x, s, w, ct, *, wanted):
        dx = (s["a"] * np.cos(x) - s["b"] * w * np.sin(w * x)) * ct if wanted[0] else None
        return dx, ({"a": np.sin(x) * ct, "b": np.cos(w * x) * ct} if wanted[1] else None)


def waves_ref(x, s, w):
    return s["a"] * jnp.sin(x) + s["b"] * jnp.cos(w * x)


def test_pytree_linear_input():
    rng = np.random.default_rng(5)
    x, w = rng.uniform(0, 3, 4), rng.uniform(0.5, 2, 4)
    s = {"a": rng.standard_normal(4), "b": rng.standard_normal(4)}
    op = Waves()
    loss = lambda f: lambda x, s: jnp.sum(f(x, s, w) ** 2)  # noqa: E731
    for argnums in (0, 1, (0, 1)):
        _close(jax.jit(jax.grad(loss(op), argnums))(x, s),
               jax.grad(loss(waves_ref), argnums)(x, s), "float64")
    # one leaf of the linear input: the transpose returns the dict, asked for it
    g = jax.jit(jax.grad(lambda a: jnp.sum(op(x, {"a": a, "b": s["b"]}, w) ** 2)))(s["a"])
    _close(g, jax.grad(lambda a: jnp.sum(waves_ref(x, {"a": a, "b": s["b"]}, w) ** 2))(s["a"]),
           "float64")
    assert Waves.wanted == (True,)
    # a tangent of one leaf: the jvp sees the other leaf's as None, the points' too
    t = jax.jit(lambda x, a, t: jax.jvp(lambda x, a: op(x, {"a": a, "b": s["b"]}, w),
                                        (x, a), (t, t))[1])(x, s["a"], x)
    _close(t, jax.jvp(lambda x, a: waves_ref(x, {"a": a, "b": s["b"]}, w), (x, s["a"]),
                      (x, x))[1], "float64")
    assert Waves.tangents == (False, {"a": False, "b": True})
    with pytest.raises(ValueError, match="input 'w' is declared nondiff="):
        jax.grad(lambda w: jnp.sum(op(x, s, w)))(w)


class Solve(jd.Primitive, linear=("b",)):
    """x = A⁻¹ b: linear in b, smooth in A, the factorisation kept for the derivatives."""

    calls: ClassVar[collections.Counter] = collections.Counter()

    @jd.abstract
    def shapes(self, a, b):
        return jax.ShapeDtypeStruct(b.shape, b.dtype)

    @jd.residuals
    def keeps(self, a, b):
        return {"inv": jax.ShapeDtypeStruct(a.shape, a.dtype)}

    @jd.forward
    def apply(self, a, b, *, saved=None):
        type(self).calls["forward"] += 1
        inv = np.linalg.inv(a)
        if saved is not None:
            saved["inv"][...] = inv
        return inv @ b

    @jd.transpose
    def apply_t(self, a, ct):
        type(self).calls["transpose"] += 1
        return np.linalg.solve(a.T, ct)

    @jd.vjp
    def pull(self, a, b, ct, *, saved, result, wanted):
        type(self).calls[f"vjp {wanted}"] += 1
        lam = saved["inv"].T @ ct
        return (-np.outer(lam, result) if wanted[0] else None), (lam if wanted[1] else None)


def test_residuals_of_a_partly_linear_op():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((3, 3)) + 3 * np.eye(3), rng.standard_normal(3)
    op = Solve()
    loss = lambda f: lambda a, b: jnp.sum(jnp.sin(f(a, b)))  # noqa: E731
    ref = jnp.linalg.solve
    for argnums, rules in ((0, {"forward": 1, "vjp (True, False)": 1}),
                           (1, {"forward": 1, "transpose": 1}),
                           ((0, 1), {"forward": 1, "vjp (True, True)": 1})):
        calls, got = _counted(Solve, jax.jit(jax.value_and_grad(loss(op), argnums)), a, b)
        _close(got, jax.value_and_grad(loss(ref), argnums)(a, b), "float64")
        assert calls == rules, argnums


class Fft(jd.Primitive, linear=("x",)):
    """An FFT along `axis`: linear in x; linear=("x",) names every differentiable input."""

    def __init__(self, axis=-1):
        self.axis = axis

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        return np.fft.fft(x, axis=self.axis).astype(x.dtype)

    @jd.transpose
    def apply_t(self, ct):
        return np.fft.fft(ct, axis=self.axis).astype(ct.dtype)


def test_linear_tuple_naming_every_input_is_linear_true():
    spec = Fft.__jaxdecl_spec__
    assert spec.linear == ("x",) and not spec.partly_linear
    x = random_array(np.random.default_rng(0), (3, 4), np.dtype("complex128"))
    f = lambda x: jnp.sum(jnp.abs(Fft()(x)) ** 2)  # noqa: E731
    _close(jax.jit(jax.hessian(lambda v: jnp.sum(Fft()(v) ** 2), holomorphic=True))(x),
           jax.hessian(lambda v: jnp.sum(jnp.fft.fft(v) ** 2), holomorphic=True)(x),
           "complex128")
    _close(jax.grad(f)(x), jax.grad(lambda x: jnp.sum(jnp.abs(jnp.fft.fft(x)) ** 2))(x),
           "complex128")


# ---------------------------------------------------------------------------
# Transposing where an op is not linear
# ---------------------------------------------------------------------------

class Mul(jd.Primitive):
    """The README's op: x1 * x2**2."""

    @jd.abstract
    def shapes(self, x1, x2):
        return jax.ShapeDtypeStruct(x1.shape, x1.dtype)

    @jd.forward
    def apply(self, x1, x2):
        return x1 * x2**2

    @jd.vjp
    def pull(self, x1, x2, ct):
        return x2**2 * ct, 2 * x1 * x2 * ct


def test_linear_transpose_of_a_nonlinear_op_names_the_declaration():
    x, b = np.arange(3.0), np.full(3, 2.0)
    with pytest.raises(jd.MissingRuleError, match=re.escape(
            "Mul is not declared linear, so JAX cannot transpose it with respect to 'x1' "
            "(jax.linear_transpose, or a function JAX believes linear in it): if Mul is "
            "linear in 'x1', declare `linear=('x1',)` on the class with a `@jd.transpose` "
            "method that returns the cotangent of 'x1'")):
        jax.linear_transpose(lambda v: Mul()(v, b), x)(np.ones(3))


def test_linear_transpose_in_the_other_inputs_names_the_declaration():
    x, c = _inputs(("float64", "complex128"))
    with pytest.raises(jd.MissingRuleError, match=re.escape(
            "Nudft is linear in 'c' only, so JAX cannot transpose it with respect to 'x'")):
        jax.linear_transpose(lambda v: Nudft()(v, c), x)(np.ones(7, complex))


# ---------------------------------------------------------------------------
# Declarations that cannot hold: refused when the class is created
# ---------------------------------------------------------------------------

def _source(text):
    namespace = {}
    exec(text, namespace)
    return next(v for k, v in namespace.items() if k != "__builtins__")


def _shapes(self, x1, x2):
    return jax.ShapeDtypeStruct(x1.shape, x1.dtype)


def _apply(self, x1, x2):
    return x1 * np.sin(x2)


def _shapes3(self, x1, x2, x3):
    return jax.ShapeDtypeStruct(x1.shape, x1.dtype)


def _apply3(self, x1, x2, x3):
    return x1 * x2 * x3


def _body(*extra, three=False, **rules):
    body = {"shapes": jd.abstract(_shapes3 if three else _shapes),
            "apply": jd.forward(_apply3 if three else _apply)}
    for name, (decorator, text) in rules.items():
        body[name] = decorator(_source(text))
    return body


T, V, J = jd.transpose, jd.vjp, jd.jvp
BAD = {
    "unknown_name": (_body(t=(T, "def t(self, x2, ct): return ct")), {"linear": ("z",)},
                     ["Bad: linear=('z',) names 'z', which is not an input of Bad"]),
    "also_nondiff": (_body(t=(T, "def t(self, x2, ct): return ct")),
                     {"linear": "x1", "nondiff": ("x1",)},
                     ["'x1' is in both linear= and nondiff=", "remove it from nondiff="]),
    "not_names": (_body(), {"linear": 5}, ["linear=5 is not True or a tuple of input names"]),
    "empty": (_body(), {"linear": ()}, ["linear=() is not True or a tuple of input names"]),
    "named_twice": (_body(t=(T, "def t(self, ct): return ct, ct")), {"linear": ("x1", "x1")},
                    ["Bad: linear=('x1', 'x1') names an input twice"]),
    "multilinear_too": (_body(), {"linear": ("x1",), "multilinear": True},
                        ["choose one of linear=True and multilinear=True (linear=('x1',)"]),
    "no_transpose": (_body(), {"linear": ("x1",)},
                     ["Bad is declared linear=('x1',) but has no @jd.transpose (or @jd.adjoint)",
                      "`@jd.transpose def apply_t(self, x2, ct)`"]),
    "transpose_takes_a_linear_input": (
        _body(t=(T, "def t(self, x1, ct): return ct")), {"linear": ("x1",)},
        ["Bad.t (@transpose) takes 'x1', an input Bad is linear in", "`def t(self, x2, ct)`"]),
    "transpose_takes_too_few": (
        _body(t=(T, "def t(self, ct): return ct")), {"linear": ("x1",)},
        ["Bad.t (@transpose) takes (self, ct), but jaxdecl passes the inputs Bad is not "
         "linear in (x2)", "`def t(self, x2, ct)`"]),
    "transpose_in_another_order": (
        _body(t=(T, "def t(self, x3, x2, ct): return ct"), three=True), {"linear": ("x1",)},
        ["Bad.t (@transpose) takes 'x3' as parameter 1", "in input order (x2, x3)",
         "`def t(self, x2, x3, ct)`"]),
    "transpose_wrt": (_body(t=(jd.transpose(wrt="x1"), "def t(self, x2, ct): return ct")),
                      {"linear": ("x1",)}, ["Bad.t: @transpose(wrt=...) is for multilinear"]),
    "vjp_of_a_fully_linear_tuple": (
        _body(t=(T, "def t(self, ct): return ct, ct"),
              p=(V, "def p(self, x1, x2, ct): return ct, ct")), {"linear": ("x1", "x2")},
        ["Bad.p: a linear=('x1', 'x2') op derives @vjp from @forward and @transpose; remove "
         "it (linear=('x1', 'x2') names every input of Bad not in nondiff=",
         "leave it out of linear="]),
    "wanted_on_jvp": (
        _body(t=(T, "def t(self, x2, ct): return ct"),
              p=(J, "def p(self, x1, x2, d1, d2, *, wanted): return d1")), {"linear": ("x1",)},
        ["Bad.p (@jvp) takes `wanted`", "`@jd.jvp(zeros=True)`"]),
    "wanted_on_transpose_wrt": (
        _body(a=(jd.transpose(wrt="x1"), "def a(self, x2, ct, *, wanted): return ct"),
              b=(jd.transpose(wrt="x2"), "def b(self, x1, ct): return ct")),
        {"multilinear": True}, ["Bad.a (@transpose(wrt=...)) takes `wanted`"]),
    "transpose_takes_saved": (
        dict(_body(t=(T, "def t(self, x2, ct, *, saved): return ct"),
                   p=(V, "def p(self, x1, x2, ct, *, saved): return ct, ct")),
             keeps=jd.residuals(_source("def keeps(self, x1, x2): return {}")),
             apply=jd.forward(_source("def apply(self, x1, x2, *, saved=None): return x1"))),
        {"linear": ("x1",)},
        ["Bad.t (@transpose) takes saved, but the transpose of a partly linear op reads only "
         "the other inputs and the cotangents"]),
    "zeros_on_a_c_kernel": (
        dict(_body(t=(T, "def t(self, x2, ct): return ct")),
             p=jd.jvp(zeros=True)(jd.cfunction(1, name="p"))), {"linear": ("x1",)},
        ["Bad.p (@jvp): a C kernel cannot receive None for a zero tangent"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_misdeclared_partly_linear_op_is_refused(case):
    body, options, fragments = BAD[case]
    with pytest.raises(jd.DeclarationError) as info:
        jd.PrimitiveMeta("Bad", (jd.Primitive,), dict(body), **options)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_zeros_is_an_option_of_jvp_alone():
    with pytest.raises(TypeError, match=r"@jd.vjp takes no zeros= option \(only @jd.jvp"):
        jd.vjp(zeros=True)


class TwoOut(jd.Primitive, linear=("c",)):
    @jd.abstract
    def shapes(self, x, c):
        return (jax.ShapeDtypeStruct(c.shape, c.dtype),) * 2

    @jd.forward
    def apply(self, x, c):
        return c * np.sin(x), c * np.cos(x)

    @jd.transpose
    def apply_t(self, x, ct):  # one cotangent where there are two outputs
        return ct

    @jd.vjp
    def pull(self, x, c, ct0, ct1):
        return c * (np.cos(x) * ct0 - np.sin(x) * ct1), np.sin(x) * ct0 + np.cos(x) * ct1


def test_transpose_arity_is_checked_at_the_first_trace():
    x = np.linspace(0, 1, 3)
    with pytest.raises(jd.DeclarationError, match=re.escape(
            "TwoOut.apply_t (@transpose) takes (self, x, ct), but at these input types jaxdecl "
            "passes the inputs it is not linear in (x), then one cotangent per floating or "
            "complex output (2 here): `def apply_t(self, x, ct0, ct1)`")):
        jax.grad(lambda c: sum(jnp.sum(o) for o in TwoOut()(x, c)))(x)


class Mixed(jd.Primitive, linear=("p",)):
    """Linear in a dict input that holds an integer leaf: refused when first traced."""

    @jd.abstract
    def shapes(self, x, p):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, p):
        return p["w"] * np.sin(x) * p["n"]

    @jd.transpose
    def apply_t(self, x, ct):
        return {"w": ct, "n": None}


def test_a_linear_input_with_integer_leaves_is_refused_naming_it():
    x = np.linspace(0, 1, 3)
    p = {"w": np.ones(3), "n": np.arange(3)}
    with pytest.raises(jd.RuleError, match=re.escape(
            "Mixed is linear in 'p', but that input mixes differentiable and integer (or "
            "nondiff) leaves; pass the integer leaves as a separate nondiff= input")):
        jax.grad(lambda w: jnp.sum(Mixed()(x, {"w": w, "n": p["n"]})))(p["w"])


def test_transposing_in_a_nondiff_input_or_a_derivative_names_it():
    x, c = _inputs(("float64", "complex128"))
    w = np.linspace(0.5, 1.5, 4)
    s = {"a": np.ones(4), "b": np.ones(4)}
    with pytest.raises(jd.MissingRuleError, match=re.escape(
            "Waves cannot be transposed with respect to 'w': it is declared nondiff=, which "
            "has no cotangent")):
        jax.linear_transpose(lambda v: Waves()(w + 1, s, v), w)(np.ones(4))
    op = Nudft()
    with pytest.raises(jd.MissingRuleError, match=re.escape(
            "Nudft: JAX asked to transpose its jvp equation with respect to x, which it is "
            "not linear in")):
        jax.linear_transpose(lambda v: jax.jvp(lambda u: op(u, c), (v,), (x,))[1], x)(
            np.ones(7, complex))


class SolveTraceable(jd.Primitive, linear=("b",)):
    """A⁻¹ b whose traceable @jvp reads what the forward kept: no second derivative in A
    through the transpose."""

    @jd.abstract
    def shapes(self, a, b):
        return jax.ShapeDtypeStruct(b.shape, b.dtype)

    @jd.residuals
    def keeps(self, a, b):
        return {"inv": jax.ShapeDtypeStruct(a.shape, a.dtype)}

    @jd.forward
    def apply(self, a, b, *, saved=None):
        inv = np.linalg.inv(a)
        if saved is not None:
            saved["inv"][...] = inv
        return inv @ b

    @jd.transpose
    def apply_t(self, a, ct):
        return np.linalg.solve(a.T, ct)

    @jd.jvp(traceable=True, zeros=True)
    def push(self, a, b, da, db, *, saved, result):
        out = 0
        if da is not None:
            out = out - saved["inv"] @ (da @ result)
        if db is not None:
            out = out + saved["inv"] @ db
        return out


def test_a_second_derivative_through_the_transpose_refuses_saved():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((3, 3)) + 3 * np.eye(3), rng.standard_normal(3)
    op = SolveTraceable()
    g = jax.grad(lambda a, b: jnp.sum(jnp.sin(op(a, b))), 1)
    _close(jax.jit(g)(a, b), jax.grad(lambda a, b: jnp.sum(jnp.sin(jnp.linalg.solve(a, b))),
                                      1)(a, b), "float64")
    with pytest.raises(jd.MissingRuleError, match=re.escape(
            "SolveTraceable.push reads `saved`, which an opaque forward kept: declare it "
            "`@jd.jvp(traceable=True)`")):
        jax.jacfwd(g)(a, b)


# ---------------------------------------------------------------------------
# jd.check: linearity and the transpose in the linear inputs, each input alone
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("op_class", [Nudft, NudftTraceable, NudftPull, NudftLoop])
def test_check_passes_partly_linear_ops(op_class):
    jd.check(op_class(), *_inputs(("float64", "complex128")))


def test_check_passes_pytrees_and_residuals():
    rng = np.random.default_rng(4)
    jd.check(Waves(), rng.uniform(0, 3, 4), {"a": rng.standard_normal(4),
                                              "b": rng.standard_normal(4)},
             rng.uniform(0.5, 2, 4))
    jd.check(Solve(), rng.standard_normal((3, 3)) + 3 * np.eye(3), rng.standard_normal(3))


class NotLinear(Nudft):
    def apply(self, x, c):  # c * |c|: not linear in c
        return super().apply(x, c * np.abs(c))


class Conjugated(Nudft):
    def apply_t(self, x, ct):  # the adjoint, where the transpose is due
        return np.conj(super().apply_t(x, np.conj(ct)))


class ForgetsPoints(Nudft):
    @jd.jvp(zeros=True)
    def push(self, x, c, dx, dc):  # drops the points' tangent when dc is None
        return super().push(x, c, None if dc is None else dx, dc) if dc is not None else \
            np.zeros(MODES.shape, np.result_type(c.dtype, np.complex64))


class WrongAlone(Nudft):
    def pull(self, x, c, ct, *, wanted):  # the points' cotangent is wrong when asked alone
        dx, dc = super().pull(x, c, ct, wanted=(True, True))
        return (2 * dx if not wanted[1] else dx), (dc if wanted[1] else None)


@pytest.mark.parametrize("op_class, message", [
    (NotLinear, "jd.check: NotLinear.apply (@forward) is not linear in 'c' (linear=('c',)) at "
                "fixed other inputs"),
    (Conjugated, "jd.check: Conjugated.apply_t (@transpose) fails the dot-product test against "
                 "Conjugated.apply (@forward) in its linear inputs at fixed other inputs"),
    (ForgetsPoints, "jd.check: ForgetsPoints.push (@jvp) disagrees with finite differences for "
                    "d output / d x: "),
    (WrongAlone, "jd.check: WrongAlone.pull (@vjp) disagrees with finite differences for "
                 "d output / d x: "),
])
def test_check_names_the_wrong_rule_of_a_partly_linear_op(op_class, message):
    with pytest.raises(AssertionError, match=re.escape(message)) as raised:
        jd.check(op_class(), *_inputs(("float64", "complex128")))
    if op_class in (ForgetsPoints, WrongAlone):  # wrong only when 'x' alone is differentiated
        assert "(differentiating in 'x' alone: " in str(raised.value)
