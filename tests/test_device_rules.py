"""Device rules (platform="gpu"): declared and checked at class creation, carried by the same
kernel as the host rule, and run by the CUDA handler on device arrays with XLA's stream.

Without a GPU the CUDA handler runs on the fake runtime, whose "device" is host memory
(tests/ops_fake_device.py reads device arrays through it); the CPU keeps the host rule.
"""

import gc
import textwrap

import jax
import numpy as np
import ops_fake_device as fake_ops
import pytest
from helpers_gpu import calls, describe, fake_cuda, kernel_for, kernel_of
from ops import compile_c
from ops_fake_device import HostArray, host

import jaxdecl as jd
from jaxdecl._host import _dispatch

STREAM = 0x5EED


def run(kernel, inputs, outputs, site=None):
    site = site or _dispatch.StagedSite()
    return site.run(kernel.slot, [describe(a) for a in inputs], [describe(a) for a in outputs],
                    ordinal=0, stream=STREAM)


def same(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


# --- declared -------------------------------------------------------------------------------


def declare(**methods):
    body = {"shapes": jd.abstract(lambda self, x: same(x)),
            "apply": jd.forward(lambda self, x: 2 * x)}
    body.update(methods)
    return type("Op", (jd.Primitive,), body)


def test_a_device_rule_beside_its_host_rule():
    def apply_gpu(self, x, *, out, stream):
        pass

    op = declare(apply_gpu=jd.forward(platform="gpu")(apply_gpu))
    spec = op.__jaxdecl_spec__
    assert spec.rules["forward"].platform is None
    assert spec.device_rules["forward"].name == "apply_gpu"
    assert spec.device_rules["forward"].platform == "gpu"


@pytest.mark.parametrize(("decorator", "message"), [
    (lambda: jd.abstract(platform="gpu"), "@jd.abstract takes no platform= option: it runs "
                                          "when the op is traced"),
    (lambda: jd.batch(platform="gpu"), "@jd.batch takes no platform= option"),
    (lambda: jd.forward(platform="tpu"), r"@jd.forward\(platform='tpu'\): the platform of a "
                                         r"device rule is 'gpu'"),
    (lambda: jd.vjp(traceable=True, platform="gpu"), r"a traceable rule is JAX code, which runs "
                                                     r"on every platform already"),
])
def test_decorators_refuse_what_has_no_device_form(decorator, message):
    with pytest.raises(TypeError, match=message):
        decorator()


def _rule(signature: str):
    namespace = {}
    exec(f"def rule{signature}:\n    pass", namespace)  # noqa: S102 - a signature under test
    return namespace["rule"]


@pytest.mark.parametrize(("methods", "message"), [
    ({"pull_gpu": jd.vjp(platform="gpu")(_rule("(self, x, ct, *, stream)"))},
     r"Op.rule \(@vjp\(platform='gpu'\)\) has no host rule: declare @jd.vjp too"),
    ({"apply_gpu": jd.forward(platform="gpu")(_rule("(self, x, *, out)"))},
     r"must take XLA's CUDA stream as the keyword-only parameter `stream`"),
    ({"apply_gpu": jd.forward(platform="gpu")(_rule("(self, x, stream, *, out)"))},
     r"`stream` is a positional parameter; jaxdecl passes XLA's stream by keyword"),
    ({"apply_gpu": jd.forward(platform="gpu")(_rule("(self, x, y, *, out, stream)"))},
     r"takes \(self, x, y\), but its host rule Op.<lambda> takes \(self, x\)"),
    ({"apply_gpu": jd.forward(platform="gpu")(_rule("(self, x, *, out, stream, mode)"))},
     r"keyword-only parameter\(s\) \['mode'\] have no default"),
    ({"one": jd.forward(platform="gpu")(_rule("(self, x, *, out, stream)")),
      "two": jd.forward(platform="gpu")(_rule("(self, x, *, out, stream)"))},
     r"Op: two device rules for the same role, rule and rule; keep one"),
])
def test_misdeclared_device_rules_name_the_rule_and_the_fix(methods, message):
    with pytest.raises(jd.DeclarationError, match=message):
        declare(**methods)


def test_an_adjoint_has_no_device_form():
    with pytest.raises(jd.DeclarationError, match=r"\(@adjoint\(platform='gpu'\)\): jaxdecl "
                                                  r"derives a transpose from an adjoint"):
        class Rotate(jd.Primitive, linear=True):
            shapes = jd.abstract(lambda self, x: same(x))
            apply = jd.forward(lambda self, x: 1j * x)
            adjoint = jd.adjoint(lambda self, y: -1j * y)

            @jd.adjoint(platform="gpu")
            def adjoint_gpu(self, y, *, stream):
                pass


def test_a_traceable_host_rule_needs_no_device_form():
    with pytest.raises(jd.DeclarationError, match=r"Op.rule \(@vjp\(platform='gpu'\)\): "
                                                  r"Op.<lambda> is traceable \(JAX code, which "
                                                  r"runs on the GPU already\)"):
        declare(pull=jd.vjp(traceable=True)(lambda self, x, ct: ct),
                pull_gpu=jd.vjp(platform="gpu")(_rule("(self, x, ct, *, stream)")))


def test_a_device_rule_asks_for_what_its_host_rule_asks():
    class Keeps(jd.Primitive):
        shapes = jd.abstract(lambda self, x: same(x))
        keeps = jd.residuals(lambda self, x: {"s": same(x)})

        @jd.forward
        def apply(self, x, *, saved=None):
            return 2 * x

        @jd.vjp
        def pull(self, x, ct, *, saved):
            return 2 * ct

    with pytest.raises(jd.DeclarationError, match=r"Sub.rule \(@vjp\(platform='gpu'\)\) "
                                                  r"takes no of `saved`/`result`, but its host "
                                                  r"rule Sub.pull takes \['saved'\]"):
        type("Sub", (Keeps,), {"pull_gpu": jd.vjp(platform="gpu")(
            _rule("(self, x, ct, *, stream)"))})
    with pytest.raises(jd.DeclarationError, match=r"takes `saved`, so it must fill `out` as well"):
        type("Sub", (Keeps,), {"apply_gpu": jd.forward(platform="gpu")(
            _rule("(self, x, *, saved=None, stream)"))})


def test_c_kernels_say_which_platform_they_are_for():
    address = 0x1000
    gpu = jd.cfunction(address, name="scale_gpu", platform="gpu")
    assert "platform='gpu'" in repr(gpu)
    op = declare(apply_gpu=jd.forward(gpu))  # a GPU C kernel makes a device rule
    assert op.__jaxdecl_spec__.device_rules["forward"].function is gpu
    with pytest.raises(TypeError, match=r"got the C kernel scale, built for the CPU; a GPU C "
                                        r"kernel takes XLA's stream too"):
        jd.forward(jd.cfunction(address, name="scale"), platform="gpu")
    with pytest.raises(TypeError, match=r"scale_gpu is a GPU C kernel: it runs on device "
                                        r"buffers"):
        gpu(np.ones(2), out=np.ones(2))
    with pytest.raises(TypeError, match=r"jd.cfunction\(platform='cuda'\)"):
        jd.cfunction(address, platform="cuda")


# --- run --------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _fresh_calls():
    fake_ops.CALLS.clear()


def test_the_cpu_runs_the_host_rule_and_the_gpu_the_device_rule():
    op, x = fake_ops.Scale(2.0), np.arange(4.0)
    on_cpu = jax.device_put(x, jax.devices("cpu")[0])  # (the default device may be a GPU)
    np.testing.assert_array_equal(jax.jit(op)(on_cpu), 2 * x)  # the host rule
    kernel, pin = kernel_of(op, x)
    out = np.zeros(4)
    with fake_cuda():
        assert run(kernel, [x], [out]) is None
        log = _dispatch.fake_cuda_log()
    np.testing.assert_array_equal(out, 3 * x)  # the device rule, on the device buffers
    assert fake_ops.CALLS == [("apply_gpu", STREAM)]
    assert calls(log) == ["SetDevice"]  # nothing staged, nothing synchronised


def test_the_return_form_copies_on_the_stream_then_synchronises():
    op, x, y = fake_ops.Mul(), np.arange(1.0, 4.0), np.full(3, 2.0)
    kernel, pin = kernel_of(op, x, y)
    prod, total = np.zeros(3), np.zeros(3)
    with fake_cuda():
        assert run(kernel, [x, y], [prod, total]) is None
        log = _dispatch.fake_cuda_log()
    np.testing.assert_array_equal(prod, 3 * x * y)
    np.testing.assert_array_equal(total, x + y)
    assert calls(log) == ["SetDevice", "MemcpyAsync", "MemcpyAsync", "StreamSynchronize"]
    assert [args[0] for _, args in log[1:3]] == [prod.ctypes.data, total.ctypes.data]
    assert all(args[3:] == [3, STREAM] for _, args in log[1:3])  # device to device


def test_a_none_cotangent_is_zeroed_on_the_device():
    op, x, y = fake_ops.Mul(), np.arange(1.0, 4.0), np.full(3, 2.0)
    ct = np.ones(3)
    kernel, pin = kernel_for(op, (x, y), "vjp", ((3,),) * 4)
    dx, dy = np.zeros(3), np.full(3, np.nan)
    with fake_cuda():
        assert run(kernel, [x, y, ct, ct], [dx, dy]) is None
        log = _dispatch.fake_cuda_log()
    np.testing.assert_array_equal(dx, 3 * y + 1)
    np.testing.assert_array_equal(dy, 0)
    assert ("MemsetAsync", [dy.ctypes.data, 0, 24, STREAM]) in log


def test_a_device_transpose():
    op, ct = fake_ops.Scale(2.0), np.arange(3.0)
    kernel, pin = kernel_for(op, (ct,), "transpose", ((3,),))
    out = np.zeros(3)
    with fake_cuda():
        assert run(kernel, [ct], [out]) is None
    np.testing.assert_array_equal(out, 3 * ct)
    assert fake_ops.CALLS == [("back_gpu", STREAM)]


def test_a_looped_batch_calls_the_device_rule_per_row():
    op, xs, y = fake_ops.Mul(), np.arange(6.0).reshape(3, 2), np.full((1, 2), 2.0)
    kernel, pin = kernel_of(op, xs[0], y[0], batch=(3,))
    prod, total = np.zeros((3, 2)), np.zeros((3, 2))
    with fake_cuda():
        assert run(kernel, [xs, y], [prod, total]) is None
    np.testing.assert_array_equal(prod, 3 * xs * y)  # y (size 1 along the batch) stays put
    np.testing.assert_array_equal(total, xs + y)
    assert fake_ops.CALLS == [("mul_gpu", STREAM, (2,))] * 3


class Returns(jd.Primitive):
    """A device rule that returns what the test asks of it."""

    value = None

    @jd.abstract
    def shapes(self, x):
        return same(x)

    @jd.forward
    def apply(self, x):
        return x

    @jd.forward(platform="gpu")
    def apply_gpu(self, x, *, stream):
        return type(self).value(x)


@pytest.mark.parametrize(("value", "message"), [
    (lambda x: HostArray(np.zeros(2)), "Returns.apply_gpu (@forward, platform='gpu') returned "
                                       "shape (2,) for output, but @abstract declared (3,)"),
    (lambda x: HostArray(np.zeros(3, np.float32)), "returned dtype float32 for output, but "
                                                   "@abstract declared float64"),
    (lambda x: np.zeros(3), "returned a ndarray for output, but a device rule returns device "
                            "arrays"),
    (lambda x: (HostArray(np.zeros(3)), HostArray(np.zeros(3))), "returned a tuple for output"),
])
def test_what_a_device_rule_returns_is_checked(value, message):
    Returns.value = staticmethod(value)
    x = np.ones(3)
    kernel, pin = kernel_of(Returns(), x)
    with fake_cuda():
        error = run(kernel, [x], [np.zeros(3)])
    assert message in error


def test_a_non_contiguous_result_is_refused():
    class Strided(HostArray):
        @property
        def __cuda_array_interface__(self):
            return dict(super().__cuda_array_interface__, strides=(16,))

    Returns.value = staticmethod(lambda x: Strided(np.zeros(3)))
    x = np.ones(3)
    kernel, pin = kernel_of(Returns(), x)
    with fake_cuda():
        error = run(kernel, [x], [np.zeros(3)])
    assert "returned a non-contiguous array for output (strides (16,)); return a C-contiguous" in \
        error


def test_a_result_ready_on_another_stream_is_waited_for():
    Returns.value = staticmethod(lambda x: HostArray(2 * host(x), stream=99))
    x = np.ones(3)
    kernel, pin = kernel_of(Returns(), x)
    out = np.zeros(3)
    with fake_cuda():
        assert run(kernel, [x], [out]) is None
        log = _dispatch.fake_cuda_log()
    np.testing.assert_array_equal(out, 2)
    assert calls(log)[1:4] == ["EventCreateWithFlags", "EventRecord", "StreamWaitEvent"]
    assert log[2][1][1] == 99 and log[3][1][0] == STREAM


def test_a_failing_device_rule_and_a_kept_device_array():
    kept = []

    def keep(x):
        kept.append(x)
        return HostArray(np.zeros(3))

    x = np.ones(3)
    kernel, pin = kernel_of(Returns(), x)
    Returns.value = staticmethod(lambda x: 1 / 0)
    with fake_cuda():
        error = run(kernel, [x], [np.zeros(3)])
    assert "Returns.apply_gpu (@forward, platform='gpu') raised ZeroDivisionError" in error
    Returns.value = staticmethod(keep)
    with fake_cuda():
        error = run(kernel, [x], [np.zeros(3)])
    assert "BufferEscapeError: Returns.apply_gpu (@forward, platform='gpu') kept a reference " \
           "to x after returning. A device array views XLA's device buffer during the call " \
           "only" in error
    with pytest.raises(RuntimeError, match="belonged to a rule call that has returned"):
        kept[0].__cuda_array_interface__  # noqa: B018


def test_the_eager_handler_runs_the_device_rule():
    op, x = fake_ops.Scale(4.0), np.arange(3.0)
    kernel, pin = kernel_of(op, x)
    slot, out = np.array(kernel.slot, np.int32), np.zeros(3)
    with fake_cuda():
        assert _dispatch.StagedSite().run_eager(describe(slot), [describe(x)], [describe(out)],
                                                0, STREAM) is None
    np.testing.assert_array_equal(out, 5 * x)


def test_a_rebuilt_kernel_carries_the_device_rule_too():
    from jaxdecl._call import flatten_inputs
    from jaxdecl._op.equation import Equation
    from jaxdecl._op.handle import BoundOp
    from jaxdecl._op.identity import handle_of
    from jaxdecl._transforms import recipes

    op, x = fake_ops.Scale(6.0), np.arange(3.0)
    _, signature = flatten_inputs(handle_of(op).spec, (x,))
    recipe = recipes.recipe(Equation(BoundOp(handle_of(op), op), "forward", signature),
                            ((3,),), required=True)
    del op
    gc.collect()
    # A new op from the recipe, its kernel built anew (as a process that loads a program).
    slot, instance = recipes.resolve(recipe.encode())
    out = np.zeros(3)
    with fake_cuda():
        assert _dispatch.StagedSite().run(slot, [describe(x)], [describe(out)],
                                          stream=STREAM) is None
    np.testing.assert_array_equal(out, 7 * x)
    del instance


GPU_C_SOURCE = textwrap.dedent(r"""
    #include <stdio.h>
    #include "jaxdecl.h"
    void* streams[8];
    int calls = 0;
    /* out = 5 x (float64) "on the device" (the fake's device is host memory) */
    int quintuple(const jaxdecl_buffer* in, int64_t nin, const jaxdecl_buffer* out,
                  int64_t nout, char* message, int64_t size, void* stream) {
      int64_t n = 1;
      for (int64_t d = 0; d < in[0].rank; ++d) n *= in[0].dims[d];
      if (calls < 8) streams[calls] = stream;
      ++calls;
      if (n == 0) {
        snprintf(message, size, "no elements");
        return 4;
      }
      for (int64_t i = 0; i < n; ++i)
        ((double*)out[0].data)[i] = 5 * ((const double*)in[0].data)[i];
      return 0;
    }
""")


def test_a_gpu_c_kernel_gets_the_stream_and_the_rows(tmp_path):
    library = compile_c(GPU_C_SOURCE, tmp_path)

    class Quintuple(jd.Primitive):
        shapes = jd.abstract(lambda self, x: same(x))
        apply = jd.forward(lambda self, x: 5 * x)
        apply_gpu = jd.forward(jd.cfunction(library.quintuple, platform="gpu"))

    op, xs = Quintuple(), np.arange(6.0).reshape(3, 2)
    kernel, pin = kernel_of(op, xs[0], batch=(3,))
    out = np.zeros((3, 2))
    with fake_cuda():
        assert run(kernel, [xs], [out]) is None
    np.testing.assert_array_equal(out, 5 * xs)
    import ctypes

    assert ctypes.c_int.in_dll(library, "calls").value == 3  # once per row
    streams = (ctypes.c_void_p * 8).in_dll(library, "streams")
    assert list(streams[:3]) == [STREAM] * 3
    empty, pin = kernel_of(op, np.zeros(0))
    with fake_cuda():
        error = run(empty, [np.zeros(0)], [np.zeros(0)])
    assert error == ("jaxdecl: Quintuple.<lambda> (@forward): GPU C kernel failed with status "
                     "4: no elements")


class Exp(jd.Primitive):
    """exp of a dict's leaves; the @vjp reads the forward's result (result=)."""

    @jd.abstract
    def shapes(self, p):
        return {"a": same(p["a"]), "b": same(p["b"])}

    @jd.forward
    def apply(self, p):
        return {"a": np.exp(p["a"]), "b": np.exp(p["b"])}

    @jd.forward(platform="gpu")
    def apply_gpu(self, p, *, out, stream):
        for key in ("a", "b"):
            np.exp(host(p[key]), out=host(out[key]))
            host(out[key])[...] *= 10  # (so that the device rule is seen to run)

    @jd.vjp
    def pull(self, p, ct, *, result):
        return {"a": ct["a"] * result["a"], "b": ct["b"] * result["b"]}

    @jd.vjp(platform="gpu")
    def pull_gpu(self, p, ct, *, result, stream):
        return {k: HostArray(host(ct[k]) * host(result[k]) * 10) for k in ("a", "b")}


def test_pytrees_and_result_reach_device_rules():
    op, a, b = Exp(), np.arange(3.0), np.ones(2)
    forward, pin = kernel_of(op, {"a": a, "b": b})
    out_a, out_b = np.zeros(3), np.zeros(2)
    with fake_cuda():
        assert run(forward, [a, b], [out_a, out_b]) is None
    np.testing.assert_allclose(out_a, 10 * np.exp(a))
    np.testing.assert_allclose(out_b, 10 * np.exp(b))
    # The vjp's operands: the inputs' leaves, the cotangents' leaves, then the result's.
    pull, pin2 = kernel_for(op, ({"a": a, "b": b},), "vjp", ((3,), (2,)) * 3)
    ct_a, ct_b, grad_a, grad_b = np.ones(3), np.full(2, 2.0), np.zeros(3), np.zeros(2)
    with fake_cuda():
        assert run(pull, [a, b, ct_a, ct_b, out_a, out_b], [grad_a, grad_b]) is None
    np.testing.assert_allclose(grad_a, ct_a * out_a * 10)
    np.testing.assert_allclose(grad_b, ct_b * out_b * 10)
