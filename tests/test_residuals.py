"""Residuals (@jd.residuals, saved=, result=): the forward runs once per derivative.

Every derivative is compared with an independent reference (jax.numpy, finite
differences through jax.test_util.check_grads); call counters prove how often
each rule runs, and that a plain call computes no residuals.
"""

import collections
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg
from conftest import needs_split, tol
from jax.test_util import check_grads
from ops import compile_c

import jaxdecl as jd

DTYPES = ["float32", "float64", "complex64", "complex128"]
CALLS: collections.Counter = collections.Counter()


def _same(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _matrix(rng, n, dtype):
    a = rng.standard_normal((n, n)) + n * np.eye(n)
    if np.issubdtype(dtype, np.complexfloating):
        a = a + 1j * rng.standard_normal((n, n))
    return a.astype(dtype)


def _vector(rng, shape, dtype):
    v = rng.standard_normal(shape)
    if np.issubdtype(dtype, np.complexfloating):
        v = v + 1j * rng.standard_normal(shape)
    return v.astype(dtype)


# ---------------------------------------------------------------------------
# Ops under test
# ---------------------------------------------------------------------------


class Solve(jd.Primitive):
    """x = A⁻¹ b, return form: A factorised once, the LU and integer pivots kept."""

    @jd.abstract
    def shapes(self, a, b):
        return _same(b)

    @jd.residuals
    def keeps(self, a, b):
        return {"lu": _same(a), "piv": jax.ShapeDtypeStruct(a.shape[:1], np.int32)}

    @jd.forward
    def apply(self, a, b, *, saved=None):
        CALLS["forward", saved is not None] += 1
        lu, piv = scipy.linalg.lu_factor(a)
        if saved is not None:
            saved["lu"][...], saved["piv"][...] = lu, piv
        return scipy.linalg.lu_solve((lu, piv), b).astype(b.dtype)

    @jd.jvp
    def push(self, a, b, da, db, *, saved, result):
        CALLS["jvp"] += 1
        assert not saved["lu"].flags.writeable and not result.flags.writeable
        return scipy.linalg.lu_solve((saved["lu"], saved["piv"]), db - da @ result)

    @jd.vjp
    def pull(self, a, b, ct, *, saved, result):
        CALLS["vjp"] += 1
        lam = scipy.linalg.lu_solve((saved["lu"], saved["piv"]), ct, trans=1)
        return -np.outer(lam, result), lam


class SolveInto(Solve):
    """The same op, zero-copy: the forward and the vjp fill `out`."""

    @jd.forward
    def apply(self, a, b, *, out, saved=None):
        CALLS["forward", saved is not None] += 1
        lu, piv = scipy.linalg.lu_factor(a)
        if saved is not None:
            np.copyto(saved["lu"], lu)
            saved["piv"][...] = piv
        out[...] = scipy.linalg.lu_solve((lu, piv), b)

    @jd.vjp
    def pull(self, a, b, ct, *, out, saved, result):
        CALLS["vjp"] += 1
        ct_a, ct_b = out
        ct_b[...] = scipy.linalg.lu_solve((saved["lu"], saved["piv"]), ct, trans=1)
        np.multiply(-ct_b[:, None], result[None, :], out=ct_a)


class SolveRebinding(Solve):
    """Rebinds the residual dict's entries instead of writing into the views."""

    @jd.forward
    def apply(self, a, b, *, saved=None):
        lu, piv = scipy.linalg.lu_factor(a)
        if saved is not None:
            saved["lu"], saved["piv"] = lu, piv.astype(np.int32)
        return scipy.linalg.lu_solve((lu, piv), b).astype(b.dtype)


def solve_ref(a, b):
    return jnp.linalg.solve(a, b)


class Softmax(jd.Primitive):
    """softmax(x), traceable rules that read only `result`: every order works."""

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x):
        CALLS["forward"] += 1
        e = np.exp(x - x.max())
        return e / e.sum()

    @jd.jvp(traceable=True)
    def push(self, x, dx, *, result):
        return result * (dx - jnp.sum(result * dx))

    @jd.vjp(traceable=True)
    def pull(self, x, ct, *, result):
        return result * (ct - jnp.sum(result * ct))


class NormalizeTraceable(jd.Primitive):
    """x / |x| with a float residual (the norm) read by traceable rules."""

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.residuals
    def keeps(self, x):
        return jax.ShapeDtypeStruct((), x.dtype)

    @jd.forward
    def apply(self, x, *, saved=None):
        CALLS["forward", saved is not None] += 1
        norm = np.linalg.norm(x)
        if saved is not None:
            saved[...] = norm
        return x / norm

    @jd.jvp(traceable=True)
    def push(self, x, dx, *, saved, result):
        return (dx - result * jnp.dot(result, dx)) / saved

    @jd.vjp(traceable=True)
    def pull(self, x, ct, *, saved, result):
        return (ct - result * jnp.dot(result, ct)) / saved


