"""The CUDA handlers' staging path (csrc/gpu/staging.cc), driven on the CPU.

The fake CUDA runtime's "device" is host memory: NumPy arrays stand for XLA's device
buffers, ``_dispatch.StagedSite`` runs a kernel exactly as the CUDA handler does (pinned
pool, copies on the stream, one synchronisation, the host kernel on the pinned copies,
copies back, an event), and the fake's log shows every CUDA call in order.
"""

import importlib.util
import textwrap

import jax
import numpy as np
import pytest
from helpers_gpu import calls, describe, fake_cuda, kernel_of
from ops import compile_c

import jaxdecl as jd
from jaxdecl._host import _dispatch

STREAM = 0x5EED


class Axpy(jd.Primitive):
    """2 x + y: two operands, one result, zero-copy."""

    @jd.abstract
    def shapes(self, x, y):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, y, *, out):
        np.add(2 * x, y, out=out)


class Stats(jd.Primitive):
    """(x + 1, sum x): two results, the return form."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((), x.dtype)

    @jd.forward
    def apply(self, x):
        return x + 1, x.sum()


class Fails(jd.Primitive):
    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        raise ValueError("the rule's own error")


class RowNorm(jd.Primitive, batch="loop"):
    """|x| of one row; under vmap the dispatcher loops over the rows."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct((), x.dtype)

    @jd.forward
    def apply(self, x):
        return np.linalg.norm(x)


def run(site, kernel, inputs, outputs, ordinal=0):
    return site.run(kernel.slot, [describe(a) for a in inputs],
                    [describe(a) for a in outputs], ordinal=ordinal, stream=STREAM)


@pytest.fixture
def axpy():
    op, x, y = Axpy(), np.linspace(0, 1, 6), np.arange(6.0)
    kernel, pin = kernel_of(op, x, y)
    yield kernel, x, y
    del pin


def test_values_and_the_copy_order(axpy):
    kernel, x, y = axpy
    out = np.full(6, np.nan)
    site = _dispatch.StagedSite()
    with fake_cuda():
        assert run(site, kernel, [x, y], [out], ordinal=1) is None
        log = _dispatch.fake_cuda_log()
    np.testing.assert_allclose(out, 2 * x + y)
    assert calls(log) == ["SetDevice", "HostAlloc", "HostAlloc", "HostAlloc",
                          "EventCreateWithFlags", "MemcpyAsync", "MemcpyAsync",
                          "StreamSynchronize", "MemcpyAsync", "EventRecord"]
    assert log[0][1] == [1]  # the call's own device, before anything else
    pinned = [args[2] for name, args in log if name == "HostAlloc"]
    assert all(args[1] == 1 for name, args in log if name == "HostAlloc")  # portable
    copies = [args for name, args in log if name == "MemcpyAsync"]
    # device -> host into the pinned operands, then host -> device from the pinned result
    assert [c[3] for c in copies] == [2, 2, 1]
    assert [c[0] for c in copies[:2]] == pinned[:2]
    assert [c[1] for c in copies[:2]] == [x.ctypes.data, y.ctypes.data]
    assert copies[2][:2] == [out.ctypes.data, pinned[2]]
    assert all(c[4] == STREAM for c in copies)  # all on XLA's stream
    assert log[7][1] == [STREAM] and log[9][1][1] == STREAM


def test_the_pool_is_reused_across_runs(axpy):
    kernel, x, y = axpy
    out = np.zeros(6)
    site = _dispatch.StagedSite()
    with fake_cuda():
        run(site, kernel, [x, y], [out])
        first = site.pools()
        _dispatch.fake_cuda_log()
        x2 = x + 10
        assert run(site, kernel, [x2, y], [out]) is None
        log = _dispatch.fake_cuda_log()
    np.testing.assert_allclose(out, 2 * x2 + y)
    assert site.pools() == first  # the same pinned buffers
    # no allocation; the last run's copies back are waited for before the buffers are reused
    assert calls(log) == ["SetDevice", "EventSynchronize", "MemcpyAsync", "MemcpyAsync",
                          "StreamSynchronize", "MemcpyAsync", "EventRecord"]


