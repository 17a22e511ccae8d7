"""jaxdecl on a CUDA GPU: host rules staged through pinned memory, a CuPy device rule,
``jax.pure_callback`` and ``jax.numpy``, side by side in one process.

Usage::

    python benchmarks/bench_gpu.py             # full run, about two minutes on one GPU
    python benchmarks/bench_gpu.py --quick     # fewer rounds, smaller large case (a smoke run)
    python benchmarks/bench_gpu.py --out DIR/results_gpu   # JSON, chart and text elsewhere

The op is ``y = 2 x`` (float32), linear: its transpose is ``2 ct``. Variants:

- ``jaxdecl[staged]``: the class's host rules (``np.multiply(x, 2, out=out)``), run by
  the CUDA handler on pinned host copies of XLA's buffers (no class change for the GPU);
- ``jaxdecl[staged,empty]``: the same with a rule that writes nothing: the staging's own
  cost (the copies, one synchronisation, the call), for the copy target;
- ``jaxdecl[cupy]``: device rules (``platform="gpu"``) in CuPy on XLA's stream, the device
  arrays wrapped as ``cupy.ndarray`` over ``UnownedMemory`` (no copy, no synchronisation);
- ``jaxdecl[cupy,asarray]`` (the 1e6 case): the same through ``cupy.asarray``, which
  synchronises XLA's stream first (CuPy's ``CUPY_CUDA_ARRAY_INTERFACE_SYNC``);
- ``pure_callback``: ``jax.pure_callback`` (its vmap ``expand_dims``) under
  ``jax.custom_vjp``, whose backward is a second callback;
- ``native``: ``jax.numpy`` (the floor).

Cases: forward (``jit``), ``grad`` of ``sum(f(x)**2)`` (the forward and the transpose) and
``vmap`` over 8 rows, each at 1e3 and 1e7 elements, and the forward at 1e6. Every
variant's result is checked against ``jax.numpy`` before timing; then the variants of a
case are timed interleaved (:mod:`harness`), every call followed by
``block_until_ready``. The D2H and H2D bandwidth of pinned memory is measured with CuPy
(``cudaMemcpyAsync`` between a pinned host buffer and device memory, events around it),
which gives the two copies' own time at 1e7.

Targets (printed with the verdicts, recorded in the JSON):

1. a host-staged call <= 0.7x ``pure_callback``'s per call at 1e3 (forward);
2. a host-staged call <= 1.15x the two copies' own time at 1e7 (forward; the
   empty-rule variant, so that the rule's own host time is not counted);
3. a CuPy device rule ``2*x`` <= 1.3x ``jnp`` ``2*x`` inside ``jit`` at 1e6.

Without a CUDA GPU the script says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness  # noqa: E402

import jaxdecl as jd  # noqa: E402

F32 = np.float32
ROWS = 8
TARGETS = {
    "staged_vs_pure_callback_1e3": 0.7,
    "staged_vs_copies_1e7": 1.15,
    "cupy_vs_jnp_1e6": 1.3,
}


def gpus() -> list:
    """JAX's CUDA devices, or [] (no plugin, no device)."""
    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


# --- the op, in every form -------------------------------------------------------------