class SortedScale(jd.Primitive):
    """y = w * sort(x) with the sorting permutation as an integer-only residual."""

    @jd.abstract
    def shapes(self, x, w):
        return _same(x)

    @jd.residuals
    def keeps(self, x, w):
        return {"order": jax.ShapeDtypeStruct(x.shape, np.int64)}

    @jd.forward
    def apply(self, x, w, *, saved=None):
        CALLS["forward", saved is not None] += 1
        order = np.argsort(x)
        if saved is not None:
            saved["order"][...] = order
        return w * x[order]

    @jd.jvp(traceable=True)
    def push(self, x, w, dx, dw, *, saved):
        return dw * x[saved["order"]] + w * dx[saved["order"]]

    @jd.vjp(traceable=True)
    def pull(self, x, w, ct, *, saved):
        ct_x = jnp.zeros_like(x).at[saved["order"]].set(w * ct)
        return ct_x, ct * x[saved["order"]]


def sorted_scale_ref(x, w):
    return w * jnp.sort(x)


class Polar(jd.Primitive, batch="vectorized"):
    """{"x", "y"} -> {"r", "phi"}: pytree inputs, outputs and residuals; vectorized batching."""

    @jd.abstract
    def shapes(self, p):
        return {"r": _same(p["x"]), "phi": _same(p["x"])}

    @jd.residuals
    def keeps(self, p):
        return {"unit": (_same(p["x"]), _same(p["x"]))}

    @jd.forward
    def apply(self, p, *, saved=None):
        CALLS["forward", saved is not None, np.shape(p["x"])] += 1
        r = np.hypot(p["x"], p["y"])
        if saved is not None:
            cos, sin = saved["unit"]
            np.divide(p["x"], r, out=cos)
            np.divide(p["y"], r, out=sin)
        return {"r": r, "phi": np.arctan2(p["y"], p["x"])}

    @jd.vjp
    def pull(self, p, ct, *, saved, result):
        CALLS["vjp"] += 1
        cos, sin = saved["unit"]
        r = result["r"]
        return {"x": ct["r"] * cos - ct["phi"] * sin / r,
                "y": ct["r"] * sin + ct["phi"] * cos / r}


def polar_ref(p):
    return {"r": jnp.hypot(p["x"], p["y"]), "phi": jnp.arctan2(p["y"], p["x"])}


class Nearest1D(jd.Primitive):
    """(distance, index) to the nearest of fixed points; the vjp reuses the index (result)."""

    def __init__(self, points):
        self.points = np.asarray(points)

    @jd.abstract
    def shapes(self, q):
        return _same(q), jax.ShapeDtypeStruct(q.shape, np.int32)

    @jd.forward
    def apply(self, q, *, out):
        CALLS["forward"] += 1
        distance, index = out
        gaps = np.abs(q[..., None] - self.points)
        index[...] = np.argmin(gaps, axis=-1)
        distance[...] = np.take_along_axis(gaps, index[..., None].astype(np.intp), -1)[..., 0]

    @jd.vjp
    def pull(self, q, ct, *, result):
        CALLS["vjp"] += 1
        _, index = result  # all outputs, the integer one too
        return ct * np.sign(q - self.points[index])


# ---------------------------------------------------------------------------
# The forward runs once per derivative
# ---------------------------------------------------------------------------


def _loss(op):
    return lambda a, b: jnp.sum(jnp.abs(op(a, b)) ** 2)


def _derivatives():
    """name -> (function of (op, a, b, t) -> values, rules each evaluation runs)."""
    def grad(op, a, b, t):
        return jax.grad(_loss(op), (0, 1))(a, b)

    def value_and_grad(op, a, b, t):
        return jax.value_and_grad(_loss(op), (0, 1))(a, b)

    def vjp(op, a, b, t):
        y, pullback = jax.vjp(op, a, b)
        return y, pullback(t[1]), pullback(2 * t[1])

    def jvp(op, a, b, t):
        return jax.jvp(op, (a, b), t)

    def linearize(op, a, b, t):
        y, f_jvp = jax.linearize(op, a, b)
        return y, f_jvp(*t), f_jvp(t[0], 2 * t[1])

    return {"grad": (grad, {"vjp": 1}), "value_and_grad": (value_and_grad, {"vjp": 1}),
            "vjp": (vjp, {"vjp": 2}), "jvp": (jvp, {"jvp": 1}),
            "linearize": (linearize, {"jvp": 2})}


DERIVATIVES = _derivatives()


def _inputs(dtype, n=4, seed=0):
    rng = np.random.default_rng(seed)
    a, b = _matrix(rng, n, dtype), _vector(rng, n, dtype)
    tangents = (_matrix(rng, n, dtype), _vector(rng, n, dtype))
    return a, b, tangents


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(DERIVATIVES))
@pytest.mark.parametrize("op_class", [Solve, SolveInto])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_runs_once_per_derivative(op_class, name, jit, dtype):
    a, b, t = _inputs(dtype)
    derivative, rules = DERIVATIVES[name]
    run = jax.jit(derivative, static_argnums=0) if jit else derivative
    expected = derivative(type("SolveRef", (), {"__call__": staticmethod(solve_ref)})(), a, b, t)
    CALLS.clear()
    actual = jax.block_until_ready(run(op_class(), a, b, t))
    assert CALLS == collections.Counter({("forward", True): 1, **rules}), dict(CALLS)
    for x, y in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(x, y, rtol=30 * tol(dtype), atol=30 * tol(dtype))


