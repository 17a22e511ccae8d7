"""Differentiation of jaxdecl ops: every JAX transformation against pure jax.numpy."""

import collections
import dataclasses
import zlib
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tol
from jax.test_util import check_grads
from ops import (
    FFTAdjoint,
    FFTTranspose,
    FlipMul,
    MulNumpy,
    MulTraceable,
    TwoOutputs,
    Weighted,
    WeightedFFT,
    complex_of,
    fft_ref,
    flip_mul_ref,
    mul_ref,
    random_array,
    two_outputs_ref,
    weighted_fft_ref,
    weighted_ref,
)

import jaxdecl as jd

DTYPES = ["float32", "float64", "complex64", "complex128"]
SHAPES = [(), (7,), (3, 4)]


def _same(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


# ---------------------------------------------------------------------------
# Ops under test: the differentiable ops of ops.py, and a Mul with a @jvp only
# ---------------------------------------------------------------------------


class MulJvpOnly(MulTraceable):
    """f(x1, x2) = x1 * x2**2 with a traceable @jvp only: JAX transposes it."""

    pull = None


# ---------------------------------------------------------------------------
# Cases: an op as a function of its differentiable inputs, and its reference
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    """An op under test: `build(rng, dtype, shape)` -> (op_fn, ref_fn, diff_args)."""

    build: Callable
    order: int  # highest derivative order the rules support
    shapes: tuple = tuple(SHAPES)


def _binary(op_class, reference):
    def build(rng, dtype, shape):
        op = op_class()
        args = (random_array(rng, shape, dtype), random_array(rng, shape, dtype))
        return op, reference, args

    return build


def _weighted(rng, dtype, shape):
    real = np.finfo(dtype).dtype
    w = random_array(rng, shape, real)
    k = rng.integers(1, 4, shape).astype(np.int32)
    op = Weighted()
    return (
        (lambda x: op(x, w, k)),
        (lambda x: weighted_ref(x, w, k)),
        (random_array(rng, shape, dtype),),
    )


def _fft(op_class):
    def build(rng, dtype, shape):
        return op_class(), fft_ref, (random_array(rng, shape, dtype),)

    return build


CASES = {
    "mul_numpy": Case(_binary(MulNumpy, mul_ref), order=1, shapes=((7,),)),
    "mul_traceable": Case(_binary(MulTraceable, mul_ref), order=2),
    "mul_jvp_only": Case(_binary(MulJvpOnly, mul_ref), order=2, shapes=((3, 4),)),
    "two_outputs": Case(_binary(TwoOutputs, two_outputs_ref), order=2, shapes=((3, 4),)),
    "weighted": Case(_weighted, order=1, shapes=((3, 4),)),
    "fft_transpose": Case(_fft(FFTTranspose), order=3, shapes=((3, 4),)),
    "fft_adjoint": Case(_fft(FFTAdjoint), order=3, shapes=((7,),)),
    "bilinear": Case(_binary(FlipMul, flip_mul_ref), order=3, shapes=((3, 4),)),
}

CASE_PARAMS = [
    pytest.param(name, shape, id=f"{name}-{shape}")
    for name, case in CASES.items()
    for shape in case.shapes
]
# numerical differences are slow: one shape per op
CHECK_GRADS_PARAMS = [
    pytest.param(name, case.shapes[-1], id=f"{name}-{case.shapes[-1]}")
    for name, case in CASES.items()
]
# Op-by-op (eager) evaluation of jacobians and second derivatives is slow; those
# run under jit only, the first-order transformations run both ways.
EAGER = ("call", "jvp", "vjp", "linearize", "grad", "value_and_grad")


# ---------------------------------------------------------------------------
# Transformations, each a function of the differentiable inputs
# ---------------------------------------------------------------------------


def _outputs(result):
    return result if isinstance(result, tuple) else (result,)


def _scalar(f, holomorphic):
    """A scalar of f's outputs: holomorphic for complex inputs, real for real ones."""

    def scalar(*args):
        outs = _outputs(f(*args))
        if holomorphic:
            return sum(jnp.sum(o**2) for o in outs)
        return sum(jnp.sum(jnp.real(o * jnp.conj(o))) for o in outs)

    return scalar


def _realified(f, holomorphic):
    """f with complex outputs split into (real, imag) where jacrev needs real outputs."""
    if holomorphic:
        return f

    def real_f(*args):
        return tuple(
            jnp.stack([o.real, o.imag]) if jnp.iscomplexobj(o) else o for o in _outputs(f(*args))
        )

    return real_f


def _linearize(f, args, ts, cts):
    y, lin = jax.linearize(f, *args)
    return y, lin(*ts), jax.linear_transpose(lin, *args)(cts)


def _vjp(f, args, cts):
    y, pullback = jax.vjp(f, *args)
    return y, pullback(cts)


def _grad_of_grad(f, argnums, holo):
    inner = jax.grad(_scalar(f, holo), argnums, holomorphic=holo)
    return jax.grad(lambda *a: sum(jnp.sum(g) for g in inner(*a)), argnums, holomorphic=holo)


# name -> (order needed, builder(f, args, ts, cts, argnums, holo) -> function of args)
TRANSFORMS = {
    "call": (0, lambda f, a, ts, cts, n, h: f),
    "jvp": (1, lambda f, a, ts, cts, n, h: lambda *x: jax.jvp(f, x, ts)),
    "vjp": (1, lambda f, a, ts, cts, n, h: lambda *x: _vjp(f, x, cts)),
    "linearize": (1, lambda f, a, ts, cts, n, h: lambda *x: _linearize(f, x, ts, cts)),
    "grad": (1, lambda f, a, ts, cts, n, h: jax.grad(_scalar(f, h), n, holomorphic=h)),
    "value_and_grad": (
        1,
        lambda f, a, ts, cts, n, h: jax.value_and_grad(_scalar(f, h), n, holomorphic=h),
    ),
    "jacfwd": (1, lambda f, a, ts, cts, n, h: jax.jacfwd(f, n, holomorphic=h)),
    "jacrev": (1, lambda f, a, ts, cts, n, h: jax.jacrev(_realified(f, h), n, holomorphic=h)),
    "hessian": (2, lambda f, a, ts, cts, n, h: jax.hessian(_scalar(f, h), n, holomorphic=h)),
    "jvp_of_grad": (
        2,
        lambda f, a, ts, cts, n, h: (
            lambda *x: jax.jvp(jax.grad(_scalar(f, h), n, holomorphic=h), x, ts)
        ),
    ),
    "grad_of_grad": (2, lambda f, a, ts, cts, n, h: _grad_of_grad(f, n, h)),
    "jacfwd_of_jacrev": (
        2,
        lambda f, a, ts, cts, n, h: jax.jacfwd(
            jax.jacrev(_realified(f, h), n, holomorphic=h), n, holomorphic=h
        ),
    ),
}


def _assert_tree_close(actual, expected, dtype):
    actual_leaves, actual_tree = jax.tree_util.tree_flatten(actual)
    expected_leaves, expected_tree = jax.tree_util.tree_flatten(expected)
    assert actual_tree == expected_tree
    rtol = tol(dtype)
    for a, e in zip(actual_leaves, expected_leaves):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape
        assert a.dtype == e.dtype, (a.dtype, e.dtype)
        scale = max(1.0, float(np.max(np.abs(e)))) if e.size else 1.0
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale)


