"""Ops that several test files use, each with its jax.numpy twin where tests compare with one.

Import them by name (``from ops import Scale``): ``tests/`` is on ``sys.path`` under pytest
and for the ``helpers_*.py`` scripts, which run as ``python tests/helpers_x.py``. An op that
a test declares to exercise one feature (a wrong rule, a rule that raises or counts its
calls, an op whose declaration is what the test is about) stays in that test's file.
"""

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

import jaxdecl as jd


def same(x):
    """The jax.ShapeDtypeStruct of `x`: what an op whose output is like its input declares."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def complex_of(dtype):
    """The complex dtype of `dtype`'s precision: complex64 for float32, complex128 for float64."""
    return np.result_type(dtype, np.complex64)


def random_array(rng, shape, dtype, low=0.5, high=1.5):
    """Uniform values in [low, high) as `dtype`, plus i * uniform(-0.5, 0.5) for complex ones."""
    value = rng.uniform(low, high, shape)
    if np.issubdtype(dtype, np.complexfloating):
        value = value + 1j * rng.uniform(-0.5, 0.5, shape)
    return np.asarray(value).astype(dtype)


def compile_c(source, folder, name="kernel"):
    """C `source` (it may include "jaxdecl.h") built into a shared library in `folder`, loaded
    with ctypes; skips the calling test where there is no C compiler."""
    import ctypes
    import pathlib
    import shutil
    import subprocess

    import pytest

    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        pytest.skip("no C compiler")
    source_file = pathlib.Path(folder) / f"{name}.c"
    library = pathlib.Path(folder) / f"lib{name}.so"
    source_file.write_text(source)
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", f"-I{jd.include_dir()}",
                    str(source_file), "-o", str(library)], check=True)
    return ctypes.CDLL(str(library))


# ---------------------------------------------------------------------------
# Elementwise ops with a forward only, zero-copy (they fill `out`)
# ---------------------------------------------------------------------------


class Scale(jd.Primitive):
    """y = factor * x, written into `out`."""

    def __init__(self, factor):
        self.factor = factor

    @jd.abstract
    def shapes(self, x):
        return same(x)

    @jd.forward
    def apply(self, x, *, out):
        np.multiply(x, self.factor, out=out)


class Offset(jd.Primitive):
    """y = x + offset, written into `out`: a hashable configuration, so equal offsets share
    compiled code."""

    def __init__(self, offset):
        self.offset = offset

    @jd.abstract
    def shapes(self, x):
        return same(x)

    @jd.forward
    def apply(self, x, *, out):
        np.add(x, self.offset, out=out)


class Negate(jd.Primitive):
    """y = -x, written into `out`."""

    @jd.abstract
    def shapes(self, x):
        return same(x)

    @jd.forward
    def apply(self, x, *, out):
        np.negative(x, out=out)


# ---------------------------------------------------------------------------
# Differentiable ops, one per kind of derivative rule
# ---------------------------------------------------------------------------


class MulNumpy(jd.Primitive):
    """f(x1, x2) = x1 * x2**2 with NumPy rules (first order only)."""

    @jd.abstract
    def shapes(self, x1, x2):
        return same(x1)

    @jd.forward
    def apply(self, x1, x2, *, out):
        np.multiply(x1, x2**2, out=out)

    @jd.jvp
    def push(self, x1, x2, dx1, dx2):
        return x2**2 * dx1 + 2 * x1 * x2 * dx2

    @jd.vjp
    def pull(self, x1, x2, ct):
        return x2**2 * ct, 2 * x1 * x2 * ct


class MulTraceable(jd.Primitive):
    """f(x1, x2) = x1 * x2**2 with jax.numpy rules (every order)."""

    @jd.abstract
    def shapes(self, x1, x2):
        return same(x1)

    @jd.forward
    def apply(self, x1, x2):
        return x1 * x2**2

    @jd.jvp(traceable=True)
    def push(self, x1, x2, dx1, dx2):
        return x2**2 * dx1 + 2 * x1 * x2 * dx2

    @jd.vjp(traceable=True)
    def pull(self, x1, x2, ct):
        return x2**2 * ct, 2 * x1 * x2 * ct