@pytest.mark.parametrize("jac, rules", [(jax.jacfwd, {"jvp": 20}), (jax.jacrev, {"vjp": 4})])
def test_jacobians_run_the_forward_once(jac, rules):
    a, b, _ = _inputs("float64")
    CALLS.clear()
    actual = jax.block_until_ready(jax.jit(jac(Solve(), (0, 1)))(a, b))
    # One forward; the batched derivative rule loops over the 4 * 4 + 4 (or 4) directions.
    assert CALLS == collections.Counter({("forward", True): 1, **rules}), dict(CALLS)
    for x, y in zip(actual, jac(solve_ref, (0, 1))(a, b)):
        np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("op_class", [Solve, SolveInto])
def test_plain_calls_compute_no_residuals(op_class):
    a, b, t = _inputs("float64")
    op = op_class()
    CALLS.clear()
    jax.block_until_ready([
        op(a, b),
        jax.jit(op)(a, b),
        jax.vmap(op)(np.stack([a, a]), np.stack([b, b])),
        jax.grad(lambda b: jnp.sum(op(jax.lax.stop_gradient(a), jax.lax.stop_gradient(b))))(b),
        jax.jvp(lambda b: op(a, jax.lax.stop_gradient(b)), (b,), (b,))])
    assert CALLS == collections.Counter({("forward", False): 6}), dict(CALLS)


def test_jit_grad_compiles_one_forward():
    a, b, _ = _inputs("float64")
    text = jax.jit(jax.grad(_loss(Solve()), (0, 1))).lower(a, b).compile().as_text()
    assert text.count("custom_call_target=\"jaxdecl_dispatch\"") == 2  # forward, vjp


def test_checkpoint_recomputes_the_residuals():
    a, b, _ = _inputs("float64")
    op = Solve()
    CALLS.clear()
    value, grads = jax.value_and_grad(jax.checkpoint(_loss(op)), (0, 1))(a, b)
    expected_value, expected = jax.value_and_grad(_loss(solve_ref), (0, 1))(a, b)
    # The forward pass computes the value; the backward pass recomputes what it keeps.
    assert CALLS[("forward", True)] == 2 and CALLS["vjp"] == 1, dict(CALLS)
    np.testing.assert_allclose(value, expected_value, rtol=1e-12)
    for x, y in zip(grads, expected):
        np.testing.assert_allclose(x, y, rtol=1e-10)


@pytest.mark.parametrize("dtype", ["float64", "complex128"])
def test_check_grads_through_saved_and_result(dtype):
    a, b, _ = _inputs(dtype)
    check_grads(Solve(), (a, b), order=1, modes=("fwd", "rev"), eps=1e-6, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------
# result= without residuals, integer outputs in `result`
# ---------------------------------------------------------------------------


def test_result_alone_binds_the_plain_forward_once():
    op = Nearest1D(np.array([-1.0, 0.5, 2.0]))
    q = jnp.array([-0.7, 0.2, 1.6, 3.0])
    CALLS.clear()
    grad = jax.block_until_ready(jax.jit(jax.grad(lambda q: jnp.sum(op(q)[0] ** 2)))(q))
    assert CALLS == collections.Counter({"forward": 1, "vjp": 1})
    ref = jax.grad(lambda q: jnp.sum(jnp.min(jnp.abs(q[:, None] - op.points), axis=1) ** 2))(q)
    np.testing.assert_allclose(grad, ref, rtol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_hessian_through_result_only_rules(dtype):
    x = jnp.asarray(np.linspace(-1.0, 2.0, 5), dtype)
    weights = jnp.arange(1.0, 6.0, dtype=dtype)

    def loss(f):
        return lambda x: jnp.sum(weights * f(x) ** 2)

    np.testing.assert_allclose(jax.hessian(loss(Softmax()))(x),
                               jax.hessian(loss(jax.nn.softmax))(x), rtol=tol(dtype),
                               atol=tol(dtype))
    check_grads(Softmax(), (x.astype(np.float64),), order=2, modes=("fwd", "rev"))


def test_second_derivative_through_float_residuals_is_refused():
    x = jnp.array([3.0, 4.0])
    op = NormalizeTraceable()
    np.testing.assert_allclose(jax.grad(lambda x: op(x)[0])(x), [0.128, -0.096], rtol=1e-12)
    with pytest.raises(jd.MissingRuleError, match=r"NormalizeTraceable keeps floating-point "
                                                  r"residuals.*NormalizeTraceable.keeps"):
        jax.hessian(lambda x: op(x)[0])(x)


def test_integer_residuals_allow_every_order():
    x = jnp.array([0.3, -1.2, 2.5, 0.9])
    w = jnp.array([1.0, 2.0, -1.0, 0.5])
    op = SortedScale()

    def loss(f):
        return lambda x, w: jnp.sum(jnp.sin(f(x, w)) * f(x, w))

    for argnums in (0, 1):
        np.testing.assert_allclose(jax.hessian(loss(op), argnums)(x, w),
                                   jax.hessian(loss(sorted_scale_ref), argnums)(x, w),
                                   rtol=1e-12, atol=1e-12)
    check_grads(op, (x, w), order=2, modes=("fwd", "rev"))


class NormalizeJvpOnly(NormalizeTraceable):
    """Only a traceable @jvp reading saved and result: JAX transposes it for reverse mode."""

    pull = None


def normalize_ref(x):
    return x / jnp.linalg.norm(x)


@pytest.mark.parametrize("op_class", [NormalizeTraceable, NormalizeJvpOnly])
def test_traceable_rules_get_saved_and_result_as_jax_values(op_class):
    x = jnp.array([3.0, -4.0, 1.0])
    t = jnp.array([0.5, 1.0, -2.0])
    op = op_class()
    CALLS.clear()
    grad = jax.block_until_ready(jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(op(x)))))(x))
    assert CALLS == collections.Counter({("forward", True): 1}), dict(CALLS)
    np.testing.assert_allclose(
        grad, jax.grad(lambda x: jnp.sum(jnp.sin(normalize_ref(x))))(x), rtol=1e-12)
    np.testing.assert_allclose(jax.jvp(op, (x,), (t,))[1],
                               jax.jvp(normalize_ref, (x,), (t,))[1], rtol=1e-12)
    xs = jnp.stack([x, 2 * x + 1, -x])
    np.testing.assert_allclose(
        jax.vmap(jax.grad(lambda x: op(x)[1]))(xs),
        jax.vmap(jax.grad(lambda x: normalize_ref(x)[1]))(xs), rtol=1e-12)
    jd.check(op, np.asarray(x))


