"""C kernels (jd.cfunction): called by XLA without Python, checked against NumPy."""

import ctypes
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ops import compile_c

import jaxdecl as jd

SOURCE = textwrap.dedent(r"""
    #include <stdio.h>
    #include "jaxdecl.h"

    static int64_t size(const jaxdecl_buffer* b) {
      int64_t n = 1;
      for (int64_t i = 0; i < b->rank; ++i) n *= b->dims[i];
      return n;
    }

    /* out = 2 * x (float64), its own transpose. */
    int twice(const jaxdecl_buffer* in, int64_t nin, const jaxdecl_buffer* out,
              int64_t nout, char* message, int64_t message_size) {
      if (nin != 1 || nout != 1 || in[0].dtype != JAXDECL_FLOAT64) {
        snprintf(message, message_size, "twice takes one float64 array");
        return 3;
      }
      const double* x = (const double*)in[0].data;
      double* y = (double*)out[0].data;
      for (int64_t i = 0, n = size(&in[0]); i < n; ++i) y[i] = 2 * x[i];
      return 0;
    }

    /* Fails with a message of 5000 characters ending in "END". */
    int verbose(const jaxdecl_buffer* in, int64_t nin, const jaxdecl_buffer* out,
                int64_t nout, char* message, int64_t message_size) {
      int64_t n = 0;
      for (; n < 4997 && n < message_size - 4; ++n) message[n] = 'a' + n % 26;
      snprintf(message + n, message_size - n, "END");
      return 7;
    }

    /* Records the data pointers it was given (zero-copy check). */
    void* seen[2];
    int record(const jaxdecl_buffer* in, int64_t nin, const jaxdecl_buffer* out,
               int64_t nout, char* message, int64_t message_size) {
      seen[0] = in[0].data;
      seen[1] = out[0].data;
      return twice(in, nin, out, nout, message, message_size);
    }
""")


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    return compile_c(SOURCE, tmp_path_factory.mktemp("ckernel"))


@pytest.fixture(scope="module")
def Twice(library):
    class Twice(jd.Primitive, linear=True):
        @jd.abstract
        def shapes(self, x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)

        apply = jd.forward(jd.cfunction(library.twice, keepalive=library))
        apply_t = jd.transpose(jd.cfunction(library.twice, keepalive=library))

    return Twice


def test_values_and_transforms(Twice):
    op = Twice()
    x = jnp.linspace(-1.0, 1.0, 7)
    np.testing.assert_array_equal(op(x), 2 * x)
    np.testing.assert_array_equal(jax.jit(op)(x), 2 * x)
    np.testing.assert_array_equal(jax.grad(lambda v: (op(v) ** 2).sum())(x), 8 * x)
    np.testing.assert_array_equal(jax.linear_transpose(op, x)(x)[0], 2 * x)
    batch = jnp.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(jax.vmap(op, in_axes=1, out_axes=1)(batch), 2 * batch)
    jd.check(op, np.arange(5.0))


def test_zero_copy(library):
    class Record(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)

        apply = jd.forward(jd.cfunction(library.record, keepalive=library))

    x = jnp.arange(1000.0)
    y = jax.jit(Record())(x)
    seen = (ctypes.c_void_p * 2).in_dll(library, "seen")
    assert seen[0] == x.unsafe_buffer_pointer()
    assert seen[1] == y.unsafe_buffer_pointer()


def test_error_status_becomes_error(Twice):
    with pytest.raises(jax.errors.JaxRuntimeError, match="status 3: twice takes one float64"):
        Twice()(jnp.arange(3, dtype=jnp.float32))
    np.testing.assert_array_equal(Twice()(jnp.ones(2)), 2 * np.ones(2))  # still works


def test_python_call_runs_kernel(library):
    kernel = jd.cfunction(library.twice, keepalive=library)
    out = np.empty(3)
    kernel(np.arange(3.0), out=out)
    np.testing.assert_array_equal(out, [0.0, 2.0, 4.0])
    with pytest.raises(RuntimeError, match="twice takes one float64"):
        kernel(np.arange(3), out=np.empty(3, np.int64))


def test_rejects_non_function():
    with pytest.raises(TypeError, match="PyCapsule, a ctypes function or an address"):
        jd.cfunction("not a function")


def test_abstract_cannot_be_c(library):
    with pytest.raises(jd.DeclarationError, match="@abstract must be a Python method"):
        class Bad(jd.Primitive):
            shapes = jd.abstract(jd.cfunction(library.twice, keepalive=library))
            apply = jd.forward(jd.cfunction(library.twice, keepalive=library))


