"""Errors from rules: mismatched results, exceptions, escaped buffer views."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecl as jd

JaxRuntimeError = jax.errors.JaxRuntimeError


def _same(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


class Wrong(jd.Primitive):
    """Declares two float64 outputs of x's shape; returns what `mode` says."""

    def __init__(self, mode):
        self.mode = mode

    @jd.abstract
    def shapes(self, x):
        return _same(x), _same(x)

    @jd.forward
    def apply(self, x):
        if self.mode == "shape":
            return x, x[:-1]
        if self.mode == "dtype":
            return x, x.astype(np.float32)
        return (x,)  # count


MISMATCHES = {
    "shape": r"Wrong\.apply \(@forward\) returned shape \(3,\) for output 1, but @abstract "
             r"declared \(4,\)",
    "dtype": r"Wrong\.apply \(@forward\) returned dtype float32 for output 1, but @abstract "
             r"declared float64: cast it in the rule, `\.astype\(np\.float64\)`, or declare "
             r"float32 in @abstract",
    "count": r"Wrong\.apply \(@forward\) returned 1 result\(s\), but 2 were expected "
             r"\(output 0, output 1\)",
}


@pytest.mark.parametrize("mode", sorted(MISMATCHES))
def test_mismatch_eager_raises_rule_error(mode):
    with pytest.raises(jd.RuleError, match=MISMATCHES[mode]):
        Wrong(mode)(jnp.arange(4.0))


@pytest.mark.parametrize("mode", sorted(MISMATCHES))
def test_mismatch_under_jit_raises_runtime_error(mode):
    with pytest.raises(JaxRuntimeError, match=MISMATCHES[mode]) as info:
        jax.block_until_ready(jax.jit(Wrong(mode))(jnp.arange(4.0)))
    assert "RuleError" in str(info.value)


def test_single_output_mismatch_names_the_output():
    class Short(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            return _same(x)

        @jd.forward
        def apply(self, x):
            return x[1:]

    with pytest.raises(jd.RuleError, match=r"Short\.apply \(@forward\) returned shape \(2,\) "
                                           r"for output, but @abstract declared \(3,\)"):
        Short()(jnp.ones(3))


class Widened(jd.Primitive):
    """Declares x's dtype; returns what NumPy makes of x in `dtype` (SciPy's float64)."""

    def __init__(self, dtype):
        self.dtype = dtype

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x):
        return x.astype(self.dtype)


@pytest.mark.parametrize("declared, got", [("float32", "float64"), ("complex64", "complex128"),
                                           ("int32", "int64")])
@pytest.mark.parametrize("where", ["eager", "jit"])
def test_a_64_bit_result_for_a_32_bit_output_names_astype_and_x64(declared, got, where):
    # JAX's default (32-bit) arrays, and a rule computing in 64 bits as SciPy does.
    op = Widened(np.dtype(got))
    x = np.arange(3).astype(declared)
    call = op if where == "eager" else jax.jit(op)
    expected = (rf"Widened\.apply \(@forward\) returned dtype {got} for output, but @abstract "
                rf"declared {declared}: cast it in the rule, `\.astype\(np\.{declared}\)` "
                rf"\(JAX makes {declared} arrays unless 64-bit mode is on, while NumPy and SciPy "
                rf"often compute in {got}\), or, where @abstract declares the inputs' dtype, "
                rf"turn 64-bit mode on \(`jax\.config\.update\(\"jax_enable_x64\", True\)`\) "
                rf"and pass {got} inputs")
    with pytest.raises(jd.RuleError if where == "eager" else JaxRuntimeError, match=expected):
        jax.block_until_ready(call(x))