# ---------------------------------------------------------------------------
# Composition: pytrees, vmap, scan, cond
# ---------------------------------------------------------------------------


def _polar_inputs(batch=()):
    rng = np.random.default_rng(3)
    return {"x": rng.uniform(0.5, 2.0, batch + (3,)), "y": rng.uniform(-1.0, 1.0, batch + (3,))}


def _polar_loss(f):
    def loss(p):
        out = f(p)
        return jnp.sum(out["r"] ** 2 + jnp.sin(out["phi"]))

    return loss


def test_pytree_residuals_and_result():
    p = _polar_inputs()
    CALLS.clear()
    value, grad = jax.block_until_ready(jax.jit(jax.value_and_grad(_polar_loss(Polar())))(p))
    assert CALLS == collections.Counter({("forward", True, (3,)): 1, "vjp": 1}), dict(CALLS)
    ref_value, ref = jax.value_and_grad(_polar_loss(polar_ref))(p)
    np.testing.assert_allclose(value, ref_value, rtol=1e-12)
    for key in ("x", "y"):
        np.testing.assert_allclose(grad[key], ref[key], rtol=1e-12)


@pytest.mark.parametrize("order", ["vmap_of_grad", "grad_of_vmap"])
def test_vectorized_batch_sees_batched_residuals(order):
    p = _polar_inputs((5,))
    grad = jax.grad(_polar_loss(Polar()))
    ref = jax.vmap(jax.grad(_polar_loss(polar_ref)))(p)
    CALLS.clear()
    if order == "vmap_of_grad":
        actual = jax.jit(jax.vmap(grad))(p)
    else:
        actual = jax.jit(jax.grad(lambda p: jnp.sum(jax.vmap(_polar_loss(Polar()))(p))))(p)
    jax.block_until_ready(actual)
    # One call on the whole batch: the residual views carry the batch dim too.
    assert CALLS == collections.Counter({("forward", True, (5, 3)): 1, "vjp": 1}), dict(CALLS)
    for key in ("x", "y"):
        np.testing.assert_allclose(actual[key], ref[key], rtol=1e-12)


class SolveBatchRule(Solve):
    """A @batch rule for the forward: the residual-keeping forward loops instead."""

    @jd.batch
    def batched(self, args, axes):
        CALLS["batch rule"] += 1
        a, b = (jnp.moveaxis(x, ax, 0) if ax is not None else x for x, ax in zip(args, axes))
        return jnp.linalg.solve(a, b[..., None])[..., 0], 0


@pytest.mark.parametrize("op_class", [Solve, SolveBatchRule])
def test_vmap_of_grad_loops_the_saving_forward(op_class):
    rng = np.random.default_rng(5)
    a = np.stack([_matrix(rng, 3, np.float64) for _ in range(4)])
    b = rng.standard_normal((4, 3))
    CALLS.clear()
    actual = jax.block_until_ready(jax.jit(jax.vmap(jax.grad(_loss(op_class()), (0, 1))))(a, b))
    expected = jax.vmap(jax.grad(_loss(solve_ref), (0, 1)))(a, b)
    assert CALLS == collections.Counter({("forward", True): 4, "vjp": 4}), dict(CALLS)
    for x, y in zip(actual, expected):
        np.testing.assert_allclose(x, y, rtol=1e-10)
    CALLS.clear()
    # A plain batched call uses the @batch rule, when there is one.
    jax.block_until_ready(jax.vmap(op_class())(a, b))
    assert CALLS == (collections.Counter({"batch rule": 1}) if op_class is SolveBatchRule
                     else collections.Counter({("forward", False): 4})), dict(CALLS)


