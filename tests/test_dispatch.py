"""The C++ dispatcher: zero-copy buffers, every dtype, shapes, transformations, lifetime."""

import gc
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import RESHAPES_IN_PLACE, subprocess_env, tol
from ops import Negate

import jaxdecl as jd

HELPER = os.path.join(os.path.dirname(__file__), "helpers_subprocess.py")
ALL_DTYPES = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
]


def _dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _sample(name, shape, seed=0):
    """Deterministic values of dtype `name` that survive the dtype exactly."""
    rng = np.random.default_rng(seed)
    dtype = _dtype(name)
    if name == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    values = rng.integers(-64, 64, shape) / 4.0
    if np.issubdtype(dtype, np.complexfloating):
        values = values + 1j * rng.integers(-64, 64, shape) / 8.0
    return values.astype(dtype)


def _same(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


class Pointers(jd.Primitive):
    """Negation that records where its buffers live and whether they are writable."""

    seen = {}

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x, *, out):
        Pointers.seen.update(
            x=x.__array_interface__["data"][0], out=out.__array_interface__["data"][0],
            x_writeable=x.flags.writeable, out_writeable=out.flags.writeable,
        )
        np.negative(x, out=out)


class ReturnPointers(jd.Primitive):
    """Return-form twin of Pointers."""

    seen = {}

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x):
        ReturnPointers.seen.update(x=x.__array_interface__["data"][0],
                                   x_writeable=x.flags.writeable)
        return -x


# ---------------------------------------------------------------------------
# Zero copy
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_zero_copy_buffers(jit):
    x = jnp.arange(10**5, dtype=jnp.float64)
    f = jax.jit(Pointers()) if jit else Pointers()
    y = f(x)
    # XLA hands parameters to the handler in place and writes the result where it lives.
    assert Pointers.seen["x"] == x.unsafe_buffer_pointer()
    assert Pointers.seen["out"] == y.unsafe_buffer_pointer()
    np.testing.assert_array_equal(y, -np.arange(10**5, dtype=np.float64))


def test_return_form_input_is_zero_copy():
    x = jnp.arange(10**5, dtype=jnp.float64)
    y = jax.jit(ReturnPointers())(x)
    assert ReturnPointers.seen["x"] == x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(y, -np.asarray(x))


def test_inputs_read_only_outputs_writable():
    Pointers.seen.clear()
    Pointers()(jnp.ones(4))
    assert Pointers.seen["x_writeable"] is False
    assert Pointers.seen["out_writeable"] is True
    ReturnPointers.seen.clear()
    ReturnPointers()(jnp.ones(4))
    assert ReturnPointers.seen["x_writeable"] is False


def test_writing_an_input_raises():
    class Scribble(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            return _same(x)

        @jd.forward
        def apply(self, x):
            x[0] = 1.0
            return x

    x = jnp.zeros(3)
    with pytest.raises(ValueError, match="read-only"):
        Scribble()(x)
    np.testing.assert_array_equal(x, np.zeros(3))


# ---------------------------------------------------------------------------
# Every dtype, shapes, both forms
# ---------------------------------------------------------------------------


class Reverse(jd.Primitive):
    """Return form: the input reversed along its first axis, copied."""

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x):
        return np.array(x[::-1])


class ReverseInto(jd.Primitive):
    """Zero-copy form of Reverse."""

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x, *, out):
        out[...] = x[::-1]


