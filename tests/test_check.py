"""jd.check: passes on correct ops of every kind, names the wrong rule otherwise."""

import re
import warnings

import jax
import jax.numpy as jnp
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


class Accumulates(PartlyWritten):
    """A zero-copy @forward that adds to `out` instead of writing it."""

    @jd.forward
    def apply(self, x, *, out):
        out += 2 * x


def test_a_forward_that_reads_out_is_named():
    with pytest.raises(AssertionError, match=r"Accumulates\.apply \(@forward\) reads output "
                                             r"before writing it: two runs whose buffers"):
        jd.check(Accumulates(), np.arange(1.0, 5.0))


# ---------------------------------------------------------------------------------------
# A family of deliberately wrong ops, and their right twins: nothing wrong passes, nothing
# right fails, at any amplitude and precision. float32 runs with x64 off, as JAX's default.
# ---------------------------------------------------------------------------------------


@pytest.fixture(params=["float32", "float64"])
def precision(request):
    """The dtype of a real op's values; float32 runs with jax_enable_x64 off."""
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", request.param == "float64")
    yield np.dtype(request.param)
    jax.config.update("jax_enable_x64", before)


@pytest.fixture
def x64_off():
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    yield
    jax.config.update("jax_enable_x64", before)


class _Sine(jd.Primitive, nondiff=("a", "s")):
    """a * sin(x / s); `a` and `s` are inputs so that every amplitude shares compiled code.
    Its rules are scaled by `jvp_factor` and `vjp_factor`: 1 is right."""

    def __init__(self, jvp_factor=1.0, vjp_factor=1.0):
        self.jvp_factor, self.vjp_factor = jvp_factor, vjp_factor

    @jd.abstract
    def shapes(self, x, a, s):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, a, s):
        return (a * np.sin(x / s)).astype(x.dtype)

    def derivative(self, x, a, s, factor):
        return factor * a / s * np.cos(x / s)


class Sine(_Sine):
    @jd.jvp
    def push(self, x, a, s, dx):
        return (self.derivative(x, a, s, self.jvp_factor) * dx).astype(x.dtype)

    @jd.vjp
    def pull(self, x, a, s, ct):
        return (self.derivative(x, a, s, self.vjp_factor) * ct).astype(x.dtype)


class SineVjpOnly(_Sine):
    @jd.vjp
    def pull(self, x, a, s, ct):
        return (self.derivative(x, a, s, self.vjp_factor) * ct).astype(x.dtype)


class SineJvpOnly(_Sine):
    @jd.jvp
    def push(self, x, a, s, dx):
        return (self.derivative(x, a, s, self.jvp_factor) * dx).astype(x.dtype)


def _sine_args(dtype, a=1.0, s=1.0, size=7):
    x = s * np.random.default_rng(1).uniform(0.5, 1.5, size)
    return x.astype(dtype), np.asarray(a, dtype), np.asarray(s, dtype)


# (op, dtype, amplitude, the rules the message must name)
WRONG_SINES = [
    (Sine(-1, -1), "float32", 1e-2, ["push", "pull"]),    # the same wrong sign in both
    (Sine(-1, -1), "float32", 1e-3, ["push", "pull"]),
    (Sine(-1, -1), "float64", 1e-6, ["push", "pull"]),
    (Sine(1.01, 1.01), "float32", 1.0, ["push", "pull"]),  # both 1 % too large
    (Sine(1.02, 1.02), "float32", 1e-4, ["push", "pull"]),
    (Sine(1.01, 1.01), "float64", 1.0, ["push", "pull"]),
    (Sine(1.0, 1.01), "float32", 1.0, ["pull"]),           # jvp right, vjp wrong
    (Sine(1.01, 1.0), "float32", 1.0, ["push"]),           # vjp right, jvp wrong
    (Sine(1.0, 1.00001), "float64", 1.0, ["pull"]),        # finer than differences: dot test
    (SineVjpOnly(1.0, 1.01), "float32", 1e8, ["pull"]),
    (SineJvpOnly(1.01, 1.0), "float32", 1e-8, ["push"]),
]