def mul_ref(x1, x2):
    return x1 * x2**2


class TwoOutputs(jd.Primitive):
    """(sin(x) * y, x + y): a traceable @jvp and a NumPy @vjp."""

    @jd.abstract
    def shapes(self, x, y):
        return same(x), same(x)

    @jd.forward
    def apply(self, x, y):
        return np.sin(x) * y, x + y

    @jd.jvp(traceable=True)
    def push(self, x, y, dx, dy):
        return jnp.cos(x) * y * dx + jnp.sin(x) * dy, dx + dy

    @jd.vjp
    def pull(self, x, y, ct_prod, ct_sum):
        return np.cos(x) * y * ct_prod + ct_sum, np.sin(x) * ct_prod + ct_sum


def two_outputs_ref(x, y):
    return jnp.sin(x) * y, x + y


class Weighted(jd.Primitive, nondiff=("w",)):
    """w * x**k: weights `w` never differentiated, integer powers `k` auto non-diff."""

    @jd.abstract
    def shapes(self, x, w, k):
        return same(x)

    @jd.forward
    def apply(self, x, w, k):
        return (w * x**k).astype(x.dtype)

    @jd.jvp
    def push(self, x, w, k, dx):
        return (w * k * x ** (k - 1) * dx).astype(x.dtype)

    @jd.vjp
    def pull(self, x, w, k, ct):
        return (w * k * x ** (k - 1) * ct).astype(x.dtype)


def weighted_ref(x, w, k):
    return (w * x**k).astype(x.dtype)


class FFTTranspose(jd.Primitive, linear=True):
    """FFT along the last axis; the transpose of the DFT matrix is itself."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, complex_of(x.dtype))

    @jd.forward
    def apply(self, x):
        return np.fft.fft(x, axis=-1).astype(complex_of(x.dtype))

    @jd.transpose
    def transposed(self, ct):
        return np.fft.fft(ct, axis=-1).astype(ct.dtype)


class FFTAdjoint(jd.Primitive, linear=True):
    """FFT along the last axis, declared through its adjoint n * ifft."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, complex_of(x.dtype))

    @jd.forward
    def apply(self, x, *, out):
        out[...] = np.fft.fft(x, axis=-1)

    @jd.adjoint
    def adjoint(self, y):
        return (np.fft.ifft(y, axis=-1) * y.shape[-1]).astype(y.dtype)


def fft_ref(x):
    return jnp.fft.fft(x, axis=-1)


class WeightedFFT(jd.Primitive, linear=True, nondiff=("w",)):
    """w * fft(x): linear in x, with fixed weights w; `seen` collects the w its transpose got."""

    seen: ClassVar[list] = []

    @jd.abstract
    def shapes(self, x, w):
        return jax.ShapeDtypeStruct(x.shape, complex_of(x.dtype))

    @jd.forward
    def apply(self, x, w):
        return (w * np.fft.fft(x)).astype(complex_of(x.dtype))

    @jd.transpose
    def transposed(self, w, ct):
        type(self).seen.append(np.array(w))
        return np.fft.fft(w * ct).astype(ct.dtype)


def weighted_fft_ref(x, w):
    return w * jnp.fft.fft(x)


class FlipMul(jd.Primitive, multilinear=True):
    """x * flip(y): bilinear, with one transpose per input."""

    @jd.abstract
    def shapes(self, x, y):
        return same(x)

    @jd.forward
    def apply(self, x, y):
        return x * np.flip(y)

    @jd.transpose(wrt="x")
    def transpose_x(self, y, ct):
        return np.flip(y) * ct

    @jd.transpose(wrt="y")
    def transpose_y(self, x, ct):
        return np.flip(x * ct)


def flip_mul_ref(x, y):
    return x * jnp.flip(y)


