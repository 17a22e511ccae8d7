"""Sharding declarations (``sharding=``, ``replicate=``, ``reduce=``) and ops run per shard.

Declarations are checked in this process. Multi-device behaviour runs in
subprocesses with 4 host CPU devices (``helpers_sharding.py``): the compiled
HLO has no gather for independent factors, the rules' call records show
local blocks, values match the unsharded computation.
"""

import contextlib
import os
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_split, run_helper, run_two_processes

import jaxdecl as jd
from jaxdecl import _compat

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
    return run_helper([sys.executable, HELPER, name], timeout=300)


@needs_split
@pytest.mark.parametrize("scenario", ["automatic", "explicit"])
def test_multi_device(scenario):
    checks = _scenario(scenario)
    failed = {name: value for name, value in checks.items() if value is not True}
    assert not failed, failed
    assert len(checks) > 10


@needs_split
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_partly_linear_op_runs_per_shard_on_two_devices(axis_type):
    """Split over its points (a sum over them): grad and jvp in the strengths run the
    forward and the transpose, in the points the jvp or the vjp asked for one cotangent,
    each on its device's block, with no gather."""
    checks = run_helper([sys.executable, HELPER, "partly_linear", axis_type], timeout=300,
                        JAXDECL_TEST_DEVICES="2")
    failed = {name: value for name, value in checks.items() if value is not True}
    assert not failed, failed
    # (on JAX < 0.9 each of the 5 cases over Explicit axes is refused, naming the version)
    refused = axis_type == "Explicit" and not _compat.EXPLICIT_REDUCTIONS
    assert len(checks) == (5 if refused else 20), sorted(checks)


def test_an_undeclared_op_types_its_result_like_its_operand_in_a_scan():
    """Over Explicit mesh axes an op without a declaration types a result like the operand
    of its shape (a split scan carry stays split, or JAX refuses the scan), eager and
    jitted, under jvp, grad and vmap, as its jax.numpy twin does; its rule still sees
    whole inputs."""
    checks = _scenario("undeclared_scan")
    failed = {name: value for name, value in checks.items() if value is not True}
    assert not failed, failed
    assert len(checks) == 3 * 7 * 3, sorted(checks)  # specs x runs x (value, type, rule)


@needs_split
def test_an_undeclared_result_is_laid_out_like_its_input_under_jit_on_auto_axes():
    """jit over Auto axes (8 devices, 1-D and 2-D meshes): an op without a declaration
    returns its result laid out like its input, as eagerly and over Explicit axes, so
    the declared op after it runs on each device's rows; only its input is gathered."""
    checks = run_helper([sys.executable, HELPER, "undeclared_auto"], JAXDECL_TEST_DEVICES="8")
    failed = {name: value for name, value in checks.items() if value is not True}
    assert not failed, failed
    assert len(checks) == 2 * (4 * 3 + 1)


@needs_split
def test_two_processes():
    """A 4-device mesh over 2 processes (jax.distributed, gloo): each runs its own shards."""
    outputs = run_two_processes([sys.executable, HELPER, "processes"],
                                JAXDECL_TEST_DEVICES="2")
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


