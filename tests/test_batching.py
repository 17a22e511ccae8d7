"""Batching: loop, vectorized and user @batch rules under every vmap pattern.

Each batched result is compared against two independent references: a Python
loop of unbatched calls of the same op, and the same computation written with
jax.numpy (vmapped by JAX itself).
"""

import collections
import itertools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RESHAPES_IN_PLACE, tol

import jaxdecl as jd

DTYPES = ["float32", "float64", "complex64"]


def _random(rng, shape, dtype):
    value = rng.standard_normal(shape)
    if np.issubdtype(np.dtype(dtype), np.complexfloating):
        value = value + 1j * rng.standard_normal(shape)
    return np.asarray(value).astype(dtype)


def _close(actual, expected, dtype):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected),
                               rtol=tol(dtype), atol=tol(dtype))


def _loop(f, args, in_axes, out_axis=0):
    """Reference: a Python loop of unbatched calls, stacked along `out_axis`.

    Derivative references pass `f` under jax.jit, so that it is traced once, not per element.
    """
    size = next(np.shape(a)[ax] for a, ax in zip(args, in_axes) if ax is not None)
    results = [f(*[a if ax is None else np.take(np.asarray(a), k, axis=ax)
                   for a, ax in zip(args, in_axes)]) for k in range(size)]
    if isinstance(results[0], (tuple, list)):
        return tuple(np.stack([np.asarray(r[j]) for r in results], axis=out_axis)
                     for j in range(len(results[0])))
    return np.stack([np.asarray(r) for r in results], axis=out_axis)


def _energy(y):
    return jnp.sum(jnp.real(y * jnp.conj(y)))


# ---------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------


def _make_mul(mode):
    """f(x1, x2) = x1 * x2**2 with NumPy @jvp/@vjp, in the given batch mode."""

    class Mul(jd.Primitive, batch=mode):
        calls: ClassVar[collections.Counter] = collections.Counter()
        seen: ClassVar[dict] = collections.defaultdict(list)  # rule -> shapes of its operands

        def _record(self, rule, *arrays):
            type(self).calls[rule] += 1
            type(self).seen[rule].append(tuple(a.shape for a in arrays))

        @jd.abstract
        def shapes(self, x1, x2):
            return jax.ShapeDtypeStruct(x1.shape, x1.dtype)

        # The zero-copy form broadcasts size-1 batch dims of `vectorized` operands
        # into the full-batch output.
        @jd.forward
        def apply(self, x1, x2, *, out):
            self._record("forward", x1, x2, out)
            out[...] = x1 * x2**2

        @jd.jvp
        def push(self, x1, x2, dx1, dx2, *, out):
            self._record("jvp", x1, x2, dx1, dx2, out)
            out[...] = dx1 * x2**2 + 2 * x1 * x2 * dx2

        @jd.vjp
        def pull(self, x1, x2, ct, *, out):
            self._record("vjp", x1, x2, ct, *out)
            out[0][...] = x2**2 * ct
            out[1][...] = 2 * x1 * x2 * ct

    Mul.__name__ = Mul.__qualname__ = f"Mul_{mode}"
    return Mul


MULS = {"loop": _make_mul("loop"), "vectorized": _make_mul("vectorized")}


def mul_ref(x1, x2):
    return x1 * x2**2


def _make_pair(mode):
    """(a, b) -> (a * b, a - b**2): two inputs, two outputs."""

    class Pair(jd.Primitive, batch=mode):
        calls: ClassVar[collections.Counter] = collections.Counter()

        @jd.abstract
        def shapes(self, a, b):
            return (jax.ShapeDtypeStruct(a.shape, a.dtype),) * 2

        @jd.forward
        def apply(self, a, b, *, out):
            type(self).calls["forward"] += 1
            out[0][...] = a * b
            out[1][...] = a - b**2

        @jd.jvp
        def push(self, a, b, da, db, *, out):
            out[0][...] = da * b + a * db
            out[1][...] = da - 2 * b * db

        @jd.vjp
        def pull(self, a, b, c1, c2, *, out):
            out[0][...] = b * c1 + c2
            out[1][...] = a * c1 - 2 * b * c2

    Pair.__name__ = Pair.__qualname__ = f"Pair_{mode}"
    return Pair


PAIRS = {"loop": _make_pair("loop"), "vectorized": _make_pair("vectorized")}


def pair_ref(a, b):
    return a * b, a - b**2


class Weighted(jd.Primitive, nondiff=("w",)):
    """y = w * x**2, with the weight `w` never differentiated."""

    seen: ClassVar[list] = []

    @jd.abstract
    def shapes(self, x, w):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, w):
        type(self).seen.append((x.shape, w.shape))
        return w * x**2

    @jd.jvp
    def push(self, x, w, dx):
        return 2 * w * x * dx

    @jd.vjp
    def pull(self, x, w, ct):
        return 2 * w * x * ct