def test_a_larger_call_reallocates_only_what_grew():
    op = Stats()
    kernel, pin = kernel_of(op, np.zeros(4))
    site = _dispatch.StagedSite()
    with fake_cuda():
        run(site, kernel, [np.zeros(4)], [np.zeros(4), np.zeros(())])
        (_, before, capacities), = site.pools()
        _dispatch.fake_cuda_log()
        # A handler sees the buffers XLA passes (a split call site's blocks, say).
        x, plus, total = np.arange(10.0), np.zeros(10), np.zeros(())
        assert run(site, kernel, [x], [plus, total]) is None
        log = _dispatch.fake_cuda_log()
        (_, after, grown), = site.pools()
    np.testing.assert_array_equal(plus, x + 1)
    assert total == 45
    assert capacities == [32, 32, 8] and grown == [80, 80, 8]
    assert after[2] == before[2] and after[0] != before[0] and after[1] != before[1]
    assert [a for n, a in log if n == "FreeHost"] == [[before[0]], [before[1]]]
    assert calls(log).count("HostAlloc") == 2


def test_a_pool_per_device(axpy):
    kernel, x, y = axpy
    site = _dispatch.StagedSite()
    with fake_cuda():
        for ordinal in (0, 1, 0):
            out = np.zeros(6)
            assert run(site, kernel, [x, y], [out], ordinal=ordinal) is None
            np.testing.assert_allclose(out, 2 * x + y)
        pools = site.pools()
    assert sorted(p[0] for p in pools) == [0, 1]
    assert set(pools[0][1]).isdisjoint(pools[1][1])


def test_several_results_the_return_form():
    op, x = Stats(), np.arange(4, dtype=np.float32)
    kernel, pin = kernel_of(op, x)
    plus, total = np.zeros(4, np.float32), np.zeros((), np.float32)
    with fake_cuda():
        assert run(_dispatch.StagedSite(), kernel, [x], [plus, total]) is None
        log = _dispatch.fake_cuda_log()
    np.testing.assert_array_equal(plus, x + 1)
    assert total == 6
    assert [a[3] for n, a in log if n == "MemcpyAsync"] == [2, 1, 1]


def test_a_looped_batch_runs_row_by_row_on_the_pinned_copies():
    op, xs = RowNorm(), np.arange(12.0).reshape(3, 4)
    kernel, pin = kernel_of(op, xs[0], batch=(3,))
    out = np.zeros(3)
    with fake_cuda():
        assert run(_dispatch.StagedSite(), kernel, [xs], [out]) is None
    np.testing.assert_allclose(out, np.linalg.norm(xs, axis=1))


def test_zero_size_buffers_are_not_copied():
    op, x, y = Axpy(), np.zeros((0, 3)), np.zeros((0, 3))
    kernel, pin = kernel_of(op, x, y)
    with fake_cuda():
        assert run(_dispatch.StagedSite(), kernel, [x, y], [np.zeros((0, 3))]) is None
        log = _dispatch.fake_cuda_log()
    assert "MemcpyAsync" not in calls(log)


def test_a_failing_rule_copies_nothing_back():
    op, x = Fails(), np.ones(3)
    kernel, pin = kernel_of(op, x)
    out = np.zeros(3)
    with fake_cuda():
        message = run(_dispatch.StagedSite(), kernel, [x], [out])
        log = _dispatch.fake_cuda_log()
    assert "Fails.apply" in message and "the rule's own error" in message
    assert [a[3] for n, a in log if n == "MemcpyAsync"] == [2]  # the operand only
    assert not out.any()


def _clean_run_calls(kernel, x, y) -> list:
    with fake_cuda():
        run(_dispatch.StagedSite(), kernel, [x, y], [np.zeros(6)])
        return calls(_dispatch.fake_cuda_log())


@pytest.mark.parametrize("step", range(10))
def test_a_cuda_error_at_every_step_names_the_op_and_the_error(axpy, step):
    kernel, x, y = axpy
    names = _clean_run_calls(kernel, x, y)
    function, on = names[step], names[:step + 1].count(names[step])
    site = _dispatch.StagedSite()
    with fake_cuda(function, on, code=700):
        message = run(site, kernel, [x, y], [np.zeros(6)], ordinal=1)
        assert message.startswith("jaxdecl: Axpy.apply (@forward) on GPU 1: ")
        assert "cudaErrorIllegalAddress (700): an illegal memory access was encountered" in \
            message
        # The process and the call site keep working.
        out = np.zeros(6)
        assert run(site, kernel, [x, y], [out], ordinal=1) is None
    np.testing.assert_allclose(out, 2 * x + y)