@pytest.mark.parametrize("cls", [Reverse, ReverseInto], ids=["return", "out"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", ALL_DTYPES)
def test_every_dtype_round_trips(name, jit, cls):
    x = _sample(name, (5, 3))
    f = jax.jit(cls()) if jit else cls()
    y = f(jnp.asarray(x))
    assert y.dtype == _dtype(name) and y.shape == x.shape
    np.testing.assert_array_equal(np.asarray(y), x[::-1])


@pytest.mark.parametrize("name", [n for n in ALL_DTYPES if n != "bool"])
def test_every_dtype_negates_like_numpy(name):
    x = _sample(name, (7,), seed=1)
    with np.errstate(over="ignore"):
        expected = np.negative(x)
    np.testing.assert_array_equal(np.asarray(jax.jit(Negate())(jnp.asarray(x))), expected)


SHAPE_CASES = [(cls, shape) for cls in (Reverse, ReverseInto, Negate)
               for shape in [(), (0,), (3, 0), (0, 4, 2)]
               if shape != () or cls is Negate]  # reversal needs an axis


@pytest.mark.parametrize("cls,shape", SHAPE_CASES,
                         ids=[f"{c.__name__}-{s}" for c, s in SHAPE_CASES])
def test_scalar_and_empty_arrays(cls, shape):
    x = _sample("float64", shape, seed=2)
    expected = -x if cls is Negate else x[::-1]
    for f in (cls(), jax.jit(cls())):
        y = f(jnp.asarray(x))
        assert y.shape == shape and y.dtype == np.float64
        np.testing.assert_array_equal(np.asarray(y), expected)


def test_scalar_zero_copy():
    y = Negate()(jnp.float32(2.5))
    assert y.shape == () and y.dtype == np.float32 and float(y) == -2.5


class Split(jd.Primitive):
    """Three inputs of mixed dtypes, three outputs: (a + b, a * b, c + 1)."""

    @jd.abstract
    def shapes(self, a, b, c):
        return _same(a), _same(a), _same(c)

    @jd.forward
    def apply(self, a, b, c):
        return a + b, a * b, c + 1


class SplitInto(jd.Primitive):
    """Zero-copy form of Split."""

    @jd.abstract
    def shapes(self, a, b, c):
        return _same(a), _same(a), _same(c)

    @jd.forward
    def apply(self, a, b, c, *, out):
        s, p, c1 = out
        np.add(a, b, out=s)
        np.multiply(a, b, out=p)
        np.add(c, 1, out=c1)


@pytest.mark.parametrize("cls", [Split, SplitInto], ids=["return", "out"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "complex64", "complex128"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_multiple_inputs_and_outputs(cls, dtype, jit):
    a = _sample(dtype, (4, 2), seed=3)
    b = _sample(dtype, (4, 2), seed=4)
    c = np.arange(5, dtype=np.int32)
    f = jax.jit(cls()) if jit else cls()
    s, p, c1 = f(jnp.asarray(a), jnp.asarray(b), jnp.asarray(c))
    np.testing.assert_allclose(s, a + b, rtol=tol(dtype))
    np.testing.assert_allclose(p, a * b, rtol=tol(dtype))
    assert c1.dtype == np.int32
    np.testing.assert_array_equal(c1, c + 1)


# ---------------------------------------------------------------------------
# Tracing and transformations
# ---------------------------------------------------------------------------


def test_eager_calls_take_every_kind_of_argument_after_a_cached_one():
    """The cached eager path (JAX arrays on one device each) and the general one agree,
    in any order: NumPy values, scalars, a one-device mesh, a changed configuration."""
    from ops import Scale

    op = Scale(3.0)
    x = jnp.arange(4.0)
    one_device = jax.device_put(x, jax.sharding.NamedSharding(
        jax.make_mesh((1,), ("d",)), jax.sharding.PartitionSpec("d")))
    for value in (x, np.arange(4.0), x, 2.0, one_device, x, jnp.arange(6.0)):
        np.testing.assert_array_equal(op(value), 3.0 * np.asarray(value))
    op.factor = -1.0  # the same instance, configured anew: a new handle, not the cached call
    np.testing.assert_array_equal(op(x), -np.asarray(x))
    np.testing.assert_array_equal(op(x=x), -np.asarray(x))


def test_eager_calls_do_not_retrace():
    traces = []
    runs = []

    class Counted(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            traces.append(x.shape)
            return _same(x)

        @jd.forward
        def apply(self, x):
            runs.append(1)
            return 2 * x

    from jaxdecl._transforms import eager as _eager

    op = Counted()
    executable = _eager.executable((((3,), np.dtype("float64")),))
    op(jnp.full(3, -1.0))
    compiled = executable._cache_size()
    for i in range(5):
        np.testing.assert_array_equal(op(jnp.full(3, float(i))), np.full(3, 2.0 * i))
    assert traces == [(3,)]
    assert len(runs) == 6
    assert executable._cache_size() == compiled
    op(jnp.ones(4))
    assert traces == [(3,), (4,)]


def test_jit_nested_in_jit():
    x = np.linspace(-1.0, 1.0, 6)
    inner = jax.jit(lambda v: Negate()(v) * 3)
    outer = jax.jit(lambda v: inner(v) + 2 * Negate()(inner(v)))
    np.testing.assert_allclose(outer(x), 3 * x, rtol=1e-15)
    outer2 = jax.jit(lambda v: inner(inner(v)))
    np.testing.assert_allclose(outer2(x), 9 * x, rtol=1e-15)


def test_scan():
    x0 = np.linspace(0.0, 1.0, 4)

    def step(carry, k):
        nxt = Negate()(carry) + k
        return nxt, Reverse()(nxt)

    final, ys = jax.jit(lambda c: jax.lax.scan(step, c, jnp.arange(3.0)))(x0)
    carry, expected = x0, []
    for k in range(3):
        carry = -carry + k
        expected.append(carry[::-1])
    np.testing.assert_allclose(final, carry, rtol=1e-15)
    np.testing.assert_allclose(ys, np.stack(expected), rtol=1e-15)


@pytest.mark.parametrize("flag", [True, False])
def test_cond(flag):
    x = np.array([1.0, -2.0, 3.0])
    f = jax.jit(lambda p, v: jax.lax.cond(p, Negate(), Reverse(), v))
    np.testing.assert_array_equal(f(flag, x), -x if flag else x[::-1])


def test_checkpoint():
    class Square(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            return _same(x)

        @jd.forward
        def apply(self, x):
            return x * x

        @jd.vjp
        def pull(self, x, ct):
            return 2 * x * ct

    x = np.array([0.5, -1.5, 2.0])
    f = jax.checkpoint(lambda v: jnp.sum(Square()(v) * v))
    np.testing.assert_allclose(jax.jit(f)(x), np.sum(x**3), rtol=1e-14)
    np.testing.assert_allclose(jax.jit(jax.grad(f))(x), 3 * x**2, rtol=1e-14)


# ---------------------------------------------------------------------------
# Lifetime
# ---------------------------------------------------------------------------


def _compile_with_a_temporary_class(x):
    class Affine(jd.Primitive):
        def __init__(self, a):
            self.a = a

        @jd.abstract
        def shapes(self, x):
            return _same(x)

        @jd.forward
        def apply(self, x):
            return self.a * x + 1

    op = Affine(3.0)
    return jax.jit(lambda v: op(v)).lower(x).compile()


def test_compiled_function_outlives_op_and_class():
    x = jnp.linspace(0.0, 1.0, 8)
    compiled = _compile_with_a_temporary_class(x)
    gc.collect()
    np.testing.assert_allclose(compiled(x), 3 * np.asarray(x) + 1, rtol=1e-15)
    np.testing.assert_allclose(compiled(2 * x), 6 * np.asarray(x) + 1, rtol=1e-15)


# ---------------------------------------------------------------------------
# Unsupported dtypes and 32-bit mode
# ---------------------------------------------------------------------------


def test_unsupported_input_dtype_raises_at_trace_time():
    x = jnp.ones(3, jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"Negate: input x has dtype float8_e4m3fn"):
        jax.jit(Negate()).lower(x)  # tracing only, nothing runs
    with pytest.raises(TypeError, match=r"input x.*float8_e4m3fn"):
        Negate()(x)


def test_unsupported_output_dtype_raises_at_trace_time():
    class ToFloat8(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            return jax.ShapeDtypeStruct(x.shape, jnp.float8_e4m3fn)

        @jd.forward
        def apply(self, x):
            return x

    with pytest.raises(TypeError, match=r"ToFloat8.shapes \(@abstract\) output has dtype"):
        jax.jit(ToFloat8()).lower(jnp.ones(2))


def test_without_x64():
    env = subprocess_env(JAX_ENABLE_X64="0")
    done = subprocess.run([sys.executable, HELPER, "x64_off"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])["results"]
    assert results == ["ok"] * 10, results


class AddThenCall(jd.Primitive):
    """x + 1, then hands the result to `inner` eagerly from inside the rule."""

    def __init__(self, inner=None):
        self.inner = inner

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x):
        y = np.array(x) + 1
        return y if self.inner is None else np.asarray(self.inner(y))


def test_rules_calling_ops_of_the_same_signature_nest():
    # Each level re-enters JAX eagerly with the same signature as the level above.
    op = AddThenCall(AddThenCall(AddThenCall()))
    x = jnp.arange(4.0)
    for _ in range(3):
        np.testing.assert_array_equal(op(x), np.arange(4.0) + 3)
    np.testing.assert_array_equal(jax.jit(op)(x), np.arange(4.0) + 3)


class ReshapesItsViews(jd.Primitive):
    """Reshapes its views in place, which NumPy < 2.5 allows on an array it was handed."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, *, out):
        x.shape = (x.size,)
        out.shape = (out.size,)
        np.multiply(x, 3.0, out=out)


class FlagsItsViews(jd.Primitive):
    """Changes its views' flags in place: the input unaligned, the output read-only."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, *, out):
        assert out.flags.writeable and x.flags.aligned  # a fresh view each run
        x.flags.aligned = False
        np.multiply(x, 3.0, out=out)
        out.flags.writeable = False


@pytest.mark.parametrize("cls", [pytest.param(ReshapesItsViews, marks=RESHAPES_IN_PLACE),
                                 FlagsItsViews, Negate], ids=["reshaping", "flags", "plain"])
def test_compiled_call_site_views_follow_each_run(cls):
    # A compiled call site reuses its NumPy views from run to run, pointed at
    # the new buffers; a view the rule changed is never reused as it is.
    f = jax.jit(cls())
    factor = -1.0 if cls is Negate else 3.0
    kept = []
    for i in range(6):
        x = jnp.full((2, 3), float(i)) + jnp.arange(6.0).reshape(2, 3)
        y = f(x)
        kept.append((np.asarray(x), y))  # earlier results stay right as new runs come
        for old_x, old_y in kept:
            np.testing.assert_array_equal(np.asarray(old_y), factor * old_x)


def _many_inputs_op(n, keep=None):
    """An op with inputs x0..x{n-1}: out = sum(x) * 2; keeps input `keep` if given."""
    import inspect

    kept = []

    def shapes(self, *xs):
        return jax.ShapeDtypeStruct(xs[0].shape, xs[0].dtype)

    def apply(self, *xs, out):
        np.multiply(sum(xs), 2, out=out)
        if keep is not None:
            kept.append(xs[keep])

    params = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD)
              for name in ["self"] + [f"x{i}" for i in range(n)]]
    out = inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY)
    shapes.__signature__ = inspect.Signature(params)
    apply.__signature__ = inspect.Signature([*params, out])
    cls = type(f"Sum{n}", (jd.Primitive,), {"shapes": jd.abstract(shapes),
                                            "apply": jd.forward(apply)})
    return cls(), kept


@pytest.mark.parametrize("n", [1, 15, 16, 40, 70])  # the dispatcher calls up to 62 directly
def test_many_inputs_call_the_rule_directly_or_through_python(n):
    xs = [jnp.arange(5.0) + i for i in range(n)]
    expected = 2 * sum(np.asarray(x) for x in xs)
    op, _ = _many_inputs_op(n)
    np.testing.assert_allclose(op(*xs), expected)
    f = jax.jit(op)
    for _ in range(2):  # the second run reuses the call site's views
        np.testing.assert_allclose(f(*xs), expected)
    rows = jax.jit(jax.vmap(op))(*[jnp.stack([x, 2 * x]) for x in xs])
    np.testing.assert_allclose(rows, np.stack([expected, 2 * expected]))


@pytest.mark.parametrize("n", [40, 70])
def test_many_inputs_kept_view_names_its_input(n):
    op, kept = _many_inputs_op(n, keep=n - 3)
    xs = [jnp.arange(5.0) + i for i in range(n)]
    with pytest.raises(jd.BufferEscapeError, match=rf"kept a reference to x{n - 3} "):
        op(*xs)
    kept.clear()


def test_not_tracing_agrees_with_jax_in_every_context():
    # The eager path asks on every call, through the fastest form this JAX allows.
    from jax._src import core

    from jaxdecl import _compat

    seen = []

    def probe(x):
        seen.append((_compat.not_tracing(), core.trace_state_clean()))
        return x

    probe(1.0)
    jax.jit(probe)(1.0)
    jax.vmap(probe)(jnp.ones(2))
    jax.grad(probe)(1.0)
    jax.eval_shape(lambda x: probe(x), 1.0)  # probe's own trace is cached from jit
    jax.lax.scan(lambda c, x: (probe(c), x), 0.0, jnp.ones(2))
    jax.grad(jax.checkpoint(probe))(1.0)
    assert seen[0] == (True, True)
    assert all(ours == theirs for ours, theirs in seen) and len(seen) == 7
    assert not any(ours for ours, _ in seen[1:])