def test_grad_through_scan_and_cond():
    a, b, _ = _inputs("float64", n=3)
    op = Solve()

    def chain(f):
        def loss(a, b):
            def body(carry, _):
                x = f(a, carry)
                return jax.lax.cond(jnp.sum(x) > 0, lambda v: v, lambda v: -v, x), None

            return jnp.sum(jax.lax.scan(body, b, None, length=3)[0] ** 2)

        return loss

    CALLS.clear()
    actual = jax.block_until_ready(jax.jit(jax.grad(chain(op), (0, 1)))(a, b))
    assert CALLS == collections.Counter({("forward", True): 3, "vjp": 3}), dict(CALLS)
    expected = jax.grad(chain(solve_ref), (0, 1))(a, b)
    for x, y in zip(actual, expected):
        np.testing.assert_allclose(x, y, rtol=1e-10)


# ---------------------------------------------------------------------------
# Declaration errors
# ---------------------------------------------------------------------------


def _class(name, namespace, **options):
    base = {"shapes": jd.abstract(lambda self, x: _same(x))}
    return type(name, (jd.Primitive,), {**base, **namespace}, **options)


def test_saved_without_residuals_is_named():
    with pytest.raises(jd.DeclarationError, match=r"NoKeeps.pull \(@vjp\) takes `saved`, but "
                                                  r"NoKeeps has no @jd.residuals"):
        class NoKeeps(jd.Primitive):
            @jd.abstract
            def shapes(self, x):
                return _same(x)

            @jd.forward
            def apply(self, x):
                return x

            @jd.vjp
            def pull(self, x, ct, *, saved):
                return ct

    with pytest.raises(jd.DeclarationError, match=r"NoKeeps2.apply \(@forward\) takes `saved`"):
        class NoKeeps2(jd.Primitive):
            @jd.abstract
            def shapes(self, x):
                return _same(x)

            @jd.forward
            def apply(self, x, *, saved=None):
                return x


def test_forward_without_saved_is_named():
    with pytest.raises(jd.DeclarationError, match=r"Keeps declares residuals \(Keeps.keeps\), "
                                                  r"but Keeps.apply \(@forward\) does not "
                                                  r"accept `saved`"):
        class Keeps(jd.Primitive):
            @jd.abstract
            def shapes(self, x):
                return _same(x)

            @jd.residuals
            def keeps(self, x):
                return _same(x)

            @jd.forward
            def apply(self, x):
                return x

            @jd.vjp
            def pull(self, x, ct, *, saved):
                return ct


def test_residuals_no_rule_reads_is_named():
    with pytest.raises(jd.DeclarationError, match=r"Unread declares residuals.*no @jvp or @vjp "
                                                  r"takes `saved`"):
        class Unread(jd.Primitive):
            @jd.abstract
            def shapes(self, x):
                return _same(x)

            @jd.residuals
            def keeps(self, x):
                return _same(x)

            @jd.forward
            def apply(self, x, *, saved=None):
                return x

            @jd.vjp
            def pull(self, x, ct):
                return ct


def test_residuals_inputs_must_match():
    with pytest.raises(jd.DeclarationError, match=r"Mismatch.keeps \(@residuals\) takes "
                                                  r"inputs \('y',\)"):
        class Mismatch(Solve):
            @jd.residuals
            def keeps(self, y):
                return _same(y)


def test_linear_and_multilinear_ops_refuse_residuals():
    with pytest.raises(jd.DeclarationError, match=r"Lin.keeps \(@residuals\): Lin is linear"):
        class Lin(jd.Primitive, linear=True):
            @jd.abstract
            def shapes(self, x):
                return _same(x)

            @jd.residuals
            def keeps(self, x):
                return _same(x)

            @jd.forward
            def apply(self, x, *, saved=None):
                return x

            @jd.transpose
            def apply_t(self, ct):
                return ct

    def transpose_x(self, y, ct, *, result):
        return ct * y

    with pytest.raises(jd.DeclarationError, match=r"Bilinear.transpose_x \(@transpose\) takes "
                                                  r"result, but Bilinear is linear"):
        type("Bilinear", (jd.Primitive,), {
            "shapes": jd.abstract(lambda self, x, y: _same(x)),
            "apply": jd.forward(lambda self, x, y: x * y),
            "transpose_x": jd.transpose(transpose_x, wrt="x"),
            "transpose_y": jd.transpose(lambda self, x, ct: ct * x, wrt="y")},
            multilinear=True)


