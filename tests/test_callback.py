"""jd.pure_callback: jax.pure_callback's behaviour, on jaxdecl's path.

Mirrors jaxdecl/_callback/__init__.py (the function, its checks of arguments) and
_callback/ops.py (the ops, vmap methods, derivatives) and results.py (the results'
checks). The behaviours are the ones users of jax.pure_callback rely on (JAX's own
tests/python_callback_test.py describes them); every value is compared with NumPy or
jax.numpy, and errors with the types JAX raises.
"""

import functools
import inspect

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from conftest import tol

import jaxdecl as jd

DTYPES = ["float32", "float64", "complex64", "complex128"]


def spec(x):
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))


@pytest.fixture
def x64_off():
    jax.config.update("jax_enable_x64", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", True)


# --- the same function -------------------------------------------------------------------


def test_the_signature_is_the_installed_jax_s():
    assert inspect.signature(jd.pure_callback) == inspect.signature(jax.pure_callback)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("how", ["eager", "jit"])
def test_values_match_numpy(dtype, how):
    x = (np.linspace(0.1, 2.0, 7) * (1 + 0.5j if "complex" in dtype else 1)).astype(dtype)

    def f(x):
        return jd.pure_callback(np.sin, spec(x), x)

    y = (jax.jit(f) if how == "jit" else f)(jnp.asarray(x))
    assert y.dtype == x.dtype
    np.testing.assert_allclose(y, np.sin(x), rtol=tol(dtype))


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_the_callback_gets_read_only_numpy_arrays(how):
    seen = []

    def cb(x, y):
        seen.append((type(x), x.flags.writeable, type(y), y.shape))
        return x * 2

    x = jnp.arange(3.0)

    def f(x):
        return jd.pure_callback(cb, spec(x), x, 1.5)

    np.testing.assert_array_equal((jax.jit(f) if how == "jit" else f)(x), [0.0, 2.0, 4.0])
    assert seen == [(np.ndarray, False, np.ndarray, ())]


def test_scalars_literals_and_array_likes_are_results():
    class Wrapped:
        def __array__(self, dtype=None, copy=None):
            return np.full(2, 7.0, dtype=dtype)

    f32 = jax.ShapeDtypeStruct((), np.float32)
    assert float(jax.jit(lambda x: jd.pure_callback(lambda x: x + np.float32(1.0), f32, x))(
        np.float32(0.0))) == 1.0
    assert float(jd.pure_callback(lambda: np.float64(2.5), jax.ShapeDtypeStruct((), float))) \
        == 2.5
    assert int(jd.pure_callback(lambda: 3, jax.ShapeDtypeStruct((), np.int64))) == 3
    assert bool(jd.pure_callback(lambda: True, jax.ShapeDtypeStruct((), np.bool_)))
    np.testing.assert_array_equal(
        jd.pure_callback(Wrapped, jax.ShapeDtypeStruct((2,), np.float64)), [7.0, 7.0])


def test_several_arguments_and_results():
    def cb(x, y, z):
        return x, y + z

    x, y, z = jnp.ones(3), jnp.arange(3.0), jnp.arange(3.0) + 1
    a, b = jax.jit(lambda *v: jd.pure_callback(cb, (spec(x), spec(x)), *v))(x, y, z)
    np.testing.assert_array_equal(a, np.ones(3))
    np.testing.assert_array_equal(b, [1.0, 3.0, 5.0])
    ints = jd.pure_callback(lambda: (np.ones(4, np.float32), np.ones(5, np.int32)),
                            (jax.ShapeDtypeStruct((4,), np.float32),
                             jax.ShapeDtypeStruct((5,), np.int32)))
    assert [v.dtype for v in ints] == [np.float32, np.int32]


def test_pytrees_in_and_out_and_keyword_arguments():
    def cb(pair, *, scale, extra):
        return {"y": [pair[0] * scale], "z": (pair[1] + extra["a"],)}

    x, y = jnp.arange(3.0), jnp.ones(2)
    out = jax.jit(lambda x, y: jd.pure_callback(
        cb, {"y": [spec(x)], "z": (spec(y),)}, (x, y), scale=2.0, extra={"a": y}))(x, y)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(
        {"y": [0], "z": (0,)})
    np.testing.assert_array_equal(out["y"][0], [0.0, 2.0, 4.0])
    np.testing.assert_array_equal(out["z"][0], [2.0, 2.0])
    only_keywords = jd.pure_callback(lambda *, a: a * 2, spec(x), a=x)
    np.testing.assert_array_equal(only_keywords, [0.0, 2.0, 4.0])


def test_results_are_matched_by_leaves_as_jax_matches_them():
    # jax.pure_callback compares only the leaves, in order: a tuple returned for a dict
    # is accepted (the leaves are reassigned by sorted key), as there.
    out = jd.pure_callback(lambda: (np.zeros(1), np.ones(2)),
                           {"a": jax.ShapeDtypeStruct((1,), float),
                            "b": jax.ShapeDtypeStruct((2,), float)})
    np.testing.assert_array_equal(out["b"], np.ones(2))
    assert jd.pure_callback(lambda: None, ()) == ()


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_zero_size_arrays_in_and_out(how):
    x, y = np.zeros((2, 0), np.float32), np.full(2, 42.0, np.float32)

    def f(x, y):
        return jd.pure_callback(
            lambda x, y: (np.ones((2, 0), np.float32), y, np.ones((3, 0), np.int32),
                          np.concatenate([y, y]) + 1),
            (spec(x), spec(y), jax.ShapeDtypeStruct((3, 0), np.int32),
             jax.ShapeDtypeStruct((4,), np.float32)), x, y)

    a, b, c, d = (jax.jit(f) if how == "jit" else f)(x, y)
    assert a.shape == (2, 0) and c.shape == (3, 0) and c.dtype == np.int32
    np.testing.assert_array_equal(b, y)
    np.testing.assert_array_equal(d, np.full(4, 43.0))


def test_a_result_spec_may_be_an_array_or_a_tracer():
    x = jnp.arange(4.0)
    np.testing.assert_allclose(jax.jit(lambda x: jd.pure_callback(np.sin, x, x))(x),
                               np.sin(np.arange(4.0)))


# --- control flow --------------------------------------------------------------------------


def test_inside_while_loop_cond_and_scan():
    inc = functools.partial(jd.pure_callback, lambda v: (v + 1).astype(v.dtype))

    @jax.jit
    def loop(x):
        return jax.lax.while_loop(lambda v: jnp.any(v < 10), lambda v: inc(spec(v), v), x)

    np.testing.assert_array_equal(loop(jnp.arange(5.0)), np.arange(10.0, 15.0))
    assert float(jax.jit(lambda x: jax.lax.while_loop(
        lambda v: v < 10, lambda v: inc(spec(v), v), x))(0.0)) == 10.0

    @jax.jit
    def branch(pred, x):
        return jax.lax.cond(pred, lambda v: inc(spec(v), v),
                            lambda v: jd.pure_callback(lambda w: w - 1, spec(v), v), x)

    np.testing.assert_array_equal(branch(True, jnp.ones(2)), [2.0, 2.0])
    np.testing.assert_array_equal(branch(False, jnp.ones(2)), [0.0, 0.0])

    @jax.jit
    def scanned(x):
        return jax.lax.scan(lambda c, _: (inc(spec(c), c), None), x, jnp.arange(10))[0]

    np.testing.assert_array_equal(scanned(jnp.arange(2.0)), [10.0, 11.0])
    np.testing.assert_array_equal(jax.jit(lambda x: jax.lax.fori_loop(
        0, 7, lambda i, c: inc(spec(c), c), x))(jnp.zeros(3)), np.full(3, 7.0))


def test_an_unused_result_is_eliminated():
    log = []

    def cb(x):
        log.append("ran")
        return x * 2

    @jax.jit
    def f(x):
        jd.pure_callback(cb, spec(x), x)
        return x * 2

    np.testing.assert_array_equal(f(jnp.float32(2.0)), 4.0)
    assert log == []


# --- vmap ----------------------------------------------------------------------------------


def _seen_shapes(method, in_axes, x, y):
    seen = []

    def cb(a, b):
        seen.append((np.shape(a), np.shape(b)))
        return np.sin(a) + b

    def one(a, b):
        return jd.pure_callback(cb, jax.ShapeDtypeStruct(
            jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b)), a.dtype), a, b, vmap_method=method)

    out = jax.jit(jax.vmap(one, in_axes=in_axes))(x, y)
    return out, seen


