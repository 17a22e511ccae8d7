"""Call-context matrix: every op form in every calling context, against jax.numpy.

Each op form is a small jaxdecl class with an independent pure-jax.numpy reference;
inputs and outputs are arrays or, for the pytree forms, pytrees of them (dicts,
NamedTuples, tuples of those, with an integer leaf among the outputs). Each calling
context (eager, jit, closure constants, keywords, control flow, checkpoint, eval_shape,
vmap, derivatives, ...) runs the op and the reference the same way and compares
values, shapes, dtypes and pytree structure. Combinations that make no sense (the
gradient of an op without inputs, linear_transpose of a nonlinear op) are listed as
skips with their reason.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import shutil
import tempfile
import textwrap
import zlib
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tol
from jax import lax
from jax.test_util import check_grads
from ops import compile_c, random_array

import jaxdecl as jd


def _same(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _real_of(dtype):
    return np.finfo(dtype).dtype


# ---------------------------------------------------------------------------
# Op forms
# ---------------------------------------------------------------------------


class XSinY(jd.Primitive):
    """(a) return form: x * sin(y) with NumPy @jvp and @vjp."""

    @jd.abstract
    def shapes(self, x, y):
        return _same(x)

    @jd.forward
    def apply(self, x, y):
        return x * np.sin(y)

    @jd.jvp
    def push(self, x, y, dx, dy):
        return np.sin(y) * dx + x * np.cos(y) * dy

    @jd.vjp
    def pull(self, x, y, ct):
        return np.sin(y) * ct, x * np.cos(y) * ct


class XSinYInto(jd.Primitive):
    """(b) zero-copy form of XSinY: every rule fills `out`."""

    @jd.abstract
    def shapes(self, x, y):
        return _same(x)

    @jd.forward
    def apply(self, x, y, *, out):
        np.multiply(x, np.sin(y), out=out)

    @jd.jvp
    def push(self, x, y, dx, dy, *, out):
        out[...] = np.sin(y) * dx + x * np.cos(y) * dy

    @jd.vjp
    def pull(self, x, y, ct, *, out):
        ct_x, ct_y = out
        np.multiply(np.sin(y), ct, out=ct_x)
        np.multiply(x * np.cos(y), ct, out=ct_y)


_MATRIX = np.array([[1.0, -2.0, 0.5, 3.0], [0.0, 1.5, -1.0, 2.0], [4.0, 0.25, 1.0, -0.5]])
_MATRIX_IMAG = np.array([[0.5, 1.0, -1.5, 0.0], [2.0, -0.5, 0.25, 1.0], [-1.0, 0.0, 3.0, 0.5]])


def _matrix_for(dtype):
    """A fixed 3x4 matrix: real for real operands, genuinely complex for complex ones."""
    if np.issubdtype(dtype, np.complexfloating):
        return (_MATRIX + 1j * _MATRIX_IMAG).astype(dtype)
    return _MATRIX.astype(dtype)


class MatVec(jd.Primitive, linear=True):
    """(c) linear: y = A x along the last axis (4 -> 3); transpose ct -> Aᵀ ct (unconjugated)."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape[:-1] + (3,), x.dtype)

    @jd.forward
    def apply(self, x):
        return (x @ _matrix_for(x.dtype).T).astype(x.dtype)

    @jd.transpose
    def apply_t(self, ct):
        return (ct @ _matrix_for(ct.dtype)).astype(ct.dtype)


def matvec_ref(x):
    return (x @ jnp.asarray(_matrix_for(x.dtype)).T).astype(x.dtype)


class Product(jd.Primitive, multilinear=True):
    """(d) multilinear: x * y, one @transpose per input."""

    @jd.abstract
    def shapes(self, x, y):
        return _same(x)

    @jd.forward
    def apply(self, x, y, *, out):
        np.multiply(x, y, out=out)

    @jd.transpose(wrt="x")
    def transpose_x(self, y, ct):
        return y * ct

    @jd.transpose(wrt="y")
    def transpose_y(self, x, ct):
        return x * ct


class ScaledRoll(jd.Primitive, nondiff=("s",)):
    """(e) s * roll(x, k): `s` declared non-differentiable, the integer `k` automatically so."""

    @jd.abstract
    def shapes(self, x, s, k):
        return _same(x)

    @jd.forward
    def apply(self, x, s, k):
        return (s * np.roll(x, int(k), axis=-1)).astype(x.dtype)

    @jd.jvp
    def push(self, x, s, k, dx):
        return (s * np.roll(dx, int(k), axis=-1)).astype(dx.dtype)

    @jd.vjp
    def pull(self, x, s, k, ct):
        return (s * np.roll(ct, -int(k), axis=-1)).astype(ct.dtype)


def scaled_roll_ref(x, s, k):
    return (s * jnp.roll(x, k, axis=-1)).astype(x.dtype)