def test_return_form_never_yields_garbage():
    # A wrong-shape return that would broadcast must still fail, not fill a partial output.
    class Broadcasts(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            return jax.ShapeDtypeStruct((4, 3), x.dtype)

        @jd.forward
        def apply(self, x):
            return x  # shape (3,), broadcastable to (4, 3)

    with pytest.raises(jd.RuleError, match="returned shape"):
        Broadcasts()(jnp.ones(3))


def test_rule_error_is_a_value_error():
    assert issubclass(jd.RuleError, ValueError)


class Boom(jd.Primitive):
    """Raises when asked to, otherwise doubles."""

    def __init__(self, fail):
        self.fail = fail

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x):
        if self.fail:
            raise KeyError("boom")
        return 2 * x


def test_exception_reaches_eager_caller_as_itself():
    with pytest.raises(KeyError, match="boom"):
        Boom(True)(jnp.ones(3))
    np.testing.assert_array_equal(Boom(False)(jnp.ones(3)), np.full(3, 2.0))


def test_exception_under_jit_carries_type_message_traceback():
    f = jax.jit(lambda v: Boom(True)(v) + 1)
    with pytest.raises(JaxRuntimeError) as info:
        jax.block_until_ready(f(jnp.ones(3)))
    message = str(info.value)
    assert "Boom.apply (@forward) raised KeyError" in message
    assert "'boom'" in message
    assert "Traceback" in message and 'raise KeyError("boom")' in message
    g = jax.jit(lambda v: Boom(False)(v) + 1)
    np.testing.assert_array_equal(g(jnp.ones(3)), np.full(3, 3.0))