@pytest.mark.parametrize("method,shapes", [
    ("sequential", [((), ())] * 4), ("sequential_unrolled", [((), ())] * 4),
    ("expand_dims", [((4,), (1,))]), ("broadcast_all", [((4,), (4,))]),
    ("legacy_vectorized", [((4,), ())])])
def test_each_vmap_method_hands_the_callback_what_jax_s_does(method, shapes):
    x, y = jnp.arange(4.0), 1.5
    out, seen = _seen_shapes(method, (0, None), x, y)
    np.testing.assert_allclose(out, np.sin(np.arange(4.0)) + 1.5, rtol=1e-12)
    assert seen == shapes


@pytest.mark.parametrize("method", ["sequential", "expand_dims", "broadcast_all"])
def test_nested_vmaps_over_other_axes(method):
    # ("legacy_vectorized" leaves unbatched inputs as they are, so a callback must
    # broadcast them itself: the same callback fails there, as it does in JAX.)
    x, y = jnp.arange(12.0).reshape(3, 4), jnp.arange(4.0) * 10
    f = jax.vmap(jax.vmap(lambda a, b: jd.pure_callback(
        lambda a, b: np.sin(a) + b, spec(a), a, b, vmap_method=method), in_axes=(0, None)),
        in_axes=(1, 0))
    np.testing.assert_allclose(jax.jit(f)(x, y), np.sin(np.arange(12.0).reshape(3, 4).T)
                               + np.arange(4.0)[:, None] * 10, rtol=1e-12)