def _setup(name, dtype, shape):
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(zlib.crc32(repr((name, str(dtype), shape)).encode()))
    op_fn, ref_fn, args = CASES[name].build(rng, dtype, shape)
    ts = tuple(random_array(rng, np.shape(a), dtype, -1.0, 1.0) for a in args)
    out_structs = _outputs(jax.eval_shape(ref_fn, *args))
    cts = tuple(random_array(rng, s.shape, s.dtype, -1.0, 1.0) for s in out_structs)
    if not isinstance(jax.eval_shape(ref_fn, *args), tuple):
        cts = cts[0]
    return op_fn, ref_fn, args, ts, cts


def _all_transforms(f, name, args, ts, cts, holo):
    """One function of the inputs returning every supported transformation of `f`."""
    argnums = tuple(range(len(args)))
    built = {
        transform: build(f, args, ts, cts, argnums, holo)
        for transform, (order, build) in TRANSFORMS.items()
        if order <= CASES[name].order
    }
    return built, lambda *x: {transform: g(*x) for transform, g in built.items()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,shape", CASE_PARAMS)
def test_transforms_against_jnp(name, shape, dtype):
    """Every transformation the op supports, eager and under jit, equals jax.numpy's."""
    op_fn, ref_fn, args, ts, cts = _setup(name, dtype, shape)
    holo = np.issubdtype(np.dtype(dtype), np.complexfloating)
    _, reference = _all_transforms(ref_fn, name, args, ts, cts, holo)
    # One jit of all transformations at once: one compilation per case keeps this fast.
    expected = jax.jit(reference)(*args)
    built, combined = _all_transforms(op_fn, name, args, ts, cts, holo)
    jitted = jax.jit(combined)(*args)
    for transform, g in built.items():
        results = [("jit", jitted[transform])]
        if transform in EAGER:
            results.append(("eager", g(*args)))
        for label, result in results:
            try:
                _assert_tree_close(result, expected[transform], dtype)
            except AssertionError as error:
                raise AssertionError(f"{transform} ({label}): {error}") from None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,shape", CHECK_GRADS_PARAMS)
def test_check_grads(name, shape, dtype):
    """jax.test_util.check_grads (numerical differences), to the order the rules allow."""
    op_fn, _, args, _, _ = _setup(name, dtype, shape)
    order = min(CASES[name].order, 2)
    eps = 1e-3 if np.dtype(dtype) in (np.float32, np.complex64) else 1e-6
    check_grads(
        op_fn, args, order, modes=("fwd", "rev"), eps=eps, rtol=5e-2 if eps == 1e-3 else 1e-5
    )


# ---------------------------------------------------------------------------
# Which rules run
# ---------------------------------------------------------------------------


class Counted(jd.Primitive):
    """x1 * x2**2 counting the calls of each rule."""

    calls: ClassVar[collections.Counter] = collections.Counter()

    @jd.abstract
    def shapes(self, x1, x2):
        return _same(x1)

    @jd.forward
    def apply(self, x1, x2):
        type(self).calls["forward"] += 1
        return x1 * x2**2

    @jd.jvp
    def push(self, x1, x2, dx1, dx2):
        type(self).calls["jvp"] += 1
        return x2**2 * dx1 + 2 * x1 * x2 * dx2

    @jd.vjp
    def pull(self, x1, x2, ct):
        type(self).calls["vjp"] += 1
        return x2**2 * ct, 2 * x1 * x2 * ct


def _count(op_class, g, *args):
    op_class.calls.clear()
    result = jax.block_until_ready(g(*args))
    return dict(op_class.calls), result


def _mul_sum(op):
    return lambda a, b: jnp.sum(op(a, b))


def test_grad_runs_only_vjp():
    a, b = np.arange(1.0, 4.0), np.arange(2.0, 5.0)
    calls, g = _count(Counted, jax.jit(jax.grad(_mul_sum(Counted()), (0, 1))), a, b)
    assert calls == {"vjp": 1}
    _assert_tree_close(g, jax.grad(lambda a, b: jnp.sum(a * b**2), (0, 1))(a, b), "float64")


def test_value_and_grad_runs_forward_and_vjp_once():
    a, b = np.arange(1.0, 4.0), np.arange(2.0, 5.0)
    calls, vg = _count(Counted, jax.jit(jax.value_and_grad(_mul_sum(Counted()), (0, 1))), a, b)
    assert calls == {"forward": 1, "vjp": 1}
    _assert_tree_close(
        vg, jax.value_and_grad(lambda a, b: jnp.sum(a * b**2), (0, 1))(a, b), "float64"
    )


def test_jvp_runs_forward_and_jvp_once():
    a, b = np.arange(1.0, 4.0), np.arange(2.0, 5.0)
    ta, tb = np.ones(3), np.full(3, 0.5)
    calls, out = _count(Counted, jax.jit(lambda a, b: jax.jvp(Counted(), (a, b), (ta, tb))), a, b)
    assert calls == {"forward": 1, "jvp": 1}
    _assert_tree_close(out, jax.jvp(lambda a, b: a * b**2, (a, b), (ta, tb)), "float64")


class OnlyJvp(Counted):
    """x1 * x2**2 with a NumPy @jvp and no @vjp."""

    calls: ClassVar[collections.Counter] = collections.Counter()
    pull = None


class OnlyVjp(Counted):
    """x1 * x2**2 with a NumPy @vjp and no @jvp."""

    calls: ClassVar[collections.Counter] = collections.Counter()
    push = None


def test_only_jvp_gives_forward_mode_and_names_missing_vjp():
    a, b = np.arange(1.0, 4.0), np.arange(2.0, 5.0)
    t = (np.ones(3), np.ones(3))
    out = jax.jit(lambda a, b: jax.jvp(OnlyJvp(), (a, b), t))(a, b)
    _assert_tree_close(out, jax.jvp(lambda a, b: a * b**2, (a, b), t), "float64")
    OnlyJvp.calls.clear()
    with pytest.raises(jd.MissingRuleError, match=r"OnlyJvp.*@vjp"):
        jax.jit(jax.grad(_mul_sum(OnlyJvp())))(a, b)
    assert sum(OnlyJvp.calls.values()) == 0


def test_only_vjp_gives_reverse_mode_and_names_missing_jvp():
    a, b = np.arange(1.0, 4.0), np.arange(2.0, 5.0)
    g = jax.jit(jax.grad(_mul_sum(OnlyVjp()), (0, 1)))(a, b)
    _assert_tree_close(g, jax.grad(lambda a, b: jnp.sum(a * b**2), (0, 1))(a, b), "float64")
    OnlyVjp.calls.clear()
    with pytest.raises(jd.MissingRuleError, match=r"OnlyVjp.*@jvp"):
        jax.jit(lambda a, b: jax.jvp(OnlyVjp(), (a, b), (a, b)))(a, b)
    assert sum(OnlyVjp.calls.values()) == 0


def test_hessian_of_numpy_rules_names_traceable():
    a = np.arange(1.0, 4.0)
    with pytest.raises(jd.MissingRuleError, match=r"MulNumpy\.pull.*traceable=True"):
        jax.hessian(lambda a: jnp.sum(MulNumpy()(a, a)))(a)


class OperandTypes(jd.Primitive):
    """x1 * x2**2 with traceable rules recording the types of what they receive."""

    seen: ClassVar[set] = set()

    @jd.abstract
    def shapes(self, x1, x2):
        return _same(x1)

    @jd.forward
    def apply(self, x1, x2):
        return x1 * x2**2

    @jd.jvp(traceable=True)
    def push(self, x1, x2, dx1, dx2):
        type(self).seen.update(type(v) for v in (x1, x2, dx1, dx2))
        return x2**2 * dx1 + 2 * x1 * x2 * dx2

    @jd.vjp(traceable=True)
    def pull(self, x1, x2, ct):
        type(self).seen.update(type(v) for v in (x1, x2, ct))
        return -(-(x2**2) * ct), 2 * x1 * x2 * ct


def test_traceable_rules_receive_arrays_not_jax_literals():
    """Constants of a traced program reach traceable rules as arrays.

    From JAX 0.7 JAX holds them as its own literal types, which lack some of an
    array's operators (``**`` in 0.7, unary minus in 0.8).
    """
    op, a, b = OperandTypes(), np.arange(1.0, 4.0), np.ones(3)
    OperandTypes.seen.clear()
    _, pullback = jax.vjp(op, a, b)
    ct_a, ct_b = pullback(np.ones(3))
    _, tangent = jax.jvp(jax.grad(lambda a: op(a, b).sum()), (a,), (a,))
    np.testing.assert_allclose(ct_a, b**2)
    np.testing.assert_allclose(ct_b, 2 * a * b)
    np.testing.assert_allclose(tangent, 0 * a)
    odd = {t for t in OperandTypes.seen
           if t is not np.ndarray and not issubclass(t, (jax.Array, jax.core.Tracer))}
    assert not odd, odd


# ---------------------------------------------------------------------------
# Symbolic zeros reach NumPy rules as real zero arrays
# ---------------------------------------------------------------------------


class Recording(jd.Primitive):
    """x1 * x2**2 recording what its rules receive."""

    seen: ClassVar[list] = []

    @jd.abstract
    def shapes(self, x1, x2):
        return _same(x1)

    @jd.forward
    def apply(self, x1, x2):
        return x1 * x2**2

    @jd.jvp
    def push(self, x1, x2, dx1, dx2):
        # Copies: the arguments are views of XLA buffers, valid during the call only.
        type(self).seen.append(("jvp", (type(dx1), type(dx2)), np.array(dx1), np.array(dx2)))
        return x2**2 * dx1 + 2 * x1 * x2 * dx2

    @jd.vjp
    def pull(self, x1, x2, ct):
        type(self).seen.append(("vjp", (type(ct),), np.array(ct)))
        return x2**2 * ct, 2 * x1 * x2 * ct


@pytest.mark.parametrize("dtype", DTYPES)
def test_jvp_with_one_tangent_passes_zero_array(dtype):
    a = random_array(np.random.default_rng(0), (3, 4), dtype)
    b = random_array(np.random.default_rng(1), (3, 4), dtype)
    t = random_array(np.random.default_rng(2), (3, 4), dtype)
    Recording.seen.clear()
    out = jax.jit(lambda a, b: jax.jvp(lambda x: Recording()(x, b), (a,), (t,)))(a, b)
    _assert_tree_close(out, jax.jvp(lambda x: x * b**2, (a,), (t,)), dtype)
    [(_, types, dx1, dx2)] = Recording.seen
    assert types == (np.ndarray, np.ndarray)
    assert dx2.shape == (3, 4) and dx2.dtype == dtype
    assert not np.any(dx2)
    np.testing.assert_array_equal(dx1, t)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_stop_gradient_and_single_argnum(dtype):
    a = random_array(np.random.default_rng(0), (5,), dtype)
    b = random_array(np.random.default_rng(1), (5,), dtype)

    def loss(mul):
        return lambda a, b: jnp.sum(jnp.sin(mul(a, jax.lax.stop_gradient(b))))

    expected = jax.grad(loss(lambda a, b: a * b**2), (0, 1))(a, b)
    assert not np.any(np.asarray(expected[1]))
    _assert_tree_close(jax.jit(jax.grad(loss(Recording()), (0, 1)))(a, b), expected, dtype)

    Recording.seen.clear()
    ref = jax.jvp(lambda x: jnp.sin(jax.lax.stop_gradient(x) * b**2), (a,), (np.ones_like(a),))
    out = jax.jvp(
        lambda x: jnp.sin(Recording()(jax.lax.stop_gradient(x), b)), (a,), (np.ones_like(a),)
    )
    _assert_tree_close(out, ref, dtype)
    # With every tangent a symbolic zero, no tangent rule needs to run.
    assert all(kind != "jvp" for kind, *_ in Recording.seen)

    # w.r.t. x2 only: the jvp rule sees a zero array for x1.
    Recording.seen.clear()
    t = np.ones_like(b)
    out = jax.jvp(lambda y: Recording()(a, y), (b,), (t,))
    _assert_tree_close(out, jax.jvp(lambda y: a * y**2, (b,), (t,)), dtype)
    [(_, types, dx1, dx2)] = Recording.seen
    assert types == (np.ndarray, np.ndarray)
    assert dx1.shape == (5,) and not np.any(dx1)
    np.testing.assert_array_equal(dx2, t)


# ---------------------------------------------------------------------------
# Non-differentiable inputs
# ---------------------------------------------------------------------------


def test_grad_wrt_integer_input_is_float0():
    x = np.array([0.5, 1.5, 2.0])
    w = np.array([1.0, 2.0, 3.0])
    k = np.array([1, 2, 3], np.int32)
    op = Weighted()
    g = jax.grad(lambda x, k: jnp.sum(op(x, w, k)), (0, 1), allow_int=True)(x, k)
    expected = jax.grad(lambda x, k: jnp.sum(w * x**k), (0, 1), allow_int=True)(x, k)
    assert g[1].dtype == jax.dtypes.float0 and g[1].shape == k.shape
    _assert_tree_close(g[0], expected[0], "float64")


@pytest.mark.parametrize("jit", [False, True])
def test_grad_wrt_nondiff_input_names_it(jit):
    x = np.array([0.5, 1.5, 2.0])
    w = np.array([1.0, 2.0, 3.0])
    k = np.array([1, 2, 3], np.int32)
    g = jax.grad(lambda w: jnp.sum(Weighted()(x, w, k)))
    with pytest.raises(Exception, match="'w'"):
        (jax.jit(g) if jit else g)(w)


def test_stop_gradient_on_nondiff_input_is_fine():
    x = np.array([0.5, 1.5, 2.0])
    w = np.array([1.0, 2.0, 3.0])
    k = np.array([1, 2, 3], np.int32)
    g = jax.grad(lambda x, w: jnp.sum(Weighted()(x * w, jax.lax.stop_gradient(w), k)), (0, 1))
    expected = jax.grad(lambda x, w: jnp.sum(jax.lax.stop_gradient(w) * (x * w) ** k), (0, 1))
    _assert_tree_close(g(x, w), expected(x, w), "float64")


# ---------------------------------------------------------------------------
# Linear and bilinear ops
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("op_class", [FFTTranspose, FFTAdjoint])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fft_third_derivative(op_class, dtype):
    x = random_array(np.random.default_rng(3), (5,), dtype)

    def cubic(fft):
        def f(x):
            y = fft(x)
            return jnp.sum(jnp.abs(y) ** 2 * jnp.real(y)) + jnp.sum(jnp.abs(y) ** 2)

        return f

    third = jax.jacfwd(jax.jacrev(jax.jacfwd(cubic(op_class()))))
    expected = jax.jit(jax.jacfwd(jax.jacrev(jax.jacfwd(cubic(jnp.fft.fft)))))(x)
    assert np.any(np.abs(np.asarray(expected)) > 1)
    _assert_tree_close(jax.jit(third)(x), expected, dtype)


@pytest.mark.parametrize("op_class", [FFTTranspose, FFTAdjoint])
@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_fft_linear_transpose_is_fft(op_class, dtype):
    rng = np.random.default_rng(4)
    x, ct = random_array(rng, (3, 6), dtype), random_array(rng, (3, 6), dtype)
    transposed = jax.linear_transpose(op_class(), x)
    expected = jnp.fft.fft(ct, axis=-1)
    _assert_tree_close(transposed(ct)[0], expected, dtype)
    _assert_tree_close(jax.jit(transposed)(ct)[0], expected, dtype)
    # The DFT matrix is symmetric, so the linear transpose equals jnp's own transpose.
    _assert_tree_close(transposed(ct), jax.linear_transpose(jnp.fft.fft, x)(ct), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_op_with_nondiff_input(dtype):
    rng = np.random.default_rng(5)
    x = random_array(rng, (6,), dtype)
    w = random_array(rng, (6,), np.finfo(dtype).dtype)
    ct = random_array(rng, (6,), complex_of(dtype))
    WeightedFFT.seen.clear()
    out, pullback = jax.vjp(lambda x: WeightedFFT()(x, w), x)
    ref_out, ref_pullback = jax.vjp(lambda x: weighted_fft_ref(x, w), x)
    _assert_tree_close(out, ref_out, dtype)
    _assert_tree_close(pullback(ct), ref_pullback(ct), dtype)
    [seen] = WeightedFFT.seen
    np.testing.assert_array_equal(seen, w)
    check_grads(
        lambda x: WeightedFFT()(x, w),
        (x,),
        2,
        modes=("fwd", "rev"),
        eps=1e-3 if tol(dtype) > 1e-6 else 1e-6,
        rtol=5e-2 if tol(dtype) > 1e-6 else 1e-5,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_bilinear_jacrev_of_jacrev(dtype):
    x = random_array(np.random.default_rng(6), (4,), dtype)
    holo = np.issubdtype(np.dtype(dtype), np.complexfloating)

    def hess(mul):
        return jax.jacrev(jax.jacrev(lambda x: mul(x, x), holomorphic=holo), holomorphic=holo)

    expected = jax.jit(hess(lambda x, y: x * jnp.flip(y)))(x)
    assert np.any(np.asarray(expected))
    _assert_tree_close(jax.jit(hess(FlipMul()))(x), expected, dtype)
    if dtype == "float64":  # op by op, once
        _assert_tree_close(hess(FlipMul())(x), expected, dtype)


class PowInt(jd.Primitive):
    """x**k with an integer exponent input; second order through the traceable @jvp."""

    @jd.abstract
    def shapes(self, x, k):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, k):
        return x**k

    @jd.jvp(traceable=True)
    def push(self, x, k, dx):
        return k * x ** (k - 1) * dx

    @jd.vjp
    def pull(self, x, k, ct):
        return k * x ** (k - 1) * ct


def test_second_order_with_an_integer_input():
    x, k = jnp.array([1.0, 2.0, 0.5]), jnp.array([3, 2, 4])
    f = lambda v: jnp.sum(PowInt()(v, k))
    reference = jax.hessian(lambda v: jnp.sum(v**k))(x)
    np.testing.assert_allclose(jax.hessian(f)(x), reference, rtol=1e-12)
    np.testing.assert_allclose(jax.jit(jax.jacfwd(jax.grad(f)))(x), reference, rtol=1e-12)