def test_exception_in_zero_copy_rule():
    class Half(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            return _same(x)

        @jd.forward
        def apply(self, x, *, out):
            out[: x.size // 2] = x[: x.size // 2]
            raise ZeroDivisionError("half done")

    with pytest.raises(ZeroDivisionError, match="half done"):
        Half()(jnp.ones(4))


# ---------------------------------------------------------------------------
# Escaping buffer views
# ---------------------------------------------------------------------------

_kept = []


class Keeps(jd.Primitive):
    """Keeps what `what` names on a global list."""

    def __init__(self, what):
        self.what = what

    @jd.abstract
    def shapes(self, x, y):
        return _same(x)

    @jd.forward
    def apply(self, x, y, *, out):
        np.add(x, y, out=out)
        if self.what == "y":
            _kept.append(y)
        elif self.what == "out_slice":
            _kept.append(out[1:])
        elif self.what == "x_slice":
            _kept.append(x[:2])


ESCAPES = {"y": "kept a reference to y", "x_slice": "kept a reference to x",
           "out_slice": "kept a reference to output"}


# Each failing call costs XLA about a second on CPU; jit is covered by one case.
@pytest.mark.parametrize("what,jit", [("y", False), ("x_slice", False), ("out_slice", False),
                                      ("y", True)])
def test_escaped_view_raises(what, jit):
    x, y = jnp.arange(4.0), jnp.ones(4)
    f = jax.jit(Keeps(what)) if jit else Keeps(what)
    try:
        error = jd.BufferEscapeError if not jit else JaxRuntimeError
        with pytest.raises(error, match=rf"Keeps\.apply \(@forward\) {ESCAPES[what]}"):
            jax.block_until_ready(f(x, y))
    finally:
        _kept.clear()
    np.testing.assert_array_equal(Keeps(None)(x, y), np.arange(4.0) + 1)
    np.testing.assert_array_equal(jax.jit(Keeps(None))(x, y), np.arange(4.0) + 1)


def test_copies_may_be_kept():
    kept = []

    class Copies(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            return _same(x)

        @jd.forward
        def apply(self, x):
            kept.append(np.array(x))
            kept.append(float(x[0]))
            return -x

    np.testing.assert_array_equal(Copies()(jnp.arange(3.0)), -np.arange(3.0))
    np.testing.assert_array_equal(kept[0], np.arange(3.0))
    assert kept[1] == 0.0


# ---------------------------------------------------------------------------
# Exceptions that tell the truth
# ---------------------------------------------------------------------------


class NotConverged(Exception):
    """A solver's error that carries its residual."""

    def __init__(self, message, residual=None):
        super().__init__(message, residual)
        self.residual = residual


class Solver(jd.Primitive):
    """Writes x * 2 into out, then raises with the output attached as `how` says."""

    def __init__(self, how):
        self.how = how

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x, *, out):
        np.multiply(x, 2, out=out)
        if self.how == "arg":
            raise NotConverged("stalled", out)
        if self.how == "nested":
            raise NotConverged("stalled", [{"r": out[1:]}])
        if self.how == "attribute":
            error = NotConverged("stalled")
            error.history = (out,)
            raise error
        if self.how == "opaque":
            raise NotConverged("stalled", Holder(out))


class Holder:
    def __init__(self, value):
        self.value = value


@pytest.mark.parametrize("size", [5, 2**19])  # 4 MB: a dangling view of it used to crash
def test_exception_carrying_its_output_gets_a_copy(size):
    x = jnp.arange(float(size))
    with pytest.raises(NotConverged, match="stalled") as info:
        Solver("arg")(x)
    residual = info.value.residual
    assert info.value.args[1] is residual
    assert residual.flags.owndata
    expected = 2 * np.arange(float(size))
    np.testing.assert_array_equal(residual, expected)
    for _ in range(3):  # XLA reuses the freed memory: the copy must not change
        Boom(False)(jnp.full(size, 7.0))
    np.testing.assert_array_equal(residual, expected)


@pytest.mark.parametrize("how", ["nested", "attribute"])
def test_exception_carrying_views_in_containers_gets_copies(how):
    with pytest.raises(NotConverged) as info:
        Solver(how)(jnp.arange(4.0))
    if how == "nested":
        carried = info.value.args[1][0]["r"]
        np.testing.assert_array_equal(carried, [2.0, 4.0, 6.0])
    else:
        carried = info.value.history[0]
        np.testing.assert_array_equal(carried, [0.0, 2.0, 4.0, 6.0])
    assert carried.base is None or carried.base.flags.owndata


def test_exception_carrying_a_view_out_of_reach_becomes_escape_error():
    with pytest.raises(jd.BufferEscapeError, match=r"Solver\.apply \(@forward\) kept a "
                                                   r"reference to output.*NotConverged: "):
        Solver("opaque")(jnp.arange(4.0))
    np.testing.assert_array_equal(Solver(None)(jnp.arange(4.0)), 2 * np.arange(4.0))


def test_exception_carrying_a_view_under_jit():
    with pytest.raises(JaxRuntimeError, match=r"NotConverged: \('stalled'"):
        jax.block_until_ready(jax.jit(Solver("arg"))(jnp.arange(4.0)))


class ReturnsInstead(jd.Primitive):
    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x, *, out):
        return 2 * x  # forgets to fill out


RETURNED = r"ReturnsInstead\.apply \(@forward\) takes `out`.*must fill `out` and return None"


@pytest.mark.parametrize("how", ["eager", "jit", "vmap"])
def test_zero_copy_rule_returning_a_value_is_an_error(how):
    x = jnp.arange(3.0)
    f = {"eager": ReturnsInstead(), "jit": jax.jit(ReturnsInstead()),
         "vmap": jax.vmap(ReturnsInstead())}[how]
    error = JaxRuntimeError if how == "jit" else jd.RuleError
    with pytest.raises(error, match=RETURNED):
        jax.block_until_ready(f(x if how != "vmap" else jnp.ones((2, 3))))


class Outer(jd.Primitive):
    """Calls another op that fails, and reports the failure its own way."""

    def __init__(self, how):
        self.how = how

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x):
        try:
            Boom(True)(np.array(x))
        except KeyError as error:
            if self.how == "from":
                raise RuntimeError("outer failed") from error
            raise RuntimeError(f"outer failed after {error!r}") from None
        return x