def test_vmap_without_a_method_is_refused_as_jax_refuses_it():
    f = jax.vmap(lambda x: jd.pure_callback(np.sin, spec(x), x))
    with pytest.raises(NotImplementedError, match="vmap_method=None.*numpy.sin"):
        f(jnp.arange(3.0))


def test_vmap_of_a_jitted_callback_and_over_axis_1():
    g = jax.jit(lambda x: jd.pure_callback(np.sin, spec(x), x, vmap_method="sequential"))
    x = jnp.arange(8.0).reshape(4, 2)
    np.testing.assert_allclose(jax.vmap(g, in_axes=1)(x), np.sin(np.arange(8.0).reshape(4, 2)).T)


# --- derivatives: none, as in JAX; wrappers work -------------------------------------------


@pytest.mark.parametrize("transform", ["grad", "jvp", "linearize", "jacrev"])
def test_a_bare_derivative_is_a_value_error_naming_the_callback(transform):
    def f(x):
        return jd.pure_callback(np.sin, spec(x), x).sum()

    x = jnp.arange(3.0)
    run = {"grad": lambda: jax.grad(f)(x), "jvp": lambda: jax.jvp(f, (x,), (x,)),
           "linearize": lambda: jax.linearize(f, x), "jacrev": lambda: jax.jacrev(f)(x)}
    with pytest.raises(ValueError, match=r"numpy\.sin\) has no derivatives.*custom_jvp"):
        run[transform]()


def _sin(x):
    return jd.pure_callback(np.sin, spec(x), x, vmap_method="expand_dims")


def _cos(x):
    return jd.pure_callback(np.cos, spec(x), x, vmap_method="expand_dims")


@jax.custom_jvp
def sin_jvp(x):
    return _sin(x)


@sin_jvp.defjvp
def _sin_jvp_rule(primals, tangents):
    (x,), (t,) = primals, tangents
    return sin_jvp(x), _cos(x) * t


@jax.custom_vjp
def sin_vjp(x):
    return _sin(x)


sin_vjp.defvjp(lambda x: (_sin(x), x), lambda x, g: (g * _cos(x),))


