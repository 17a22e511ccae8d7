"""On a CUDA GPU: every op in GPU programs, host rules staged and device rules on XLA's
stream, against jax.numpy.

Marked ``gpu``; they skip where JAX has no CUDA device (tools/gpu-check runs them on a GPU
machine). Libraries a test needs (CuPy, Numba-CUDA, PyTorch, nvcc) skip that test alone.
"""

import ctypes
import shutil
import subprocess
import textwrap
import warnings

import jax
import jax.export  # noqa: F401 - (older JAX does not import it with jax)
import jax.numpy as jnp
import numpy as np
import ops
import ops_saved
import pytest
from helpers_gpu import fake_cuda, gpu, needs_gpu
from ops import compile_c
from ops_gpu import Batched, CupyScale, Vectorized, cupy_stream

import jaxdecl as jd
from jaxdecl import _compat
from jaxdecl._host import _dispatch

pytestmark = [gpu, needs_gpu]


def on_gpu(value) -> bool:
    return all(d.platform in ("gpu", "cuda") for leaf in jax.tree_util.tree_leaves(value)
               for d in leaf.devices())


def close(got, want, rtol=1e-10):
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=1e-12)


X = np.linspace(0.1, 0.9, 8)
M = np.arange(24.0).reshape(3, 8) / 10


def _sum(f):
    return lambda *a: jnp.sum(jnp.abs(f(*a)) ** 2)


A4 = np.asarray(ops_saved.A[:4, :4])

