# requires: finufft (pip install ".[finufft]")
"""A NUFFT whose rules are C kernels calling finufft's C library.

finufft's Python wheel ships its C library (``libfinufft.so`` inside the
``finufft`` package). A few lines of C++, compiled here on the spot against it,
make the type-1 non-uniform FFT a jaxdecl op whose ``@forward`` (finufft's
type 1) and ``@transpose`` (its type 2) are C kernels (``jd.cfunction``): XLA
calls them on its own buffers, without Python and without the GIL. The points
are a non-differentiable input, every derivative follows from the two kernels,
and a ``@jd.batch`` rule folds a ``vmap`` into finufft's own batch of
transforms (``n_trans``): one call for the whole batch. The results are
checked against finufft's Python API and against the sum itself, evaluated
term by term in ``jax.numpy``; the transpose by the dot-product test of
``jd.check``. A second pair of kernels keeps finufft's plan between calls of
one shape, which is where most of the time of a small transform goes. Without
a C++ compiler the tutorial says so and stops.
"""

import requires  # tutorials/requires.py: without line 1's package, stops with its pip command

requires.check(__file__)

import ctypes
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import finufft
import jax
import jax.numpy as jnp
import numpy as np

import jaxdecl as jd

jax.config.update("jax_enable_x64", True)  # the kernels take float64 points, complex128 values

TOLERANCE = 1e-9  # finufft's requested accuracy, compiled into the kernels

# finufft's C API as documented (finufft.h, version 2.5): the wheel ships the library, not
# the header, so the few declarations needed are written out here.
SOURCE = r"""
#include "jaxdecl.h"

#include <array>
#include <complex>
#include <cstdint>
#include <cstdio>
#include <map>

extern "C" {
struct finufft_plan_s;
typedef finufft_plan_s* finufft_plan;
void finufft_default_opts(void* opts);
int finufft_makeplan(int type, int dim, const int64_t* n_modes, int iflag, int ntrans,
                     double tol, finufft_plan* plan, void* opts);
int finufft_setpts(finufft_plan plan, int64_t M, const double* x, const double* y,
                   const double* z, int64_t N, const double* s, const double* t,
                   const double* u);
int finufft_execute(finufft_plan plan, std::complex<double>* c, std::complex<double>* f);
int finufft_destroy(finufft_plan plan);
}

namespace {

// finufft_opts starts with these fields; the union leaves room for the rest of the
// struct (finufft_default_opts fills all of it), whatever a finufft version adds.
union alignas(16) Options {
  struct {
    int modeord, spreadinterponly, debug, spread_debug, showwarn, nthreads;
  } head;
  char room[1024];
};

// Plans kept by one thread, per (type, dim, modes, ntrans); destroyed when it exits.
// XLA may run kernels on several threads at once: no plan is ever shared.
struct Plans {
  std::map<std::array<int64_t, 6>, finufft_plan> kept;
  void clear() {
    for (auto& entry : kept) finufft_destroy(entry.second);
    kept.clear();
  }
  ~Plans() { clear(); }
};
thread_local Plans plans;

int fail(char* message, int64_t size, const char* what, int code) {
  std::snprintf(message, size, "finufft kernel: %s (code %d)", what, code);
  return 1;
}

// type 1: points (d, M), strengths c (..., M) -> modes f (..., N1[, N2[, N3]])
// type 2: points (d, M), modes f (..., N1[, ...]) -> values c (..., M)
// Leading dims of c and f are finufft's batch of transforms (n_trans).
int run(int type, bool keep_plan, const jaxdecl_buffer* in, int64_t n_in,
        const jaxdecl_buffer* out, int64_t n_out, char* message, int64_t size) {
  if (n_in != 2 || n_out != 1) return fail(message, size, "takes 2 inputs, gives 1 output", 0);
  const jaxdecl_buffer& points = in[0];
  const jaxdecl_buffer& modes = type == 1 ? out[0] : in[1];
  const jaxdecl_buffer& values = type == 1 ? in[1] : out[0];
  if (points.dtype != JAXDECL_FLOAT64 || modes.dtype != JAXDECL_COMPLEX128 ||
      values.dtype != JAXDECL_COMPLEX128)
    return fail(message, size, "needs float64 points and complex128 values", 0);
  if (points.rank != 2 || points.dims[0] < 1 || points.dims[0] > 3)
    return fail(message, size, "points must be (d, M) with d = 1, 2 or 3", 0);
  const int dim = static_cast<int>(points.dims[0]);
  const int64_t m = points.dims[1];
  if (values.rank < 1 || values.dims[values.rank - 1] != m || modes.rank < dim)
    return fail(message, size, "values must be (..., M), modes (..., N1, ..., Nd)", 0);
  int64_t ntrans = 1, mode_batch = 1;
  for (int64_t i = 0; i + 1 < values.rank; ++i) ntrans *= values.dims[i];
  for (int64_t i = 0; i < modes.rank - dim; ++i) mode_batch *= modes.dims[i];
  if (ntrans != mode_batch) return fail(message, size, "values and modes batch differently", 0);
  if (ntrans == 0) return 0;

  // finufft counts dimensions Fortran-style: its first (x) is the fastest-varying mode
  // axis, the last of the row-major output, whose coordinates are the last row of points.
  std::array<int64_t, 6> key = {type, dim, 1, 1, 1, ntrans};
  const double* coordinate[3] = {nullptr, nullptr, nullptr};
  for (int i = 0; i < dim; ++i) {
    key[2 + i] = modes.dims[modes.rank - 1 - i];
    coordinate[i] = static_cast<const double*>(points.data) + (dim - 1 - i) * m;
  }

  finufft_plan plan = nullptr;
  auto found = keep_plan ? plans.kept.find(key) : plans.kept.end();
  if (found != plans.kept.end()) {
    plan = found->second;
  } else {
    Options options;
    finufft_default_opts(&options);
    options.head.nthreads = 1;  // one thread per call: XLA decides the parallelism
    // Sign +1 both ways: the transpose of type 1 is type 2 with the same sign.
    int code = finufft_makeplan(type, dim, &key[2], +1, static_cast<int>(ntrans), TOLERANCE,
                                &plan, &options);
    if (code > 1) return fail(message, size, "finufft_makeplan failed", code);  // 1: a warning
    if (keep_plan) {
      if (plans.kept.size() >= 16) plans.clear();  // a bound on what one thread keeps
      plans.kept[key] = plan;
    }
  }
  // Points change from call to call: setpts every time (it sorts them for the spreader).
  int code = finufft_setpts(plan, m, coordinate[0], coordinate[1], coordinate[2], 0, nullptr,
                            nullptr, nullptr);
  if (code <= 1) {
    code = finufft_execute(plan, static_cast<std::complex<double>*>(values.data),
                           static_cast<std::complex<double>*>(modes.data));
  }
  if (!keep_plan) {
    finufft_destroy(plan);
  } else if (code > 1) {
    finufft_destroy(plan);
    plans.kept.erase(key);
  }
  return code > 1 ? fail(message, size, "finufft_setpts/finufft_execute failed", code) : 0;
}

}  // namespace

extern "C" {
int nufft_type1(const jaxdecl_buffer* in, int64_t n_in, const jaxdecl_buffer* out,
                int64_t n_out, char* message, int64_t size) {
  return run(1, false, in, n_in, out, n_out, message, size);
}
int nufft_type2(const jaxdecl_buffer* in, int64_t n_in, const jaxdecl_buffer* out,
                int64_t n_out, char* message, int64_t size) {
  return run(2, false, in, n_in, out, n_out, message, size);
}
int nufft_type1_kept(const jaxdecl_buffer* in, int64_t n_in, const jaxdecl_buffer* out,
                     int64_t n_out, char* message, int64_t size) {
  return run(1, true, in, n_in, out, n_out, message, size);
}
int nufft_type2_kept(const jaxdecl_buffer* in, int64_t n_in, const jaxdecl_buffer* out,
                     int64_t n_out, char* message, int64_t size) {
  return run(2, true, in, n_in, out, n_out, message, size);
}
}
"""