C_SOURCE = textwrap.dedent(r"""
    #include <stdio.h>
    #include "jaxdecl.h"

    /* out = 3 * x for float32 or float64: linear and its own transpose. */
    int triple(const jaxdecl_buffer* in, int64_t nin, const jaxdecl_buffer* out,
               int64_t nout, char* message, int64_t message_size) {
      if (nin != 1 || nout != 1 || in[0].dtype != out[0].dtype) {
        snprintf(message, message_size, "triple takes one array and gives one of its dtype");
        return 1;
      }
      int64_t n = 1;
      for (int64_t i = 0; i < in[0].rank; ++i) n *= in[0].dims[i];
      if (in[0].dtype == JAXDECL_FLOAT64) {
        const double* x = (const double*)in[0].data;
        double* y = (double*)out[0].data;
        for (int64_t i = 0; i < n; ++i) y[i] = 3 * x[i];
      } else if (in[0].dtype == JAXDECL_FLOAT32) {
        const float* x = (const float*)in[0].data;
        float* y = (float*)out[0].data;
        for (int64_t i = 0; i < n; ++i) y[i] = 3 * x[i];
      } else {
        snprintf(message, message_size, "triple takes float32 or float64, not dtype %d",
                 (int)in[0].dtype);
        return 2;
      }
      return 0;
    }
""")


@functools.cache
def _c_library():
    folder = tempfile.mkdtemp(prefix="jaxdecl_matrix_")
    atexit.register(shutil.rmtree, folder, True)
    return compile_c(C_SOURCE, folder, "triple")


@functools.cache
def _triple_op():
    library = _c_library()

    class Triple(jd.Primitive, linear=True):
        """(f) C kernel rules: 3 * x, forward and transpose."""

        @jd.abstract
        def shapes(self, x):
            return _same(x)

        apply = jd.forward(jd.cfunction(library.triple, keepalive=library))
        apply_t = jd.transpose(jd.cfunction(library.triple, keepalive=library))

    return Triple()


class Arange(jd.Primitive):
    """(g) no inputs: arange(5) of a configured dtype."""

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype).name

    @jd.abstract
    def shapes(self):
        return jax.ShapeDtypeStruct((5,), np.dtype(self.dtype))

    @jd.forward
    def apply(self):
        return np.arange(5).astype(self.dtype)


class SumProdBigger(jd.Primitive):
    """(h) several outputs: (x + y, x * y, |x| > |y| as int32); the int32 one has no tangent."""

    @jd.abstract
    def shapes(self, x, y):
        return _same(x), _same(x), jax.ShapeDtypeStruct(x.shape, np.int32)

    @jd.forward
    def apply(self, x, y, *, out):
        total, product, bigger = out
        np.add(x, y, out=total)
        np.multiply(x, y, out=product)
        bigger[...] = np.abs(x) > np.abs(y)

    @jd.jvp
    def push(self, x, y, dx, dy):
        return dx + dy, y * dx + x * dy

    @jd.vjp
    def pull(self, x, y, ct_total, ct_product):
        return ct_total + y * ct_product, ct_total + x * ct_product


def sum_prod_bigger_ref(x, y):
    return x + y, x * y, (jnp.abs(x) > jnp.abs(y)).astype(jnp.int32)


class ScaleCount(jd.Primitive):
    """(h2) (x * n, n + 1): the integer input is non-differentiable automatically, the integer
    output carries no tangent, so the zero-copy @jvp/@vjp see one bare array as `out`."""

    @jd.abstract
    def shapes(self, x, n):
        return _same(x), _same(n)

    @jd.forward
    def apply(self, x, n):
        return (x * n).astype(x.dtype), (n + 1).astype(n.dtype)

    @jd.jvp
    def push(self, x, n, dx, *, out):
        np.multiply(dx, n, out=out, casting="unsafe")

    @jd.vjp
    def pull(self, x, n, ct, *, out):
        np.multiply(ct, n, out=out, casting="unsafe")


def scale_count_ref(x, n):
    x, n = jnp.asarray(x), jnp.asarray(n)
    return (x * n).astype(x.dtype), (n + 1).astype(n.dtype)


class AffineSin(jd.Primitive):
    """(i) pytrees, return form: x and a dict of parameters in, a dict of two float outputs out:
    {"y": scale * sin(x) + shift, "z": x * shift}, with NumPy @jvp and @vjp on those dicts."""

    @jd.abstract
    def shapes(self, x, params):
        return {"y": _same(x), "z": _same(x)}

    @jd.forward
    def apply(self, x, params):
        assert type(params) is dict and sorted(params) == ["scale", "shift"]
        return {"y": params["scale"] * np.sin(x) + params["shift"], "z": x * params["shift"]}

    @jd.jvp
    def push(self, x, params, dx, dparams):
        assert sorted(dparams) == ["scale", "shift"]
        scale, shift = params["scale"], params["shift"]
        return {"y": scale * np.cos(x) * dx + np.sin(x) * dparams["scale"] + dparams["shift"],
                "z": shift * dx + x * dparams["shift"]}

    @jd.vjp
    def pull(self, x, params, ct):
        ct_y, ct_z = ct["y"], ct["z"]
        return (params["scale"] * np.cos(x) * ct_y + params["shift"] * ct_z,
                {"scale": np.sin(x) * ct_y, "shift": ct_y + x * ct_z})


def affine_sin_ref(x, params):
    return {"y": params["scale"] * jnp.sin(x) + params["shift"], "z": x * params["shift"]}


class Pair(NamedTuple):
    a: jax.Array
    b: jax.Array


class Stats(NamedTuple):
    y: jax.Array
    sign: jax.Array


