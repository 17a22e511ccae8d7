"""Rows in parallel: a vmapped C kernel on XLA's intra-op pool, side by side in one run.

Usage::

    python benchmarks/bench_threads.py              # full run, about two minutes on 2 cores
    python benchmarks/bench_threads.py --quick      # few rounds, about 20 s
    python benchmarks/bench_threads.py --no-chart   # JSON only

The rule is a real one: the cube root of every value of a row, refined by one Newton
steps (a C kernel, ``jd.cfunction``; the same C function serves the by-hand runs). ``jit(vmap)``
over 8 and 64 rows of 1 KiB, 64 KiB and 1 MiB (float64). Variants:

- ``jaxdecl[C, pool]``: the op as users get it, rows on XLA's pool once the call moves
  256 KiB;
- ``jaxdecl[C, sequential]``: the same op, rows in sequence (``set_row_threads(1)``,
  what ``JAXDECL_ROW_THREADS=1`` sets);
- ``jaxdecl[NumPy rule]``: ``np.cbrt`` as a Python rule (its rows run in sequence);
- ``pure_callback``: ``jax.pure_callback`` of ``np.cbrt``, ``vmap_method="sequential"``;
- ``native``: ``jnp.cbrt``;
- ``floor[N threads]``: the C function by hand on as many Python threads as there are
  CPUs, each on its share of the rows (ctypes releases the GIL); ``by hand[1 thread]``.

``4 devices``: one program on 4 host devices (XLA runs the 4 calls at once), a C kernel, a
NumPy rule and a rule holding the GIL, against the same rows on 1 device.

Targets: 1 MiB rows on the pool >= 0.85 x the floor's speed (pool time <= floor / 0.85);
1 KiB rows no slower than in sequence (<= 1.05 x). Results go to
``benchmarks/results_threads.json`` and a chart to ``benchmarks/results_threads.png``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import os
import pathlib
import platform
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)
HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness  # noqa: E402

import jaxdecl as jd  # noqa: E402
from jaxdecl._host import _dispatch  # noqa: E402

SOURCE = r"""
#include <math.h>
#include "jaxdecl.h"

/* y = cbrt(x) for n values: libm's, then one Newton step (which keeps it). */
void cbrt_span(const double* x, double* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    double v = x[i], r = cbrt(v);
    for (int k = 0; k < 1; ++k) r = r - (r * r * r - v) / (3.0 * r * r);
    y[i] = r;
  }
}

int cbrt_rows(const jaxdecl_buffer* in, int64_t nin, const jaxdecl_buffer* out,
              int64_t nout, char* message, int64_t message_size) {
  int64_t n = 1;
  for (int64_t d = 0; d < in[0].rank; ++d) n *= in[0].dims[d];
  cbrt_span((const double*)in[0].data, (double*)out[0].data, n);
  return 0;
}
"""
ROWS = (8, 64)
ROW_BYTES = {"1 KiB": 1 << 10, "64 KiB": 64 << 10, "1 MiB": 1 << 20}
FLOOR_TARGET = 0.85  # pool speed / floor speed, 1 MiB rows
TINY_TARGET = 1.05  # pool time / sequential time, 1 KiB rows


def _compiled():
    import shutil
    import subprocess

    folder = pathlib.Path(tempfile.mkdtemp())
    (folder / "cbrt.c").write_text(SOURCE)
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", f"-I{jd.include_dir()}",
                    str(folder / "cbrt.c"), "-o", str(folder / "libcbrt.so"), "-lm"], check=True)
    library = ctypes.CDLL(str(folder / "libcbrt.so"))
    library.cbrt_span.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    library.cbrt_span.restype = None
    return library


LIBRARY = _compiled()


class CbrtC(jd.Primitive):
    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    apply = jd.forward(jd.cfunction(LIBRARY.cbrt_rows, keepalive=LIBRARY))


class CbrtNumPy(jd.Primitive):
    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, *, out):
        np.cbrt(x, out=out)


class CbrtHoldingTheGIL(jd.Primitive):
    """The same values, by np.cbrt on 256-value pieces in a Python loop: the GIL is held
    between the pieces (most of the time), as a rule doing Python work holds it."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, *, out):
        flat, into = x.reshape(-1), out.reshape(-1)
        for start in range(0, flat.size, 256):
            np.cbrt(flat[start:start + 256], out=into[start:start + 256])


def _by_rows(cls):
    """`cls` declared by rows (``sharding="b n -> b n"``): each device runs its block."""
    return type(cls.__name__ + "ByRows", (cls,), {}, sharding="b n -> b n")