def _complex_of(dtype):
    return np.result_type(dtype, np.complex64)


class FFT(jd.Primitive, linear=True):
    """numpy.fft.fft along `axis`; @batch folds the vmapped axis into a wider FFT call."""

    calls: ClassVar[collections.Counter] = collections.Counter()
    seen: ClassVar[dict] = collections.defaultdict(list)

    def __init__(self, axis=-1):
        self.axis = axis

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, _complex_of(x.dtype))

    @jd.forward
    def apply(self, x):
        type(self).calls["forward"] += 1
        type(self).seen["forward"].append(x.shape)
        return np.fft.fft(x, axis=self.axis).astype(_complex_of(x.dtype))

    # The DFT matrix is symmetric, so its (non-conjugated) transpose is itself; for
    # a real input jaxdecl keeps the real part of the cotangent.
    @jd.transpose
    def apply_t(self, ct):
        type(self).calls["transpose"] += 1
        type(self).seen["transpose"].append(ct.shape)
        return np.fft.fft(ct, axis=self.axis).astype(ct.dtype)

    @jd.batch
    def batched(self, args, axes):
        type(self).calls["batch"] += 1
        (x,), (axis,) = args, axes
        x = jnp.moveaxis(x, axis, 0)
        return FFT(axis=self.axis + 1 if self.axis >= 0 else self.axis)(x), 0


def fft_ref(x, axis):
    return jnp.fft.fft(x, axis=axis).astype(_complex_of(x.dtype))


@pytest.fixture(autouse=True)
def _reset_counters():
    for cls in (*MULS.values(), *PAIRS.values(), FFT, Dft):
        cls.calls.clear()
    for cls in (*MULS.values(), FFT):
        cls.seen.clear()
    Weighted.seen.clear()


# ---------------------------------------------------------------------------
# Nonlinear op, loop and vectorized modes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["loop", "vectorized"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mul_check(mode, dtype):
    rng = np.random.default_rng(0)
    jd.check(MULS[mode](), _random(rng, (3, 2), dtype), _random(rng, (3, 2), dtype))