class StatsInto(jd.Primitive):
    """(j) pytrees, zero-copy form: (x, Pair(a, b)) -> (Stats(y, sign), {"sum": ...}) with
    y = x * sin(a), sign = sign(Re x - Re b) as int32 (no tangent) and sum = x + b. Every rule
    fills `out`, the same pytrees of views (None where an integer leaf has no tangent)."""

    @jd.abstract
    def shapes(self, x, pair):
        return Stats(_same(x), jax.ShapeDtypeStruct(x.shape, np.int32)), {"sum": _same(x)}

    @jd.forward
    def apply(self, x, pair, *, out):
        assert type(pair) is Pair
        stats, totals = out
        assert type(stats) is Stats and stats.sign.dtype == np.int32
        np.multiply(x, np.sin(pair.a), out=stats.y)
        stats.sign[...] = np.sign(np.real(x) - np.real(pair.b))
        np.add(x, pair.b, out=totals["sum"])

    @jd.jvp
    def push(self, x, pair, dx, dpair, *, out):
        stats, totals = out
        assert type(dpair) is Pair and type(stats) is Stats and stats.sign is None
        stats.y[...] = np.sin(pair.a) * dx + x * np.cos(pair.a) * dpair.a
        np.add(dx, dpair.b, out=totals["sum"])

    @jd.vjp
    def pull(self, x, pair, ct_stats, ct_totals, *, out):
        ct_x, ct_pair = out
        assert type(ct_stats) is Stats and ct_stats.sign is None and type(ct_pair) is Pair
        ct_x[...] = np.sin(pair.a) * ct_stats.y + ct_totals["sum"]
        np.multiply(x * np.cos(pair.a), ct_stats.y, out=ct_pair.a)
        ct_pair.b[...] = ct_totals["sum"]


def stats_ref(x, pair):
    sign = jnp.sign(jnp.real(x) - jnp.real(pair.b)).astype(jnp.int32)
    return Stats(x * jnp.sin(pair.a), sign), {"sum": x + pair.b}


class XExpYSaved(jd.Primitive):
    """(k) residuals: x * exp(y). When a derivative follows, the forward keeps {"exp": exp(y),
    "finite": int8} (a float and an integer residual); the zero-copy @jvp and the return-form
    @vjp read them (`saved`) and the forward's output (`result` = x * exp(y))."""

    @jd.abstract
    def shapes(self, x, y):
        return _same(x)

    @jd.residuals
    def keeps(self, x, y):
        return {"exp": _same(y), "finite": jax.ShapeDtypeStruct(y.shape, np.int8)}

    @jd.forward
    def apply(self, x, y, *, saved=None):
        e = np.exp(y)
        if saved is not None:
            saved["exp"][...] = e
            saved["finite"][...] = np.isfinite(e)
        return x * e

    @jd.jvp
    def push(self, x, y, dx, dy, *, out, saved, result):
        np.multiply(saved["exp"], dx, out=out)
        out += result * dy

    @jd.vjp
    def pull(self, x, y, ct, *, saved, result):
        finite = saved["finite"].astype(bool)
        return np.where(finite, saved["exp"] * ct, 0), np.where(finite, result * ct, 0)


class Wave(jd.Primitive, linear=("c",)):
    """(l) partly linear: c * sin(x), linear in c (a @transpose), differentiable in x
    through a @jvp that receives None for a zero tangent and a @vjp told which cotangents
    are wanted."""

    @jd.abstract
    def shapes(self, x, c):
        return _same(c)

    @jd.forward
    def apply(self, x, c):
        return (c * np.sin(x)).astype(c.dtype)

    @jd.transpose
    def apply_t(self, x, ct):
        return (np.sin(x) * ct).astype(ct.dtype)

    @jd.jvp(zeros=True)
    def push(self, x, c, dx, dc):
        out = np.zeros(c.shape, c.dtype)
        if dx is not None:
            out += c * np.cos(x) * dx
        if dc is not None:
            out += np.sin(x) * dc
        return out

    @jd.vjp
    def pull(self, x, c, ct, *, wanted):
        dx = (c * np.cos(x) * ct).astype(x.dtype) if wanted[0] else None
        return dx, ((np.sin(x) * ct).astype(c.dtype) if wanted[1] else None)


class MulZInto(jd.Primitive):
    """(m) symbolic zeros, zero-copy: x * y**2; the @jvp(zeros=True) gets None for a zero
    tangent, the @vjp fills only the cotangents wanted (`out` holds None for the others)."""

    @jd.abstract
    def shapes(self, x, y):
        return _same(x)

    @jd.forward
    def apply(self, x, y, *, out):
        np.multiply(x, y**2, out=out)

    @jd.jvp(zeros=True)
    def push(self, x, y, dx, dy, *, out):
        out[...] = 0
        if dx is not None:
            out += y**2 * dx
        if dy is not None:
            out += 2 * x * y * dy

    @jd.vjp
    def pull(self, x, y, ct, *, out, wanted):
        ct_x, ct_y = out
        assert (ct_x is not None, ct_y is not None) == wanted
        if wanted[0]:
            np.multiply(y**2, ct, out=ct_x)
        if wanted[1]:
            np.multiply(2 * x * y, ct, out=ct_y)


# jd.pure_callback, as jax.pure_callback users write it: the value from a callback, the
# derivatives from jax.custom_jvp around it (a tangent rule of callback-computed partials
# times the tangents in jax.numpy, which JAX also transposes for reverse mode).


def _np_xsiny(x, y):
    return x * np.sin(y)


def _np_xsiny_partials(x, y):
    return np.sin(y), x * np.cos(y)