@pytest.mark.parametrize("wrapped", [sin_jvp, sin_vjp], ids=["custom_jvp", "custom_vjp"])
def test_custom_derivative_wrappers_work_unchanged(wrapped):
    x = jnp.linspace(0.1, 1.0, 5)
    np.testing.assert_allclose(jax.jit(jax.grad(lambda v: wrapped(v).sum()))(x), jnp.cos(x),
                               rtol=1e-12)
    np.testing.assert_allclose(jax.vmap(jax.grad(lambda v: wrapped(v)))(x), jnp.cos(x),
                               rtol=1e-12)
    if wrapped is sin_jvp:
        jax.test_util.check_grads(wrapped, (x,), order=1, modes=["fwd", "rev"])


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["eager", "jit"])
@pytest.mark.parametrize("returned,declared,what", [
    (lambda: (np.ones(4, np.float32), np.ones(4, np.float32)),
     jax.ShapeDtypeStruct((4,), np.float32), "returned 2 array.* declares 1"),
    (lambda: np.float32(1.0), jax.ShapeDtypeStruct((1,), np.float32),
     r"result #0 has shape \(\) where result_shape_dtypes declares \(1,\)"),
    (lambda: np.array([1], np.float64), jax.ShapeDtypeStruct((1,), np.float32),
     "result #0 has dtype float64 where result_shape_dtypes declares float32"),
    (lambda: np.array([1], np.int32), jax.ShapeDtypeStruct((1,), np.float32),
     "result #0 has dtype int32"),
], ids=["count", "shape", "dtype", "kind"])
def test_wrong_results_are_runtime_errors_naming_the_callback(how, returned, declared, what):
    def f():
        return jd.pure_callback(returned, declared)

    with pytest.raises(RuntimeError, match=r"jd\.pure_callback\(<lambda> \(.*test_callback.py:"
                                           r"\d+\)\).*" + what):
        jax.block_until_ready((jax.jit(f) if how == "jit" else f)())
    np.testing.assert_array_equal(jd.pure_callback(np.ones, jax.ShapeDtypeStruct(
        (2,), float), 2), np.ones(2))  # the process keeps working


def test_wrong_result_errors_are_jaxdecl_rule_errors_eagerly():
    with pytest.raises(jd.RuleError):
        jd.pure_callback(lambda: np.ones(3), jax.ShapeDtypeStruct((4,), float))


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_an_exception_in_the_callback_keeps_its_type_or_its_message(how):
    def cb(x):
        raise KeyError("no such table")

    def f(x):
        return jd.pure_callback(cb, spec(x), x)

    if how == "eager":
        with pytest.raises(KeyError, match="no such table"):
            f(jnp.ones(2))
    else:
        with pytest.raises(RuntimeError, match="KeyError.*no such table"):
            jax.block_until_ready(jax.jit(f)(jnp.ones(2)))


def test_a_callback_called_with_the_wrong_arguments_fails_at_run_time():
    with pytest.raises(RuntimeError, match="TypeError"):
        jax.block_until_ready(jax.jit(lambda: jd.pure_callback(
            lambda x: np.ones(4, np.float32), jax.ShapeDtypeStruct((4,), np.float32)))())


def test_arguments_are_checked_as_jax_checks_them():
    x = jnp.ones(2)
    with pytest.raises(ValueError, match="vmap_method must be on of the allowed methods"):
        jd.pure_callback(np.sin, spec(x), x, vmap_method="parallel")
    with pytest.raises(TypeError, match="not callable"):
        jd.pure_callback(3, spec(x), x)
    with pytest.raises(TypeError, match="leaf #1 is a str"):
        jd.pure_callback(np.sin, (spec(x), "f32"), x)
    if "vectorized" in inspect.signature(jax.pure_callback).parameters:
        with pytest.raises(ValueError, match="'vectorized' argument .* was removed"):
            jd.pure_callback(np.sin, spec(x), x, vectorized=True)
    else:  # this JAX passes it to the callback, like any keyword
        got = jd.pure_callback(lambda v, vectorized: v * vectorized, spec(x), x, vectorized=2.0)
        np.testing.assert_array_equal(got, [2.0, 2.0])


# --- 64-bit types, x64 off ------------------------------------------------------------------


def test_64_bit_result_types_are_refused_without_x64(x64_off):
    with pytest.raises(ValueError, match="cannot specify 64-bit types"):
        jd.pure_callback(lambda: np.float64(1.0), jax.ShapeDtypeStruct((), np.float64))
    with pytest.raises(ValueError, match="cannot specify 64-bit types"):
        jax.jit(lambda: jd.pure_callback(lambda: 1, jax.ShapeDtypeStruct((), np.int64)))()


def test_64_bit_results_become_32_bit_without_x64(x64_off):
    x = jnp.arange(3.0)
    assert x.dtype == np.float32
    y = jax.jit(lambda v: jd.pure_callback(lambda v: v.astype(np.float64) * 2, spec(v), v))(x)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, [0.0, 2.0, 4.0])
    assert float(jd.pure_callback(lambda: 2.5, jax.ShapeDtypeStruct((), np.float32))) == 2.5
    assert int(jd.pure_callback(lambda: 7, jax.ShapeDtypeStruct((), np.int32))) == 7