def test_rebound_residuals_are_copied():
    a, b, _ = _inputs("float64")
    grads = jax.jit(jax.grad(_loss(SolveRebinding()), (0, 1)))(a, b)
    expected = jax.grad(_loss(solve_ref), (0, 1))(a, b)
    for x, y in zip(grads, expected):
        np.testing.assert_allclose(x, y, rtol=1e-10)


class WrongPivots(Solve):
    @jd.forward
    def apply(self, a, b, *, saved=None):
        lu, piv = scipy.linalg.lu_factor(a)
        if saved is not None:
            saved["lu"], saved["piv"] = lu, piv.astype(np.int64)  # declared int32
        return scipy.linalg.lu_solve((lu, piv), b)


class WrongStructure(Solve):
    @jd.forward
    def apply(self, a, b, *, saved=None):
        if saved is not None:
            saved["perm"] = np.arange(3)
        return np.linalg.solve(a, b)


class WrongDeclaration(Solve):
    @jd.residuals
    def keeps(self, a, b):
        return {"lu": "a string"}


@pytest.mark.parametrize("op_class, message", [
    (WrongPivots, r"WrongPivots.apply \(@forward\) put shape \(4,\) int64 at saved\['piv'\], "
                  r"but @residuals declared shape \(4,\) int32"),
    (WrongStructure, r"WrongStructure.apply \(@forward\) changed the structure of `saved`"),
    (WrongDeclaration, r"WrongDeclaration.keeps \(@residuals\) must return "
                       r"jax.ShapeDtypeStruct.*saved\['lu'\]"),
])
def test_residuals_that_do_not_match_name_the_key_path(op_class, message):
    a, b, _ = _inputs("float64")
    with pytest.raises(jd.RuleError, match=message):
        jax.grad(_loss(op_class()), (0, 1))(a, b)


def test_eager_jvp_without_jvp_rule_fails_before_the_forward():
    class PullOnly(Solve):
        push = None

    a, b, t = _inputs("float64")
    CALLS.clear()
    with pytest.raises(jd.MissingRuleError, match="PullOnly has no @jvp"):
        jax.jvp(PullOnly(), (a, b), t)
    assert not CALLS


# ---------------------------------------------------------------------------
# jd.check
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("op", [Solve(), SolveInto(), SolveRebinding()],
                         ids=["return", "zero_copy", "rebinding"])
def test_check_accepts_ops_with_residuals(op):
    a, b, _ = _inputs("float64")
    jd.check(op, a, b)


def test_check_accepts_pytree_integer_and_result_only_ops():
    jd.check(Polar(), _polar_inputs())
    jd.check(SortedScale(), np.array([0.3, -1.2, 2.5]), np.array([1.0, 2.0, -1.0]))
    jd.check(Softmax(), np.array([0.3, -1.2, 2.5]))


class KeepsAView(Solve):
    @jd.forward
    def apply(self, a, b, *, saved=None):
        x = Solve.apply(self, a, b, saved=saved)
        if saved is not None:
            self.kept = saved["lu"]  # a view of XLA's buffer, kept past the call
        return x


def test_a_kept_residual_view_is_named():
    a, b, _ = _inputs("float64")
    with pytest.raises(jd.BufferEscapeError, match=r"KeepsAView.apply \(@forward\) kept a "
                                                   r"reference to saved\['lu'\]"):
        jax.grad(_loss(KeepsAView()), (0, 1))(a, b)


class HalfWritten(Solve):
    @jd.forward
    def apply(self, a, b, *, saved=None):
        lu, piv = scipy.linalg.lu_factor(a)
        if saved is not None:
            saved["lu"][:2] = lu[:2]  # rows 2 and 3 left as they were
            saved["piv"][...] = piv
        return scipy.linalg.lu_solve((lu, piv), b)


class StaleResult(Solve):
    @jd.vjp
    def pull(self, a, b, ct, *, saved, result):
        lam = scipy.linalg.lu_solve((saved["lu"], saved["piv"]), ct, trans=0)  # not transposed
        return -np.outer(lam, result), lam


class DependsOnSaved(Solve):
    @jd.forward
    def apply(self, a, b, *, saved=None):
        x = Solve.apply(self, a, b, saved=saved)
        return x if saved is None else 2 * x


@pytest.mark.parametrize("op, message", [
    (HalfWritten(), r"HalfWritten.apply \(@forward\) leaves 8 of 16 elements of saved\['lu'\] "
                    r"unwritten"),
    (StaleResult(), r"StaleResult.pull \(@vjp\) disagrees with finite differences for d "
                    r"output / d a: "),
    (DependsOnSaved(), r"DependsOnSaved.apply \(@forward\) returns a different output when "
                       r"given saved="),
])
def test_check_rejects_wrong_residual_rules(op, message):
    a, b, _ = _inputs("float64")
    with pytest.raises(AssertionError, match=message):
        jd.check(op, a, b)


# ---------------------------------------------------------------------------
# C kernels
# ---------------------------------------------------------------------------