@pytest.mark.parametrize("op, dtype, amplitude, wrong", WRONG_SINES)
def test_wrong_derivative_rules_are_caught_at_any_amplitude(op, dtype, amplitude, wrong):
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", dtype == "float64")
    try:
        with pytest.raises(AssertionError) as info:
            jd.check(op, *_sine_args(dtype, a=amplitude))
    finally:
        jax.config.update("jax_enable_x64", before)
    lines = str(info.value).splitlines()
    named = {"push": r"\.push \(@jvp\) disagrees with finite differences",
             "pull": r"\.pull \(@vjp\) (disagrees with finite differences|fails the dot-prod)"}
    for rule, pattern in named.items():
        assert any(re.search(pattern, line) for line in lines) == (rule in wrong), lines
    for line in lines:  # where, by how much, against what
        assert re.search(r"for d output / d x: .*relative error [\d.e+-]+ against a tolerance "
                         r"of [\d.e+-]+", line), line


@pytest.mark.parametrize("a, s", [(1e-8, 1), (1e-4, 1), (1, 1), (1e4, 1), (1e8, 1),
                                  (1, 1e-8), (1, 1e8), (1e-8, 1e8), (1e8, 1e-8)])
@pytest.mark.parametrize("op_class", [Sine, SineVjpOnly, SineJvpOnly])
def test_right_derivative_rules_pass_at_any_amplitude(op_class, a, s, precision):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor does it call the differences weak
        jd.check(op_class(), *_sine_args(precision, a, s))


def test_the_message_says_the_error_and_its_tolerance(x64_off):
    with pytest.raises(AssertionError) as info:
        jd.check(Sine(1.01, 1.0), *_sine_args("float32"))
    message = str(info.value)
    assert message.startswith("jd.check: Sine.push (@jvp) disagrees with finite differences "
                              "for d output / d x: relative error 0.01 against a tolerance of")
    rtol, fd_error = map(float, re.search(r"\(rtol ([\d.e+-]+) of the larger of the two \+ "
                                          r"([\d.e+-]+) for the finite differences' own "
                                          r"error and rounding\)", message).groups())
    assert rtol == 1e-3 and 0 < fd_error < 1e-3  # accurate enough to see 1 % in float32
    assert message.endswith("; step 0.016 of each input element")


class TwoInputs(jd.Primitive):
    """(x * y**2, x + y), with the tangent of the first output w.r.t. y scaled by `factor`."""

    def __init__(self, factor=1.0):
        self.factor = factor

    @jd.abstract
    def shapes(self, x, y):
        return jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, y):
        return x * y**2, x + y

    @jd.jvp
    def push(self, x, y, dx, dy):
        return y**2 * dx + self.factor * 2 * x * y * dy, dx + dy

    @jd.vjp
    def pull(self, x, y, ct, ct_sum):
        return y**2 * ct + ct_sum, self.factor * 2 * x * y * ct + ct_sum


def test_the_message_says_which_output_and_input():
    args = np.linspace(1, 2, 5), np.linspace(0.5, 1.5, 5)
    jd.check(TwoInputs(), *args)
    with pytest.raises(AssertionError) as info:
        jd.check(TwoInputs(-1.0), *args)
    lines = str(info.value).splitlines()
    assert len(lines) == 2, lines  # d output 1 / d x, d output 0 / d x, ... are right
    assert "TwoInputs.push (@jvp) disagrees with finite differences for d output 0 / d y: " \
           "relative error 2 " in lines[0]
    assert "TwoInputs.pull (@vjp) disagrees with finite differences for d output 0 / d y: " \
           "<J^T ct, t> = -" in lines[1]


class Square(jd.Primitive):
    """z**2 (holomorphic); `conjugate` names the rule that conjugates its derivative."""

    def __init__(self, conjugate=None):
        self.conjugate = conjugate

    @jd.abstract
    def shapes(self, z):
        return jax.ShapeDtypeStruct(z.shape, z.dtype)

    @jd.forward
    def apply(self, z):
        return z**2

    @jd.jvp
    def push(self, z, dz):
        return (np.conj(2 * z) if self.conjugate == "jvp" else 2 * z) * dz

    @jd.vjp
    def pull(self, z, ct):
        return (np.conj(2 * z) if self.conjugate == "vjp" else 2 * z) * ct


class AbsSquare(jd.Primitive):
    """|z|**2, real from complex: its vjp is 2 conj(z) ct (JAX's unconjugated pairing)."""

    def __init__(self, conjugate=False):
        self.conjugate = conjugate

    @jd.abstract
    def shapes(self, z):
        return jax.ShapeDtypeStruct(z.shape, np.finfo(z.dtype).dtype)

    @jd.forward
    def apply(self, z):
        return np.abs(z) ** 2

    @jd.jvp
    def push(self, z, dz):
        return 2 * np.real(np.conj(z) * dz)

    @jd.vjp
    def pull(self, z, ct):
        return (2 * ct * (z if self.conjugate else np.conj(z))).astype(z.dtype)


