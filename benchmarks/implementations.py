"""The benchmarked operations, once per library: jaxdecl, JAXbind, pure_callback, buffer_callback.

Three operations (``2x``, ``2 Σ xᵢ`` over n inputs, ``x1 * x2**2`` with its
derivatives) are written once as NumPy rules that fill an output buffer; each
library's variant wraps the same rule, so the benchmarks compare the cost of
getting in and out of the rule, not the rules. :mod:`run` combines them into
cases. A library that is not installed is None here (``jaxbind``,
``buffer_callback``), and the cases skip its variants.
"""

from __future__ import annotations

import functools
import inspect
import pathlib

import jax
import numpy as np

import jaxdecl as jd

try:
    import jaxbind
except ImportError:  # the suite still runs, without the JAXbind column
    jaxbind = None

try:
    from jax.experimental.buffer_callback import buffer_callback
except ImportError:
    buffer_callback = None


# ---------------------------------------------------------------------------
# The rules: plain NumPy functions shared by every variant.
# ---------------------------------------------------------------------------


def double_into(x, out):
    np.multiply(x, 2, out=out)


def sum_double_into(xs, out):
    np.add(xs[0], xs[1], out=out)
    for x in xs[2:]:
        np.add(out, x, out=out)
    np.multiply(out, 2, out=out)


def mulsq_into(x1, x2, out):
    np.multiply(x2, x2, out=out)
    np.multiply(out, x1, out=out)


def mulsq_jvp_into(x1, x2, dx1, dx2, out):
    # dx1 * x2**2 + 2 * x1 * x2 * dx2
    np.multiply(x2, x2, out=out)
    np.multiply(out, dx1, out=out)
    out += 2 * x1 * x2 * dx2


def mulsq_vjp_into(x1, x2, ct, out1, out2):
    np.multiply(x2, x2, out=out1)
    np.multiply(out1, ct, out=out1)
    np.multiply(x1, x2, out=out2)
    np.multiply(out2, ct, out=out2)
    np.multiply(out2, 2, out=out2)


def _sds(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


# ---------------------------------------------------------------------------
# jaxdecl ops.
# ---------------------------------------------------------------------------


class Double(jd.Primitive):
    @jd.abstract
    def shapes(self, x):
        return _sds(x)

    @jd.forward
    def apply(self, x, *, out):
        double_into(x, out)


class DoubleVectorized(Double, batch="vectorized"):
    pass


class DoubleReturning(jd.Primitive):
    """The case-1 op with its forward in the return form (a new array per call)."""

    @jd.abstract
    def shapes(self, x):
        return _sds(x)

    @jd.forward
    def apply(self, x):
        return x * 2


class DoubleEmpty(jd.Primitive):
    @jd.abstract
    def shapes(self, x):
        return _sds(x)

    @jd.forward
    def apply(self, x, *, out):
        pass


_C_SOURCE = r"""
#include "jaxdecl.h"
int double_into(const jaxdecl_buffer* in, int64_t n_in, const jaxdecl_buffer* out,
                int64_t n_out, char* message, int64_t message_size) {
  int64_t n = 1;
  for (int64_t i = 0; i < in[0].rank; ++i) n *= in[0].dims[i];
  const double* x = (const double*)in[0].data;
  double* y = (double*)out[0].data;
  for (int64_t i = 0; i < n; ++i) y[i] = 2 * x[i];
  return 0;
}
"""


@functools.cache
def double_c_class():
    """The case-1 op with a C kernel (jd.cfunction): no Python on the call path.

    Compiled here with the system C compiler; None when there is none.
    """
    import ctypes
    import shutil
    import subprocess
    import tempfile

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    folder = pathlib.Path(tempfile.mkdtemp(prefix="jaxdecl_bench_"))
    (folder / "double.c").write_text(_C_SOURCE)
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", f"-I{jd.include_dir()}",
                    str(folder / "double.c"), "-o", str(folder / "libdouble.so")], check=True)
    library = ctypes.CDLL(str(folder / "libdouble.so"))

    class DoubleC(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            return _sds(x)

        apply = jd.forward(jd.cfunction(library.double_into, keepalive=library))

    return DoubleC


def sum_double_class(n: int):
    """A jaxdecl op with `n` named inputs x0..x{n-1}: out = 2 * sum(x)."""
    names = [f"x{i}" for i in range(n)]
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    inputs = [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in names]
    out = inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY)

    def shapes(self, *xs):
        return _sds(xs[0])

    def apply(self, *xs, out):
        sum_double_into(xs, out)

    # jaxdecl reads input names from the signature; *xs hides them, so state them.
    shapes.__signature__ = inspect.Signature([self_param, *inputs])
    apply.__signature__ = inspect.Signature([self_param, *inputs, out])
    namespace = {"shapes": jd.abstract(shapes), "apply": jd.forward(apply)}
    return type(f"SumDouble{n}", (jd.Primitive,), namespace)