@pytest.fixture
def Verbose(library):
    class Verbose(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)

        apply = jd.forward(jd.cfunction(library.verbose, keepalive=library))

    return Verbose


def test_long_error_message_arrives_whole(Verbose):
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"status 7: abc.{4990,}END") as info:
        Verbose()(jnp.ones(2))
    assert "Verbose.verbose (@forward)" in str(info.value)


@pytest.mark.parametrize("how", ["eager", "jit", "vmap", "jit_vmap"])
def test_error_is_the_same_in_every_context(Verbose, how):
    f = {"eager": Verbose(), "jit": jax.jit(Verbose()), "vmap": jax.vmap(Verbose()),
         "jit_vmap": jax.jit(jax.vmap(Verbose()))}[how]
    x = jnp.ones((2, 3)) if "vmap" in how else jnp.ones(3)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"Verbose\.verbose \(@forward\): C kernel "
                                                         r"failed with status 7: abc"):
        jax.block_until_ready(f(x))


SHAPE_SOURCE = textwrap.dedent(r"""
    #include "jaxdecl.h"

    /* Fills out (float64) with 1000 * rank + the first dim of what it is given. */
    int rank_and_rows(const jaxdecl_buffer* in, int64_t nin, const jaxdecl_buffer* out,
                      int64_t nout, char* message, int64_t message_size) {
      int64_t n = 1;
      for (int64_t i = 0; i < out[0].rank; ++i) n *= out[0].dims[i];
      double value = 1000.0 * in[0].rank + (in[0].rank ? in[0].dims[0] : 0);
      for (int64_t i = 0; i < n; ++i) ((double*)out[0].data)[i] = value;
      return 0;
    }
""")


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices")
def test_a_c_kernel_split_by_xla_sees_its_block(tmp_path):
    """A declared elementwise C kernel under jit on a sharded input: each device's kernel
    gets its rows, with the rule's own rank (no extra dim)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdecl import _compat

    if not _compat.SPLITS_PER_SHARD:
        pytest.skip("running a sharding declaration per shard under jit needs JAX >= 0.7")
    library = compile_c(SHAPE_SOURCE, tmp_path)

    class RankAndRows(jd.Primitive, sharding="b n -> b n"):
        @jd.abstract
        def shapes(self, x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)

        apply = jd.forward(jd.cfunction(library.rank_and_rows, keepalive=library))

    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("d")))
    f = jax.jit(RankAndRows())
    assert "jaxdecl_dispatch_split" in f.lower(x).compile().as_text()
    np.testing.assert_array_equal(np.asarray(f(x)), np.full((8, 4), 2004.0))
    np.testing.assert_array_equal(np.asarray(RankAndRows()(jnp.ones((8, 4)))), 2008.0)


ROWS_SOURCE = textwrap.dedent(r"""
    #include <complex.h>
    #include "jaxdecl.h"

    static int64_t size(const jaxdecl_buffer* b) {
      int64_t n = 1;
      for (int64_t i = 0; i < b->rank; ++i) n *= b->dims[i];
      return n;
    }

    /* out = x * w + sum(x) (float64, one element of a batch: x and w of one shape). */
    int row_rule(const jaxdecl_buffer* in, int64_t nin, const jaxdecl_buffer* out,
                 int64_t nout, char* message, int64_t message_size) {
      const double* x = (const double*)in[0].data;
      const double* w = (const double*)in[1].data;
      double* y = (double*)out[0].data;
      double total = 0;
      int64_t n = size(&in[0]);
      for (int64_t i = 0; i < n; ++i) total += x[i];
      for (int64_t i = 0; i < n; ++i) y[i] = x[i] * w[i] + total;
      return 0;
    }

    /* A x with A = diag(1 + 2i, 3 - i, ...): out = d * x, d_k = (1 + k) + (2 - 3k) i. */
    int diag_apply(const jaxdecl_buffer* in, int64_t nin, const jaxdecl_buffer* out,
                   int64_t nout, char* message, int64_t message_size) {
      const double complex* x = (const double complex*)in[0].data;
      double complex* y = (double complex*)out[0].data;
      int64_t n = in[0].dims[in[0].rank - 1];
      for (int64_t i = 0, total = size(&in[0]); i < total; ++i) {
        int64_t k = i % n;
        y[i] = ((1.0 + k) + (2.0 - 3.0 * k) * I) * x[i];
      }
      return 0;
    }

    /* Its adjoint A^H y = conj(d) * y. */
    int diag_adjoint(const jaxdecl_buffer* in, int64_t nin, const jaxdecl_buffer* out,
                     int64_t nout, char* message, int64_t message_size) {
      const double complex* x = (const double complex*)in[0].data;
      double complex* y = (double complex*)out[0].data;
      int64_t n = in[0].dims[in[0].rank - 1];
      for (int64_t i = 0, total = size(&in[0]); i < total; ++i) {
        int64_t k = i % n;
        y[i] = ((1.0 + k) - (2.0 - 3.0 * k) * I) * x[i];
      }
      return 0;
    }