class Phase(jd.Primitive):
    """a * exp(i x), complex from real; `conjugate` conjugates the vjp's derivative."""

    def __init__(self, conjugate=False):
        self.conjugate = conjugate

    @jd.abstract
    def shapes(self, x, a):
        return jax.ShapeDtypeStruct(x.shape, np.result_type(x.dtype, np.complex64))

    @jd.forward
    def apply(self, x, a):
        return (a * np.exp(1j * x)).astype(np.result_type(x.dtype, np.complex64))

    @jd.jvp
    def push(self, x, a, dx, da):
        return ((1j * a * dx + da) * np.exp(1j * x)).astype(np.result_type(x, np.complex64))

    @jd.vjp
    def pull(self, x, a, ct):
        d = np.exp(1j * x)
        d = np.conj(d) if self.conjugate else d
        return np.real(ct * 1j * a * d).astype(x.dtype), np.real(ct * d).astype(x.dtype)


def _complex_args(op, dtype, amplitude):
    rng = np.random.default_rng(2)
    if isinstance(op, Phase):
        return rng.uniform(0, 3, 6).astype(dtype), np.full(6, amplitude, dtype)
    z = rng.uniform(0.5, 1.5, 6) * np.exp(1j * rng.uniform(0, 3, 6))
    return (amplitude * z).astype(np.result_type(dtype, np.complex64)),


@pytest.mark.parametrize("op, rule", [(Square("jvp"), r"Square\.push \(@jvp\)"),
                                      (Square("vjp"), r"Square\.pull \(@vjp\)"),
                                      (AbsSquare(True), r"AbsSquare\.pull \(@vjp\)"),
                                      (Phase(True), r"Phase\.pull \(@vjp\) .* d x")])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_conjugated_derivative_is_caught(op, rule, dtype):
    with pytest.raises(AssertionError, match=r"jd\.check: " + rule):
        jd.check(op, *_complex_args(op, dtype, 1.0))


@pytest.mark.parametrize("amplitude", [1e-8, 1.0, 1e8])
@pytest.mark.parametrize("op", [Square(), AbsSquare(), Phase()])
def test_right_complex_rules_pass(op, amplitude, precision):
    jd.check(op, *_complex_args(op, precision, amplitude))


class MatVec(jd.Primitive, linear=True):
    """A fixed non-symmetric matrix times x; `wrong` transposes with the matrix itself."""

    def __init__(self, wrong=False):
        self.wrong = wrong

    @staticmethod
    def matrix(n, dtype):
        return (np.arange(n * n).reshape(n, n) % 7 - 3.0 + np.eye(n)).astype(dtype)

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        return self.matrix(x.shape[-1], x.dtype) @ x

    @jd.transpose
    def transposed(self, ct):
        a = self.matrix(ct.shape[-1], ct.dtype)
        return (a if self.wrong else a.T) @ ct


def test_a_wrong_transpose_of_a_linear_op_is_caught(precision):
    x = np.linspace(-1, 1, 5).astype(precision)
    jd.check(MatVec(), x)
    with pytest.raises(AssertionError, match=r"MatVec\.transposed \(@transpose\) disagrees "
                                             r"with finite differences"):
        jd.check(MatVec(wrong=True), x)


class Twice(jd.Primitive):
    """2 x, with a @batch rule that (`wrong`) returns the batch in reverse order."""

    def __init__(self, wrong=False):
        self.wrong = wrong

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        return 2 * x

    @jd.batch
    def batched(self, args, axes):
        x = jnp.moveaxis(args[0], axes[0], 0)
        return Twice()(x[::-1] if self.wrong else x), 0


def test_a_wrong_batch_rule_is_caught(precision):
    x = np.linspace(1e-8, 2e-8, 4).astype(precision)  # amplitude 1e-8: still caught
    jd.check(Twice(), x)
    with pytest.raises(AssertionError, match=r"vmap of Twice disagrees with a loop of calls "
                                             r"for output, batch element 0 \(relative "
                                             r"difference"):
        jd.check(Twice(wrong=True), x)