@pytest.mark.parametrize(("function", "words"), [
    ("HostAlloc", "allocating 48 bytes of pinned host memory for operand 0 (cudaHostAlloc)"),
    ("MemcpyAsync", "copying operand 0 to the host (cudaMemcpyAsync)"),
    ("StreamSynchronize", "waiting for the operands (cudaStreamSynchronize)"),
    ("EventRecord", "recording an event after the results (cudaEventRecord)"),
    ("SetDevice", "cudaSetDevice"),
])
def test_each_failure_says_what_failed(axpy, function, words):
    kernel, x, y = axpy
    with fake_cuda(function, 1, code=2):
        message = run(_dispatch.StagedSite(), kernel, [x, y], [np.zeros(6)])
    assert message == (f"jaxdecl: Axpy.apply (@forward) on GPU 0: {words} failed: "
                       f"cudaErrorMemoryAllocation (2): out of memory")


def test_a_broken_stream_discards_the_pool(axpy):
    kernel, x, y = axpy
    site = _dispatch.StagedSite()
    with fake_cuda("StreamSynchronize", 1, code=700):
        assert run(site, kernel, [x, y], [np.zeros(6)]) is not None
        assert site.pools() == []  # its copies may still be in flight: never reused
        assert run(site, kernel, [x, y], [np.zeros(6)]) is None


def test_a_busy_pool_stages_through_a_temporary_one():
    site = _dispatch.StagedSite()
    inner_op, x = Stats(), np.arange(3.0)
    inner, inner_pin = kernel_of(inner_op, x)
    seen = {}

    class Outer(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)

        @jd.forward
        def apply(self, x):
            # The same site again while this run holds its pool (as a second thread
            # running the same call site on the same device would).
            plus, total = np.zeros(3), np.zeros(())
            seen["message"] = run(site, inner, [np.array(x)], [plus, total])
            seen["plus"] = plus
            return -x

    outer, pin = kernel_of(Outer(), x)
    out = np.zeros(3)
    with fake_cuda():
        live = _dispatch.fake_cuda_live()
        assert run(site, outer, [x], [out]) is None
        log = _dispatch.fake_cuda_log()
        assert _dispatch.fake_cuda_live()[0] == live[0] + 2  # the kept pool only
    assert seen["message"] is None
    np.testing.assert_array_equal(seen["plus"], x + 1)
    np.testing.assert_array_equal(out, -x)
    nested = calls(log)[calls(log).index("StreamSynchronize") + 1:]
    # the temporary pool: allocated, synchronised after its copies back, freed
    assert nested[:4] == ["SetDevice", "HostAlloc", "HostAlloc", "HostAlloc"]
    assert nested[nested.index("EventCreateWithFlags"):][:8] == [
        "EventCreateWithFlags", "MemcpyAsync", "StreamSynchronize", "MemcpyAsync",
        "MemcpyAsync", "StreamSynchronize", "EventDestroy", "FreeHost"]


def test_nothing_leaks(axpy):
    kernel, x, y = axpy
    with fake_cuda():
        before = _dispatch.fake_cuda_live()
        site = _dispatch.StagedSite()
        for ordinal in (0, 1):
            run(site, kernel, [x, y], [np.zeros(6)], ordinal=ordinal)
        assert _dispatch.fake_cuda_live() == (before[0] + 6, before[1] + 2)
        del site
        assert _dispatch.fake_cuda_live() == before


def test_the_compiled_handler_finds_its_kernel_by_fingerprint(axpy):
    # (XLA's CUDA compiler crashes on handlers with an instantiate stage: no call-site state)
    kernel, x, y = axpy
    hi, lo = kernel.fingerprint  # (the compiled call's int64 attributes)
    site = _dispatch.StagedSite()
    outs = [np.full(6, np.nan), np.full(6, np.nan)]
    with fake_cuda():
        for out in outs:
            assert site.run_compiled(hi, lo, "Axpy.apply", "", [describe(x), describe(y)],
                                     [describe(out)], stream=STREAM) is None
        log = _dispatch.fake_cuda_log()
    for out in outs:
        np.testing.assert_allclose(out, 2 * x + y)
    # the kernel's own pool: allocated by the first run, reused by the second
    assert calls(log).count("HostAlloc") == 3 and calls(log).count("StreamSynchronize") == 2