def test_outer_rule_error_wins_over_the_inner_one():
    with pytest.raises(RuntimeError, match="outer failed after KeyError") as info:
        Outer("text")(jnp.ones(2))
    assert type(info.value) is RuntimeError


def test_raise_from_keeps_the_cause():
    with pytest.raises(RuntimeError, match="outer failed") as info:
        Outer("from")(jnp.ones(2))
    assert isinstance(info.value.__cause__, KeyError)
    assert info.value.__cause__.args == ("boom",)


class Says(jd.Primitive):
    def __init__(self, error):
        self.error = error

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x):
        raise self.error


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no str for you")


def test_message_that_looks_like_an_error_mark_is_delivered_as_itself():
    with pytest.raises(ValueError, match=r"see \[jaxdecl error #1\]"):
        Says(ValueError("see [jaxdecl error #1] and [jaxdecl error #2]"))(jnp.ones(2))


def test_exception_whose_str_raises_is_delivered_as_itself():
    with pytest.raises(Unprintable):
        Says(Unprintable())(jnp.ones(2))
    with pytest.raises(JaxRuntimeError, match="Unprintable"):
        jax.block_until_ready(jax.jit(Says(Unprintable()))(jnp.ones(2)))


# ---------------------------------------------------------------------------
# No false escapes
# ---------------------------------------------------------------------------


class Constant(jd.Primitive):
    """Zero inputs: the rule's arguments tuple is Python's shared empty tuple."""

    @jd.abstract
    def shapes(self):
        return jax.ShapeDtypeStruct((3,), np.float32)

    @jd.forward
    def apply(self, *, out):
        out[...] = np.arange(3)


def test_zero_input_rule_is_not_an_escape():
    np.testing.assert_array_equal(Constant()(), np.arange(3.0))
    np.testing.assert_array_equal(jax.jit(Constant())(), np.arange(3.0))