# (function, its jax.numpy twin, arguments)
PROGRAMS = {
    "forward": (ops.Scale(2.0), lambda x: 2 * x, (X,)),
    "jvp": (lambda a, b: jax.jvp(ops.MulNumpy(), (a, b), (b, a)),
            lambda a, b: jax.jvp(ops.mul_ref, (a, b), (b, a)), (X, X + 1)),
    "vjp": (jax.grad(_sum(ops.MulNumpy()), argnums=(0, 1)),
            jax.grad(_sum(ops.mul_ref), argnums=(0, 1)), (X, X + 1)),
    "transpose": (jax.grad(_sum(ops.FFTTranspose())), jax.grad(_sum(ops.fft_ref)), (X,)),
    "adjoint": (jax.grad(_sum(ops.FFTAdjoint())), jax.grad(_sum(ops.fft_ref)), (X,)),
    "multilinear": (jax.grad(_sum(ops.FlipMul()), argnums=(0, 1)),
                    jax.grad(_sum(ops.flip_mul_ref), argnums=(0, 1)), (X, X + 1)),
    "residuals": (jax.grad(lambda b: jnp.sum(ops_saved.Solve()(A4, b) ** 2)),
                  jax.grad(lambda b: jnp.sum(jnp.linalg.solve(A4, b) ** 2)), (X[:4],)),
    "batch loop": (jax.vmap(ops.Scale(3.0)), lambda m: 3 * m, (M,)),
    "batch vectorized": (jax.vmap(Vectorized()), lambda m: jnp.cumsum(m, axis=-1), (M,)),
    "@batch": (jax.vmap(Batched()), lambda m: m[:, ::-1], (M,)),
    "scan": (lambda x: jax.lax.scan(lambda c, _: (ops.Scale(0.5)(c), None), x, None,
                                    length=3)[0], lambda x: x / 8, (X,)),
    "checkpoint": (jax.grad(jax.checkpoint(_sum(ops.MulNumpy()))),
                   jax.grad(_sum(ops.mul_ref)), (X, X + 1)),
    "two outputs": (jax.grad(lambda x, y: jnp.sum(ops.TwoOutputs()(x, y)[0]), argnums=(0, 1)),
                    jax.grad(lambda x, y: jnp.sum(ops.two_outputs_ref(x, y)[0]),
                             argnums=(0, 1)), (X, X + 1)),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
@pytest.mark.parametrize("mode", ["jit", "eager"])
def test_host_rules_run_in_gpu_programs(name, mode):
    f, twin, args = PROGRAMS[name]
    args = tuple(jnp.asarray(a) for a in args)  # on the default device: the GPU
    got = jax.jit(f)(*args) if mode == "jit" else f(*args)
    close(got, twin(*args))
    assert on_gpu(got)


def test_the_cuda_runtime_is_the_one_jax_loaded():
    ops.Scale(2.0)(jnp.ones(3))
    assert _dispatch.cuda_runtime_origin().endswith("(loaded by JAX)")


def test_a_c_kernel_is_staged(tmp_path):
    library = compile_c(textwrap.dedent(r"""
        #include "jaxdecl.h"
        int triple(const jaxdecl_buffer* in, int64_t nin, const jaxdecl_buffer* out,
                   int64_t nout, char* message, int64_t size) {
          int64_t n = 1;
          for (int64_t d = 0; d < in[0].rank; ++d) n *= in[0].dims[d];
          for (int64_t i = 0; i < n; ++i)
            ((double*)out[0].data)[i] = 3 * ((const double*)in[0].data)[i];
          return 0;
        }
    """), tmp_path)

    class Triple(jd.Primitive, linear=True):
        shapes = jd.abstract(lambda self, x: jax.ShapeDtypeStruct(x.shape, x.dtype))
        apply = jd.forward(jd.cfunction(library.triple))
        back = jd.transpose(jd.cfunction(library.triple))

    x = jnp.asarray(M)
    close(jax.jit(jax.vmap(Triple()))(x), 3 * M)
    close(jax.grad(lambda v: jnp.sum(Triple()(v) ** 2))(x), 18 * M)


def test_many_calls_reuse_their_pinned_buffers():
    f = jax.jit(lambda x: ops.Scale(1.0001)(x))
    x = jnp.asarray(np.random.default_rng(0).normal(size=100_000))
    for _ in range(50):
        x = f(x)
    close(x, np.random.default_rng(0).normal(size=100_000) * 1.0001 ** 50, rtol=1e-9)


class Raises(jd.Primitive):
    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        if np.any(x < 0):
            raise ValueError("negative input")
        return np.sqrt(x)


def test_a_failing_rule_keeps_the_process_working():
    with pytest.raises(ValueError, match="negative input"):
        Raises()(-jnp.ones(3))  # eager: the rule's own exception
    with pytest.raises(jax.errors.JaxRuntimeError, match="negative input"):
        jax.jit(Raises())(-jnp.ones(3)).block_until_ready()
    close(jax.jit(Raises())(jnp.full(3, 4.0)), np.full(3, 2.0))


def test_a_cuda_error_keeps_the_process_working():
    f = jax.jit(lambda x: ops.Scale(3.0)(x) + 1)
    x = jnp.arange(4.0)
    close(f(x), 3 * np.arange(4.0) + 1)
    g = jax.jit(lambda x: ops.Scale(5.0)(x))  # a new call site, on the fake runtime's pool
    # The fake runtime fails its first copy (before it would touch device memory).
    with fake_cuda("MemcpyAsync", 1, code=700):
        with pytest.raises(jax.errors.JaxRuntimeError) as raised:
            g(x).block_until_ready()
    assert "Scale.apply (@forward) on GPU 0: copying operand 0 to the host (cudaMemcpyAsync)" \
           " failed: cudaErrorIllegalAddress" in str(raised.value)
    close(g(x), 5 * np.arange(4.0))  # the real runtime again, the same call site
    close(f(x), 3 * np.arange(4.0) + 1)


def test_a_cpu_cuda_export_runs_on_the_gpu():
    exported = jax.export.export(jax.jit(ops_saved.program), platforms=["cpu", "cuda"],
                                 disabled_checks=jd.disabled_checks())(
        jnp.asarray(np.linspace(0.1, 0.8, 8)), jnp.asarray(np.arange(32.0).reshape(8, 4) / 40))
    back = jax.export.deserialize(exported.serialize())
    args = (jnp.asarray(np.linspace(0.1, 0.8, 8)), jnp.asarray(np.arange(32.0).reshape(8, 4) / 40))
    close(back.call(*args), ops_saved.twin(*args))


# --- device rules ---------------------------------------------------------------------------


def quietly_import(name: str):
    """`name`, imported with its own deprecation warnings ignored (they are not
    jaxdecl's), or the calling test skipped without it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pytest.importorskip(name)


@pytest.fixture
def cupy():
    return quietly_import("cupy")


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64])
def test_cupy_device_rules_under_jit_grad_and_vmap(cupy, dtype):
    CupyScale.calls.clear()
    op, x = CupyScale(3.0), jnp.asarray(M.astype(dtype))
    close(jax.jit(op)(x), 3 * M.astype(dtype), rtol=1e-6)
    close(op(x), 3 * M.astype(dtype), rtol=1e-6)  # eager
    close(jax.jit(jax.vmap(op))(x), 3 * M.astype(dtype), rtol=1e-6)  # a device call per row
    grad = jax.jit(jax.grad(lambda v: jnp.sum(jnp.abs(op(v)) ** 2)))(x)
    close(grad, jax.grad(lambda v: jnp.sum(jnp.abs(3 * v) ** 2))(x), rtol=1e-5)
    ran = {c if isinstance(c, str) else c[0] for c in CupyScale.calls}
    assert ran == {"apply_gpu", "back_gpu"}  # never the host rules
    assert ("apply_gpu", 0, (8,)) in CupyScale.calls  # the loop's rows
    on_cpu = jax.device_put(np.asarray(M), jax.devices("cpu")[0])
    close(jax.jit(op)(on_cpu), 3 * M)  # the same op on the CPU: its host rule
    assert "apply" in CupyScale.calls


def test_cupy_from_dlpack_and_the_stream(cupy):
    seen = {}

    class Dlpack(jd.Primitive):
        shapes = jd.abstract(lambda self, x: jax.ShapeDtypeStruct(x.shape, x.dtype))
        apply = jd.forward(lambda self, x: x + 1)

        @jd.forward(platform="gpu")
        def apply_gpu(self, x, *, out, stream):
            seen["stream"] = stream
            with cupy_stream(stream):
                seen["current"] = cupy.cuda.get_current_stream().ptr
                cupy.add(cupy.from_dlpack(x), 1, out=cupy.from_dlpack(out))

    close(jax.jit(Dlpack())(jnp.arange(5.0)), np.arange(5.0) + 1)
    assert seen["stream"] == seen["current"] != 0  # XLA's stream, CuPy's current one


def test_numba_cuda_device_rule():
    numba_cuda = quietly_import("numba.cuda")

    @numba_cuda.jit
    def double(x, out):
        i = numba_cuda.grid(1)
        if i < x.size:
            out[i] = 2 * x[i]

    try:  # Numba itself, without jaxdecl: some Numba and NumPy releases do not work together
        probe = numba_cuda.to_device(np.arange(4.0))
        double[1, 4](probe, probe)
    except Exception as error:  # noqa: BLE001 - reported in the skip
        pytest.skip(f"Numba-CUDA does not run here (NumPy {np.__version__}): "
                    f"{type(error).__name__}: {error}")

    class NumbaDouble(jd.Primitive):
        shapes = jd.abstract(lambda self, x: jax.ShapeDtypeStruct(x.shape, x.dtype))
        apply = jd.forward(lambda self, x: 2 * x)

        @jd.forward(platform="gpu")
        def apply_gpu(self, x, *, out, stream):
            on = numba_cuda.external_stream(int(stream))
            double[(x.size + 127) // 128, 128, on](numba_cuda.as_cuda_array(x),
                                                  numba_cuda.as_cuda_array(out))

    close(jax.jit(NumbaDouble())(jnp.arange(1000.0)), 2 * np.arange(1000.0))


def test_torch_device_rule():
    torch = quietly_import("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")

    def external(stream, device):
        wrap = getattr(torch.cuda, "get_stream_from_external", None)  # (newer PyTorch)
        if wrap is not None:
            return wrap(int(stream), device)
        return torch.cuda.ExternalStream(int(stream), device=device)

    class TorchSquare(jd.Primitive):
        shapes = jd.abstract(lambda self, x: jax.ShapeDtypeStruct(x.shape, x.dtype))
        apply = jd.forward(lambda self, x: x * x)

        @jd.forward(platform="gpu")
        def apply_gpu(self, x, *, stream):
            device = f"cuda:{x.device}"
            with torch.cuda.stream(external(stream, device)):
                t = torch.as_tensor(x, device=device)
                return t * t  # the return form: copied into XLA's buffer on the stream

    close(jax.jit(TorchSquare())(jnp.arange(6.0)), np.arange(6.0) ** 2)


def test_a_gpu_c_kernel_compiled_with_nvcc(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc")
    source = tmp_path / "scale.cu"
    source.write_text(textwrap.dedent(r"""
        #include "jaxdecl.h"
        #include <cuda_runtime.h>
        __global__ void scale(const double* x, double* y, long n, double f) {
          long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
          if (i < n) y[i] = f * x[i];
        }
        extern "C" int scale_gpu(const jaxdecl_buffer* in, int64_t nin,
                                 const jaxdecl_buffer* out, int64_t nout,
                                 char* message, int64_t size, void* stream) {
          long n = 1;
          for (int64_t d = 0; d < in[0].rank; ++d) n *= in[0].dims[d];
          scale<<<(n + 255) / 256, 256, 0, (cudaStream_t)stream>>>(
              (const double*)in[0].data, (double*)out[0].data, n, 4.0);
          return cudaGetLastError() == cudaSuccess ? 0 : 1;
        }
    """))
    library = tmp_path / "libscale.so"
    subprocess.run([nvcc, "-shared", "-Xcompiler", "-fPIC", f"-I{jd.include_dir()}",
                    str(source), "-o", str(library)], check=True)
    lib = ctypes.CDLL(str(library))

    class Quadruple(jd.Primitive):
        shapes = jd.abstract(lambda self, x: jax.ShapeDtypeStruct(x.shape, x.dtype))
        apply = jd.forward(lambda self, x: 4 * x)
        apply_gpu = jd.forward(jd.cfunction(lib.scale_gpu, platform="gpu"))

    close(jax.jit(Quadruple())(jnp.arange(1000.0)), 4 * np.arange(1000.0))
    close(jax.jit(jax.vmap(Quadruple()))(jnp.asarray(M)), 4 * M)


def test_each_shard_runs_on_its_own_gpu(cupy):
    gpus = jax.devices("cuda")
    if len(gpus) < 2:
        pytest.skip("needs 2 GPUs")
    seen = []

    class Where(jd.Primitive, sharding="i -> i"):
        shapes = jd.abstract(lambda self, x: jax.ShapeDtypeStruct(x.shape, x.dtype))
        apply = jd.forward(lambda self, x: x + 1)

        @jd.forward(platform="gpu")
        def apply_gpu(self, x, *, out, stream):
            seen.append((x.device, cupy.cuda.runtime.getDevice()))
            with cupy_stream(stream):
                cupy.add(cupy.asarray(x), 1, out=cupy.asarray(out))

    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=gpus[:2])
    x = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
    close(jax.jit(Where())(x), np.arange(8.0) + 1)
    assert sorted(seen) == [(0, 0), (1, 1)]
    spec = jax.sharding.PartitionSpec("d")
    y = jax.jit(_compat.shard_map(ops.Scale(2.0), mesh, spec, spec))(x)  # staged, per device
    close(y, 2 * np.arange(8.0))