def finufft_library() -> pathlib.Path:
    """The C library inside the finufft package (libfinufft.so, .dylib or .dll)."""
    folder = pathlib.Path(finufft.__file__).resolve().parent
    found = sorted(p for p in folder.glob("*finufft*") if p.suffix in (".so", ".dylib", ".dll"))
    if not found:
        raise FileNotFoundError(f"no finufft C library in {folder}")
    return found[0]


def build_library(directory: pathlib.Path, tolerance: float = TOLERANCE):
    """Compiles SOURCE against finufft's library; returns (ctypes library, note).

    The library is None where no C++ compiler runs (the note says why), else
    the note is the compile command.
    """
    compiler = os.environ.get("CXX") or next(
        (shutil.which(c) for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    if compiler is None:
        return None, "no C++ compiler found (install g++ or clang++, or set CXX)"
    source = directory / "finufft_kernels.cpp"
    source.write_text(SOURCE)
    finufft_lib = finufft_library()
    library = directory / ("libfinufft_kernels" + (".dylib" if sys.platform == "darwin" else ".so"))
    # Linked against the wheel's own library (found again at load time through the rpath),
    # the one finufft's Python module has already loaded into this process.
    command = [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", f"-DTOLERANCE={tolerance!r}",
               "-I", jd.include_dir(), "-o", str(library), str(source), str(finufft_lib),
               f"-Wl,-rpath,{finufft_lib.parent}"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"running {compiler} failed: {error}"
    if result.returncode != 0:
        return None, f"{' '.join(command)} failed:\n{result.stderr}"
    return ctypes.CDLL(str(library)), " ".join(command)


def declare(lib, keep_plan: bool = False):
    """The op class whose rules are `lib`'s kernels (those keeping plans with `keep_plan`).

    C kernels take no instance configuration, so the class is made once the
    library exists; `n_modes` lives on the instance for ``@abstract`` only
    (the kernels read the modes from the output's shape).
    """
    suffix = "_kept" if keep_plan else ""

    class FinufftType1(jd.Primitive, linear=True, nondiff=("points",)):
        """f_k = Σ_j c_j exp(+i k·x_j), k in [-N/2, N/2) per axis: finufft's type 1.

        Inputs: ``points`` (d, M) float64 in [-3π, 3π), one row per coordinate,
        never differentiated; ``c`` (..., M) complex128. Output (..., N1, ..., Nd).
        Leading dims of ``c`` are a batch of transforms sharing the points.
        """

        def __init__(self, n_modes):
            self.n_modes = tuple(int(n) for n in np.atleast_1d(n_modes))

        @jd.abstract
        def shapes(self, points, c):
            if points.dtype != np.float64 or c.dtype != np.complex128:
                raise TypeError(f"FinufftType1 takes float64 points and complex128 strengths, "
                                f"got {points.dtype} and {c.dtype}")
            if points.shape[:1] != (len(self.n_modes),) or c.shape[-1:] != points.shape[1:]:
                raise ValueError(f"FinufftType1{self.n_modes} takes points "
                                 f"({len(self.n_modes)}, M) and c (..., M), got "
                                 f"{points.shape} and {c.shape}")
            return jax.ShapeDtypeStruct(c.shape[:-1] + self.n_modes, c.dtype)

        apply = jd.forward(jd.cfunction(getattr(lib, "nufft_type1" + suffix), keepalive=lib))
        # The transpose of type 1 (non-conjugated, as JAX's) is type 2 with the same sign.
        apply_t = jd.transpose(jd.cfunction(getattr(lib, "nufft_type2" + suffix),
                                            keepalive=lib))

        @jd.batch
        def batched(self, args, axes):
            (points, c), (points_axis, c_axis) = args, axes
            if points_axis is None:  # shared points: the batch is finufft's n_trans
                return self(points, jnp.moveaxis(c, c_axis, 0)), 0
            # Points of their own per element: one call per element.
            points = jnp.moveaxis(points, points_axis, 0)
            c = (jnp.broadcast_to(c, points.shape[:1] + c.shape) if c_axis is None
                 else jnp.moveaxis(c, c_axis, 0))
            return jax.lax.map(lambda pc: self(*pc), (points, c)), 0

    # (Only the name changes: a class made in a function keeps "<locals>" in its qualified
    # name, which tells jaxdecl that two such classes of one name may differ.)
    FinufftType1.__name__ = "FinufftType1Kept" if keep_plan else "FinufftType1"
    return FinufftType1


def nudft_type1(points, c, n_modes):
    """The type-1 sum term by term in jax.numpy (M × N terms): the reference."""
    grids = jnp.meshgrid(*[jnp.arange(-(n // 2), (n + 1) // 2) for n in n_modes], indexing="ij")
    phase = sum(k[..., None] * x for k, x in zip(grids, points))  # (N1, ..., Nd, M)
    return jnp.sum(c * jnp.exp(1j * phase), axis=-1)


def relative(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


def per_call_us(fn, *args, number=200) -> float:
    """Best of 5 batches of `number` calls, µs per call (block_until_ready after each)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(number):
            jax.block_until_ready(fn(*args))
        best = min(best, (time.perf_counter() - start) / number)
    return best * 1e6


def main() -> None:
    directory = tempfile.TemporaryDirectory(prefix="jaxdecl_finufft_")  # removed at the end
    lib, note = build_library(pathlib.Path(directory.name))
    if lib is None:
        print("Could not compile the C++ kernels, so this tutorial stops here.")
        print("Reason:", note)
        print("Note: jaxdecl itself needs no compiler; only this example builds its own kernels.")
        return
    print("compiled with:", note)
    print("finufft's C library:", finufft_library())
    FinufftType1 = declare(lib)

    rng = np.random.default_rng(12)
    m, n = 300, 32
    points = rng.uniform(-np.pi, np.pi, (1, m))
    c = rng.standard_normal(m) + 1j * rng.standard_normal(m)
    op = FinufftType1(n)

    print("\n== 1. forward (the C kernel) against finufft's Python API and the sum itself")
    f = jax.jit(op)(points, c)
    by_python = finufft.nufft1d1(points[0], c, n, eps=TOLERANCE, nthreads=1)  # as the kernels
    by_sum = nudft_type1(points, c, (n,))
    print("f[:3]                   :", np.round(np.asarray(f[:3]), 6))
    print("max |C - finufft.py| / max |f| :", f"{relative(f, by_python):.1e}",
          "(the same library, one thread each: the same bits)")
    print("max |C - direct sum| / max |f| :", f"{relative(f, by_sum):.1e}",
          f"(tolerance {TOLERANCE})")
    assert relative(f, by_python) < 1e-14 and relative(f, by_sum) < 1e-8

    print("\n== 2. the same class in 2-D: points (2, M), modes (16, 12)")
    points_2d = rng.uniform(-np.pi, np.pi, (2, m))
    f2 = jax.jit(FinufftType1((16, 12)))(points_2d, c)
    by_python_2d = finufft.nufft2d1(*points_2d, c, (16, 12), eps=TOLERANCE, nthreads=1)
    by_sum_2d = nudft_type1(points_2d, c, (16, 12))
    print("shape", f2.shape, "| vs finufft.nufft2d1:", f"{relative(f2, by_python_2d):.1e}",
          "| vs the direct sum:", f"{relative(f2, by_sum_2d):.1e}")
    assert relative(f2, by_python_2d) < 1e-14 and relative(f2, by_sum_2d) < 1e-8

    print("\n== 3. grad of a real loss: the C transpose kernel (finufft's type 2)")
    weights = jnp.linspace(0.5, 1.5, n)
    loss = lambda c: jnp.sum(weights * jnp.abs(op(points, c)) ** 2)  # noqa: E731
    ref_loss = lambda c: jnp.sum(weights * jnp.abs(nudft_type1(points, c, (n,))) ** 2)  # noqa: E731
    grad = jax.jit(jax.grad(loss))(c)
    ref_grad = jax.grad(ref_loss)(c)
    print("grad[:3]                :", np.round(np.asarray(grad[:3]), 6))
    print("jnp reference           :", np.round(np.asarray(ref_grad[:3]), 6))
    print("max |C - jnp| / max     :", f"{relative(grad, ref_grad):.1e}")
    assert relative(grad, ref_grad) < 1e-8
    # <ct, A t> = <Aᵀ ct, t> for random t, ct (and jit against eager, vmap against a loop):
    # the two kernels are each other's transpose to finufft's tolerance.
    jd.check(op, points, c, rtol=1e-7)
    jd.check(FinufftType1((16, 12)), points_2d, c, rtol=1e-7)
    print("jd.check passed: the dot-product test, jit, vmap, in 1-D and 2-D")
    try:
        jax.grad(lambda x: jnp.sum(jnp.abs(op(x, c)) ** 2))(points)
    except Exception as error:  # the points are nondiff: differentiating them is an error
        print("grad wrt the points     :", type(error).__name__)
        print("   ", str(error).splitlines()[0])

    print("\n== 4. vmap over 8 strength vectors: ONE kernel call, finufft's n_trans = 8")
    cs = rng.standard_normal((8, m)) + 1j * rng.standard_normal((8, m))
    batched = jax.jit(jax.vmap(op, in_axes=(None, 0)))
    hlo = batched.lower(points, cs).as_text()
    print("kernel calls in the compiled program:", hlo.count("jaxdecl_dispatch"),
          "| result", batched(points, cs).shape)
    by_python_batch = finufft.nufft1d1(points[0], cs, n, eps=TOLERANCE, nthreads=1)
    print("max |vmap - finufft.py| / max:", f"{relative(batched(points, cs), by_python_batch):.1e}",
          "(finufft.py with the 8 vectors at once)")
    # Per-element points take the other branch of the @batch rule: one call per element.
    per_points = jax.vmap(op)(jnp.stack([points, -points]), cs[:2])
    print("own points per element  :", f"{relative(per_points[1], op(-points, cs[1])):.1e}")

    print("\n== 5. keeping finufft's plan: same values, less work per call")
    kept = declare(lib, keep_plan=True)(n)
    print("max |kept - per call|   :", f"{relative(jax.jit(kept)(points, c), f):.1e}")
    timings = {
        "finufft.nufft1d1 from NumPy": per_call_us(
            lambda: finufft.nufft1d1(points[0], c, n, eps=TOLERANCE, nthreads=1)),
        "jit(op), a plan per call": per_call_us(jax.jit(op), points, c),
        "jit(op), the plan kept": per_call_us(jax.jit(kept), points, c),
    }
    for name, us in timings.items():
        print(f"  {name:28s} {us:8.1f} µs per call (M = {m}, N = {n}; this machine, now)")
    print("A plan per call is what finufft's simple interface does: its first setpts fits the")
    print("spreading kernel's polynomials, computes the kernel's Fourier series and plans the")
    print("FFT, most of a small transform's time. A kept plan pays only for sorting the points")
    print("and the transform itself. Each thread keeps its own plans.")


if __name__ == "__main__":
    main()
