"""Lifetimes: memory bounded by what is alive, kernels named by stable fingerprints.

Mirrors jaxdecl/_op/handle.py (handles, anchors), _runtime.py (kernel registrations),
_eager.py (one executable per signature) and _fingerprint.py.
"""

import gc
import json
import os
import subprocess
import sys
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import subprocess_env
from ops import Offset

import jaxdecl as jd
from jaxdecl._host import _dispatch
from jaxdecl._op import fingerprint as _fingerprint
from jaxdecl._op.identity import handle_of
from jaxdecl._transforms import eager as _eager

HELPER = os.path.join(os.path.dirname(__file__), "helpers_subprocess.py")


def _scenario(*args, timeout=300, devices=2):
    env = subprocess_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    done = subprocess.run([sys.executable, HELPER, *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"scenario {args} exited {done.returncode}:\n" \
                                 f"{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])["results"]


class Table(jd.Primitive):
    """An op whose configuration holds an array: keyed by identity."""

    def __init__(self, table):
        self.table = table

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        return x + self.table[0]


def _collect():
    for _ in range(3):
        gc.collect()
        _dispatch.release_pending()  # what dropped executables left to release


@pytest.mark.parametrize("how", ["eager", "jit", "grad", "vmap"])
def test_dropped_ops_are_freed(how):
    x = jnp.arange(3.0)
    _collect()
    kernels = _dispatch.kernel_count()
    refs = []
    for i in range(50):
        op = Table(np.full(4, float(i)))
        if how == "eager":
            y = op(x)
        elif how == "jit":
            y = jax.jit(lambda v, op=op: op(v))(x)
        elif how == "grad":
            y = jax.jit(jax.grad(lambda v, op=op: jax.lax.stop_gradient(op(v)).sum() + v.sum()))(x)
        else:
            y = jax.vmap(op)(jnp.ones((2, 3)))
        if how in ("eager", "jit"):
            np.testing.assert_array_equal(y, np.arange(3.0) + i)
        refs.append(weakref.ref(op))
        del op, y
    _collect()
    assert sum(r() is not None for r in refs) == 0
    assert _dispatch.kernel_count() == kernels


def test_handles_of_dropped_value_configurations_are_freed():
    x = jnp.arange(3.0)
    _collect()
    kernels = _dispatch.kernel_count()
    handles = []
    for i in range(30):
        op = Offset(float(i) + 0.5)
        np.testing.assert_array_equal(op(x), np.arange(3.0) + i + 0.5)
        handles.append(weakref.ref(handle_of(op)))
        del op
    _collect()
    assert sum(h() is not None for h in handles) == 0
    assert _dispatch.kernel_count() == kernels


def _compile_table(x, value):
    op = Table(np.full(4, value))
    return jax.jit(lambda v: op(v)).lower(x).compile(), weakref.ref(op)


def test_compiled_function_keeps_its_op_until_dropped():
    x = jnp.arange(3.0)
    compiled, ref = _compile_table(x, 5.0)
    _collect()
    assert ref() is not None  # the executable holds what it runs
    np.testing.assert_array_equal(compiled(x), np.arange(3.0) + 5)
    del compiled
    _collect()
    assert ref() is None


def test_equal_configurations_share_one_kernel():
    x = jnp.arange(3.0)
    first = Offset(7.25)
    first(x)
    kernels = _dispatch.kernel_count()
    for _ in range(5):
        np.testing.assert_array_equal(Offset(7.25)(x), np.arange(3.0) + 7.25)
    assert _dispatch.kernel_count() == kernels


def test_eager_path_compiles_once_per_signature():
    x = jnp.arange(3.0)
    Table(np.zeros(4))(x)
    out_avals = (((3,), np.dtype(x.dtype)),)
    executable = _eager.executable(out_avals)
    size = executable._cache_size()
    for i in range(20):  # twenty identity-keyed ops: one compiled executable
        np.testing.assert_array_equal(Table(np.full(4, float(i)))(x), np.arange(3.0) + i)
    assert _eager.executable(out_avals) is executable
    assert executable._cache_size() == size


def test_reused_identity_never_finds_a_dead_op():
    # CPython reuses the ids of freed objects; a fresh op must never get a dead op's kernel.
    x = jnp.arange(3.0)
    seen = set()
    for i in range(200):
        op = Table(np.full(4, float(i)))
        seen.add(id(op))
        np.testing.assert_array_equal(op(x), np.arange(3.0) + i)
        np.testing.assert_array_equal(jax.jit(lambda v, op=op: op(v))(x), np.arange(3.0) + i)
        del op
    assert len(seen) < 200  # ids were indeed reused


@pytest.mark.parametrize("devices,extra,eager,jitted", [
    (2, [], 2000, 200),
    # Eager calls on sharded arrays once compiled (and kept) one executable per
    # configuration: 1459 MB per 1000 ops, every op alive.
    (4, ["--sharded"], 2000, 100),
], ids=["one-device", "sharded-4dev"])
def test_create_call_drop_keeps_memory_bounded(devices, extra, eager, jitted):
    # Identity-keyed ops (each holding an 8 kB array); before kernels were
    # released this grew by ~1.4 GB per 1000 eager ops.
    script = os.path.join(os.path.dirname(HELPER), "..", "benchmarks", "memory.py")
    env = subprocess_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    done = subprocess.run([sys.executable, script, "--eager", str(eager), "--jit", str(jitted),
                           *extra], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["wrong_results"] == 0
    assert report["ops_alive"] == 0
    assert report["kernels_left"] == 0
    assert report["call_sites_left"] == 0
    assert report["rss_growth_mb"] < 30, report


def test_compiled_call_sites_go_with_their_executables():
    x = jnp.arange(3.0)
    jax.clear_caches()  # what earlier tests left in JAX's caches goes first
    _collect()
    sites = _dispatch.call_site_count()
    f = jax.jit(lambda v: Offset(0.5)(v) + Offset(1.5)(v))
    np.testing.assert_allclose(f(x), 2 * np.arange(3.0) + 2.0)
    assert _dispatch.call_site_count() == sites + 2  # one per call of the program
    del f
    jax.clear_caches()
    _collect()
    assert _dispatch.call_site_count() == sites


# ---------------------------------------------------------------------------
# Fingerprints
# ---------------------------------------------------------------------------


def test_canonical_texts():
    assert _fingerprint.canonical(1) != _fingerprint.canonical(1.0)
    assert _fingerprint.canonical(1) != _fingerprint.canonical(True)
    assert _fingerprint.canonical((1, "a")) == _fingerprint.canonical((1, "a"))
    assert _fingerprint.canonical(np.float32(1)) != _fingerprint.canonical(np.float64(1))
    assert _fingerprint.canonical(frozenset({1, 2})) == _fingerprint.canonical(frozenset({2, 1}))
    assert _fingerprint.canonical(object()) is None
    assert _fingerprint.canonical((1, object())) is None
    assert _fingerprint.process_unique() != _fingerprint.process_unique()


def test_classes_sharing_a_qualified_name_get_distinct_kernels():
    def make(factor):
        class Scale(jd.Primitive):
            @jd.abstract
            def shapes(self, x):
                return jax.ShapeDtypeStruct(x.shape, x.dtype)

            @jd.forward
            def apply(self, x):
                return factor * x

        return Scale()

    two, three = make(2.0), make(3.0)
    x = jnp.arange(3.0)
    f2, f3 = jax.jit(lambda v: two(v)), jax.jit(lambda v: three(v))
    np.testing.assert_array_equal(f2(x), 2 * np.arange(3.0))
    np.testing.assert_array_equal(f3(x), 3 * np.arange(3.0))
    np.testing.assert_array_equal(f2(x), 2 * np.arange(3.0))
    assert handle_of(two).fingerprint != handle_of(three).fingerprint


def test_hlo_names_the_op_the_same_in_every_process():
    # No process-local number in the HLO: the persistent compilation cache hits
    # whatever order ops were first used in.
    (quiet,) = _scenario("hlo_text", "none")
    (busy,) = _scenario("hlo_text", "many")
    assert quiet == busy
    assert "_Shift.apply (@forward)" in quiet


def test_serialized_executable_never_runs_another_op(tmp_path):
    path = tmp_path / "shift.bin"
    assert _scenario("serialize", path, devices=1) == ["ok"]
    (other,) = _scenario("run_serialized", path, "other", devices=1)
    assert other.startswith("error:"), other  # never a wrong value
    assert "_Shift.apply (@forward)" in other and "not available in this process" in other
    assert _scenario("run_serialized", path, "same", devices=1) == ["ok"]


def test_bound_method_in_configuration_does_not_keep_the_op():
    class WithCallback(jd.Primitive):
        def __init__(self):
            self.callback = self.scale  # a bound method of the op itself

        def scale(self, x):
            return 3 * x

        @jd.abstract
        def shapes(self, x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)

        @jd.forward
        def apply(self, x):
            return self.callback(x)

    op = WithCallback()
    np.testing.assert_array_equal(op(jnp.arange(3.0)), 3 * np.arange(3.0))
    ref = weakref.ref(op)
    del op
    _collect()
    assert ref() is None


def test_configurations_equal_in_value_but_not_in_type_do_not_share():
    class Flag(jd.Primitive):
        def __init__(self, flag):
            self.flag = flag

        @jd.abstract
        def shapes(self, x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)

        @jd.forward
        def apply(self, x):
            return x + (10.0 if self.flag is True else 1.0)

    one, true = Flag(1), Flag(True)
    assert handle_of(one) is not handle_of(true)
    np.testing.assert_array_equal(one(jnp.zeros(2)), [1.0, 1.0])
    np.testing.assert_array_equal(true(jnp.zeros(2)), [10.0, 10.0])


def test_local_classes_get_no_cross_process_fingerprint():
    class Local(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)

        @jd.forward
        def apply(self, x):
            return x

    # A class made inside a function may differ between processes under one name.
    assert "process-" in handle_of(Local()).fingerprint
    assert "process-" not in handle_of(Offset(1.0)).fingerprint


def test_kernels_are_not_copied_or_pickled():
    import copy
    import pickle

    op = Offset(2.5)
    op(jnp.arange(3.0))
    kernel = next(iter(handle_of(op)._kernels.values()))
    assert copy.copy(kernel) is kernel and copy.deepcopy(kernel) is kernel
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(kernel)


def test_errors_under_jit_are_not_kept_for_an_eager_caller():
    from jaxdecl import _errors

    class Fails(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)

        @jd.forward
        def apply(self, x):
            raise KeyError("under jit")

    kept = len(_errors._pending)
    for _ in range(3):
        with pytest.raises((jax.errors.JaxRuntimeError, ValueError), match="under jit"):
            jax.block_until_ready(jax.jit(Fails())(jnp.ones(2)))
    assert len(_errors._pending) == kept


def test_persistent_compilation_cache_hits_across_processes(tmp_path):
    # The second process uses other ops first: with process-local kernel numbers
    # in the HLO it would miss the cache (or worse, run another op).
    cache = tmp_path / "cache"
    assert _scenario("cached_run", cache, "none") == ["ok", "new"]
    assert _scenario("cached_run", cache, "many") == ["ok", "hit"]
