"""Sharding declarations (``sharding=``, ``replicate=``, ``reduce=``) and ops run per shard.

Declarations are checked in this process. Multi-device behaviour runs in
subprocesses with 4 host CPU devices (``helpers_sharding.py``): the compiled
HLO has no gather for independent factors, the rules' call records show
local blocks, values match the unsharded computation.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import subprocess_env

import jaxdecl as jd

HELPER = os.path.join(os.path.dirname(__file__), "helpers_sharding.py")


def _op(name="Op", body=None, **options):
    """A class with an elementwise @abstract/@forward and the given options."""

    def shapes(self, x, y):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    def apply(self, x, y):
        return x * np.sum(y)

    namespace = {"shapes": jd.abstract(shapes), "apply": jd.forward(apply)}
    namespace.update(body or {})
    return type(name, (jd.Primitive,), namespace, **options)


def test_declaration_is_stored():
    op = _op(sharding="b n, k -> b n", replicate=("n", "k"))
    assert op.__jaxdecl_spec__.sharding == jd.ShardingRule("b n, k -> b n", replicate=("n", "k"))


@pytest.mark.parametrize("options, words", [
    (dict(sharding="b n -> b n"), ["describes 1 input", "takes 2"]),
    (dict(sharding="b n, k b n"), ["'->'"]),
    (dict(sharding="b 1n, k -> b 1n"), ["'1n'", "not a factor name"]),
    (dict(sharding="b b, k -> b b"), ["two dims"]),
    (dict(sharding="b n, k -> b n", replicate=("z",)), ["replicate=", "'z'"]),
    (dict(sharding="b n, k -> b n"), ["result 0", "'k'", "reduce="]),
    (dict(sharding="b n, k -> b n k", reduce=("k",)), ["reduce=", "'k'", "result dim"]),
    (dict(sharding="b n, k -> b n", reduce=("k",), replicate=("k",)), ["both"]),
    (dict(sharding="b n, k -> b n z", reduce=("k",)), ["'z'", "results only"]),
    (dict(replicate=("n",)), ["replicate=", "sharding="]),
    (dict(sharding=3), ["string"]),
])
def test_declaration_errors_name_the_class(options, words):
    with pytest.raises(jd.DeclarationError) as info:
        _op("Bad", **options)
    message = str(info.value)
    assert "Bad" in message
    for word in words:
        assert word in message, message


def test_options_and_method_are_exclusive():
    def split(self, x, y):
        return jd.ShardingRule("n, k -> n", reduce=("k",))

    with pytest.raises(jd.DeclarationError, match="not both"):
        _op("Both", {"split": jd.sharding(split)}, sharding="n, k -> n", reduce=("k",))

    def wrong_inputs(self, x):
        return jd.ShardingRule("n -> n")

    with pytest.raises(jd.DeclarationError, match="wrong_inputs.*must match"):
        _op("Inputs", {"wrong_inputs": jd.sharding(wrong_inputs)})


def test_trace_time_errors_name_class_and_operand():
    op = _op("Rank", sharding="b n, k -> b n", reduce=("k",))
    with pytest.raises(ValueError, match=r"Rank.*input 'x' 2 dim\(s\).*shape \(3,\)"):
        jax.jit(op())(jnp.ones(3), jnp.ones(2))
    with pytest.raises(ValueError, match=r"Sizes.*factor 'b' has size 3.*4 in input 'y'"):
        op2 = _op("Sizes", sharding="b n, b -> b n", reduce=())
        jax.jit(op2())(jnp.ones((3, 2)), jnp.ones(4))

    def split(self, x, y):
        return "n, k -> n"

    op3 = _op("Method", {"split": jd.sharding(split)})
    with pytest.raises(jd.RuleError, match=r"Method.split \(@sharding\) must return"):
        jax.jit(op3())(jnp.ones(3), jnp.ones(2))


def test_method_declaration_sees_shapes():
    seen = []

    def split(self, x, y):
        seen.append((x.shape, y.shape))
        dims = " ".join(f"d{i}" for i in range(x.ndim))
        return jd.ShardingRule(f"{dims}, k -> {dims}", reduce=("k",))

    op = _op("Shaped", {"split": jd.sharding(split)})
    out = jax.jit(op())(jnp.ones((2, 3)), jnp.ones(4))
    np.testing.assert_allclose(out, 4 * np.ones((2, 3)))
    assert seen == [((2, 3), (4,))]


def test_single_device_lowering_is_unchanged():
    declared = _op("Declared", sharding="b n, k -> b n", reduce=("k",))()
    plain = _op("Plain")()
    args = (jnp.ones((2, 3)), jnp.ones(4))
    texts = [jax.jit(op).lower(*args).as_text() for op in (declared, plain)]
    for text in texts:
        assert "CustomSPMDPartitioning" not in text
        assert text.count("stablehlo.custom_call") == 1
    # Same program but for the kernel's fingerprint (the class differs).
    strip = [t.split("fingerprint")[0] for t in texts]
    assert strip[0] == strip[1]


def _scenario(name: str) -> dict:
    completed = subprocess.run(
        [sys.executable, HELPER, name], capture_output=True, text=True, timeout=300,
        env=subprocess_env())
    lines = [line for line in completed.stdout.splitlines() if line.startswith("{")]
    assert completed.returncode == 0 and lines, completed.stderr[-3000:]
    return json.loads(lines[-1])["checks"]


@pytest.mark.parametrize("scenario", ["automatic", "explicit"])
def test_multi_device(scenario):
    checks = _scenario(scenario)
    failed = {name: value for name, value in checks.items() if value is not True}
    assert not failed, failed
    assert len(checks) > 10


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_processes():
    """A 4-device mesh over 2 processes (jax.distributed, gloo): each runs its own shards."""
    port = str(_free_port())
    env = subprocess_env(JAXDECL_TEST_DEVICES="2")
    children = [subprocess.Popen([sys.executable, HELPER, "processes", port, str(i)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=env) for i in range(2)]
    outputs = []
    try:
        for child in children:
            stdout, stderr = child.communicate(timeout=300)
            lines = [line for line in stdout.splitlines() if line.startswith("{")]
            assert child.returncode == 0 and lines, stderr[-3000:]
            outputs.append(json.loads(lines[-1])["checks"])
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    for process, checks in enumerate(outputs):
        failed = {name: value for name, value in checks.items() if value is not True}
        assert not failed, (process, failed)


# ---------------------------------------------------------------------------------------
# jd.check verifies the declaration on one device (slices along each factor)
# ---------------------------------------------------------------------------------------

class _CumSum(jd.Primitive, sharding="b n -> b n"):
    """Declared independent along n, which a cumulative sum is not."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        return np.cumsum(x, axis=1)