def test_rule_can_be_debugged_with_pdb():
    import io
    import pdb

    class Debugged(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            return _same(x)

        @jd.forward
        def apply(self, x, *, out):
            # What `breakpoint()` followed by `p x` and `c` does at a terminal.
            pdb.Pdb(stdin=io.StringIO("p x\nc\n"), stdout=io.StringIO()).set_trace()
            np.negative(x, out=out)

    np.testing.assert_array_equal(Debugged()(jnp.arange(3.0)), -np.arange(3.0))
    np.testing.assert_array_equal(jax.jit(Debugged())(jnp.arange(3.0)), -np.arange(3.0))
    # A looped batch checks for escapes after every row: each row stops once.
    rows = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(jax.vmap(Debugged())(rows), -np.asarray(rows))


_BREAKPOINT = """
import jax, jax.numpy as jnp, numpy as np
import jaxdecl as jd

class Debugged(jd.Primitive):
    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, *, out):
        breakpoint()
        np.negative(x, out=out)

print("eager", Debugged()(jnp.arange(3.0)).tolist())
print("jit", jax.jit(Debugged())(jnp.arange(3.0)).tolist())
print("vmap", jax.vmap(Debugged())(jnp.ones((2, 3))).tolist())
"""


def test_rule_can_be_debugged_with_breakpoint_at_a_prompt(tmp_path):
    # A user's session: breakpoint() in a rule, `p x` and `c` typed at pdb's prompt.
    import subprocess
    import sys

    from conftest import subprocess_env

    env = subprocess_env()
    env.pop("PYTHONBREAKPOINT", None)
    # (run outside the checkout, as a user's script: `import jaxdecl` is the installed one)
    done = subprocess.run([sys.executable, "-c", _BREAKPOINT], input="p x\nc\n" * 4,
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    # `p x` printed the rule's input at each stop: twice whole, once per row of the batch.
    assert done.stdout.count("(Pdb) array([0., 1., 2.], dtype=float32)") == 2, done.stdout
    assert done.stdout.count("(Pdb) array([1., 1., 1.], dtype=float32)") == 2, done.stdout
    assert "eager [-0.0, -1.0, -2.0]" in done.stdout
    assert "jit [-0.0, -1.0, -2.0]" in done.stdout
    assert "vmap [[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]]" in done.stdout


def test_message_with_lone_surrogates_is_delivered():
    error = ValueError("bad name \udcff")  # what os.fsdecode makes of undecodable bytes
    with pytest.raises(ValueError) as info:
        Says(error)(jnp.ones(2))
    assert info.value is error
    with pytest.raises(JaxRuntimeError, match=r"bad name \\udcff"):
        jax.block_until_ready(jax.jit(Says(ValueError("bad name \udcff")))(jnp.ones(2)))


def test_eager_calls_under_disable_jit():
    class Cube(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            return _same(x)

        @jd.forward
        def apply(self, x):
            return x**3

        @jd.jvp
        def push(self, x, dx):
            return 3 * x**2 * dx

    x = jnp.arange(3.0)
    with jax.disable_jit():
        np.testing.assert_array_equal(Cube()(x), np.arange(3.0) ** 3)
        np.testing.assert_array_equal(jax.jit(Cube())(x), np.arange(3.0) ** 3)
        _, tangent = jax.jvp(Cube(), (x,), (jnp.ones(3),))
        np.testing.assert_array_equal(tangent, 3 * np.arange(3.0) ** 2)
        with pytest.raises(KeyError, match="boom"):
            Boom(True)(x)


# ---------------------------------------------------------------------------------------
# Writing into an input: inputs are read-only views, and the error says so
# ---------------------------------------------------------------------------------------


class WritesInput(jd.Primitive):
    """Adds one to its input in place (wrong), in the form `how` says."""

    def __init__(self, how):
        self.how = how

    @jd.abstract
    def shapes(self, x):
        return _same(x)

    @jd.forward
    def apply(self, x, *, out):
        if self.how == "ufunc":
            np.add(x, 1, out=x)  # NumPy: "output array is read-only"
        elif self.how == "setitem":
            x[0] = 1.0  # NumPy: "assignment destination is read-only"
        elif self.how == "in_place":
            x += 1
        out[...] = x

    @jd.vjp
    def pull(self, x, ct):
        ct *= 2  # a cotangent is an input of @vjp: read-only too
        return ct


INPUT_WRITES = {"ufunc": "output array is read-only",
                "setitem": "assignment destination is read-only",
                "in_place": "output array is read-only"}


@pytest.mark.parametrize("how", sorted(INPUT_WRITES))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_writing_into_an_input_says_it_is_an_input_and_how_to_copy(how, jit):
    expected = (rf"{INPUT_WRITES[how]}: the inputs of WritesInput\.apply \(@forward\) \(x\) are "
                r"read-only views of XLA's buffers.*Copy an input before changing it "
                r"\(`x = np\.array\(x\)`\), or write the result into `out`")
    if jit:
        with pytest.raises(JaxRuntimeError, match="ValueError: " + expected):
            jax.block_until_ready(jax.jit(WritesInput(how))(jnp.ones(3)))
    else:
        with pytest.raises(ValueError, match=expected):  # NumPy's type, kept
            WritesInput(how)(jnp.ones(3))


def test_writing_into_a_cotangent_names_the_rule_and_its_inputs():
    with pytest.raises(ValueError, match=r"the inputs of WritesInput\.pull \(@vjp\) \(x, "
                                         r"cotangent of output\) are read-only views.*compute a "
                                         r"new array and return it"):
        jax.grad(lambda v: WritesInput("none")(v).sum())(jnp.ones(3))


def test_other_value_errors_keep_their_message():
    error = ValueError("output array is read-only? no: a message of the rule's own")
    with pytest.raises(ValueError) as info:
        Says(error)(jnp.ones(2))
    assert info.value is error and str(error) == \
        "output array is read-only? no: a message of the rule's own"