def test_the_compiled_handler_names_a_kernel_this_process_lacks(axpy):
    _, x, y = axpy
    out = np.zeros(6)
    with fake_cuda():
        message = _dispatch.StagedSite().run_compiled(
            123, 456, "Gone.apply (@forward)", "", [describe(x), describe(y)],
            [describe(out)], stream=STREAM)
    assert message.startswith("jaxdecl: Gone.apply (@forward) (kernel 00000000000000"
                              "7b00000000000001c8) is not available in this process")


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_the_eager_handler_reads_the_slot_from_the_device(axpy, dtype):
    kernel, x, y = axpy
    slot = np.array(kernel.slot, dtype)
    out = np.zeros(6)
    with fake_cuda():
        message = _dispatch.StagedSite().run_eager(describe(slot), [describe(x), describe(y)],
                                                   [describe(out)], 1, STREAM)
        log = _dispatch.fake_cuda_log()
    assert message is None
    np.testing.assert_allclose(out, 2 * x + y)
    assert calls(log)[:3] == ["SetDevice", "MemcpyAsync", "StreamSynchronize"]
    assert log[1][1][1:4] == [slot.ctypes.data, slot.itemsize, 2]


def test_the_eager_handler_names_a_failed_slot_read(axpy):
    kernel, x, y = axpy
    slot = np.array(kernel.slot, np.int32)
    with fake_cuda("MemcpyAsync", 1, code=700):
        message = _dispatch.StagedSite().run_eager(describe(slot), [describe(x), describe(y)],
                                                   [describe(np.zeros(6))], 0, STREAM)
    assert message.startswith("jaxdecl: reading an eager call's kernel slot on GPU 0 failed: "
                              "cudaErrorIllegalAddress")


C_SOURCE = textwrap.dedent(r"""
    #include "jaxdecl.h"
    /* out = 2 * x + y (float64) */
    int axpy(const jaxdecl_buffer* in, int64_t nin, const jaxdecl_buffer* out, int64_t nout,
             char* message, int64_t size) {
      int64_t n = 1;
      for (int64_t d = 0; d < in[0].rank; ++d) n *= in[0].dims[d];
      const double* x = (const double*)in[0].data;
      const double* y = (const double*)in[1].data;
      double* z = (double*)out[0].data;
      for (int64_t i = 0; i < n; ++i) z[i] = 2 * x[i] + y[i];
      return 0;
    }
""")


def test_a_c_kernel_runs_on_the_pinned_copies(tmp_path):
    library = compile_c(C_SOURCE, tmp_path)

    class CAxpy(jd.Primitive):
        @jd.abstract
        def shapes(self, x, y):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)

        apply = jd.forward(jd.cfunction(library.axpy))

    x, y = np.linspace(0, 1, 5), np.ones(5)
    kernel, pin = kernel_of(CAxpy(), x, y)
    out = np.zeros(5)
    with fake_cuda():
        assert run(_dispatch.StagedSite(), kernel, [x, y], [out]) is None
        log = _dispatch.fake_cuda_log()
    np.testing.assert_allclose(out, 2 * x + y)
    assert calls(log).count("MemcpyAsync") == 3


@pytest.mark.skipif(importlib.util.find_spec("jax_cuda13_plugin") is not None or
                    importlib.util.find_spec("jax_cuda12_plugin") is not None,
                    reason="JAX's CUDA plugin is installed: a CUDA runtime can be found")
def test_without_a_cuda_runtime_the_handler_says_what_to_install(axpy):
    kernel, x, y = axpy
    message = run(_dispatch.StagedSite(), kernel, [x, y], [np.zeros(6)])
    assert message.startswith("jaxdecl: Axpy.apply (@forward): jaxdecl found no CUDA runtime "
                              "(libcudart.so.13 or .12) in this process")
    assert 'pip install -U "jax[cuda13]"' in message
    assert _dispatch.cuda_runtime_origin() is None


def test_the_fake_is_host_memory():
    source, target = np.arange(4.0), np.zeros(4)
    with fake_cuda():
        _dispatch.copy_on_device(target.ctypes.data, source.ctypes.data, source.nbytes, STREAM)
        _dispatch.synchronize_stream(STREAM)
        _dispatch.stream_wait(1, STREAM)
        log = _dispatch.fake_cuda_log()
    np.testing.assert_array_equal(target, source)
    assert calls(log) == ["MemcpyAsync", "StreamSynchronize", "EventCreateWithFlags",
                          "EventRecord", "StreamWaitEvent", "EventDestroy"]
    assert log[0][1][3] == 3  # device to device
    with fake_cuda("MemcpyAsync", 1, code=1):
        with pytest.raises(RuntimeError, match="cudaMemcpyAsync .device to device. failed: "
                                               "cudaErrorInvalidValue"):
            _dispatch.copy_on_device(target.ctypes.data, source.ctypes.data, 8, STREAM)