def test_where_jax_cannot_split_the_op_gathers_with_one_warning(monkeypatch):
    """On a JAX without Shardy's replication and reduction factors (< 0.7), or with Shardy
    off, a declared op stays correct under jit, gathers, and says so once."""
    from jaxdecl import _compat

    monkeypatch.setattr(_compat, "SPLITS_PER_SHARD", False)
    op = _op("NeedsNewerJax", sharding="b n, k -> b n", reduce=("k",))()
    devices = jax.devices()[:2]
    mesh = jax.sharding.Mesh(np.array(devices), ("d",),
                             axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.device_put(jnp.arange(6.0).reshape(2, 3),
                       jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
    y = jnp.arange(4.0)
    with pytest.warns(RuntimeWarning, match=r"NeedsNewerJax .*needs JAX >= 0\.7 \(this is JAX"):
        text = jax.jit(op).lower(x, y).as_text()
    assert "CustomSPMDPartitioning" not in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per op: the second program says nothing
        out = jax.jit(lambda a, b: op(a, b) * 1.0)(x, y)
    np.testing.assert_allclose(out, np.arange(6.0).reshape(2, 3) * 6.0)  # x * sum(y)


def test_explicit_sums_name_the_jax_they_need(monkeypatch):
    from jaxdecl import _compat
    from jaxdecl._sharded import plan as _plan

    monkeypatch.setattr(_compat, "EXPLICIT_REDUCTIONS", False)
    summing = _plan.Plan({"k": ("d",)}, ((None, "d"),), ((None,),), (("d",),))
    with pytest.raises(_compat.ShardingTypeError, match=r"MatVec: .*needs JAX >= 0\.9 \(this is"):
        _plan.check_explicit_sums("MatVec", summing)
    _plan.check_explicit_sums("MatVec", _plan.Plan({}, ((None,),), ((None,),), ((),)))
    monkeypatch.setattr(_compat, "EXPLICIT_REDUCTIONS", True)
    _plan.check_explicit_sums("MatVec", summing)


class _Cube(jd.Primitive, sharding="n m -> n m"):
    """x**3 with NumPy rules; records the shapes its rules see."""

    seen: list = []

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        _Cube.seen.append(("forward", x.shape))
        return x ** 3

    @jd.jvp
    def push(self, x, dx):
        _Cube.seen.append(("jvp", x.shape))
        return 3 * x ** 2 * dx

    @jd.vjp
    def pull(self, x, ct):
        _Cube.seen.append(("vjp", x.shape))
        return 3 * x ** 2 * ct


@jd.primitive(sharding="n m -> n m")
class _TreeProduct:
    """a * b for a dict {"a", "b"}: a plain class declared by the decorator."""

    @jd.abstract
    def shapes(self, t):
        return jax.ShapeDtypeStruct(t["a"].shape, t["a"].dtype)

    @jd.forward
    def apply(self, t):
        _Cube.seen.append(("forward", t["a"].shape))
        return t["a"] * t["b"]


@pytest.mark.parametrize("how", ["forward", "grad", "jvp", "vjp", "pytree"])
def test_eager_calls_on_sharded_arrays_run_per_shard(how):
    """Outside jit, every rule of a declared op runs on each device's block (no gather)
    and the result keeps the sharding; the executables are shared across configurations."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",),
                             axis_types=(jax.sharding.AxisType.Auto,))
    rows = NamedSharding(mesh, P("d"))
    xn = np.linspace(0.5, 2.0, 24).reshape(4, 6)
    x = jax.device_put(jnp.asarray(xn), rows)
    op = _Cube()
    _Cube.seen.clear()
    if how == "forward":
        out, expected = op(x), xn ** 3
    elif how == "grad":
        out, expected = jax.grad(lambda v: op(v).sum())(x), 3 * xn ** 2
    elif how == "jvp":
        out, expected = jax.jvp(op, (x,), (x,))[1], 3 * xn ** 3
    elif how == "vjp":
        out, expected = jax.vjp(op, x)[1](x)[0], 3 * xn ** 3
    else:  # an op whose argument is a pytree of sharded leaves
        out, expected = _TreeProduct()({"a": x, "b": x}), xn * xn
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-12)
    assert out.sharding.spec == P("d"), out.sharding
    assert _Cube.seen and all(shape == (2, 6) for _, shape in _Cube.seen), _Cube.seen


class _Dot(jd.Primitive, sharding="n, n -> ", reduce=("n",)):
    """A dot product: one 0-d result, each device sums its slice, jaxdecl adds them up."""

    @jd.abstract
    def shapes(self, a, b):
        return jax.ShapeDtypeStruct((), a.dtype)

    @jd.forward
    def apply(self, a, b):
        _Cube.seen.append(("forward", a.shape))
        return np.dot(a, b)

    @jd.vjp
    def pull(self, a, b, ct):
        return ct * b, ct * a


@needs_split
def test_a_dot_product_declares_a_0d_result_and_sums_per_shard():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    assert jd.ShardingRule("n, n -> ", reduce=("n",)).results == ((),)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",),
                             axis_types=(jax.sharding.AxisType.Auto,))
    an, bn = np.linspace(-1.0, 2.0, 8), np.linspace(0.5, 3.0, 8)
    a, b = (jax.device_put(jnp.asarray(v), NamedSharding(mesh, P("d"))) for v in (an, bn))
    _Cube.seen.clear()
    np.testing.assert_allclose(float(_Dot()(a, b)), an @ bn, rtol=1e-12)
    f = jax.jit(_Dot())
    np.testing.assert_allclose(float(f(a, b)), an @ bn, rtol=1e-12)
    assert _Cube.seen and all(shape == (4,) for _, shape in _Cube.seen), _Cube.seen
    compiled = f.lower(a, b).compile().as_text()
    assert "all-gather" not in compiled and "all-reduce" in compiled
    grads = jax.jit(jax.grad(lambda u, v: _Dot()(u, v), argnums=(0, 1)))(a, b)
    np.testing.assert_allclose(np.asarray(grads[0]), bn, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(grads[1]), an, rtol=1e-12)
    jd.check(_Dot(), an, bn)  # the declaration too: halves summed equal the whole


class _PlainCube(jd.Primitive):
    """_Cube without a sharding declaration."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        _Cube.seen.append(("forward", x.shape))
        return x ** 3

    @jd.vjp
    def pull(self, x, ct):
        _Cube.seen.append(("vjp", x.shape))
        return 3 * x ** 2 * ct


@pytest.mark.parametrize("how", [
    pytest.param("jit", marks=needs_split), pytest.param("jit_grad", marks=needs_split),
    "eager", "grad"])
def test_an_undeclared_op_runs_once_not_once_per_device(how):
    """Without a declaration the op needs its inputs whole: they are gathered and the rule
    runs once (as jax.pure_callback does), not on every device."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",),
                             axis_types=(jax.sharding.AxisType.Auto,))
    xn = np.linspace(0.5, 2.0, 24).reshape(4, 6)
    x = jax.device_put(jnp.asarray(xn), NamedSharding(mesh, P("d")))
    op = _PlainCube()
    _Cube.seen.clear()
    if how == "jit":
        out, expected, rules = jax.jit(lambda v: op(v) + 1.0)(x), xn ** 3 + 1.0, ["forward"]
    elif how == "jit_grad":
        out = jax.jit(jax.grad(lambda v: op(v).sum()))(x)
        expected, rules = 3 * xn ** 2, ["vjp"]  # the unused forward is not run
    elif how == "eager":
        out, expected, rules = op(x), xn ** 3, ["forward"]
    else:
        out, expected, rules = jax.grad(lambda v: op(v).sum())(x), 3 * xn ** 2, \
            ["forward", "vjp"]
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-12)
    assert sorted(_Cube.seen) == sorted((rule, (4, 6)) for rule in rules), _Cube.seen


class _Lin(jd.Primitive, sharding="n m -> n m", linear=True):
    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        return 3.0 * x

    @jd.transpose
    def back(self, ct):
        return 3.0 * ct


class _MatVec(jd.Primitive, sharding="b k, k -> b", reduce=("k",)):
    @jd.abstract
    def shapes(self, a, x):
        return jax.ShapeDtypeStruct(a.shape[:1], a.dtype)

    @jd.forward
    def apply(self, a, x):
        return a @ x

    @jd.vjp
    def pull(self, a, x, ct):
        return np.outer(ct, x), a.T @ ct


@pytest.mark.skipif(not hasattr(jax, "set_mesh"), reason="jax.set_mesh needs JAX >= 0.7")
@pytest.mark.parametrize("how", ["grad", "vjp", "jvp", "vmap", "linear_transpose",
                                 "jit_grad_replicated_matrix", "jit_grad_undeclared"])
def test_explicit_axes_keep_the_sharding_in_every_result_type(how):
    """With Explicit mesh axes, derivatives (jitted or not) carry their primal's sharding
    in their types, as JAX's own ops do."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdecl import _compat

    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:2])
    xn = np.linspace(0.5, 2.0, 24).reshape(4, 6)
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.asarray(xn), NamedSharding(mesh, P("d")))
        if how == "grad":
            out, want = jax.grad(lambda v: _Cube()(v).sum())(x), 3 * xn ** 2
        elif how == "vjp":
            out, want = jax.vjp(_Cube(), x)[1](x)[0], 3 * xn ** 3
        elif how == "jvp":
            out, want = jax.jvp(_Cube(), (x,), (x,))[1], 3 * xn ** 3
        elif how == "vmap":  # a batch of two, each split by rows
            x = jax.device_put(jnp.stack([xn, 2 * xn]), NamedSharding(mesh, P(None, "d")))
            out, want = jax.vmap(_Cube())(x), np.stack([xn ** 3, 8 * xn ** 3])
        elif how == "linear_transpose":
            out, want = jax.linear_transpose(_Lin(), x)(x)[0], 3 * xn
        elif how == "jit_grad_undeclared":  # run on gathered inputs, typed as its primal
            out = jax.jit(jax.grad(lambda v: _PlainCube()(v).sum()))(x)
            want = 3 * xn ** 2
        else:
            if not _compat.EXPLICIT_REDUCTIONS:
                pytest.skip("a psum over Explicit axes needs JAX >= 0.9")
            a = jax.device_put(jnp.asarray(xn[:, :4].T @ xn[:, :4]), NamedSharding(mesh, P()))
            v = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("d")))
            ga, gv = jax.jit(jax.grad(lambda a, v: _MatVec()(a, v).sum(), argnums=(0, 1)))(a, v)
            assert jax.typeof(ga).sharding.spec == P(None, None), jax.typeof(ga)
            assert jax.typeof(gv).sharding.spec == P("d"), jax.typeof(gv)
            np.testing.assert_allclose(np.asarray(ga), np.outer(np.ones(4), np.arange(4.0)))
            np.testing.assert_allclose(np.asarray(gv), np.asarray(a).T @ np.ones(4))
            return
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-12)
    assert "d" in tuple(jax.typeof(out).sharding.spec), jax.typeof(out)


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "undeclared"])
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_shard_map_over_some_mesh_axes_differentiates(axis_type, declared):
    """shard_map manual over "x" only, on an x-by-y mesh: the op's results vary over "x"
    as its operands do, so grad (jitted or not) gets the cotangent types it expects."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdecl import _compat

    if _compat.JAX_VERSION < (0, 7):
        pytest.skip("JAX < 0.7 has no eager shard_map over some axes, nor jax.set_mesh")
    kind = getattr(jax.sharding.AxisType, axis_type)
    mesh = jax.make_mesh((2, 1), ("x", "y"), axis_types=(kind, kind), devices=jax.devices()[:2])
    cube = _Cube if declared else _PlainCube
    f = jax.shard_map(lambda v: cube()(v), mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                      axis_names={"x"})
    xn = np.linspace(0.5, 2.0, 24).reshape(4, 6)
    context = jax.set_mesh(mesh) if axis_type == "Explicit" else contextlib.nullcontext()
    with context:
        x = jax.device_put(jnp.asarray(xn), NamedSharding(mesh, P("x")))
        np.testing.assert_allclose(np.asarray(f(x)), xn ** 3, rtol=1e-12)
        for grad in (jax.grad(lambda v: f(v).sum()), jax.jit(jax.grad(lambda v: f(v).sum()))):
            np.testing.assert_allclose(np.asarray(grad(x)), 3 * xn ** 2, rtol=1e-12)


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


@needs_split
def test_gather_forced_by_replicate_warns_once_naming_op_input_and_factor():
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


@pytest.mark.skipif(not hasattr(jax, "set_mesh"), reason="jax.set_mesh needs JAX >= 0.7")
def test_explicit_axes_lower_without_a_partitioner_callback():
    """Under Explicit axes the types fix the plan while lowering: a shard_map of the rule,
    no custom_partitioning (whose per-call callback dominates compile time), no gather."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:2])
    xn = np.linspace(0.5, 2.0, 24).reshape(4, 6)
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.asarray(xn), NamedSharding(mesh, P("d")))
        f = jax.jit(lambda v: _Cube()(_Cube()(v)))
        lowered = f.lower(x)
        assert "CustomSPMDPartitioning" not in lowered.as_text()
        assert "all-gather" not in lowered.compile().as_text()
        _Cube.seen.clear()
        np.testing.assert_allclose(np.asarray(f(x)), xn ** 9, rtol=1e-12)
        assert _Cube.seen and all(shape == (2, 6) for _, shape in _Cube.seen), _Cube.seen


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "undeclared"])
def test_jit_of_vmap_over_a_sharded_batch(declared):
    """The batch dim vmap adds is split over the devices: the op's result meets other
    values (a sum) without losing the mesh, declared or not."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",),
                             axis_types=(jax.sharding.AxisType.Auto,))
    xn = np.linspace(0.5, 2.0, 48).reshape(2, 4, 6)
    x = jax.device_put(jnp.asarray(xn), NamedSharding(mesh, P("d")))
    cube = _Cube() if declared else _PlainCube()
    out = jax.jit(jax.vmap(lambda v: cube(v) + v))(x)
    np.testing.assert_allclose(np.asarray(out), xn ** 3 + xn, rtol=1e-12)


# ---------------------------------------------------------------------------------------
# Elementwise declarations: one call that XLA splits itself, no partition callback
# ---------------------------------------------------------------------------------------

def _factors(operands, results, replicate=(), sizes=None):
    from jaxdecl._spec.factors import RuleFactors

    names = {f for t in (*operands, *results) for f in t}
    return RuleFactors(operands=operands, results=results, replicate=frozenset(replicate),
                       sizes=sizes or dict.fromkeys(names, 8), inputs=(), batch=())


@pytest.mark.parametrize("factors, looped, rank", [
    (_factors((("b", "n"),), (("b", "n"),)), False, 2),
    (_factors((("b", "n"), ("b", "n")), (("b", "n"),)), False, 2),
    (_factors((("#0", "b"),), (("#0", "b"),)), False, 2),  # a vmap dim in front
    (_factors((("#0", "b"),), (("#0", "b"),)), True, 0),  # batch="loop": whole batch shape
    (_factors((("b", "n"),), (("b", "n"),), replicate=("n",)), False, 0),
    (_factors((("b", "k"), ("k",)), (("b",),)), False, 0),  # reduce
    (_factors((("b", "n"), ("b",)), (("b", "n"),)), False, 0),  # an input without n
    (_factors((("b", "n"),), (("n", "b"),)), False, 0),  # transposed
    (_factors((("n", "n"),), (("n", "n"),)), False, 0),  # a repeated factor
    (_factors((("b", "n"),), (("b", "n"),), sizes={"b": 6, "n": 8}), False, 0),  # uneven
    (_factors(((),), ((),)), False, 0),  # 0-d
])
def test_split_rank_takes_only_elementwise_equations(factors, looped, rank):
    from jaxdecl._sharded import shardy as _shardy

    assert _shardy.split_rank(factors, 4, looped) == rank


class _Twice(jd.Primitive, sharding="b n -> b n"):
    """2x, zero-copy into `out`, recording the shapes it is given."""

    seen: list = []

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, *, out):
        _Twice.seen.append(x.shape)
        np.multiply(x, 2, out=out)

    @jd.vjp
    def pull(self, x, ct):
        _Twice.seen.append(ct.shape)
        return 2 * ct


@needs_split
@pytest.mark.parametrize("spec, block", [(("d", None), (2, 6)), ((None, "d"), (4, 3))])
def test_elementwise_ops_are_split_by_xla_without_a_callback(spec, block):
    """Either dim split: each device runs the rule on its block, the compiled program has no
    collective and no partition callback, and its result keeps the sharding."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh()
    xn = np.linspace(0.5, 2.0, 24).reshape(4, 6)
    x = jax.device_put(jnp.asarray(xn), NamedSharding(mesh, P(*spec)))
    op = _Twice()
    for f, want in ((jax.jit(lambda v: op(v) + v), 3 * xn),
                    (jax.jit(jax.grad(lambda v: (op(v) * v).sum())), 4 * xn)):
        lowered = f.lower(x)
        assert "jaxdecl.lowering" not in lowered.as_text()  # cacheable: no per-lowering mark
        text = lowered.compile().as_text()
        assert 'custom_call_target="jaxdecl_dispatch_split"' in text
        assert 'custom_call_target="jaxdecl_dispatch"' not in text  # no callback's program
        assert "all-gather" not in text and "all-to-all" not in text
        _Twice.seen.clear()
        out = f(x)
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-12)
        assert out.sharding.spec == P(*spec), out.sharding
        assert _Twice.seen and set(_Twice.seen) == {block}, _Twice.seen


