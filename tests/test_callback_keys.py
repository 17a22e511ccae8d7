"""jd.pure_callback's ops: made once per callback, freed with it.

Mirrors jaxdecl/_callback/keys.py (which callables are the same callback) and
op_for in _callback/__init__.py (the recently used ops, the ones still alive).
Memory is bounded by what is alive: distinct lambdas by the thousand leave no kernels
behind once they are gone, and a fresh lambda of the same code and closure reuses its
op and kernel.
"""

import functools
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecl as jd
from jaxdecl import _callback
from jaxdecl._callback import keys
from jaxdecl._host import _dispatch

S = jax.ShapeDtypeStruct((3,), np.float64)
ONE = np.float64(1.0)
X = jnp.arange(3.0)


def _collect():
    for _ in range(3):
        gc.collect()
        _dispatch.release_pending()


def _scaled(c):
    return lambda x: x * c


class Model:
    def __init__(self, c):
        self.c = c

    def rhs(self, x):
        return x * self.c


def test_fresh_functions_of_one_code_and_closure_are_one_callback():
    two = np.float64(2.0)
    a, b = _scaled(two), _scaled(two)
    assert a is not b and keys.key_of(a) == keys.key_of(b) and keys.same(a, b)
    assert not keys.same(a, _scaled(np.float64(2.0)))  # an equal value, another object
    model = Model(3.0)
    assert keys.key_of(model.rhs) == keys.key_of(model.rhs) and keys.same(model.rhs, model.rhs)
    assert not keys.same(model.rhs, Model(3.0).rhs)
    p = functools.partial(np.add, 1.0)
    assert keys.same(p, p) and not keys.same(p, functools.partial(np.add, 1.0))


def test_defaults_and_rebound_cells_make_other_callbacks():
    def f(x, k=ONE):
        return x * k

    def g(x, k=ONE):
        return x * k

    assert not keys.same(f, g)  # other code objects
    value = np.float64(1.0)

    def make():
        return lambda x: x + value

    first = make()
    value = np.float64(5.0)  # noqa: F841 - rebinds the cell both lambdas share
    np.testing.assert_array_equal(jd.pure_callback(first, S, X), X + 5.0)


def test_an_eager_loop_of_fresh_lambdas_reuses_one_op_and_kernel():
    c = np.float64(1.5)
    jd.pure_callback(_scaled(c), S, X)
    kernels = _dispatch.kernel_count()
    ops = {id(_callback.op_for(_scaled(c), S, "sequential")) for _ in range(20)}
    for _ in range(200):
        np.testing.assert_array_equal(jd.pure_callback(_scaled(c), S, X), X * 1.5)
    assert len(ops) == 1
    assert _dispatch.kernel_count() == kernels


def test_bound_methods_and_module_functions_reuse_their_op():
    model = Model(2.0)
    assert _callback.op_for(model.rhs, S) is _callback.op_for(model.rhs, S)
    assert _callback.op_for(np.sin, S) is _callback.op_for(np.sin, S)
    assert _callback.op_for(np.sin, S) is not _callback.op_for(np.cos, S)
    assert _callback.op_for(np.sin, S) is not _callback.op_for(
        np.sin, jax.ShapeDtypeStruct((4,), np.float64))


def test_one_callback_called_by_turns_with_other_arguments_gets_each_its_op():
    """The quickest lookup (a callback's last op) checks every argument: shapes, dtypes,
    structure, vmap_method and x64 alternating call by call each get their own op."""
    calls = [(S, (X,), "sequential"), (jax.ShapeDtypeStruct((4,), np.float64), (jnp.ones(4),),
                                       "sequential"),
             (S, (X,), "expand_dims"), (jax.ShapeDtypeStruct((3,), np.float32),
                                        (X.astype(np.float32),), "sequential"),
             (S, ({"x": X},), "sequential")]

    def sine(x):
        return np.sin(x["x"] if isinstance(x, dict) else x)

    for _ in range(3):
        found = []
        for result, args, method in calls:
            y = jd.pure_callback(sine, result, *args, vmap_method=method)
            assert y.shape == result.shape and y.dtype == result.dtype
            np.testing.assert_allclose(y, np.sin(np.arange(float(y.size))) if y.size == 3
                                       else np.sin(np.ones(4)), rtol=1e-6)
            found.append(_callback.op_for(
                sine, result, method, None,
                jax.tree_util.tree_structure((args, {}))))
        assert len({id(op) for op in found}) == len(calls)
    jax.config.update("jax_enable_x64", False)
    try:
        assert jd.pure_callback(sine, jax.ShapeDtypeStruct((3,), np.float32),
                                X.astype(np.float32)).dtype == np.float32
        off = _callback.op_for(sine, jax.ShapeDtypeStruct((3,), np.float32))
    finally:
        jax.config.update("jax_enable_x64", True)
    assert off is not _callback.op_for(sine, jax.ShapeDtypeStruct((3,), np.float32))


def test_an_unhashable_callable_object_is_a_callback_too():
    class Scaled:
        __hash__ = None  # (defines __eq__: unhashable, as such classes are)

        def __init__(self, c):
            self.c = c

        def __eq__(self, other):
            return isinstance(other, Scaled) and self.c == other.c

        def __call__(self, x):
            return x * self.c

    for c in (2.0, 3.0, 2.0):
        np.testing.assert_array_equal(jd.pure_callback(Scaled(c), S, X), X * c)


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_distinct_lambdas_leave_no_kernels_behind(how):
    _callback.clear()
    _collect()
    kernels = _dispatch.kernel_count()
    refs = []
    for i in range(2 * _callback.RECENT + 50):
        c = np.float64(i)
        f = _scaled(c)
        if how == "eager":
            y = jd.pure_callback(f, S, X)
        else:
            y = jax.jit(lambda x, f=f: jd.pure_callback(f, S, x))(X)
        if i % 97 == 0:
            np.testing.assert_array_equal(y, X * i)
        refs.append(weakref.ref(f))
        del f, c, y
    _collect()
    # (other tests' ops may be alive too: only this test's are counted)
    assert _dispatch.kernel_count() - kernels <= _callback.RECENT
    assert sum(r() is not None for r in refs) <= _callback.RECENT
    _callback.clear()
    _collect()
    assert sum(r() is not None for r in refs) == 0
    assert _dispatch.kernel_count() <= kernels


@pytest.mark.slow
def test_a_hundred_thousand_distinct_lambdas_leave_no_kernels_behind():
    _callback.clear()
    _collect()
    kernels = _dispatch.kernel_count()
    most = 0
    for i in range(100_000):
        y = jd.pure_callback(_scaled(np.float64(i)), S, X)
        if i % 10_000 == 0:
            np.testing.assert_array_equal(y, X * i)
            most = max(most, _dispatch.kernel_count() - kernels)
    assert most <= _callback.RECENT + 1
    _callback.clear()
    _collect()
    assert _dispatch.kernel_count() <= kernels


def test_a_compiled_program_outlives_its_callback():
    def make():
        c = np.float64(4.0)
        f = lambda x: x * c  # noqa: E731
        return jax.jit(lambda x: jd.pure_callback(f, S, x)).lower(X).compile(), weakref.ref(f)

    compiled, ref = make()
    _callback.clear()
    _collect()
    assert ref() is not None  # the executable holds what it runs
    np.testing.assert_array_equal(compiled(X), X * 4.0)
    del compiled
    _collect()
    assert ref() is None