class SineAndCount(jd.Primitive):
    """(k * sin(x), k + count of x > 1): integer inputs and outputs beside float ones."""

    @jd.abstract
    def shapes(self, x, k):
        return jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(x.shape, k.dtype)

    @jd.forward
    def apply(self, x, k):
        return (k * np.sin(x)).astype(x.dtype), k + (x > 1)

    @jd.jvp
    def push(self, x, k, dx):
        return (k * np.cos(x) * dx).astype(x.dtype)

    @jd.vjp
    def pull(self, x, k, ct):
        return (k * np.cos(x) * ct).astype(x.dtype)


def test_integer_inputs_and_outputs_pass(precision):
    x = np.linspace(0.5, 1.5, 6).astype(precision)
    jd.check(SineAndCount(), x, np.arange(1, 7, dtype=np.int32))


class Noisy(jd.Primitive, nondiff=("a",)):
    """a * Σ_k sin(k x) / k², summed in a random order at every run (as threads would) and
    then moved by one ulp at random: a complete forward whose last bits vary. Zero-copy; its
    residual (the derivative) varies the same way."""

    terms = np.arange(1, 9)

    @jd.abstract
    def shapes(self, x, a):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.residuals
    def keeps(self, x, a):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    def _sum(self, terms):
        rng = np.random.default_rng()
        total = np.zeros_like(terms[0])
        for k in rng.permutation(len(terms)):
            total += terms[k]
        return np.nextafter(total, np.where(rng.random(total.shape) < 0.5, -np.inf, np.inf))

    @jd.forward
    def apply(self, x, a, *, out, saved=None):
        k = self.terms[:, None].astype(x.dtype)
        out[...] = self._sum(a * np.sin(k * x) / k**2)
        if saved is not None:
            saved[...] = self._sum(a * np.cos(k * x) / k)

    @jd.jvp
    def push(self, x, a, dx, *, saved):
        return saved * dx

    @jd.vjp
    def pull(self, x, a, ct, *, saved):
        return saved * ct


@pytest.mark.parametrize("amplitude", [1e-8, 1.0, 1e8])
def test_a_complete_forward_whose_last_bits_vary_passes(amplitude, precision):
    x = np.linspace(0.3, 1.3, 6).astype(precision)
    a = np.asarray(amplitude, precision)
    outputs = {Noisy()(x, a).tobytes() for _ in range(8)}
    assert len(outputs) > 1  # it does vary
    jd.check(Noisy(), x, a)


class Shifted(jd.Primitive):
    """x + 1e6 in float32: rounding noise hides the derivative from finite differences."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        return x + np.float32(1e6)

    @jd.vjp
    def pull(self, x, ct):
        return ct


def test_weak_finite_differences_are_reported(x64_off):
    with pytest.warns(UserWarning, match=r"jd.check: finite differences resolve the "
                                         r"derivatives of Shifted only to \d+% at these inputs"):
        jd.check(Shifted(), np.linspace(0.5, 1.5, 4).astype(np.float32))


class Root(Shifted):
    @jd.forward
    def apply(self, x):
        with np.errstate(invalid="ignore"):
            return np.sqrt(x)

    @jd.vjp
    def pull(self, x, ct):
        with np.errstate(divide="ignore"):
            return ct / (2 * np.sqrt(x))


def test_differences_outside_the_domain_are_named():
    with pytest.raises(AssertionError, match=r"finite differences of Root are not finite at "
                                             r"the example inputs \(output is NaN"):
        jd.check(Root(), np.array([0.0, 1.0, 2.0]))


class Floor(Shifted):
    """floor(x), whose @vjp (and the @jvp JAX transposes from it) claims slope 1."""

    @jd.forward
    def apply(self, x):
        return np.floor(x)

    @jd.jvp
    def push(self, x, dx):
        return dx


def test_a_derivative_where_the_op_does_not_move_is_caught():
    with pytest.raises(AssertionError, match=r"Floor\.push \(@jvp\) disagrees with finite "
                                             r"differences for d output / d x: off by "
                                             r"[\d.e+-]+ where finite differences give 0"):
        jd.check(Floor(), np.array([0.2, 1.3, 2.4]))


class Counting(jd.Primitive):
    """x plus the number of earlier calls: a forward that depends on more than its inputs."""

    calls = 0

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        type(self).calls += 1
        return x + type(self).calls


def test_a_forward_that_differs_under_jit_is_named():
    with pytest.raises(AssertionError, match=r"Counting\.apply gives different output under "
                                             r"jax\.jit than eagerly \(relative difference "
                                             r"[\d.e+-]+, tolerance 1e-08\)"):
        jd.check(Counting(), np.arange(3.0))