@jax.custom_jvp
def callback_xsiny(x, y):
    """(g) jd.pure_callback, vmap_method="sequential": x * sin(y)."""
    x, y = jnp.asarray(x), jnp.asarray(y)
    result = jax.ShapeDtypeStruct(jnp.broadcast_shapes(x.shape, y.shape), jnp.result_type(x, y))
    return jd.pure_callback(_np_xsiny, result, x, y, vmap_method="sequential")


@callback_xsiny.defjvp
def _callback_xsiny_jvp(primals, tangents):
    x, y = primals
    dx, dy = tangents
    out = callback_xsiny(x, y)
    partials = jd.pure_callback(_np_xsiny_partials, (_same(out), _same(out)),
                                jnp.asarray(x), jnp.asarray(y), vmap_method="sequential")
    return out, partials[0] * dx + partials[1] * dy


def _np_affine(x, *, scale, shift):
    return {"y": np.sin(x) * scale + shift, "z": x * shift}


def _np_affine_partials(x):
    return np.cos(x), np.sin(x)


@jax.custom_jvp
def callback_affine(x, params):
    """(h) jd.pure_callback with a pytree of keyword arguments, vmap_method="expand_dims":
    {"y": sin(x) * scale + shift, "z": x * shift}, as AffineSin."""
    x = jnp.asarray(x)
    return jd.pure_callback(_np_affine, {"y": _same(x), "z": _same(x)}, x,
                            vmap_method="expand_dims", scale=jnp.asarray(params["scale"]),
                            shift=jnp.asarray(params["shift"]))


@callback_affine.defjvp
def _callback_affine_jvp(primals, tangents):
    (x, params), (dx, dparams) = primals, tangents
    out = callback_affine(x, params)
    x = jnp.asarray(x)
    cos, sin = jd.pure_callback(_np_affine_partials, (_same(x), _same(x)), x,
                                vmap_method="expand_dims")
    return out, {"y": cos * params["scale"] * dx + sin * dparams["scale"] + dparams["shift"],
                 "z": dx * params["shift"] + x * dparams["shift"]}


# ---------------------------------------------------------------------------
# Forms: an op, its reference and example inputs
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Form:
    op: Callable[[], Callable]  # returns the (shared) op instance
    ref: Callable  # pure jax.numpy reference with the op's signature
    args: Callable  # (rng, dtype) -> tuple of inputs: NumPy arrays or pytrees of them
    names: tuple  # the op's parameter names
    diff: tuple  # positions of the differentiable inputs
    dtypes: tuple
    in_axes: tuple  # vmap in_axes, one per input: an axis, None or a pytree prefix of the input
    scalars: Callable | None  # args -> the same inputs with Python scalars where they fit
    linear: str = ""  # "linear", "multilinear" or "partly" (linear in its last input)


_OPS = {"return": XSinY(), "out": XSinYInto(), "linear": MatVec(), "multilinear": Product(),
        "nondiff": ScaledRoll(), "multi_output": SumProdBigger(), "float_and_int": ScaleCount(),
        "pytree": AffineSin(), "pytree_out": StatsInto(), "residuals": XExpYSaved(),
        "partly_linear": Wave(), "zeros": MulZInto()}


def _shared(name):
    return lambda: _OPS[name]


def _pair(shape):
    return lambda rng, dtype: (random_array(rng, shape, dtype), random_array(rng, shape, dtype))


def _python_scalars(args):
    """Every leaf of every input replaced by its first element as a Python scalar."""
    return jax.tree.map(lambda a: a.flat[0].item(), tuple(args))


def _affine_args(rng, dtype):
    return (random_array(rng, (3,), dtype),
            {"scale": random_array(rng, (3,), dtype), "shift": random_array(rng, (3,), dtype)})


def _stats_args(rng, dtype):
    return random_array(rng, (2, 3), dtype), Pair(random_array(rng, (2, 3), dtype),
                                             random_array(rng, (2, 3), dtype))