class _CumSumDeclared(_CumSum, sharding="b n -> b n", replicate=("n",)):
    pass


class _RowMax(jd.Primitive, sharding="b k -> b", reduce=("k",)):
    """A maximum declared as a sum over k: wrong."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape[:1], x.dtype)

    @jd.forward
    def apply(self, x):
        return np.max(x, axis=1)


class _MatVecPytree(jd.Primitive, sharding="b k, k -> b", reduce=("k",)):
    """A matvec whose vector arrives in a dict: the declaration covers its leaves."""

    @jd.abstract
    def shapes(self, a, v):
        return {"y": jax.ShapeDtypeStruct(a.shape[:1], a.dtype)}

    @jd.forward
    def apply(self, a, v):
        return {"y": a @ v["x"] + a @ v["z"]}


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex128])
def test_check_accepts_right_declarations(dtype):
    x = np.arange(12.0).reshape(3, 4)
    x = (x + 1j * x[::-1] if dtype == np.complex128 else x).astype(dtype)
    jd.check(_CumSumDeclared(), x)
    jd.check(_MatVecPytree(), x, {"x": np.ones(4, dtype), "z": np.arange(4).astype(dtype)})


@pytest.mark.parametrize("op, factor, kind", [
    (_CumSum(), "n", "independent"),
    (_RowMax(), "k", "reduce="),
])
def test_check_rejects_a_wrong_declaration_naming_class_and_factor(op, factor, kind):
    x = np.arange(1.0, 13.0).reshape(3, 4)
    name = type(op).__name__
    with pytest.raises(AssertionError, match=rf"{name}'s sharding declaration is wrong: factor "
                                             rf"'{factor}' is declared {kind}"):
        jd.check(op, x)


# ---------------------------------------------------------------------------------------
# Subclasses redeclaring sharding=, and gathers forced by replicate= (2 host devices)
# ---------------------------------------------------------------------------------------

class _Scale(jd.Primitive, sharding="b n -> b n", replicate=("n",)):
    """Elementwise, but declared (over-cautiously) to need each row whole."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        return 2 * x