def _same(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


class Staged(jd.Primitive, linear=True, batch="vectorized"):
    """2 x with NumPy host rules: on a GPU, staged through pinned host memory."""

    shapes = jd.abstract(lambda self, x: _same(x))

    @jd.forward
    def apply(self, x, *, out):
        np.multiply(x, 2, out=out)

    @jd.transpose
    def back(self, ct, *, out):
        np.multiply(ct, 2, out=out)


class StagedEmpty(jd.Primitive, linear=True, batch="vectorized"):
    """Writes nothing: the staging's own cost (copies, synchronisation, the call)."""

    shapes = jd.abstract(lambda self, x: _same(x))

    @jd.forward
    def apply(self, x, *, out):
        pass

    @jd.transpose
    def back(self, ct, *, out):
        pass


@functools.lru_cache(maxsize=64)
def _cupy_stream(stream: int):
    import cupy

    return cupy.cuda.ExternalStream(stream)


def _cupy_view(array):
    """A cupy.ndarray over a device array's memory: no copy, no synchronisation (the
    rule runs on the stream the data is ready on)."""
    import cupy

    memory = cupy.cuda.UnownedMemory(array.ptr, array.nbytes, array, array.device)
    return cupy.ndarray(array.shape, array.dtype, cupy.cuda.MemoryPointer(memory, 0))


class Cupy(jd.Primitive, linear=True, batch="vectorized"):
    """2 x with device rules in CuPy (and the same host rules for the CPU)."""

    shapes = jd.abstract(lambda self, x: _same(x))
    apply = Staged.apply
    back = Staged.back

    @jd.forward(platform="gpu")
    def apply_gpu(self, x, *, out, stream):
        import cupy

        with _cupy_stream(stream):
            cupy.multiply(_cupy_view(x), 2, out=_cupy_view(out))

    @jd.transpose(platform="gpu")
    def back_gpu(self, ct, *, out, stream):
        import cupy

        with _cupy_stream(stream):
            cupy.multiply(_cupy_view(ct), 2, out=_cupy_view(out))


class CupyAsarray(jd.Primitive, linear=True, batch="vectorized"):
    """The same, the device arrays wrapped with cupy.asarray (which synchronises)."""

    shapes = jd.abstract(lambda self, x: _same(x))
    apply = Staged.apply
    back = Staged.back

    @jd.forward(platform="gpu")
    def apply_gpu(self, x, *, out, stream):
        import cupy

        with _cupy_stream(stream):
            cupy.multiply(cupy.asarray(x), 2, out=cupy.asarray(out))

    @jd.transpose(platform="gpu")
    def back_gpu(self, ct, *, out, stream):
        import cupy

        with _cupy_stream(stream):
            cupy.multiply(cupy.asarray(ct), 2, out=cupy.asarray(out))


def _host_double(x):
    return np.multiply(np.asarray(x), 2)


@jax.custom_vjp
def pure_double(x):
    return jax.pure_callback(_host_double, _same(x), x, vmap_method="expand_dims")


def _pure_fwd(x):
    return pure_double(x), None


def _pure_bwd(_, ct):
    return (jax.pure_callback(_host_double, _same(ct), ct, vmap_method="expand_dims"),)


pure_double.defvjp(_pure_fwd, _pure_bwd)

FORMS = {
    "jaxdecl[staged]": Staged(),
    "jaxdecl[staged,empty]": StagedEmpty(),
    "jaxdecl[cupy]": Cupy(),
    "jaxdecl[cupy,asarray]": CupyAsarray(),
    "pure_callback": pure_double,
    "native": lambda x: 2 * x,
}


def _program(kind: str, f):
    if kind == "forward":
        return jax.jit(f)
    if kind == "grad":
        return jax.jit(jax.grad(lambda x: jnp.sum(f(x) ** 2)))
    return jax.jit(jax.vmap(f))


def candidates(kind: str, n: int, names, have_cupy: bool) -> tuple:
    """``(makers, unchecked)`` of one case: name -> a zero-argument maker of the variant."""
    shape = (ROWS, n // ROWS) if kind == "vmap" else (n,)
    x = jax.device_put(jnp.asarray(np.random.default_rng(0).normal(size=shape).astype(F32)),
                       gpus()[0])

    def maker(name):
        if "cupy" in name and not have_cupy:
            return None
        program = _program(kind, FORMS[name])
        return lambda: (lambda: program(x))

    makers = {name: maker(name) for name in names}
    return makers, {"jaxdecl[staged,empty]"}


CASES = [  # (key, kind, elements, variants)
    ("forward_1e3", "forward", 10**3, None),
    ("grad_1e3", "grad", 10**3, None),
    ("vmap_1e3", "vmap", 10**3, None),
    ("forward_1e6", "forward", 10**6, None),
    ("forward_1e7", "forward", 10**7, None),
    ("grad_1e7", "grad", 10**7, None),
    ("vmap_1e7", "vmap", 10**7, None),
]
BASE = ["native", "jaxdecl[staged]", "jaxdecl[cupy]", "pure_callback"]


def variants_of(key: str) -> list:
    if key == "forward_1e6":
        return ["native", "jaxdecl[cupy]", "jaxdecl[cupy,asarray]", "jaxdecl[staged]"]
    if key == "forward_1e7":
        return BASE + ["jaxdecl[staged,empty]"]
    return BASE


# --- the copies' own time ------------------------------------------------------------------


def bandwidth(nbytes: int, repeats: int = 20) -> dict:
    """Pinned host <-> device copy rates (bytes/s), median of `repeats`, with CuPy."""
    import cupy

    pinned = cupy.cuda.alloc_pinned_memory(nbytes)
    device = cupy.empty(nbytes, dtype=np.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    runtime = cupy.cuda.runtime
    rates = {}
    for name, (dst, src, kind) in {
            "d2h": (pinned.ptr, device.data.ptr, runtime.memcpyDeviceToHost),
            "h2d": (device.data.ptr, pinned.ptr, runtime.memcpyHostToDevice)}.items():
        times = []
        for _ in range(repeats + 2):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            runtime.memcpyAsync(dst, src, nbytes, kind, stream.ptr)
            end.record(stream)
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
        rates[name] = nbytes / float(np.median(times[2:]))
    return rates


def host_rule_time(n: int, repeats: int = 20) -> float:
    """Seconds of the host rule alone (np.multiply into a buffer) on n float32."""
    x, out = np.ones(n, F32), np.empty(n, F32)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.multiply(x, 2, out=out)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


# --- the run ---------------------------------------------------------------------------------


def verdicts(cases: dict, copies_1e7: float | None) -> dict:
    """The three targets: the measured ratio, the target, and whether it holds."""
    def median(key, name):
        variant = cases.get(key, {}).get("variants", {}).get(name)
        return None if variant is None else variant["median_s"]

    found = {}
    pairs = {
        "staged_vs_pure_callback_1e3": (median("forward_1e3", "jaxdecl[staged]"),
                                        median("forward_1e3", "pure_callback")),
        "staged_vs_copies_1e7": (median("forward_1e7", "jaxdecl[staged,empty]"), copies_1e7),
        "cupy_vs_jnp_1e6": (median("forward_1e6", "jaxdecl[cupy]"),
                            median("forward_1e6", "native")),
    }
    for name, (mine, theirs) in pairs.items():
        ratio = None if not mine or not theirs else mine / theirs
        found[name] = {"ratio": ratio, "target": TARGETS[name],
                       "met": None if ratio is None else ratio <= TARGETS[name]}
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: few rounds")
    parser.add_argument("--out", default=str(HERE / "results_gpu"),
                        help="prefix of the JSON, PNG and TXT results")
    parser.add_argument("--no-chart", action="store_true")
    args = parser.parse_args(argv)
    devices = gpus()
    if not devices:
        platforms = sorted({d.platform for d in jax.devices()})
        print(f"bench_gpu: needs a CUDA GPU and JAX's CUDA plugin (pip install "
              f"'jax[cuda13]'); JAX sees only {', '.join(platforms)} here. Nothing measured.",
              file=sys.stderr)
        return 2
    try:
        import cupy  # noqa: F401
        have_cupy = True
    except ImportError:
        have_cupy = False
    rounds, target_s, max_seconds = (5, 2e-3, 5.0) if args.quick else (31, 4e-3, 20.0)
    cases = {}
    for key, kind, n, _ in CASES:
        if args.quick and n >= 10**7:
            n //= 10
        makers, unchecked = candidates(kind, n, variants_of(key), have_cupy)
        built, skipped = harness.build_variants(makers, unchecked=unchecked, rtol=1e-6)
        stats = harness.time_case(built, rounds=rounds, target_s=target_s, warmup=2,
                                  max_seconds=max_seconds, min_rounds=3)
        to_native = harness.ratios(stats, "native")
        to_callback = harness.ratios(stats, "pure_callback")
        title = f"{kind}, {n:.0e} float32" + (f" ({ROWS} rows)" if kind == "vmap" else "")
        harness.print_case(title, stats, {"/ native": to_native, "/ callback": to_callback},
                           skipped)
        cases[key] = {"title": title, "elements": n, "skipped": skipped, "variants": {
            name: dict(s.as_dict(), vs_native=to_native.get(name),
                       vs_pure_callback=to_callback.get(name)) for name, s in stats.items()}}
    n_large = 10**6 if args.quick else 10**7
    nbytes = 4 * n_large
    rates = bandwidth(nbytes) if have_cupy else {}
    copies = nbytes / rates["d2h"] + nbytes / rates["h2d"] if rates else None
    if copies is not None:
        print(f"\npinned copies of {nbytes / 1e6:.0f} MB: D2H {rates['d2h'] / 1e9:.1f} GB/s, "
              f"H2D {rates['h2d'] / 1e9:.1f} GB/s, both {harness.format_time(copies)}; "
              f"the host rule alone {harness.format_time(host_rule_time(n_large))}")
    found = verdicts(cases, copies)
    print("\ntargets:")
    for name, v in found.items():
        ratio = "n/a" if v["ratio"] is None else f"{v['ratio']:.2f}"
        state = "n/a" if v["met"] is None else ("met" if v["met"] else "MISSED")
        print(f"  {name:30s} {ratio:>6s} (target <= {v['target']}): {state}")
    device = devices[0]
    report = {
        "meta": {"device": getattr(device, "device_kind", str(device)), "gpus": len(devices),
                 "jax": jax.__version__, "jaxdecl": jd.__version__,
                 "python": platform.python_version(), "quick": args.quick, "cupy": have_cupy},
        "bandwidth_bytes_per_s": rates, "copies_s": copies, "targets": found, "cases": cases}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    harness.write_json(out.with_suffix(".json"), report)
    if not args.no_chart:
        harness.draw_chart(out.with_suffix(".png"), cases,
                           title=f"jaxdecl on {report['meta']['device']} (y = 2x, float32)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