FORMS = {
    "return": Form(
        _shared("return"), lambda x, y: x * jnp.sin(y), _pair((3,)), ("x", "y"), (0, 1),
        ("float32", "float64", "complex128"), (0, None), _python_scalars),
    "out": Form(
        _shared("out"), lambda x, y: x * jnp.sin(y), _pair((2, 3)), ("x", "y"), (0, 1),
        ("float32", "complex128"), (1, 0), _python_scalars),
    "linear": Form(
        _shared("linear"), matvec_ref, lambda rng, dtype: (random_array(rng, (2, 4), dtype),),
        ("x",), (0,), ("float32", "complex128"), (1,), None, linear="linear"),
    "multilinear": Form(
        _shared("multilinear"), lambda x, y: x * y, _pair((3,)), ("x", "y"), (0, 1),
        ("float64", "complex64"), (None, 0), _python_scalars,
        linear="multilinear"),
    "nondiff": Form(
        _shared("nondiff"), scaled_roll_ref,
        lambda rng, dtype: (random_array(rng, (4,), dtype), _real_of(dtype).type(1.5), np.int32(1)),
        ("x", "s", "k"), (0,), ("float32", "complex128"), (0, None, 0),
        lambda args: (args[0], 1.5, 1)),
    "c_kernel": Form(
        _triple_op, lambda x: 3 * x, lambda rng, dtype: (random_array(rng, (5,), dtype),), ("x",),
        (0,), ("float32", "float64"), (0,), _python_scalars, linear="linear"),
    "no_inputs": Form(
        None, None, lambda rng, dtype: (), (), (), ("float64", "int32"), (), None),
    "multi_output": Form(
        _shared("multi_output"), sum_prod_bigger_ref, _pair((3,)), ("x", "y"), (0, 1),
        ("float64", "complex64"), (0, 0), _python_scalars),
    "float_and_int": Form(
        _shared("float_and_int"), scale_count_ref,
        lambda rng, dtype: (random_array(rng, (3,), dtype), np.array([1, -2, 3], np.int32)),
        ("x", "n"), (0,), ("float64", "complex64"), (0, 0), _python_scalars),
    "pytree": Form(
        _shared("pytree"), affine_sin_ref, _affine_args, ("x", "params"), (0, 1),
        ("float32", "float64", "complex128"), (0, {"scale": None, "shift": 0}),
        _python_scalars),
    "pytree_out": Form(
        _shared("pytree_out"), stats_ref, _stats_args, ("x", "pair"), (0, 1),
        ("float64", "complex64"), (1, Pair(0, None)), _python_scalars),
    "residuals": Form(
        _shared("residuals"), lambda x, y: x * jnp.exp(y), _pair((3,)), ("x", "y"), (0, 1),
        ("float32", "float64", "complex128"), (0, None), _python_scalars),
    "partly_linear": Form(
        _shared("partly_linear"), lambda x, c: c * jnp.sin(x), _pair((3,)), ("x", "c"),
        (0, 1), ("float32", "float64", "complex128"), (0, None), _python_scalars,
        linear="partly"),
    "zeros": Form(
        _shared("zeros"), lambda x, y: x * y**2, _pair((2, 3)), ("x", "y"), (0, 1),
        ("float32", "float64", "complex128"), (None, 1), _python_scalars),
    "pure_callback": Form(
        lambda: callback_xsiny, lambda x, y: x * jnp.sin(y), _pair((3,)), ("x", "y"), (0, 1),
        ("float32", "float64", "complex128"), (0, None), _python_scalars),
    "pure_callback_pytree": Form(
        lambda: callback_affine, affine_sin_ref, _affine_args, ("x", "params"), (0, 1),
        ("float32", "float64", "complex128"), (0, {"scale": None, "shift": 0}),
        _python_scalars),
}

_ARANGE = {dtype: Arange(dtype) for dtype in FORMS["no_inputs"].dtypes}


def _op(form_name, dtype):
    if form_name == "no_inputs":
        return _ARANGE[dtype]
    return FORMS[form_name].op()


def _no_inputs_ref(dtype):
    return jnp.arange(5).astype(dtype)


def _ref(form_name, dtype):
    """The reference, compiled as a whole (op-by-op jax.numpy would be slow)."""
    if form_name == "no_inputs":
        return jax.jit(functools.partial(_no_inputs_ref, dtype))
    return jax.jit(FORMS[form_name].ref)


@dataclasses.dataclass
class Setup:
    name: str
    form: Form
    dtype: str
    op: Callable
    ref: Callable
    args: tuple
    rng: np.random.Generator


def _setup(form_name, dtype):
    rng = np.random.default_rng(zlib.crc32(f"{form_name}-{dtype}".encode()))
    form = FORMS[form_name]
    return Setup(form_name, form, dtype, _op(form_name, dtype), _ref(form_name, dtype),
                 form.args(rng, np.dtype(dtype)), rng)


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _close(actual, expected, dtype):
    actual_leaves, actual_tree = jax.tree.flatten(actual)
    expected_leaves, expected_tree = jax.tree.flatten(expected)
    assert actual_tree == expected_tree, (actual_tree, expected_tree)
    for a, e in zip(actual_leaves, expected_leaves):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape, (a.shape, e.shape)
        assert a.dtype == e.dtype, (a.dtype, e.dtype)
        if a.dtype == jax.dtypes.float0:
            continue
        np.testing.assert_allclose(a, e, rtol=tol(dtype), atol=tol(dtype))


def _times(tree, scale):
    """Every leaf times a (possibly traced) integer scalar, in the leaf's dtype."""
    return jax.tree.map(lambda o: o * jnp.asarray(scale).astype(o.dtype), tree)


def _plus(a, b):
    return jax.tree.map(jnp.add, a, b)