class _ScaleSplit(_Scale, sharding="b n -> b n"):
    """A new declaration: the parent's replicate= does not carry over."""


class _ScaleMethod(_Scale):
    """A @jd.sharding method replaces the parent's class options too."""

    @jd.sharding
    def split(self, x):
        return jd.ShardingRule("b n -> b n")


class _ScaleMore(_Scale, replicate=("b", "n")):
    """Options given without sharding= update the inherited declaration."""


def test_redeclared_sharding_does_not_inherit_replicate_or_reduce():
    assert _Scale.__jaxdecl_spec__.sharding.replicate == ("n",)
    assert _ScaleSplit.__jaxdecl_spec__.sharding == jd.ShardingRule("b n -> b n")
    assert _ScaleMethod.__jaxdecl_spec__.sharding is None
    assert "sharding" in _ScaleMethod.__jaxdecl_spec__.rules
    assert _ScaleMore.__jaxdecl_spec__.sharding == jd.ShardingRule("b n -> b n",
                                                                   replicate=("b", "n"))
    matvec = _op("MatVec", sharding="b k, k -> b", reduce=("k",))
    elementwise = type("Elementwise", (matvec,), {}, sharding="b n, k -> b n",
                       replicate=("k",))
    assert elementwise.__jaxdecl_spec__.sharding.reduce == ()
    x = np.arange(12.0).reshape(3, 4)
    for op in (_ScaleSplit(), _ScaleMethod()):
        jd.check(op, x)  # independent along both factors: right, and verified
        np.testing.assert_array_equal(op(x), 2 * x)


def _mesh():
    from jax.sharding import AxisType

    return jax.make_mesh((2,), ("d",), axis_types=(AxisType.Auto,))


def test_gather_forced_by_replicate_warns_once_naming_op_input_and_factor():
    import warnings

    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh()
    x = np.arange(16.0).reshape(2, 8)
    split_n = jax.device_put(x, NamedSharding(mesh, P(None, "d")))  # along the replicate factor
    with pytest.warns(UserWarning, match=r"_Scale: input 'x' is split along dim 1 \(factor "
                                         r"'n'\) over mesh axes \('d',\), but the op declares "
                                         r"'n' in replicate=.*gathers.*jd.check") as record:
        y = jax.jit(lambda v: _Scale()(v))(split_n)
    assert len([w for w in record if "_Scale" in str(w.message)]) == 1
    np.testing.assert_array_equal(y, 2 * x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same op and signature: no second warning
        np.testing.assert_array_equal(jax.jit(lambda v: _Scale()(v) + 0)(split_n), 2 * x)
        np.testing.assert_array_equal(_Scale()(split_n), 2 * x)  # eager, per shard
        # Split along an independent factor: nothing is gathered, nothing said.
        split_b = jax.device_put(x, NamedSharding(mesh, P("d", None)))
        np.testing.assert_array_equal(jax.jit(lambda v: _Scale()(v))(split_b), 2 * x)
    # Another signature warns again, as does the eager path's first call.
    with pytest.warns(UserWarning, match=r"_ScaleMore: input 'x' is split along dim 1"):
        _ScaleMore()(jax.device_put(np.ones((2, 4)), NamedSharding(mesh, P(None, "d"))))