# ---------------------------------------------------------------------------------------
# Ops that record the shape of every rule call: what each device (each process) ran on
# ---------------------------------------------------------------------------------------

#: ``(class, rule, shape of the first operand)`` of every rule call of the ops below.
SEEN: list = []


class RowNorm(jd.Primitive, sharding="b n -> b", reduce=("n",)):
    """The squared norm of each row: rows independent, ``n`` summed over."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape[:1], x.dtype)

    @jd.forward
    def apply(self, x):
        SEEN.append(("RowNorm", "forward", x.shape))
        return (x * x).sum(axis=-1)

    @jd.jvp
    def push(self, x, dx):
        SEEN.append(("RowNorm", "jvp", x.shape))
        return 2 * (x * dx).sum(axis=-1)

    @jd.vjp
    def pull(self, x, ct):
        SEEN.append(("RowNorm", "vjp", x.shape))
        return 2 * x * ct[:, None]


def row_norm_ref(x):
    return jnp.sum(x * x, axis=-1)


class Softsign(jd.Primitive):
    """x / (1 + |x|), with no sharding declaration (its rules see whole arrays)."""

    @jd.abstract
    def shapes(self, x):
        return same(x)

    @jd.forward
    def apply(self, x):
        SEEN.append(("Softsign", "forward", x.shape))
        return x / (1 + np.abs(x))

    @jd.vjp
    def pull(self, x, ct):
        SEEN.append(("Softsign", "vjp", x.shape))
        return ct / (1 + np.abs(x)) ** 2


def softsign_ref(x):
    return x / (1 + jnp.abs(x))


class Cube(jd.Primitive, sharding="... n -> ... n"):
    """x³, declared elementwise."""

    @jd.abstract
    def shapes(self, x):
        return same(x)

    @jd.forward
    def apply(self, x):
        SEEN.append(("Cube", "forward", x.shape))
        return x ** 3

    @jd.vjp
    def pull(self, x, ct):
        SEEN.append(("Cube", "vjp", x.shape))
        return 3 * x ** 2 * ct


def cube_ref(x):
    return x ** 3


def seen(function, *args, **kwargs) -> list:
    """Runs `function` (blocking) and returns the sorted distinct SEEN entries of the run."""
    SEEN.clear()
    jax.block_until_ready(function(*args, **kwargs))
    return sorted(set(SEEN))


class SinProd(jd.Primitive, sharding="... n, ... n -> ... n, ... n"):
    """(sin(x) * y, x + y): two results, declared elementwise."""

    @jd.abstract
    def shapes(self, x, y):
        return same(x), same(x)

    @jd.forward
    def apply(self, x, y):
        SEEN.append(("SinProd", "forward", x.shape))
        return np.sin(x) * y, x + y

    @jd.vjp
    def pull(self, x, y, ct_prod, ct_sum):
        SEEN.append(("SinProd", "vjp", x.shape))
        return np.cos(x) * y * ct_prod + ct_sum, np.sin(x) * ct_prod + ct_sum


def sin_prod_ref(x, y):
    return jnp.sin(x) * y, x + y


class RowAffine(jd.Primitive, sharding="b n, b -> b n"):
    """{"y": x * p["w"][:, None] + p["c"][:, None]}: a dict input and output, by rows."""

    @jd.abstract
    def shapes(self, x, p):
        return {"y": same(x)}

    @jd.forward
    def apply(self, x, p):
        SEEN.append(("RowAffine", "forward", x.shape))
        return {"y": x * p["w"][:, None] + p["c"][:, None]}

    @jd.vjp
    def pull(self, x, p, ct):
        SEEN.append(("RowAffine", "vjp", x.shape))
        y = ct["y"]
        return y * p["w"][:, None], {"w": np.sum(y * x, axis=1), "c": np.sum(y, axis=1)}


def row_affine_ref(x, p):
    return {"y": x * p["w"][:, None] + p["c"][:, None]}