C_SOURCE = textwrap.dedent(r"""
    #include "jaxdecl.h"

    static int64_t size(const jaxdecl_buffer* b) {
      int64_t n = 1;
      for (int64_t i = 0; i < b->rank; ++i) n *= b->dims[i];
      return n;
    }

    /* y = x * x; with a residual buffer (a derivative follows), also keeps 2x. */
    int square(const jaxdecl_buffer* in, int64_t nin, const jaxdecl_buffer* out,
               int64_t nout, char* message, int64_t message_size) {
      const double* x = (const double*)in[0].data;
      double* y = (double*)out[0].data;
      for (int64_t i = 0, n = size(&in[0]); i < n; ++i) y[i] = x[i] * x[i];
      if (nout == 2) {
        double* twice = (double*)out[1].data;
        for (int64_t i = 0, n = size(&in[0]); i < n; ++i) twice[i] = 2 * x[i];
      }
      return 0;
    }

    /* operands: x, ct, saved (2x) -> ct * 2x */
    int square_vjp(const jaxdecl_buffer* in, int64_t nin, const jaxdecl_buffer* out,
                   int64_t nout, char* message, int64_t message_size) {
      if (nin != 3) return 1;
      const double* ct = (const double*)in[1].data;
      const double* twice = (const double*)in[2].data;
      double* g = (double*)out[0].data;
      for (int64_t i = 0, n = size(&in[0]); i < n; ++i) g[i] = ct[i] * twice[i];
      return 0;
    }
""")


@pytest.fixture(scope="module")
def c_library(tmp_path_factory):
    return compile_c(C_SOURCE, tmp_path_factory.mktemp("residual_kernels"))


@pytest.mark.parametrize("with_result_jvp", [False, True],
                         ids=["c_vjp_direct", "c_vjp_without_result"])
def test_c_kernels_keep_and_read_residuals(c_library, with_result_jvp):
    lib = c_library
    namespace = {
        "shapes": jd.abstract(lambda self, x: _same(x)),
        "keeps": jd.residuals(lambda self, x: _same(x)),
        "apply": jd.forward(jd.cfunction(lib.square, keepalive=lib, saved=True)),
        "pull": jd.vjp(jd.cfunction(lib.square_vjp, keepalive=lib, saved=True)),
    }
    if with_result_jvp:
        # A Python @jvp that takes result: the equations carry the output too, and the
        # C @vjp (saved only) is called without it.
        def push(self, x, dx, *, result, saved):
            assert np.allclose(result, x * x)
            return saved * dx

        namespace["push"] = jd.jvp(push)
    op = type("CSquare", (jd.Primitive,), namespace)()
    x = jnp.linspace(-1.0, 2.0, 7)
    np.testing.assert_allclose(op(x), x * x)
    for run in (jax.grad, lambda f: jax.jit(jax.grad(f))):
        np.testing.assert_allclose(run(lambda x: jnp.sum(jnp.sin(op(x))))(x),
                                   jnp.cos(x * x) * 2 * x, rtol=1e-12)
    np.testing.assert_allclose(jax.vmap(jax.grad(lambda v: jnp.sum(op(v))))(
        jnp.stack([x, 2 * x])), jnp.stack([2 * x, 4 * x]), rtol=1e-12)
    if with_result_jvp:
        np.testing.assert_allclose(jax.jvp(op, (x,), (x,))[1], 2 * x * x, rtol=1e-12)
    jd.check(op, np.asarray(x))


def test_c_forward_must_take_saved(c_library):
    lib = c_library
    with pytest.raises(jd.DeclarationError, match=r"does not accept `saved`"):
        type("CNoSaved", (jd.Primitive,), {
            "shapes": jd.abstract(lambda self, x: _same(x)),
            "keeps": jd.residuals(lambda self, x: _same(x)),
            "apply": jd.forward(jd.cfunction(lib.square, keepalive=lib)),
            "pull": jd.vjp(jd.cfunction(lib.square_vjp, keepalive=lib, saved=True))})


# ---------------------------------------------------------------------------
# Sharding: residuals take the factors `residuals=` gives them
# ---------------------------------------------------------------------------


SHARD_CALLS: list = []  # appended from XLA's threads: list.append is atomic


class BatchSolve(jd.Primitive, sharding="b n m, b n -> b n", replicate=("n", "m"),
                 residuals={"lu": "b n m", "piv": "b n"}):
    """A batch of independent solves: the batch is split, each device keeps its own LUs."""

    @jd.abstract
    def shapes(self, a, b):
        return _same(b)

    @jd.residuals
    def keeps(self, a, b):
        return {"lu": _same(a), "piv": jax.ShapeDtypeStruct(a.shape[:2], np.int32)}

    @jd.forward
    def apply(self, a, b, *, saved=None):
        SHARD_CALLS.append(("forward", saved is not None, a.shape))
        x = np.empty_like(b)
        for i in range(a.shape[0]):
            lu, piv = scipy.linalg.lu_factor(a[i])
            if saved is not None:
                saved["lu"][i], saved["piv"][i] = lu, piv
            x[i] = scipy.linalg.lu_solve((lu, piv), b[i])
        return x

    @jd.vjp
    def pull(self, a, b, ct, *, saved, result):
        SHARD_CALLS.append(("vjp", a.shape))
        lam = np.stack([scipy.linalg.lu_solve((saved["lu"][i], saved["piv"][i]), ct[i],
                                              trans=1) for i in range(a.shape[0])])
        return -lam[:, :, None] * result[:, None, :], lam