@needs_split
def test_a_split_call_reuses_views_of_the_right_shape_across_runs():
    """The trailing dim XLA's partitioner needs never reaches the rule, run after run."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    x = jax.device_put(jnp.arange(8.0).reshape(4, 2), NamedSharding(_mesh(), P("d")))
    f = jax.jit(_Twice())
    for k in range(3):
        _Twice.seen.clear()
        np.testing.assert_array_equal(np.asarray(f(x + k)), 2 * (np.arange(8.0).reshape(4, 2) + k))
        assert _Twice.seen == [(2, 2), (2, 2)], _Twice.seen


class _TwiceVectorized(_Twice, sharding="b n -> b n", batch="vectorized"):
    """_Twice seeing the whole vmap batch in one call."""


@needs_split
def test_a_vectorized_op_under_vmap_is_split_by_xla_along_the_batch():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    xn = np.linspace(0.5, 2.0, 48).reshape(2, 4, 6)
    x = jax.device_put(jnp.asarray(xn), NamedSharding(_mesh(), P("d")))
    f = jax.jit(jax.vmap(lambda v: _TwiceVectorized()(v) + v))
    text = f.lower(x).compile().as_text()
    assert 'custom_call_target="jaxdecl_dispatch_split"' in text and "all-gather" not in text
    _Twice.seen.clear()
    np.testing.assert_allclose(np.asarray(f(x)), 3 * xn, rtol=1e-12)
    assert _Twice.seen == [(1, 4, 6), (1, 4, 6)], _Twice.seen


class _Square(jd.Primitive, sharding="n m -> n m"):
    """x**2 with a NumPy @jvp; its own class, so no other test has run it per shard yet."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        return x ** 2

    @jd.jvp
    def push(self, x, dx):
        return 2 * x * dx