def test_with_x64_a_float64_result_for_float32_is_an_error():
    with pytest.raises(RuntimeError, match="dtype float64 where .* declares float32"):
        jd.pure_callback(lambda: 2.5, jax.ShapeDtypeStruct((), np.float32))


def test_sharding_names_one_device_as_jax_requires():
    x = jnp.arange(4.0)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    for one in (jax.sharding.SingleDeviceSharding(jax.devices()[0]),
                jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())):
        np.testing.assert_allclose(jax.jit(lambda v, one=one: jd.pure_callback(
            np.sin, spec(v), v, sharding=one))(x), np.sin(np.arange(4.0)))
    with pytest.raises(NotImplementedError, match="only supports SingleDeviceSharding"):
        jd.pure_callback(np.sin, spec(x), x, sharding="cpu:0")


def _counted(calls):
    def sine(v):
        calls.append(v.shape)
        return np.sin(v)
    return sine


@pytest.mark.parametrize("kind", ["Auto", "Explicit"])
@pytest.mark.parametrize("vmapped", [False, True], ids=["whole", "vmap"])
def test_sharding_runs_the_call_once_on_that_device_over_a_mesh(kind, vmapped):
    """Under jit over rows split on every device, sharding= makes the one device it names
    run the callback, on every row (which device: test_processes, one process per device
    group); the values reach every device."""
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("d",),
                             axis_types=(getattr(jax.sharding.AxisType, kind),))
    x = np.arange(4.0 * len(devices) * 3).reshape(2 * len(devices), -1) / 7
    xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
    calls = []
    one = jax.sharding.SingleDeviceSharding(devices[-1])

    def f(v):
        return jd.pure_callback(_counted(calls), spec(v), v, sharding=one,
                                vmap_method="sequential")

    got = jax.jit(jax.vmap(f) if vmapped else f)(xs) + 1
    np.testing.assert_allclose(got, np.sin(x) + 1, rtol=1e-15)
    # (before JAX 0.9 a program over Explicit axes cannot sum from one device: every
    # device runs the callback, as an op without a declaration runs there)
    everywhere = kind == "Explicit" and not jd._compat.EXPLICIT_REDUCTIONS
    assert calls == ([x.shape[1:]] * x.shape[0] if vmapped else [x.shape]) * \
        (len(devices) if everywhere else 1)


def test_an_eager_call_with_sharding_runs_on_that_device():
    device = jax.devices()[-1]
    calls = []
    y = jd.pure_callback(_counted(calls), spec(jnp.ones(3)), jnp.arange(3.0),
                         sharding=jax.sharding.SingleDeviceSharding(device))
    assert y.sharding.device_set == {device} and calls == [(3,)]
    np.testing.assert_allclose(y, np.sin(np.arange(3.0)))


def test_sharding_on_a_device_the_program_lacks_is_a_value_error_naming_both():
    first, last = jax.devices()[0], jax.devices()[-1]
    x = jax.device_put(jnp.arange(3.0), first)
    for lib in (jax, jd):  # JAX's type, with a message that says what is wrong
        with pytest.raises(ValueError) as raised:
            jax.jit(lambda v, lib=lib: lib.pure_callback(
                np.sin, spec(v), v, sharding=jax.sharding.SingleDeviceSharding(last)))(x)
    assert "jd.pure_callback(numpy.sin)" in str(raised.value)
    assert f"specifies device {last}" in str(raised.value)
    assert str(first) in str(raised.value)


def test_sharding_inside_shard_map_is_not_implemented_as_in_jax():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    P = jax.sharding.PartitionSpec
    xs = jax.device_put(jnp.arange(4.0), jax.sharding.NamedSharding(mesh, P("d")))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    for lib in (jax, jd):
        mapped = jd._compat.shard_map(lambda v, lib=lib: lib.pure_callback(
            np.sin, spec(v), v, sharding=one), mesh, in_specs=(P("d"),), out_specs=P("d"))
        with pytest.raises(NotImplementedError, match="specifying sharding inside spmd"):
            jax.jit(mapped)(xs)
