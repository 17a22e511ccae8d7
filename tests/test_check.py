"""jd.check: passes on correct ops of every kind, names the wrong rule otherwise."""

import jax
import numpy as np
import pytest
from ops import (
    FFTAdjoint,
    FFTTranspose,
    FlipMul,
    MulNumpy,
    MulTraceable,
    TwoOutputs,
    Weighted,
    WeightedFFT,
    random_array,
)

import jaxdecl as jd

DTYPES = ["float32", "float64", "complex64", "complex128"]


def _args(kind, dtype):
    rng = np.random.default_rng(0)
    x, y = random_array(rng, (5,), dtype), random_array(rng, (5,), dtype)
    real = np.finfo(dtype).dtype
    if kind in ("mul_numpy", "mul_traceable", "two_outputs", "bilinear"):
        return x, y
    if kind == "weighted":
        return x, random_array(rng, (5,), real), np.arange(1, 6, dtype=np.int32) % 3 + 1
    if kind == "weighted_fft":
        return x, random_array(rng, (5,), real)
    return (x,)


OPS = {
    "mul_numpy": MulNumpy,
    "mul_traceable": MulTraceable,
    "two_outputs": TwoOutputs,
    "weighted": Weighted,
    "fft_transpose": FFTTranspose,
    "fft_adjoint": FFTAdjoint,
    "weighted_fft": WeightedFFT,
    "bilinear": FlipMul,
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", list(OPS))
def test_check_passes_on_correct_ops(kind, dtype):
    jd.check(OPS[kind](), *_args(kind, dtype))


class WrongVjp(MulNumpy):
    """The @vjp misses a factor 2 in the second cotangent."""

    @jd.vjp
    def pull(self, x1, x2, ct):
        return x2**2 * ct, x1 * x2 * ct


class WrongTranspose(FFTTranspose):
    """The @transpose conjugates (an adjoint where a transpose is due)."""

    @jd.transpose
    def transposed(self, ct):
        return np.conj(np.fft.fft(np.conj(ct))).astype(ct.dtype)


class WrongAdjoint(FFTAdjoint):
    """The @adjoint forgets the factor n."""

    @jd.adjoint
    def adjoint(self, y):
        return np.fft.ifft(y).astype(y.dtype)


class WrongTransposeWrt(FlipMul):
    """The transpose w.r.t. y forgets the flip."""

    @jd.transpose(wrt="y")
    def transpose_y(self, x, ct):
        return x * ct


@pytest.mark.parametrize("dtype", DTYPES)
def test_wrong_vjp_is_named(dtype):
    with pytest.raises(AssertionError, match=r"WrongVjp\.pull.*@vjp"):
        jd.check(WrongVjp(), *_args("mul_numpy", dtype))


@pytest.mark.parametrize("dtype", ["float64", "complex64"])
@pytest.mark.parametrize(
    "op_class,pattern",
    [
        (WrongTranspose, r"WrongTranspose\.transposed.*@transpose"),
        (WrongAdjoint, r"WrongAdjoint\.adjoint.*@adjoint"),
        (WrongTransposeWrt, r"WrongTransposeWrt.*@transpose"),
    ],
)
def test_wrong_transpose_is_named(op_class, pattern, dtype):
    args = _args("bilinear" if op_class is WrongTransposeWrt else "fft", dtype)
    with pytest.raises(AssertionError, match=pattern):
        jd.check(op_class(), *args)


class WrongJvp(MulNumpy):
    """The @jvp drops the dx2 term."""

    @jd.jvp
    def push(self, x1, x2, dx1, dx2):
        return x2**2 * dx1


def test_wrong_jvp_is_named():
    with pytest.raises(AssertionError, match=r"WrongJvp\.push.*@jvp"):
        jd.check(WrongJvp(), *_args("mul_numpy", "float64"))


class WrongAbstract(jd.Primitive):
    """@abstract declares shape (3,); the forward returns (4,)."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct((3,), x.dtype)

    @jd.forward
    def apply(self, x):
        return np.concatenate([x, x[:1]])


def test_wrong_abstract_is_named():
    with pytest.raises(AssertionError, match="@abstract") as info:
        jd.check(WrongAbstract(), np.arange(3.0))
    assert "WrongAbstract" in str(info.value)


class PartlyWritten(jd.Primitive):
    """A zero-copy @forward that never writes the last element of `out`."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, *, out):
        out[:-1] = 2 * x[:-1]


def test_unwritten_zero_copy_output_is_named():
    with pytest.raises(AssertionError, match=r"PartlyWritten\.apply.*@forward.*1 of 4"):
        jd.check(PartlyWritten(), np.arange(4.0))