@pytest.mark.parametrize("mode", ["loop", "vectorized"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_axes,out_axes",
                         [((0, 0), 0), ((0, None), 1), ((None, 1), -1), ((1, 0), 1)],
                         ids=["00-0", "0None-1", "None1-neg1", "10-1"])
def test_mul_vmap_and_jit(mode, dtype, in_axes, out_axes):
    rng = np.random.default_rng(1)
    element = (3, 2)
    args = []
    for ax in in_axes:
        shape = element if ax is None else element[:ax] + (4,) + element[ax:]
        args.append(_random(rng, shape, dtype))
    op = MULS[mode]()
    batched = jax.vmap(op, in_axes=in_axes, out_axes=out_axes)
    expected = jax.vmap(mul_ref, in_axes=in_axes, out_axes=out_axes)(*args)
    looped = _loop(op, args, in_axes, out_axis=out_axes)
    for f in (batched, jax.jit(batched), jax.vmap(jax.jit(op), in_axes, out_axes)):
        y = f(*args)
        assert y.dtype == np.dtype(dtype)
        _close(y, expected, dtype)
        _close(y, looped, dtype)


@pytest.mark.parametrize("mode", ["loop", "vectorized"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mul_vmap_of_derivatives(mode, dtype):
    rng = np.random.default_rng(2)
    x1, x2, t1, t2, ct = (_random(rng, (5, 3), dtype) for _ in range(5))
    op = MULS[mode]()

    def loss(f):
        return lambda a, b: _energy(f(a, b))

    # vmap of grad, with one input unbatched
    g = jax.vmap(jax.grad(loss(op), argnums=(0, 1)), in_axes=(0, None))(x1, x2[0])
    g_ref = jax.vmap(jax.grad(loss(mul_ref), argnums=(0, 1)), in_axes=(0, None))(x1, x2[0])
    g_loop = _loop(jax.jit(jax.grad(loss(op), argnums=(0, 1))), [x1, x2[0]], (0, None))
    for a, b, c in zip(g, g_ref, g_loop):
        _close(a, b, dtype)
        _close(a, c, dtype)

    # vmap of jvp
    def jvp_of(f):
        return lambda a, b, da, db: jax.jvp(f, (a, b), (da, db))

    y, t = jax.vmap(jvp_of(op))(x1, x2, t1, t2)
    y_ref, t_ref = jax.vmap(jvp_of(mul_ref))(x1, x2, t1, t2)
    _close(y, y_ref, dtype)
    _close(t, t_ref, dtype)
    _close(t, _loop(jax.jit(jvp_of(op)), [x1, x2, t1, t2], (0,) * 4)[1], dtype)

    # vmap of vjp, cotangent batched, second primal unbatched
    def vjp_of(f):
        return lambda a, b, c: jax.vjp(f, a, b)[1](c)

    v = jax.vmap(vjp_of(op), in_axes=(0, None, 0))(x1, x2[1], ct)
    v_ref = jax.vmap(vjp_of(mul_ref), in_axes=(0, None, 0))(x1, x2[1], ct)
    v_loop = _loop(jax.jit(vjp_of(op)), [x1, x2[1], ct], (0, None, 0))
    for a, b, c in zip(v, v_ref, v_loop):
        _close(a, b, dtype)
        _close(a, c, dtype)

    # vmap of vjp, the primals unbatched and only the cotangent batched
    v = jax.vmap(vjp_of(op), in_axes=(None, None, 0))(x1[0], x2[0], ct)
    v_ref = jax.vmap(vjp_of(mul_ref), in_axes=(None, None, 0))(x1[0], x2[0], ct)
    for a, b in zip(v, v_ref):
        _close(a, b, dtype)

    # vmap of linearize
    def lin_of(f):
        return lambda a, b, da, db: jax.linearize(f, a, b)[1](da, db)

    _close(jax.vmap(lin_of(op))(x1, x2, t1, t2),
           jax.vmap(lin_of(mul_ref))(x1, x2, t1, t2), dtype)

    # vmap of linear_transpose of the linearized op (the tangent map transposed)
    struct = jax.ShapeDtypeStruct((3,), x1.dtype)

    def lt_of(f):
        return lambda a, b, c: jax.linear_transpose(jax.linearize(f, a, b)[1], struct,
                                                    struct)(c)

    for a, b, c in zip(jax.vmap(lt_of(op), (0, None, 0))(x1, x2[2], ct),
                       jax.vmap(lt_of(mul_ref), (0, None, 0))(x1, x2[2], ct),
                       _loop(jax.jit(lt_of(op)), [x1, x2[2], ct], (0, None, 0))):
        _close(a, b, dtype)
        _close(a, c, dtype)

    # grad and jvp of vmap
    def total(f):
        return lambda a, b: _energy(jax.vmap(f, in_axes=(0, None))(a, b))

    for a, b in zip(jax.grad(total(op), argnums=(0, 1))(x1, x2[0]),
                    jax.grad(total(mul_ref), argnums=(0, 1))(x1, x2[0])):
        _close(a, b, dtype)
    _, t = jax.jvp(jax.vmap(op), (x1, x2), (t1, t2))
    _, t_ref = jax.jvp(jax.vmap(mul_ref), (x1, x2), (t1, t2))
    _close(t, t_ref, dtype)


@pytest.mark.parametrize("mode", ["loop", "vectorized"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_mul_jacrev_and_vmap_of_jacobians(mode, dtype):
    rng = np.random.default_rng(3)
    x1, x2 = _random(rng, (2, 3), dtype), _random(rng, (2, 3), dtype)
    op = MULS[mode]()
    for jac in (jax.jacrev, jax.jacfwd):
        j = jax.vmap(jac(op, argnums=(0, 1)))(x1, x2)
        j_ref = jax.vmap(jac(mul_ref, argnums=(0, 1)))(x1, x2)
        for a, b in zip(j, j_ref):
            _close(a, b, dtype)
    for a, b in zip(jax.jacrev(op, argnums=(0, 1))(x1, x2),
                    jax.jacrev(mul_ref, argnums=(0, 1))(x1, x2)):
        _close(a, b, dtype)


@pytest.mark.parametrize("mode", ["loop", "vectorized"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mul_nested_vmap(mode, dtype):
    rng = np.random.default_rng(4)
    x1 = _random(rng, (3, 2, 4), dtype)  # batch axes 0 (outer) and 2 (inner)
    x2 = _random(rng, (2, 4), dtype)  # inner batch axis 1, not batched in the outer vmap
    op = MULS[mode]()

    def nest(f):
        return jax.vmap(jax.vmap(f, in_axes=(1, 1), out_axes=1), in_axes=(0, None),
                        out_axes=-1)

    y = nest(op)(x1, x2)
    _close(y, nest(mul_ref)(x1, x2), dtype)
    _close(y, _loop(lambda a, b: _loop(op, [a, b], (1, 1), out_axis=1), [x1, x2],
                    (0, None), out_axis=-1), dtype)


@pytest.mark.parametrize("mode", ["loop", "vectorized"])
@pytest.mark.parametrize("size", [1, 0])
def test_mul_tiny_batches(mode, size):
    rng = np.random.default_rng(5)
    x1, x2 = _random(rng, (size, 3), "float64"), _random(rng, (3,), "float64")
    op = MULS[mode]()
    y = jax.vmap(op, in_axes=(0, None))(x1, x2)
    assert y.shape == (size, 3)
    _close(y, mul_ref(x1, x2[None]), "float64")
    g = jax.vmap(jax.grad(lambda a, b: _energy(op(a, b))), in_axes=(0, None))(x1, x2)
    assert g.shape == (size, 3)
    _close(g, 2 * np.abs(x2) ** 4 * x1, "float64")


class MulReturning(jd.Primitive, batch="vectorized"):
    """x1 * x2**2 in the return-value form, written with NumPy broadcasting."""

    @jd.abstract
    def shapes(self, x1, x2):
        return jax.ShapeDtypeStruct(x1.shape, x1.dtype)

    @jd.forward
    def apply(self, x1, x2):
        return x1 * x2**2

    @jd.vjp
    def pull(self, x1, x2, ct):
        return x2**2 * ct, 2 * x1 * x2 * ct


def test_vectorized_return_form_broadcasts_results():
    # Under vmap(grad) with x2 unbatched, the cotangent of sum() is unbatched too, so
    # x2**2 * ct has a size-1 batch dim although the rule is correct.
    x1, x2 = np.arange(12.0).reshape(4, 3), np.array([1.0, 2.0, 3.0])
    g1, g2 = jax.vmap(jax.grad(lambda a, b: jnp.sum(MulReturning()(a, b)), argnums=(0, 1)),
                      in_axes=(0, None))(x1, x2)
    _close(g1, np.broadcast_to(x2**2, (4, 3)), "float64")
    _close(g2, 2 * x1 * x2, "float64")


# ---------------------------------------------------------------------------
# Rule calls: what each mode hands to the rules, and how many times
# ---------------------------------------------------------------------------


def test_loop_calls_rule_per_element_inside_one_xla_call():
    Mul = MULS["loop"]
    rng = np.random.default_rng(6)
    x1, x2 = _random(rng, (6, 3, 2), "float64"), _random(rng, (3, 2), "float64")
    f = jax.jit(jax.vmap(Mul(), in_axes=(0, None)))
    text = f.lower(x1, x2).as_text()
    assert text.count("jaxdecl_dispatch") == 1
    assert "while" not in text
    y = f(x1, x2)
    _close(y, mul_ref(x1, x2), "float64")
    assert Mul.calls["forward"] == 6
    # The rule sees one element at a time, never the batch.
    assert set(Mul.seen["forward"]) == {((3, 2), (3, 2), (3, 2))}


def test_loop_derived_rules_see_element_shapes():
    Mul = MULS["loop"]
    rng = np.random.default_rng(7)
    x1, x2 = _random(rng, (4, 3), "float64"), _random(rng, (4, 3), "float64")
    loss = jax.grad(lambda a, b: _energy(Mul()(a, b)), argnums=(0, 1))
    f = jax.jit(jax.vmap(jax.vmap(loss), in_axes=(None, 0)))
    f(x1, np.stack([x2] * 4))
    for rule in ("forward", "vjp"):
        assert Mul.calls[rule] == 16
        assert {s for shapes in Mul.seen[rule] for s in shapes} == {(3,)}
    jax.vmap(lambda a, b, t: jax.jvp(Mul(), (a, b), (t, t))[1])(x1, x2, x1)
    assert Mul.calls["jvp"] == 4
    assert {s for shapes in Mul.seen["jvp"] for s in shapes} == {(3,)}


def test_vectorized_calls_rule_once_with_the_batch():
    Mul = MULS["vectorized"]
    rng = np.random.default_rng(8)
    x1, x2 = _random(rng, (6, 3, 2), "float64"), _random(rng, (3, 2), "float64")
    f = jax.jit(jax.vmap(Mul(), in_axes=(0, None)))
    text = f.lower(x1, x2).as_text()
    assert text.count("jaxdecl_dispatch") == 1
    _close(f(x1, x2), mul_ref(x1, x2), "float64")
    assert Mul.calls["forward"] == 1
    # Batch dims lead; the unbatched input gets a size-1 batch dim.
    assert Mul.seen["forward"] == [((6, 3, 2), (1, 3, 2), (6, 3, 2))]

    Mul.seen.clear()
    jax.vmap(jax.vmap(Mul(), in_axes=(0, None)), in_axes=(None, 0))(x1[:, 0], x2)
    assert Mul.seen["forward"] == [((1, 6, 2), (3, 1, 2), (3, 6, 2))]

    Mul.calls.clear()
    jax.vmap(jax.grad(lambda a, b: _energy(Mul()(a, b))))(x1, x2[None].repeat(6, 0))
    assert Mul.calls["forward"] == 1 and Mul.calls["vjp"] == 1


def test_user_batch_rule_makes_one_call():
    rng = np.random.default_rng(9)
    x = _random(rng, (5, 4, 6), "complex128")
    f = jax.jit(jax.vmap(FFT(axis=0), in_axes=2))
    _close(f(x), jnp.moveaxis(jnp.fft.fft(x, axis=0), 2, 0), "complex128")
    assert FFT.calls == {"batch": 1, "forward": 1}
    assert FFT.seen["forward"] == [(6, 5, 4)]
    assert "jaxdecl_dispatch" in f.lower(x).as_text()


class Dft(jd.Primitive, linear=True, nondiff=("points",)):
    """A non-uniform DFT, sum_j c_j exp(i k x_j): linear in `c`, `points` non-differentiable.

    Its @batch rule batches strengths natively (one call with a leading batch) and
    declines a batch of point sets, which then runs one call per element.
    """

    calls: ClassVar[collections.Counter] = collections.Counter()

    def __init__(self, batched=False):
        self.batched = batched

    @jd.abstract
    def shapes(self, points, c):
        return jax.ShapeDtypeStruct(c.shape[:-1] + (6,), c.dtype)

    def _matrix(self, points):
        return np.exp(1j * np.outer(np.arange(6), points))

    @jd.forward
    def apply(self, points, c):
        type(self).calls["forward"] += 1
        return (c @ self._matrix(points).T).astype(c.dtype)

    @jd.transpose
    def back(self, points, ct):
        type(self).calls["transpose"] += 1
        return (ct @ self._matrix(points)).astype(ct.dtype)

    @jd.batch
    def batch(self, args, axes):
        (points, c), (points_axis, c_axis) = args, axes
        type(self).calls[f"batch {points_axis} {c_axis}"] += 1
        if points_axis is not None or self.batched:
            return NotImplemented
        return Dft(batched=True)(points, jnp.moveaxis(c, c_axis, 0)), 0


def _dft_ref(points, c):
    return c @ np.exp(1j * np.outer(np.arange(6), points)).T


def test_a_batch_rule_declines_the_mixes_it_does_not_handle():
    rng = np.random.default_rng(21)
    points, c = rng.uniform(0, 1, (3, 5)), rng.standard_normal((3, 5)) + 0j
    op = Dft()
    # strengths batched, points shared: the rule's one call
    np.testing.assert_allclose(jax.vmap(op, in_axes=(None, 0))(points[0], c),
                               _dft_ref(points[0], c), rtol=1e-12)
    assert Dft.calls == {"batch None 0": 1, "forward": 1}
    # points batched: declined, then one call per element (batch="loop")
    Dft.calls.clear()
    got = jax.jit(jax.vmap(op))(points, c)
    np.testing.assert_allclose(got, np.stack([_dft_ref(p, v) for p, v in zip(points, c)]),
                               rtol=1e-12)
    assert Dft.calls == {"batch 0 0": 1, "forward": 3}
    # the transpose of a declined batch is declined too, and right
    Dft.calls.clear()
    ct = rng.standard_normal((3, 6)) + 1j * rng.standard_normal((3, 6))
    transposed = jax.vmap(lambda p, v: jax.linear_transpose(lambda x: op(p, x), c[0])(v)[0])
    expected = np.stack([t @ np.exp(1j * np.outer(np.arange(6), p)) for p, t in zip(points, ct)])
    np.testing.assert_allclose(transposed(points, ct), expected, rtol=1e-12)
    assert Dft.calls["transpose"] == 3
    jd.check(op, points[0], c[0])


# ---------------------------------------------------------------------------
# Nondiff inputs
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_axes", [(0, None), (0, 0), (None, 0)],
                         ids=lambda a: "".join(map(str, a)))
def test_nondiff_input_batched_or_not(dtype, in_axes):
    rng = np.random.default_rng(10)
    x = _random(rng, (4, 3) if in_axes[0] == 0 else (3,), dtype)
    w = _random(rng, (4, 3) if in_axes[1] == 0 else (3,), "float64").astype(
        np.real(x).dtype)
    op = Weighted()

    def ref(x, w):
        return w * x**2

    y = jax.vmap(op, in_axes)(x, w)
    _close(y, jax.vmap(ref, in_axes)(x, w), dtype)
    _close(y, _loop(op, [x, w], in_axes), dtype)
    assert {shapes for shapes in Weighted.seen} == {((3,), (3,))}

    def grad_of(f):
        return jax.grad(lambda x, w: _energy(f(x, w)))

    g = jax.vmap(grad_of(op), in_axes)(x, w)
    _close(g, jax.vmap(grad_of(ref), in_axes)(x, w), dtype)
    _close(g, _loop(jax.jit(grad_of(op)), [x, w], in_axes), dtype)


def test_nondiff_input_under_vmap_still_refuses_differentiation():
    x, w = np.ones((2, 3)), np.ones((2, 3))
    with pytest.raises(ValueError, match="'w'"):
        jax.vmap(jax.grad(lambda x, w: jnp.sum(Weighted()(x, w)), argnums=1))(x, w)


# ---------------------------------------------------------------------------
# Two inputs, two outputs: every in_axes/out_axes placement
# ---------------------------------------------------------------------------

AXES = [0, 1, 2, None]
IN_AXES = [p for p in itertools.product(AXES, AXES) if p != (None, None)]


def _place(base, axis):
    """`base` (batch axis first) with its batch axis moved to `axis`; None: unbatched."""
    return base[0] if axis is None else np.moveaxis(base, 0, axis)


@pytest.mark.parametrize("mode", ["loop", "vectorized"])
@pytest.mark.parametrize("in_axes", IN_AXES, ids=lambda a: "".join(map(str, a)))
def test_pair_axis_matrix(mode, in_axes):
    dtype = "float64"
    rng = np.random.default_rng(11)
    a = _place(_random(rng, (3, 4, 5), dtype), in_axes[0])
    b = _place(_random(rng, (3, 4, 5), dtype), in_axes[1])
    op = PAIRS[mode]()
    looped = _loop(op, [a, b], in_axes)  # stacked along axis 0
    for out_axes in [(0, 0), (1, 2), (2, -1), (-2, 1)]:
        ys = jax.vmap(op, in_axes=in_axes, out_axes=out_axes)(a, b)
        refs = jax.vmap(pair_ref, in_axes=in_axes, out_axes=out_axes)(a, b)
        for j, (y, r) in enumerate(zip(ys, refs)):
            assert y.shape == r.shape
            _close(y, r, dtype)
            _close(y, np.moveaxis(looped[j], 0, out_axes[j]), dtype)


NESTED = [  # (outer in_axes, inner in_axes, outer out_axes, inner out_axes)
    ((0, 0), (0, 0), 0, 0),
    ((4, None), (1, 1), -1, 2),
    ((2, 3), (None, 0), 1, (0, 1)),
    ((None, 1), (3, 2), (2, 0), -1),
]


@pytest.mark.parametrize("mode", ["loop", "vectorized"])
@pytest.mark.parametrize("axes", NESTED, ids=str)
def test_pair_nested_vmap_5d(mode, axes):
    dtype = "float64"
    outer_in, inner_in, outer_out, inner_out = axes
    rng = np.random.default_rng(12)
    # 5-d when batched by both vmaps: element shape (2, 3, 2).
    shapes = []
    for o, i in zip(outer_in, inner_in):
        shape = [2, 3, 2]
        if i is not None:
            shape.insert(i, 4)
        if o is not None:
            shape.insert(o, 5)
        shapes.append(tuple(shape))
    a, b = (_random(rng, s, dtype) for s in shapes)
    op = PAIRS[mode]()

    def nest(f):
        return jax.vmap(jax.vmap(f, in_axes=inner_in, out_axes=inner_out),
                        in_axes=outer_in, out_axes=outer_out)

    ys, refs = nest(op)(a, b), nest(pair_ref)(a, b)
    inner_outs = inner_out if isinstance(inner_out, tuple) else (inner_out,) * 2
    outer_outs = outer_out if isinstance(outer_out, tuple) else (outer_out,) * 2
    for j, (y, r) in enumerate(zip(ys, refs)):
        assert y.ndim == 5
        _close(y, r, dtype)
        looped = _loop(lambda x, z, j=j: _loop(op, [x, z], inner_in, inner_outs[j])[j],
                       [a, b], outer_in, out_axis=outer_outs[j])
        _close(y, looped, dtype)


@pytest.mark.parametrize("mode", ["loop", "vectorized"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pair_vmap_of_vjp(mode, dtype):
    rng = np.random.default_rng(13)
    a, b, c1, c2 = (_random(rng, (3, 4), dtype) for _ in range(4))
    op = PAIRS[mode]()

    def vjp_of(f):
        return lambda a, b, c1, c2: jax.vjp(f, a, b)[1]((c1, c2))

    in_axes = (0, None, 1, 0)
    args = [a, b[0], c1.T, c2]
    for x, r, lp in zip(jax.vmap(vjp_of(op), in_axes)(*args),
                        jax.vmap(vjp_of(pair_ref), in_axes)(*args),
                        _loop(jax.jit(vjp_of(op)), args, in_axes)):
        _close(x, r, dtype)
        _close(x, lp, dtype)
    jd.check(op, a, b)


# ---------------------------------------------------------------------------
# Linear op with a @batch rule
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [0, -1])
@pytest.mark.parametrize("in_axis,out_axis", [(0, 0), (1, -1), (2, 1)])
def test_fft_vmap(dtype, axis, in_axis, out_axis):
    rng = np.random.default_rng(14)
    x = _random(rng, (3, 4, 5), dtype)
    op = FFT(axis=axis)
    y = jax.vmap(op, in_axes=in_axis, out_axes=out_axis)(x)
    assert y.dtype == _complex_of(dtype)
    _close(y, jax.vmap(lambda v: fft_ref(v, axis), in_axis, out_axis)(x), dtype)
    _close(y, _loop(op, [x], (in_axis,), out_axis=out_axis), dtype)
    assert FFT.calls["batch"] == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_fft_check(dtype):
    jd.check(FFT(axis=0), _random(np.random.default_rng(15), (4, 3), dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [0, -1])
def test_fft_derivatives_under_vmap(dtype, axis):
    rng = np.random.default_rng(16)
    x, ct = _random(rng, (3, 4, 5), dtype), _random(rng, (3, 4, 5), _complex_of(dtype))
    op = FFT(axis=axis)

    def ref(v):
        return fft_ref(v, axis)

    def loss(f):
        return lambda v: _energy(f(v) * jnp.arange(1, 6))

    # vmap of grad: the transpose is batched through the @batch rule.
    g = jax.vmap(jax.grad(loss(op)), in_axes=1)(x)
    assert FFT.calls["batch"] >= 2  # the forward, and the transpose through it
    assert FFT.calls["forward"] == 1 and FFT.calls["transpose"] == 1
    _close(g, jax.vmap(jax.grad(loss(ref)), in_axes=1)(x), dtype)
    _close(g, _loop(jax.jit(jax.grad(loss(op))), [x], (1,)), dtype)

    # grad of vmap
    def total(f):
        return lambda v: _energy(jax.vmap(f, in_axes=2)(v) * jnp.arange(1, 6)[:, None, None])

    _close(jax.grad(total(op))(x), jax.grad(total(ref))(x), dtype)

    # vmap of linear_transpose, on complex inputs (a real input's transpose keeps Re).
    struct = jax.ShapeDtypeStruct((4, 5), x.dtype)

    def transposed(f):
        return lambda c: jax.linear_transpose(f, struct)(c)[0]

    FFT.calls.clear()
    t = jax.vmap(transposed(op))(ct)
    assert FFT.calls["transpose"] == 1 and FFT.calls["forward"] == 0
    _close(t, jax.vmap(transposed(ref))(ct), dtype)
    _close(t, _loop(jax.jit(transposed(op)), [ct], (0,)), dtype)

    # vmap of jvp and of linearize
    _, tan = jax.vmap(lambda v, dv: jax.jvp(op, (v,), (dv,)))(x, x[::-1])
    _close(tan, jax.vmap(lambda v, dv: jax.jvp(ref, (v,), (dv,))[1])(x, x[::-1]), dtype)
    lin = jax.vmap(lambda v, dv: jax.linearize(op, v)[1](dv), in_axes=(None, 0))(x[0], x)
    _close(lin, jax.vmap(ref)(x), dtype)


@pytest.mark.parametrize("size", [1, 0])
def test_fft_tiny_batches(size):
    x = _random(np.random.default_rng(17), (size, 4), "complex128")
    y = jax.vmap(FFT())(x)
    assert y.shape == (size, 4)
    _close(y, np.fft.fft(x, axis=-1), "complex128")


class Cube(jd.Primitive):
    """Elementwise x**3 on 0-d elements: the per-element views are 0-d arrays."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, *, out):
        assert isinstance(x, np.ndarray) and isinstance(out, np.ndarray)
        np.power(x, 3, out=out)


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 1, 3)])
def test_loop_over_scalar_elements(shape):
    x = np.random.default_rng(0).standard_normal(shape)
    f = Cube()
    for _ in shape:
        f = jax.vmap(f)
    _close(f(x), x**3, "float64")


def test_loop_over_scalar_elements_broadcasting_in_one_dim():
    class Add(jd.Primitive):
        @jd.abstract
        def shapes(self, x, y):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)

        @jd.forward
        def apply(self, x, y, *, out):
            np.add(x, y, out=out)

    x, y = np.arange(6.0).reshape(2, 3), np.array([10.0, 20.0])
    f = jax.vmap(jax.vmap(Add(), in_axes=(0, None)), in_axes=(0, 0))
    _close(f(x, y), x + y[:, None], "float64")


def test_loop_over_scalar_elements_keeps_no_plan():
    # 0-d elements take the streaming path: no per-element memory kept between calls,
    # and no slower per element than 1-d elements (it used to be 10x slower, and to
    # keep ~280 bytes per element for the life of the process).
    import time
    n = 200_000
    scalar, rows = jax.jit(jax.vmap(Cube())), jax.jit(jax.vmap(Cube()))
    xs, xr = jnp.ones(n), jnp.ones((n, 1))
    jax.block_until_ready((scalar(xs), rows(xr)))

    def best(f, x):
        times = []
        for _ in range(3):
            start = time.perf_counter()
            jax.block_until_ready(f(x))
            times.append(time.perf_counter() - start)
        return min(times)

    assert best(scalar, xs) < 3 * best(rows, xr)


# ---------------------------------------------------------------------------
# Looped rows: the dispatcher re-points one view per operand from row to row
# ---------------------------------------------------------------------------


class RowRule(jd.Primitive):
    """out = x * y + x.sum(), one row at a time; `how` makes a row misbehave."""

    def __init__(self, how=None, at=2):
        self.how, self.at = how, at
        self.row = 0

    @jd.abstract
    def shapes(self, x, y):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, y, *, out):
        row, self.row = self.row, self.row + 1
        if self.how == "reshape":  # in place: the next row must still see (2, 3)
            assert x.shape == (2, 3) and out.shape == (2, 3)
            x.shape = y.shape = out.shape = (6,)
        if self.how == "flags":  # in place too: the next row must get fresh views
            assert out.flags.writeable and x.flags.aligned
            x.flags.aligned = y.flags.aligned = False
        np.multiply(x, y, out=out)
        out += x.sum()
        if self.how == "flags":
            out.flags.writeable = False
        if row != self.at:
            return None
        if self.how == "keep":
            _kept_rows.append(out[:1])
        elif self.how == "raise":
            raise NotConvergedRow("row stalled", out)
        elif self.how == "return":
            return out.copy()
        return None


_kept_rows = []


class NotConvergedRow(Exception):
    def __init__(self, message, residual):
        super().__init__(message, residual)
        self.residual = residual


def _row_ref(x, y):
    return x * y + x.sum(axis=tuple(range(-2, 0)), keepdims=True)


@pytest.mark.parametrize("dtype", DTYPES + ["complex128"])
@pytest.mark.parametrize("in_axes", [(0, 0), (0, None), (None, 0)])
@pytest.mark.parametrize("jit", [False, True])
def test_loop_rows_see_their_own_element(dtype, in_axes, jit):
    rng = np.random.default_rng(11)
    x = _random(rng, (5, 2, 3) if in_axes[0] == 0 else (2, 3), dtype)
    y = _random(rng, (5, 2, 3) if in_axes[1] == 0 else (2, 3), dtype)
    f = jax.vmap(RowRule(), in_axes=in_axes)
    y_got = (jax.jit(f) if jit else f)(x, y)
    xb, yb = np.broadcast_to(x, (5, 2, 3)), np.broadcast_to(y, (5, 2, 3))
    _close(y_got, _row_ref(xb, yb), dtype)


def test_loop_rows_over_two_batch_dims_and_runs_after_runs():
    rng = np.random.default_rng(12)
    f = jax.jit(jax.vmap(jax.vmap(RowRule(), in_axes=(0, None)), in_axes=(0, 0)))
    for _ in range(3):  # the compiled site re-points its views run after run
        x, y = rng.standard_normal((4, 3, 2, 3)), rng.standard_normal((4, 2, 3))
        _close(f(x, y), _row_ref(x, y[:, None]), "float64")


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("how", [pytest.param("reshape", marks=RESHAPES_IN_PLACE), "flags"])
def test_loop_row_changed_in_place_is_not_reused(how, jit):
    rng = np.random.default_rng(13)
    x, y = rng.standard_normal((4, 2, 3)), rng.standard_normal((4, 2, 3))
    f = jax.vmap(RowRule(how))
    _close((jax.jit(f) if jit else f)(x, y), _row_ref(x, y), "float64")


def test_loop_row_kept_by_the_rule_is_an_escape():
    x = jnp.ones((4, 2, 3))
    try:
        with pytest.raises(jd.BufferEscapeError,
                           match=r"RowRule\.apply \(@forward\) kept a reference to output"):
            jax.block_until_ready(jax.vmap(RowRule("keep"))(x, x))
    finally:
        _kept_rows.clear()
    _close(jax.vmap(RowRule())(x, x), _row_ref(np.ones((4, 2, 3)), 1.0), "float64")


def test_loop_row_exception_keeps_its_type_and_a_copy_of_its_row():
    x = jnp.arange(24.0).reshape(4, 2, 3)
    with pytest.raises(NotConvergedRow, match="row stalled") as info:
        jax.vmap(RowRule("raise", at=2))(x, x)
    residual = info.value.residual
    assert residual.flags.owndata or residual.base.flags.owndata
    _close(residual, _row_ref(np.asarray(x), np.asarray(x))[2], "float64")


def test_loop_row_returning_a_value_names_the_rule():
    x = jnp.ones((3, 2, 3))
    with pytest.raises(jd.RuleError, match=r"RowRule\.apply \(@forward\) takes `out`"):
        jax.vmap(RowRule("return", at=1))(x, x)
