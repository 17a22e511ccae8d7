"""A looped C kernel's rows on XLA's intra-op thread pool (csrc/c_kernel.cc, RunRowsOf).

Under ``vmap`` (``batch="loop"``) a ``jd.cfunction`` rule, thread-safe by contract, runs
the rows of a large call on XLA's pool: the kernel's own threads report which rows they
ran. Results equal the sequential run's bit for bit; the first failing row in row order
fails the call, naming it, however the rows were scheduled; small calls stay on the
calling thread.
"""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ops import compile_c

import jaxdecl as jd

SOURCE = textwrap.dedent(r"""
    #define _GNU_SOURCE
    #include <time.h>
    #include <unistd.h>
    #include <sys/syscall.h>
    #include <stdio.h>
    #include "jaxdecl.h"

    /* A row: y = 2 x + 1 (float64, any shape), and the id of the thread that ran it
       (a float64 scalar). in[1] (a float64 scalar) is how long the row sleeps, in
       microseconds; a row whose first x is negative fails, saying so. */
    int twice(const jaxdecl_buffer* in, int64_t nin, const jaxdecl_buffer* out,
              int64_t nout, char* message, int64_t message_size) {
      int64_t n = 1;
      for (int64_t d = 0; d < in[0].rank; ++d) n *= in[0].dims[d];
      const double* x = (const double*)in[0].data;
      if (n > 0 && x[0] < 0) {
        snprintf(message, message_size, "negative row %g", x[0]);
        return 3;
      }
      double wait = *(const double*)in[1].data;
      struct timespec pause = {0, (long)(wait * 1000)};
      if (wait > 0) nanosleep(&pause, NULL);
      double* y = (double*)out[0].data;
      for (int64_t i = 0; i < n; ++i) y[i] = 2 * x[i] + 1;
      *(double*)out[1].data = (double)syscall(SYS_gettid);
      return 0;
    }
""")

ROW = 8192  # float64 values per row: 64 KiB, so 8 rows are past the threshold


def twice_op(folder):
    """The op of SOURCE's kernel, built in `folder`: (2 x + 1, the thread's id) per row."""
    library = compile_c(SOURCE, folder, name="parallel")

    class Twice(jd.Primitive):
        @jd.abstract
        def shapes(self, x, wait):
            return (jax.ShapeDtypeStruct(x.shape, x.dtype),
                    jax.ShapeDtypeStruct((), np.float64))

        apply = jd.forward(jd.cfunction(library.twice, keepalive=library))

    return Twice


@pytest.fixture(scope="module")
def Twice(tmp_path_factory):
    return twice_op(tmp_path_factory.mktemp("parallel"))


def _rows(n, size=ROW, seed=0):
    return np.random.default_rng(seed).standard_normal((n, size)) ** 2


@pytest.mark.parametrize("how", ["jit", "eager"])
def test_large_rows_run_on_several_threads_with_the_sequential_results(Twice, how):
    x = _rows(8)
    f = jax.vmap(Twice(), in_axes=(0, None))
    y, threads = (jax.jit(f) if how == "jit" else f)(x, 2000.0)  # 2 ms a row
    np.testing.assert_array_equal(y, 2 * x + 1)  # (bit for bit: each row is one call)
    if jax.local_devices()[0].client.platform == "cpu" and len(set(threads.tolist())) < 2:
        pytest.fail(f"8 rows of 2 ms ran on one thread: {threads.tolist()}")


def test_small_calls_stay_on_the_calling_thread(Twice):
    x = _rows(8, size=16)
    y, threads = jax.jit(jax.vmap(Twice(), in_axes=(0, None)))(x, 500.0)
    np.testing.assert_array_equal(y, 2 * x + 1)
    assert len(set(threads.tolist())) == 1