def _batch_solve_inputs():
    rng = np.random.default_rng(8)
    return (np.stack([_matrix(rng, 3, np.float64) for _ in range(4)]),
            rng.standard_normal((4, 3)))


def _batch_solve_ref(a, b):
    return jnp.linalg.solve(a, b[..., None])[..., 0]


@needs_split
def test_sharded_grad_keeps_residuals_per_device():
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    a, b = _batch_solve_inputs()
    mesh = jax.make_mesh((2,), ("d",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:2])
    a_s = jax.device_put(a, NamedSharding(mesh, P("d")))
    b_s = jax.device_put(b, NamedSharding(mesh, P("d")))
    grad = jax.jit(jax.grad(_loss(BatchSolve()), (0, 1)))
    assert "all-gather" not in grad.lower(a_s, b_s).compile().as_text()
    SHARD_CALLS.clear()
    actual = jax.block_until_ready(grad(a_s, b_s))
    # Each device factorises its own 2 matrices once and reads them back in the vjp.
    assert collections.Counter(SHARD_CALLS) == collections.Counter(
        {("forward", True, (2, 3, 3)): 2, ("vjp", (2, 3, 3)): 2}), SHARD_CALLS
    expected = jax.grad(_loss(_batch_solve_ref), (0, 1))(a, b)
    for x, y in zip(actual, expected):
        np.testing.assert_allclose(x, y, rtol=1e-10)
        assert x.sharding.spec == P("d")
    jd.check(BatchSolve(), a, b)


def test_sharding_residuals_declaration_errors():
    with pytest.raises(jd.DeclarationError, match=r"residual saved\['piv'\] \('n'\) has no dim "
                                                  r"for factor\(s\) \['b'\]"):
        jd.ShardingRule("b n m, b n -> b n", replicate=("n", "m"),
                        residuals={"lu": "b n m", "piv": "n"})
    with pytest.raises(jd.DeclarationError, match=r"\['k'\] that no input has"):
        jd.ShardingRule("b n -> b n", residuals="b n k")
    with pytest.raises(jd.DeclarationError, match="residuals= needs a sharding= rule"):
        _class("Lonely", {"apply": jd.forward(lambda self, x: x)}, residuals="b")
    rule = jd.ShardingRule("b n -> b n", replicate=("n",), residuals={"s": "b n"})
    assert rule == jd.ShardingRule("b n -> b n", replicate=("n",), residuals={"s": "b n"})
    assert rule != jd.ShardingRule("b n -> b n", replicate=("n",))
    assert "residuals={'s': 'b n'}" in repr(rule)


class BatchSolveUndeclared(BatchSolve, sharding="b n m, b n -> b n", replicate=("n", "m"),
                           residuals=None):
    pass


@needs_split
def test_sharded_grad_without_residual_factors_names_the_fix():
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    a, b = _batch_solve_inputs()
    mesh = jax.make_mesh((2,), ("d",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:2])
    a_s = jax.device_put(a, NamedSharding(mesh, P("d")))
    op = BatchSolveUndeclared()
    np.testing.assert_allclose(jax.jit(op)(a_s, b), _batch_solve_ref(a, b), rtol=1e-10)
    with pytest.raises(Exception, match=r"BatchSolveUndeclared keeps residuals.*add residuals="):
        jax.jit(jax.grad(_loss(op), (0, 1)))(a_s, b)


@needs_split
@pytest.mark.parametrize("where", ["shard_map", "explicit_axes", "explicit_axes_eager"])
def test_residuals_under_shard_map_and_explicit_axes(where):
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    a, b = _batch_solve_inputs()
    mesh = jax.make_mesh((2,), ("d",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:2])
    a_s, b_s = (jax.device_put(x, NamedSharding(mesh, P("d"))) for x in (a, b))
    grad = jax.grad(_loss(BatchSolve()), (0, 1))
    SHARD_CALLS.clear()
    if where == "shard_map":
        actual = jax.jit(jax.shard_map(grad, mesh=mesh, in_specs=(P("d"), P("d")),
                                       out_specs=(P("d"), P("d"))))(a_s, b_s)
    else:  # un-jitted too: each rule runs per shard
        with jax.set_mesh(mesh):
            actual = (grad if where.endswith("eager") else jax.jit(grad))(a_s, b_s)
        assert actual[0].sharding.spec == P("d", None, None)
    jax.block_until_ready(actual)  # both devices' calls have finished
    assert collections.Counter(SHARD_CALLS) == collections.Counter(
        {("forward", True, (2, 3, 3)): 2, ("vjp", (2, 3, 3)): 2}), SHARD_CALLS
    expected = jax.grad(_loss(_batch_solve_ref), (0, 1))(a, b)
    for x, y in zip(actual, expected):
        np.testing.assert_allclose(x, y, rtol=1e-10)
