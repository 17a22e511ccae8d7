"""Every op lowers for CUDA, on a machine without a GPU: the same custom calls, with the
same attributes, as on the CPU (one lowering serves both platforms); other platforms are
refused, naming the op; a CPU-only process never loads CUDA."""

import importlib.util
import pathlib
import re
import sys
import textwrap

import jax
import jax.export  # noqa: F401 - (older JAX does not import it with jax)
import jax.numpy as jnp
import numpy as np
import ops
import ops_saved
import pytest
from conftest import needs_split, run_helper
from helpers_gpu import kernel_of
from ops import compile_c
from ops_gpu import Batched, Vectorized

import jaxdecl as jd
from jaxdecl import _compat

P = jax.sharding.PartitionSpec  # (jax.P from JAX 0.7)

CUDA_PLUGIN = bool(importlib.util.find_spec("jax_cuda13_plugin") or
                   importlib.util.find_spec("jax_cuda12_plugin"))
HELPER = str(pathlib.Path(__file__).with_name("helpers_gpu_export.py"))
CALL = re.compile(r"stablehlo\.custom_call @(jaxdecl_dispatch\w*)\((.*?)\{(.*)$", re.M)


def custom_calls(text: str) -> list:
    """``(target, attributes)`` of every jaxdecl custom call in a module's text."""
    return [(m.group(1), m.group(3)) for m in CALL.finditer(text)]


def lowered(f, *args, platforms=("cuda",)) -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=platforms).as_text()


def assert_cuda_calls(f, *args, names=()):
    """`f` lowers for CUDA exactly as for the CPU, with each of `names` (``Class.method
    (@kind)``) a jaxdecl custom call carrying the kernel's fingerprint, name and recipe."""
    text = lowered(f, *args)
    assert text == lowered(f, *args, platforms=("cpu",))  # the same program on both
    found = custom_calls(text)
    assert found, "no jaxdecl custom call"
    for _, attributes in found:
        for attribute in ("fingerprint_hi = ", "fingerprint_lo = ", "name = ", "recipe = "):
            assert attribute in attributes
    called = {re.search(r'name = "([^"]*)"', a).group(1) for _, a in found}
    assert set(names) <= called, called
    return text


X = jnp.linspace(0.1, 0.9, 4)
M = jnp.arange(8.0).reshape(2, 4) / 10
C = (jnp.arange(4.0) + 1j).astype(jnp.complex128)


def _sum(op):
    return lambda *a: jnp.sum(jnp.abs(op(*a)) ** 2)