class MulSq(jd.Primitive):
    @jd.abstract
    def shapes(self, x1, x2):
        return _sds(x1)

    @jd.forward
    def apply(self, x1, x2, *, out):
        mulsq_into(x1, x2, out)

    @jd.jvp
    def push(self, x1, x2, dx1, dx2, *, out):
        mulsq_jvp_into(x1, x2, dx1, dx2, out)

    @jd.vjp
    def pull(self, x1, x2, ct, *, out):
        mulsq_vjp_into(x1, x2, ct, *out)


# ---------------------------------------------------------------------------
# JAXbind ops (kernels take (out, args, kwargs_dump)).
# ---------------------------------------------------------------------------


def _jb_abstract_first(*args, **kwargs):
    return ((args[0].shape, args[0].dtype),)


def _jb_abstract_first_two(*args, **kwargs):
    return ((args[0].shape, args[0].dtype), (args[1].shape, args[1].dtype))


def _jb_double(out, args, kwargs_dump):
    double_into(args[0], out[0])


def _jb_sum_double(out, args, kwargs_dump):
    sum_double_into(args, out[0])


def _jb_empty(out, args, kwargs_dump):
    pass


def _jb_mulsq(out, args, kwargs_dump):
    mulsq_into(args[0], args[1], out[0])


def _jb_mulsq_jvp(out, args, kwargs_dump):
    mulsq_jvp_into(*args, out[0])


def _jb_mulsq_vjp(out, args, kwargs_dump):
    mulsq_vjp_into(*args, out[0], out[1])


def _jaxbind_op(kernel, derivatives=(None, None), abstract_reverse=None):
    f = jaxbind.get_nonlinear_call(kernel, derivatives, _jb_abstract_first, abstract_reverse)
    # JAXbind calls return a list of outputs; the benchmarks compare single arrays.
    return lambda *args: f(*args)[0]


def jaxbind_double():
    return _jaxbind_op(_jb_double)


def jaxbind_empty():
    return _jaxbind_op(_jb_empty)


def jaxbind_sum_double():
    return _jaxbind_op(_jb_sum_double)


def jaxbind_mulsq():
    return _jaxbind_op(_jb_mulsq, (_jb_mulsq_jvp, _jb_mulsq_vjp), _jb_abstract_first_two)


# ---------------------------------------------------------------------------
# jax.pure_callback and buffer_callback.
# ---------------------------------------------------------------------------


# Host functions live at module level: JAX caches an eager callback's compiled
# code by the callable, so a fresh lambda per call would recompile every call.
def _host_double(a):
    return np.multiply(a, 2)


def _host_sum_double(*arrays):
    out = np.empty_like(arrays[0])
    sum_double_into(arrays, out)
    return out


def pure_double(x, vmap_method="sequential"):
    return jax.pure_callback(_host_double, _sds(x), x, vmap_method=vmap_method)


def pure_sum_double(*xs):
    return jax.pure_callback(_host_sum_double, _sds(xs[0]), *xs, vmap_method="sequential")


def _bc_double(ctx, out, x):
    double_into(np.asarray(x), np.asarray(out))


def _bc_sum_double(ctx, out, *xs):
    sum_double_into([np.asarray(x) for x in xs], np.asarray(out))


def buffer_double(x):
    return buffer_callback(_bc_double, _sds(x), vmap_method="sequential")(x)


def buffer_sum_double(*xs):
    return buffer_callback(_bc_sum_double, _sds(xs[0]), vmap_method="sequential")(*xs)


@jax.custom_vjp
def pure_mulsq(x1, x2):
    def host(a, b):
        out = np.empty_like(a)
        mulsq_into(a, b, out)
        return out

    return jax.pure_callback(host, _sds(x1), x1, x2, vmap_method="sequential")


def _pure_mulsq_fwd(x1, x2):
    return pure_mulsq(x1, x2), (x1, x2)


def _pure_mulsq_bwd(residuals, ct):
    x1, x2 = residuals

    def host(a, b, c):
        g1, g2 = np.empty_like(a), np.empty_like(b)
        mulsq_vjp_into(a, b, c, g1, g2)
        return g1, g2

    return jax.pure_callback(host, (_sds(x1), _sds(x2)), x1, x2, ct, vmap_method="sequential")


pure_mulsq.defvjp(_pure_mulsq_fwd, _pure_mulsq_bwd)