""")


@pytest.fixture(scope="module")
def rows_library(tmp_path_factory):
    return compile_c(ROWS_SOURCE, tmp_path_factory.mktemp("rows"), name="rows")


def _no_jaxdecl_python_while(run) -> list:
    """The jaxdecl Python functions that ran while `run()` ran (on this thread)."""
    import os
    import sys

    package = os.path.dirname(jd.__file__)
    seen = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            seen.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        jax.block_until_ready(run())
    finally:
        sys.setprofile(None)
    return seen


def test_looped_c_kernel_runs_every_row_in_the_dispatcher(rows_library):
    class RowRule(jd.Primitive):  # batch="loop", the default
        @jd.abstract
        def shapes(self, x, w):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)

        apply = jd.forward(jd.cfunction(rows_library.row_rule, keepalive=rows_library))

    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((4, 3, 5)), rng.standard_normal((3, 5))
    # Two batch dims; w broadcast along the outer one (in_axes None), batched along the inner.
    f = jax.jit(jax.vmap(jax.vmap(RowRule(), in_axes=(0, 0)), in_axes=(0, None)))
    expected = x * w + x.sum(-1, keepdims=True)
    np.testing.assert_allclose(f(x, w), expected, rtol=1e-13)
    # Compiled: the 12 rows run without any of jaxdecl's Python.
    assert _no_jaxdecl_python_while(lambda: f(x, w)) == []
    np.testing.assert_allclose(jax.vmap(RowRule(), in_axes=(0, None))(x[:, 0], w[0]),
                               x[:, 0] * w[0] + x[:, 0].sum(-1, keepdims=True), rtol=1e-13)


def test_adjoint_c_kernel_gives_the_transpose_without_python(rows_library):
    class Diag(jd.Primitive, linear=True):
        @jd.abstract
        def shapes(self, x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)

        apply = jd.forward(jd.cfunction(rows_library.diag_apply, keepalive=rows_library))
        back = jd.adjoint(jd.cfunction(rows_library.diag_adjoint, keepalive=rows_library))

    k = np.arange(4)
    d = (1.0 + k) + (2.0 - 3.0 * k) * 1j
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 4)) + 1j * rng.standard_normal((3, 4))
    ct = rng.standard_normal((3, 4)) + 1j * rng.standard_normal((3, 4))
    op = Diag()
    np.testing.assert_allclose(op(x[0]), d * x[0], rtol=1e-14)
    # JAX's transpose is the non-conjugated one: A^T ct = d * ct (A is diagonal).
    transpose = jax.jit(jax.linear_transpose(op, x[0]))
    np.testing.assert_allclose(transpose(ct[0])[0], d * ct[0], rtol=1e-14)
    looped = jax.jit(jax.vmap(lambda c: jax.linear_transpose(op, x[0])(c)[0]))
    np.testing.assert_allclose(looped(ct), d * ct, rtol=1e-14)
    assert _no_jaxdecl_python_while(lambda: looped(ct)) == []
    # The input buffer is untouched by the conjugation (it works on a copy).
    ct_device = jnp.asarray(ct)
    jax.block_until_ready(looped(ct_device))
    np.testing.assert_array_equal(np.asarray(ct_device), ct)
    jd.check(op, x[0])


def test_element_type_codes_agree_with_the_dispatcher():
    # A C kernel called from Python (ctypes) and from XLA sees the same dtype codes.
    from jaxdecl import _dtypes
    from jaxdecl._host import _dispatch

    assert _dtypes.ELEMENT_TYPES == _dispatch.element_types()
    assert set(_dtypes.ELEMENT_TYPES) == set(jd.SUPPORTED_DTYPES)


def test_python_call_reports_a_truncated_message(library):
    kernel = jd.cfunction(library.verbose, keepalive=library)
    with pytest.raises(RuntimeError, match=r"status 7: abc.{4990,}END$"):
        kernel(np.ones(2), out=np.empty(2))