CASES = {
    "forward, return form": (ops.FFTTranspose(), (X,), ["FFTTranspose.apply (@forward)"]),
    "forward, zero-copy": (ops.Scale(2.0), (X,), ["Scale.apply (@forward)"]),
    "jvp": (lambda a, b: jax.jvp(ops.MulNumpy(), (a, b), (b, a))[1], (X, X),
            ["MulNumpy.push (@jvp)"]),
    "vjp (grad)": (jax.grad(_sum(ops.MulNumpy()), argnums=(0, 1)), (X, X),
                   ["MulNumpy.apply (@forward)", "MulNumpy.pull (@vjp)"]),
    "traceable jvp": (jax.grad(_sum(ops.MulTraceable())), (X, X),
                      ["MulTraceable.apply (@forward)"]),
    "transpose": (jax.grad(_sum(ops.FFTTranspose())), (X,),
                  ["FFTTranspose.transposed (@transpose)"]),
    "adjoint": (jax.grad(_sum(ops.FFTAdjoint())), (X,), ["FFTAdjoint.adjoint (@adjoint)"]),
    "multilinear": (jax.grad(_sum(ops.FlipMul()), argnums=(0, 1)), (X, X),
                    ["FlipMul.transpose_x (@transpose)", "FlipMul.transpose_y (@transpose)"]),
    "residuals": (jax.grad(lambda b: jnp.sum(ops_saved.Solve()(jnp.asarray(ops_saved.A[:4, :4]),
                                                                b))), (X,),
                  ["Solve.apply (@forward)", "Solve.pull (@vjp)"]),
    "batch loop": (jax.vmap(ops.Scale(3.0)), (M,), ["Scale.apply (@forward)"]),
    "batch vectorized": (jax.vmap(Vectorized()), (M,), ["Vectorized.apply (@forward)"]),
    "@batch": (jax.vmap(Batched()), (M,), ["Batched.apply (@forward)"]),
    "scan": (lambda x: jax.lax.scan(lambda c, _: (ops.Scale(0.5)(c), None), x, None,
                                    length=3)[0], (X,), ["Scale.apply (@forward)"]),
    "checkpoint": (jax.grad(jax.checkpoint(_sum(ops.MulNumpy()))), (X, X),
                   ["MulNumpy.apply (@forward)", "MulNumpy.pull (@vjp)"]),
    "complex linear": (jax.grad(lambda c: jnp.sum(jnp.abs(ops_saved.Scale(2.0)(c)))), (C,),
                       ["Scale.apply (@forward)"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_rule_kind_lowers_for_cuda(case):
    f, args, names = CASES[case]
    assert_cuda_calls(f, *args, names=names)


C_SOURCE = textwrap.dedent(r"""
    #include "jaxdecl.h"
    int triple(const jaxdecl_buffer* in, int64_t nin, const jaxdecl_buffer* out,
               int64_t nout, char* message, int64_t size) {
      int64_t n = 1;
      for (int64_t d = 0; d < in[0].rank; ++d) n *= in[0].dims[d];
      for (int64_t i = 0; i < n; ++i)
        ((double*)out[0].data)[i] = 3 * ((const double*)in[0].data)[i];
      return 0;
    }
""")


def test_c_kernels_lower_for_cuda(tmp_path):
    library = compile_c(C_SOURCE, tmp_path)

    class Triple(jd.Primitive, linear=True):
        @jd.abstract
        def shapes(self, x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)

        apply = jd.forward(jd.cfunction(library.triple, name="triple"))
        back = jd.transpose(jd.cfunction(library.triple, name="triple_t"))

    assert_cuda_calls(jax.grad(lambda x: jnp.sum(Triple()(x) ** 2)), X,
                      names=["Triple.triple (@forward)", "Triple.triple_t (@transpose)"])
    assert_cuda_calls(jax.vmap(Triple()), M, names=["Triple.triple (@forward)"])


# --- sharding: the mechanisms over a 2-device mesh ------------------------------------


def _mesh(kind):
    # (the host devices conftest makes: on a GPU machine the default backend has one GPU)
    return jax.make_mesh((2,), ("d",), axis_types=(kind,), devices=jax.devices("cpu")[:2])


def _sharded(mesh, value, *spec):
    return jax.device_put(value, jax.NamedSharding(mesh, P(*spec)))


@needs_split
def test_an_xla_split_call_lowers_for_cuda():
    x = _sharded(_mesh(jax.sharding.AxisType.Auto), jnp.linspace(0, 1, 8), "d")
    text = assert_cuda_calls(ops_saved.Scale(2.0), x, names=["Scale.apply (@forward)"])
    assert [t for t, _ in custom_calls(text)] == ["jaxdecl_dispatch_split"]
    assert 'num_batch_dims = "1"' in text


@needs_split
@pytest.mark.parametrize("op", [ops_saved.RowNorms(), ops_saved.MatVec()])
def test_a_partitioned_call_lowers_for_cuda(op):
    mesh = _mesh(jax.sharding.AxisType.Auto)
    m = _sharded(mesh, jnp.arange(32.0).reshape(8, 4), "d", None)
    args = (m,) if isinstance(op, ops_saved.RowNorms) else (m, jnp.ones(4))
    text = lowered(op, *args)
    # The per-shard kernels are built by the partitioner's callback; the program names
    # the equation it splits by its kernel's fingerprint.
    assert "CustomSPMDPartitioning" in text and "jaxdecl.partitioned" in text


@pytest.mark.skipif(not _compat.EXPLICIT_REDUCTIONS or not _compat.SPLITS_PER_SHARD,
                    reason="per-shard maps over Explicit axes need JAX >= 0.9")
def test_a_per_shard_map_lowers_for_cuda():
    mesh = _mesh(jax.sharding.AxisType.Explicit)
    x = _sharded(mesh, jnp.linspace(0, 1, 8), "d")
    with jax.set_mesh(mesh):
        text = assert_cuda_calls(ops_saved.Scale(2.0), x, names=["Scale.apply (@forward)"])
    assert "manual_computation" in text or "shard_map" in text


def test_inside_shard_map_lowers_for_cuda():
    mesh = _mesh(jax.sharding.AxisType.Auto)
    x = _sharded(mesh, jnp.linspace(0, 1, 8), "d")
    f = _compat.shard_map(ops.Scale(3.0), mesh, P("d"), P("d"))
    assert_cuda_calls(f, x, names=["Scale.apply (@forward)"])


# --- one artifact for CPU and CUDA ------------------------------------------------------


def test_a_cpu_cuda_export_holds_each_call_once():
    exported = jax.export.export(jax.jit(ops_saved.program), platforms=["cpu", "cuda"],
                                 disabled_checks=jd.disabled_checks())(X.repeat(2), M.repeat(4, 0))
    text = exported.mlir_module()
    assert exported.platforms == ("cpu", "cuda")
    # each call once: no switch on the platform around them (JAX 0.6 still switches on it
    # for a constant of its own, which holds no call)
    names = [re.search(r'name = "([^"]*)"', a).group(1) for _, a in custom_calls(text)]
    assert len(names) == len(set(names)) == 6


def test_a_cpu_cuda_export_round_trips_in_fresh_processes_that_load_no_cuda(tmp_path):
    """Saved over a 2-device mesh (the per-shard map an export plans), loaded and run on
    CPU in another process; neither process maps a CUDA library, though one ran ops, lowered
    for CUDA and exported for it (unless JAX's own CUDA plugin is installed: it loads them)."""
    saved = run_helper([sys.executable, HELPER, "save", str(tmp_path), "2"])
    assert saved["platforms"] == ["cpu", "cuda"]
    assert saved["ran"] and saved["lowered"]
    loaded = run_helper([sys.executable, HELPER, "load", str(tmp_path), "2"])
    assert loaded["platforms"] == ["cpu", "cuda"]
    for name in ("forward", "grad", "vmap"):
        assert loaded[name], name
    if not CUDA_PLUGIN:
        assert saved["cuda_libraries"] == loaded["cuda_libraries"] == []


# --- other platforms ----------------------------------------------------------------------


@pytest.mark.parametrize("platform", ["rocm", "tpu"])
def test_other_platforms_are_refused_naming_the_op(platform):
    with pytest.raises(NotImplementedError) as raised:
        lowered(jax.grad(_sum(ops.MulNumpy())), X, X, platforms=(platform,))
    assert str(raised.value).startswith(
        f"MulNumpy.apply (@forward) cannot run on '{platform}': jaxdecl runs its ops on CPUs "
        f"and CUDA GPUs (platforms 'cpu' and 'cuda')")


def test_an_export_for_cpu_and_tpu_is_refused():
    with pytest.raises(NotImplementedError, match="Scale.apply .@forward. cannot run on 'tpu'"):
        jax.export.export(jax.jit(ops.Scale(2.0)), platforms=["cpu", "tpu"],
                          disabled_checks=jd.disabled_checks())(X)


def test_an_eager_call_on_another_platform_names_the_op():
    from jaxdecl._errors import PlatformError
    from jaxdecl._transforms import eager

    # The eager executables are shared by every op: their lowering cannot name it...
    x = jnp.ones(3)
    shared = jax.jit(lambda slot, v: eager.eager_p.bind(slot, v, out_avals=(((3,), x.dtype),)))
    with pytest.raises(NotImplementedError, match="^a jaxdecl op cannot run on 'tpu'"):
        shared.trace(np.int32(1), x).lower(lowering_platforms=("tpu",))

    # ... so the eager call that ran into it does.
    def on_tpu(*operands):
        raise PlatformError("a jaxdecl op", ("tpu",))

    op = ops.Scale(2.0)
    kernel, pin = kernel_of(op, x)
    call = eager.Call(kernel, (((3,), x.dtype),), single=True, caller=on_tpu)
    with pytest.raises(NotImplementedError, match="^Scale.apply .@forward. cannot run on 'tpu'"):
        eager.run(call, [x])