def devices_case(pool):
    """The 4 concurrent calls of one program on 4 host devices (a block of 16 rows of
    64 KiB each), against the same rows on 1 device: how a C kernel, a NumPy rule and a
    rule holding the GIL overlap."""
    x_np = np.random.default_rng(4).uniform(0.1, 100.0, (64, 8192))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("d",))
    split = jax.device_put(x_np, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
    whole = jax.device_put(x_np, jax.devices()[0])
    variants = {}
    for label, cls in (("C", CbrtC), ("NumPy rule", CbrtNumPy),
                       ("rule holding the GIL", CbrtHoldingTheGIL)):
        f = jax.jit(_by_rows(cls)())
        variants[f"jaxdecl[{label}, 4 devices]"] = lambda f=f: lambda: f(split)
        variants[f"jaxdecl[{label}, 1 device]"] = lambda f=f: lambda: f(whole)
    return variants


def _by_hand(x: np.ndarray, threads: int, pool):
    y = np.empty_like(x)
    n = x.shape[1]

    def rows(first):
        for r in range(first, x.shape[0], threads):
            LIBRARY.cbrt_span(x[r].ctypes.data, y[r].ctypes.data, n)

    if threads == 1:
        rows(0)
    else:
        list(pool.map(rows, range(threads)))
    return y


def _sequential(f):
    def run():
        _dispatch.set_row_threads(1)
        try:
            return jax.block_until_ready(f())
        finally:
            _dispatch.set_row_threads(0)
    return run


def case(rows: int, row_bytes: int, pool):
    x_np = np.random.default_rng(rows).uniform(0.1, 100.0, (rows, row_bytes // 8))
    x = jnp.asarray(x_np)
    row = jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    c_op = jax.jit(jax.vmap(CbrtC()))
    numpy_op = jax.jit(jax.vmap(CbrtNumPy()))
    callback = jax.jit(jax.vmap(lambda v: jax.pure_callback(np.cbrt, row, v,
                                                            vmap_method="sequential")))
    native = jax.jit(jax.vmap(jnp.cbrt))
    cpus = os.cpu_count() or 1
    return {"jaxdecl[C, pool]": lambda: lambda: c_op(x),
            "jaxdecl[C, sequential]": lambda: _sequential(lambda: c_op(x)),
            "jaxdecl[NumPy rule]": lambda: lambda: numpy_op(x),
            "pure_callback": lambda: lambda: callback(x),
            "native": lambda: lambda: native(x),
            f"floor[{cpus} threads]": lambda: lambda: _by_hand(x_np, cpus, pool),
            "by hand[1 thread]": lambda: lambda: _by_hand(x_np, 1, pool)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds, seconds")
    parser.add_argument("--out", default=str(HERE / "results_threads"),
                        help="prefix of the .json and .png outputs")
    parser.add_argument("--no-chart", action="store_true", help="skip the PNG")
    args = parser.parse_args(argv)
    rounds, min_rounds = (3, 3) if args.quick else (41, 9)
    target_s, max_seconds = (0.002, 0.6) if args.quick else (0.02, 8.0)
    cpus = os.cpu_count() or 1
    floor = f"floor[{cpus} threads]"
    report = {"meta": {"python": platform.python_version(), "jax": jax.__version__,
                       "numpy": np.__version__, "jaxdecl": jd.__version__, "cpus": cpus,
                       "quick": args.quick,
                       "method": "interleaved rounds (harness.time_case), one untimed call "
                                 "before each batch; block_until_ready after every call"},
              "cases": {}, "targets": []}
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(cpus) as pool:
        for rows in ROWS:
            for label, row_bytes in ROW_BYTES.items():
                name = f"{rows} rows x {label}"
                variants, skipped = harness.build_variants(case(rows, row_bytes, pool),
                                                           rtol=1e-12)
                stats = harness.time_case(variants, rounds=rounds, target_s=target_s,
                                          warmup=1, max_seconds=max_seconds,
                                          min_rounds=min_rounds, settle=1)
                to_sequential = harness.ratios(stats, "jaxdecl[C, sequential]")
                to_floor = harness.ratios(stats, floor)
                harness.print_case(name, stats, {"/ sequential": to_sequential,
                                                 "/ floor": to_floor}, skipped)
                report["cases"][name] = {
                    "title": name, "rows": rows, "row_bytes": row_bytes, "skipped": skipped,
                    "variants": {v: {**s.as_dict(), "vs_sequential": to_sequential.get(v),
                                     "vs_floor": to_floor.get(v)} for v, s in stats.items()}}
                pooled = report["cases"][name]["variants"].get("jaxdecl[C, pool]", {})
                if label == "1 MiB" and pooled.get("vs_floor"):
                    speed = 1.0 / pooled["vs_floor"]
                    report["targets"].append({"case": name, "measure": "speed / floor",
                                              "value": speed, "target": f">= {FLOOR_TARGET}",
                                              "met": speed >= FLOOR_TARGET})
                if label == "1 KiB" and pooled.get("vs_sequential"):
                    value = pooled["vs_sequential"]
                    report["targets"].append({"case": name, "measure": "time / sequential",
                                              "value": value, "target": f"<= {TINY_TARGET}",
                                              "met": value <= TINY_TARGET})
        name = "4 devices x 16 rows x 64 KiB"
        variants, skipped = harness.build_variants(devices_case(pool), rtol=1e-12)
        stats = harness.time_case(variants, rounds=rounds, target_s=target_s, warmup=1,
                                  max_seconds=max_seconds, min_rounds=min_rounds, settle=1)
        speedups = {v: stats[v.replace("4 devices", "1 device")].median / stats[v].median
                    for v in stats if "4 devices" in v}
        harness.print_case(name, stats, {"1 device / 4 devices": speedups}, skipped)
        report["devices"] = {
            "title": name, "skipped": skipped,
            "speedup_4_over_1": speedups,
            "variants": {v: s.as_dict() for v, s in stats.items()}}
    report["meta"]["wall_s"] = time.perf_counter() - start
    print()
    for target in report["targets"]:
        print(f"  {'met   ' if target['met'] else 'MISSED'} {target['case']:20s} "
              f"{target['measure']} = {target['value']:.3f} ({target['target']})")
    harness.write_json(args.out + ".json", report)
    if not args.no_chart:
        harness.draw_chart(args.out + ".png", report["cases"],
                           title=f"rows in parallel (jax {jax.__version__}, {cpus} CPUs; "
                                 f"bars median, ticks min)")
    return report


if __name__ == "__main__":
    main()