@jd.primitive(sharding="n m -> n m")
class _TreeSquare:
    """{"y": a * a} for a dict {"a"}: a pytree result."""

    @jd.abstract
    def shapes(self, t):
        return {"y": jax.ShapeDtypeStruct(t["a"].shape, t["a"].dtype)}

    @jd.forward
    def apply(self, t):
        return {"y": t["a"] ** 2}

    @jd.jvp
    def push(self, t, dt):
        return {"y": 2 * t["a"] * dt["a"]}


@pytest.mark.parametrize("order", ["call_first", "jvp_first"])
@pytest.mark.parametrize("tree", [False, True], ids=["array", "pytree"])
def test_eager_call_and_eager_jvp_of_one_sharded_signature(order, tree):
    """The op's own eager call (its result as @abstract declares it) and an un-jitted
    jvp's forward (a flat list of results) run the same rule on the same shards: each
    gets its own result structure, whichever ran first."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",),
                             axis_types=(jax.sharding.AxisType.Auto,))
    xn = np.linspace(0.5, 2.0, 24).reshape(4, 6)
    x = jax.device_put(jnp.asarray(xn), NamedSharding(mesh, P("d")))
    op, arg = (_TreeSquare(), {"a": x}) if tree else (_Square(), x)
    leaf = (lambda out: out["y"]) if tree else (lambda out: out)

    def call():
        out = op(arg)
        assert isinstance(out, dict) if tree else isinstance(out, jax.Array), type(out)
        np.testing.assert_allclose(np.asarray(leaf(out)), xn ** 2, rtol=1e-12)

    def jvp():
        out, tangent = jax.jvp(op, (arg,), (arg,))
        np.testing.assert_allclose(np.asarray(leaf(out)), xn ** 2, rtol=1e-12)
        np.testing.assert_allclose(np.asarray(leaf(tangent)), 2 * xn ** 2, rtol=1e-12)

    for step in ((call, jvp) if order == "call_first" else (jvp, call)):
        step()


@pytest.mark.skipif(not hasattr(jax, "set_mesh"), reason="jax.set_mesh needs JAX >= 0.7")
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_an_undeclared_op_outside_jit_inside_set_mesh_runs_once(axis_type):
    """Outside jit, inside jax.set_mesh: the rule runs once on the whole arrays, and its
    results stay on the mesh, where they mix with the mesh's arrays; a gradient has its
    primal's sharding."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    kind = getattr(jax.sharding.AxisType, axis_type)
    mesh = jax.make_mesh((2,), ("d",), axis_types=(kind,), devices=jax.devices()[:2])
    xn = np.linspace(0.5, 2.0, 24).reshape(4, 6)
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.asarray(xn), NamedSharding(mesh, P("d")))
        _Cube.seen.clear()
        y = _PlainCube()(x)
        assert _Cube.seen == [("forward", (4, 6))], _Cube.seen
        np.testing.assert_allclose(np.asarray(y + x), xn ** 3 + xn, rtol=1e-12)
        assert y.sharding.mesh == mesh
        g = jax.grad(lambda v: _PlainCube()(v).sum())(x)
        np.testing.assert_allclose(np.asarray(g), 3 * xn ** 2, rtol=1e-12)
        # Sharded like its primal, as the gradient of JAX's own ops is.
        twin = jax.grad(lambda v: jnp.sum(v ** 3))(x)
        assert g.sharding.is_equivalent_to(NamedSharding(mesh, P("d")), 2), g.sharding
        assert g.sharding.is_equivalent_to(twin.sharding, 2), (g.sharding, twin.sharding)