def _zeros_like(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def _perturbed(value, k):
    """Batch element k of an input: distinct values of the same dtype."""
    value = np.asarray(value)
    if np.issubdtype(value.dtype, np.integer):
        return value + k
    return (value * (1 + 0.25 * k)).astype(value.dtype)


def _stacked(args, axes, size=3):
    """A batch of `size` along `axes` (per input: an axis, None or a pytree prefix of it)."""

    def stack(ax, value):
        if ax is None:
            return value
        return jax.tree.map(
            lambda a: np.stack([_perturbed(a, k) for k in range(size)], axis=ax), value)

    return tuple(jax.tree.map(stack, ax, a, is_leaf=lambda node: node is None)
                 for a, ax in zip(args, axes, strict=True))


def _of_diff(f, s):
    """f as a function of the differentiable inputs only; the others are closed over."""

    def g(*diff):
        full = list(s.args)
        for i, value in zip(s.form.diff, diff):
            full[i] = value
        return f(*full)

    return g, tuple(s.args[i] for i in s.form.diff)


@jax.jit
def _loss(outputs):
    """Σ|o|² over the floating output leaves: a real scalar, compiled once per structure."""
    return sum(jnp.sum(jnp.real(o * jnp.conj(o))) for o in jax.tree.leaves(outputs)
               if jnp.issubdtype(o.dtype, jnp.inexact))


def _grad(f, s):
    g, diff = _of_diff(f, s)
    return jax.grad(lambda *d: _loss(g(*d)), argnums=tuple(range(len(diff))))(*diff)


def _ref_grad(s):
    """The reference gradient, compiled once (op-by-op jax.numpy would be slow)."""
    return jax.jit(lambda *a: _grad(s.ref, dataclasses.replace(s, args=a)))(*s.args)


# ---------------------------------------------------------------------------
# Calling contexts
# ---------------------------------------------------------------------------


def ctx_eager(s):
    out, expected = s.op(*s.args), s.ref(*s.args)
    assert isinstance(out, jax.Array if isinstance(expected, jax.Array) else type(expected))
    _close(out, expected, s.dtype)


def ctx_jit(s):
    _close(jax.jit(s.op)(*s.args), s.ref(*s.args), s.dtype)


def ctx_nested_jit(s):
    inner = jax.jit(s.op)
    outer = jax.jit(lambda *a: _plus(inner(*a), jax.jit(lambda *b: inner(*b))(*a)))
    _close(outer(*s.args), _times(s.ref(*s.args), 2), s.dtype)


def ctx_jit_const(s):
    # The op sees only NumPy constants captured from the closure; the jit has a traced input.
    f = jax.jit(lambda one: _times(s.op(*s.args), one))
    _close(f(np.int32(1)), s.ref(*s.args), s.dtype)


def ctx_jit_mixed(s):
    # The first input traced, the others NumPy constants captured from the closure.
    rest = s.args[1:]
    _close(jax.jit(lambda a: s.op(a, *rest))(s.args[0]), s.ref(*s.args), s.dtype)


def ctx_eager_pyscalar(s):
    scalars = s.form.scalars(s.args)
    _close(s.op(*scalars), s.ref(*scalars), "float64")


def ctx_jit_pyscalar(s):
    scalars = s.form.scalars(s.args)
    f = jax.jit(lambda one: _times(s.op(*scalars), one))
    _close(f(np.int32(1)), s.ref(*scalars), "float64")


def ctx_keyword(s):
    # All inputs by keyword, in reverse order.
    kwargs = dict(reversed(list(zip(s.form.names, s.args))))
    _close(s.op(**kwargs), s.ref(*s.args), s.dtype)


def ctx_jit_keyword(s):
    # The first input positionally, the rest by keyword (all by keyword with one input).
    if len(s.args) > 1:
        f = jax.jit(lambda a, rest: s.op(a, **rest))
        out = f(s.args[0], dict(zip(s.form.names[1:], s.args[1:])))
    else:
        out = jax.jit(lambda kw: s.op(**kw))(dict(zip(s.form.names, s.args)))
    _close(out, s.ref(*s.args), s.dtype)


def ctx_scan(s):
    xs = _stacked(s.args, [0] * len(s.args), size=2)

    def body(carry, a):
        return carry + 1, s.op(*a)

    count, ys = jax.jit(lambda xs: lax.scan(body, 0, xs, length=2))(xs)
    expected = jax.tree.map(lambda *r: jnp.stack(r), *[
        s.ref(*jax.tree.map(lambda x, k=k: np.asarray(x)[k], xs)) for k in range(2)])
    assert int(count) == 2
    _close(ys, expected, s.dtype)


def ctx_scan_const(s):
    def body(carry, one):
        return carry, _times(s.op(*s.args), one)

    _, ys = jax.jit(lambda ones: lax.scan(body, 0, ones))(np.ones(2, np.int32))
    _close(ys, jax.tree.map(lambda r: jnp.stack([r, r]), s.ref(*s.args)), s.dtype)


def ctx_fori_loop(s):
    expected = s.ref(*s.args)

    def run(*a):
        return lax.fori_loop(0, 3, lambda i, acc: _plus(acc, s.op(*a)), _zeros_like(expected))

    _close(jax.jit(run)(*s.args), _times(expected, 3), s.dtype)


def ctx_while_loop(s):
    expected = s.ref(*s.args)

    def run(*a):
        def body(state):
            i, acc = state
            return i + 1, _plus(acc, s.op(*a))

        return lax.while_loop(lambda state: state[0] < 2, body, (0, _zeros_like(expected)))[1]

    _close(jax.jit(run)(*s.args), _times(expected, 2), s.dtype)


def ctx_cond(s):
    expected = s.ref(*s.args)
    f = jax.jit(lambda p, *a: lax.cond(p, s.op, lambda *b: _zeros_like(expected), *a))
    _close(f(True, *s.args), expected, s.dtype)
    _close(f(False, *s.args), _zeros_like(expected), s.dtype)


def ctx_cond_const(s):
    expected = s.ref(*s.args)
    f = jax.jit(lambda p: lax.cond(p, lambda: s.op(*s.args), lambda: _zeros_like(expected)))
    _close(f(True), expected, s.dtype)
    _close(f(False), _zeros_like(expected), s.dtype)


def ctx_checkpoint(s):
    _close(jax.jit(jax.checkpoint(s.op))(*s.args), s.ref(*s.args), s.dtype)


def ctx_checkpoint_grad(s):
    f = jax.jit(lambda *a: _grad(jax.checkpoint(s.op), dataclasses.replace(s, args=a)))
    _close(f(*s.args), _ref_grad(s), s.dtype)


def ctx_eval_shape(s):
    actual = jax.eval_shape(s.op, *s.args)
    expected = jax.eval_shape(s.ref, *s.args)
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    assert [(a.shape, a.dtype) for a in jax.tree.leaves(actual)] == \
        [(e.shape, e.dtype) for e in jax.tree.leaves(expected)]


def ctx_eval_shape_const(s):
    actual = jax.eval_shape(lambda: s.op(*s.args))
    expected = jax.eval_shape(lambda: s.ref(*s.args))
    assert [(a.shape, a.dtype) for a in jax.tree.leaves(actual)] == \
        [(e.shape, e.dtype) for e in jax.tree.leaves(expected)]


def ctx_vmap(s):
    if not s.args:  # the op is called unbatched inside a vmapped function
        ones = np.arange(1, 4, dtype=np.int32)
        _close(jax.vmap(lambda t: _times(s.op(), t))(ones),
               jax.vmap(lambda t: _times(s.ref(), t))(ones), s.dtype)
        return
    batched = _stacked(s.args, s.form.in_axes)
    actual = jax.vmap(s.op, in_axes=s.form.in_axes)(*batched)
    _close(actual, jax.vmap(s.ref, in_axes=s.form.in_axes)(*batched), s.dtype)


def ctx_grad(s):
    _close(_grad(s.op, s), _ref_grad(s), s.dtype)


def ctx_jit_grad(s):
    f = jax.jit(lambda *a: _grad(s.op, dataclasses.replace(s, args=a)))
    _close(f(*s.args), _ref_grad(s), s.dtype)


def ctx_jit_grad_const(s):
    # Differentiates by the first input only; the other inputs are closed-over constants.
    def grad_of(f):
        def g(first):
            return jax.grad(lambda v: _loss(f(v, *s.args[1:])))(first)

        return g

    _close(jax.jit(grad_of(s.op))(s.args[0]), grad_of(s.ref)(s.args[0]), s.dtype)


def ctx_vmap_grad(s):
    # Per-example gradients.
    batched = _stacked(s.args, s.form.in_axes)

    def per_example(f):
        return jax.jit(jax.vmap(lambda *a: _grad(f, dataclasses.replace(s, args=a)),
                                in_axes=s.form.in_axes))(*batched)

    _close(per_example(s.op), per_example(s.ref), s.dtype)


def ctx_check_grads(s):
    def inexact_outputs(*a):  # integer outputs have no derivative to check: dropped
        return jax.tree.map(lambda o: o if jnp.issubdtype(o.dtype, jnp.inexact) else None,
                            s.op(*a))

    g, diff = _of_diff(inexact_outputs, s)
    check_grads(g, diff, order=1, modes=("fwd", "rev"), eps=1e-6, atol=1e-5, rtol=1e-5)


def _direction(rng, struct):
    """A random tangent or cotangent for an array (or ShapeDtypeStruct) leaf."""
    if jnp.issubdtype(struct.dtype, jnp.inexact):
        return random_array(rng, struct.shape, struct.dtype)
    return np.zeros(struct.shape, jax.dtypes.float0)  # integer leaves take none


def ctx_jvp(s):
    g, diff = _of_diff(s.op, s)
    ref_g, _ = _of_diff(s.ref, s)
    tangents = jax.tree.map(lambda d: _direction(s.rng, np.asarray(d)), diff)
    _close(jax.jvp(g, diff, tangents), jax.jvp(ref_g, diff, tangents), s.dtype)


def ctx_vjp(s):
    g, diff = _of_diff(s.op, s)
    ref_g, _ = _of_diff(s.ref, s)
    cts = jax.tree.map(lambda o: _direction(s.rng, o), jax.eval_shape(ref_g, *diff))
    out, pullback = jax.vjp(g, *diff)
    ref_out, ref_pullback = jax.vjp(ref_g, *diff)
    _close(out, ref_out, s.dtype)
    _close(pullback(cts), ref_pullback(cts), s.dtype)


def ctx_linear_transpose(s):
    ct_struct = jax.eval_shape(s.ref, *s.args)
    ct = random_array(s.rng, ct_struct.shape, ct_struct.dtype)
    if s.form.linear == "linear":
        _close(jax.linear_transpose(s.op, *s.args)(ct),
               jax.linear_transpose(s.ref, *s.args)(ct), s.dtype)
        return
    x, y = s.args
    if s.form.linear == "partly":  # in its linear input only (else: test_partly_linear)
        _close(jax.linear_transpose(lambda v: s.op(x, v), y)(ct),
               jax.linear_transpose(lambda v: s.ref(x, v), y)(ct), s.dtype)
        return
    _close(jax.linear_transpose(lambda v: s.op(v, y), x)(ct),
           jax.linear_transpose(lambda v: s.ref(v, y), x)(ct), s.dtype)
    _close(jax.linear_transpose(lambda v: s.op(x, v), y)(ct),
           jax.linear_transpose(lambda v: s.ref(x, v), y)(ct), s.dtype)


# ---------------------------------------------------------------------------
# The matrix
# ---------------------------------------------------------------------------

NO_INPUTS = "an op without inputs has nothing to differentiate"


def _needs_inputs(why):
    def skip(form):
        return why if not form.names else None

    return skip


def _differentiable(form):
    return NO_INPUTS if not form.diff else None


def _several_inputs(form):
    if len(form.names) < 2:
        return "fewer than two inputs: 'jit', 'jit_const' and 'jit_grad' cover it"
    return None


def _linear(form):
    if not form.names:
        return NO_INPUTS
    return None if form.linear else "the op is not declared linear (in any input) or multilinear"


def _scalars(form):
    if not form.names:
        return "an op without inputs takes no scalars"
    return None if form.scalars else "the op needs an array input (a vector of length 4)"


@dataclasses.dataclass(frozen=True)
class Context:
    run: Callable
    skip: Callable = lambda form: None  # form -> reason it makes no sense, or None
    dtypes: tuple | None = None  # restricts the dtype axis; None: every dtype of the form


CONTEXTS = {
    "eager": Context(ctx_eager),
    "jit": Context(ctx_jit),
    "nested_jit": Context(ctx_nested_jit),
    "jit_const": Context(ctx_jit_const, _needs_inputs("no inputs: 'jit' already has no traced "
                                                      "operand")),
    "jit_mixed": Context(ctx_jit_mixed, _several_inputs),
    "eager_pyscalar": Context(ctx_eager_pyscalar, _scalars, dtypes=()),
    "jit_pyscalar": Context(ctx_jit_pyscalar, _scalars, dtypes=()),
    "keyword": Context(ctx_keyword, _needs_inputs("no inputs to pass by keyword")),
    "jit_keyword": Context(ctx_jit_keyword, _needs_inputs("no inputs to pass by keyword")),
    "scan": Context(ctx_scan),
    "scan_const": Context(ctx_scan_const, _needs_inputs("no inputs: 'scan' already applies the "
                                                        "op to no traced operand")),
    "fori_loop": Context(ctx_fori_loop),
    "while_loop": Context(ctx_while_loop),
    "cond": Context(ctx_cond),
    "cond_const": Context(ctx_cond_const, _needs_inputs("no inputs: 'cond' already applies the "
                                                        "op to no traced operand")),
    "checkpoint": Context(ctx_checkpoint),
    "checkpoint_grad": Context(ctx_checkpoint_grad, _differentiable),
    "eval_shape": Context(ctx_eval_shape),
    "eval_shape_const": Context(ctx_eval_shape_const, _needs_inputs(
        "no inputs: 'eval_shape' already applies the op to no abstract operand")),
    "vmap": Context(ctx_vmap),
    "grad": Context(ctx_grad, _differentiable),
    "jit_grad": Context(ctx_jit_grad, _differentiable),
    "jit_grad_const": Context(ctx_jit_grad_const, _several_inputs),
    "vmap_grad": Context(ctx_vmap_grad, _differentiable),
    # Finite differences need 64-bit precision.
    "check_grads": Context(ctx_check_grads, _differentiable, dtypes=("float64", "complex128")),
    "jvp": Context(ctx_jvp, _differentiable),
    "vjp": Context(ctx_vjp, _differentiable),
    "linear_transpose": Context(ctx_linear_transpose, _linear),
}


def _params():
    params = []
    for form_name, form in FORMS.items():
        for ctx_name, ctx in CONTEXTS.items():
            if ctx.dtypes == ():  # dtype-independent context: one case, on float64 inputs
                dtypes = ["float64"]
            elif ctx.dtypes is None:
                dtypes = list(form.dtypes)
            else:
                dtypes = [d for d in form.dtypes if d in ctx.dtypes]
            for dtype in dtypes:
                case_id = f"{form_name}-{ctx_name}" + (f"-{dtype}" if ctx.dtypes != () else "")
                reason = ctx.skip(form)
                marks = [pytest.mark.skip(reason=reason)] if reason else []
                params.append(pytest.param(form_name, ctx_name, dtype, id=case_id, marks=marks))
    return params


@pytest.mark.parametrize("form_name,ctx_name,dtype", _params())
def test_matrix(form_name, ctx_name, dtype):
    CONTEXTS[ctx_name].run(_setup(form_name, dtype))


def test_matrix_is_complete():
    """Every form runs eagerly, under jit and under vmap; every context has a case."""
    ids = [p.id for p in _params()]
    for form_name in FORMS:
        for ctx_name in ("eager", "jit", "vmap"):
            assert any(i.startswith(f"{form_name}-{ctx_name}") for i in ids)
    for ctx_name in CONTEXTS:
        assert any(f"-{ctx_name}" in i for i in ids)


# ---------------------------------------------------------------------------
# Form-specific contracts the matrix cannot express
# ---------------------------------------------------------------------------


def test_nondiff_input_refuses_differentiation():
    x, s, k = FORMS["nondiff"].args(np.random.default_rng(0), np.dtype("float64"))
    op = _OPS["nondiff"]
    with pytest.raises(Exception, match=r"ScaledRoll.*'s'"):
        jax.grad(lambda v: jnp.sum(op(x, v, k)))(s)


def test_multi_output_jvp_has_no_tangent_for_integer_output():
    x, y = FORMS["multi_output"].args(np.random.default_rng(1), np.dtype("float64"))
    _, tangents = jax.jvp(_OPS["multi_output"], (x, y), (np.ones(3), np.ones(3)))
    assert tangents[2].dtype == jax.dtypes.float0
    np.testing.assert_allclose(tangents[0], 2 * np.ones(3))
    np.testing.assert_allclose(tangents[1], x + y)