@pytest.mark.parametrize("rows", [2, 7, 64])
def test_the_first_failing_row_in_row_order_fails_the_call(Twice, rows):
    """Rows fail at random places, 20 times over: the error names the first of them,
    every time, and the process goes on working."""
    f = jax.jit(jax.vmap(Twice(), in_axes=(0, None)))
    rng = np.random.default_rng(rows)
    for _ in range(20):
        x = _rows(rows, size=max(ROW * 8 // rows, 1024))
        bad = np.sort(rng.choice(rows, size=rng.integers(1, rows + 1), replace=False))
        x[bad, 0] = -1.0 - bad
        # (JAX before 0.7 reports a failed run of a compiled call after its first as
        # ValueError)
        with pytest.raises((jax.errors.JaxRuntimeError, ValueError)) as raised:
            jax.block_until_ready(f(x, 100.0))
        first = bad[0]
        assert f"failed with status 3: negative row {-1.0 - first:g} (row {first} of {rows})" \
            in str(raised.value)
    y, _ = f(np.abs(x), 0.0)
    np.testing.assert_array_equal(y, 2 * np.abs(x) + 1)


def test_rows_in_parallel_under_scan_and_nested_vmap(Twice):
    """Two batch dims (a broadcast one) inside a scan: every row once, in place."""
    x = _rows(4 * 4).reshape(4, 4, ROW)

    def step(carry, xs):
        y, _ = jax.vmap(jax.vmap(Twice(), in_axes=(0, None)), in_axes=(0, None))(xs, 0.0)
        return carry + y.sum(), y

    total, ys = jax.jit(lambda x: jax.lax.scan(step, 0.0, x[None].repeat(3, 0)))(x)
    np.testing.assert_array_equal(ys, np.broadcast_to(2 * x + 1, (3,) + x.shape))
    np.testing.assert_allclose(total, 3 * (2 * x + 1).sum(), rtol=1e-12)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices")
def test_rows_split_over_devices_run_on_each_devices_call(Twice):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    x = _rows(16)
    xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
    y, _ = jax.jit(jax.vmap(Twice(), in_axes=(0, None)))(xs, 500.0)
    np.testing.assert_array_equal(y, 2 * x + 1)
    assert isinstance(jnp.asarray(y), jax.Array)


def test_row_threads_caps_the_threads_of_a_call(Twice):
    """``JAXDECL_ROW_THREADS`` (read at start-up) and ``set_row_threads``: 1 runs the rows
    in sequence, on the calling thread; 0 lifts the cap again."""
    from jaxdecl._host import _dispatch

    f = jax.jit(jax.vmap(Twice(), in_axes=(0, None)))
    x = _rows(8)
    before = _dispatch.row_threads()
    _dispatch.set_row_threads(1)
    try:
        y, threads = f(x, 1000.0)
        np.testing.assert_array_equal(y, 2 * x + 1)
        assert len(set(threads.tolist())) == 1
    finally:
        _dispatch.set_row_threads(before)
    _, threads = f(x, 2000.0)
    assert len(set(threads.tolist())) > 1


def test_the_environment_variable_sets_the_cap_at_start_up():
    import os
    import subprocess
    import sys

    from conftest import subprocess_env

    code = "from jaxdecl._host import _dispatch; print(_dispatch.row_threads())"
    for value, expected in (("1", "1"), ("3", "3"), ("", "0"), ("many", "0")):
        # (from the tests' folder: `python -c` puts its folder first on the path, and the
        # checkout's root holds the source tree, built or not)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=subprocess_env(JAXDECL_ROW_THREADS=value),
                              cwd=os.path.dirname(os.path.abspath(__file__)))
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == expected, (value, done.stdout, done.stderr)


@pytest.mark.slow
@pytest.mark.parametrize("repeat", range(3))
def test_concurrent_calls_with_failing_rows_under_forced_gc(tmp_path, repeat):
    """4 threads on 4 devices, 40 calls each at once, failing rows at random, GC at every
    allocation, in a fresh process each time: every value right, every error naming its
    call's first failing row, nothing hung (helpers_parallel_rows.py)."""
    import os
    import subprocess
    import sys

    from conftest import subprocess_env

    helper = os.path.join(os.path.dirname(__file__), "helpers_parallel_rows.py")
    done = subprocess.run([sys.executable, helper, str(tmp_path)], capture_output=True,
                          text=True, timeout=600, env=subprocess_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok"), done.stdout[-3000:]
