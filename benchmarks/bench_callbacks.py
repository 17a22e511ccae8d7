"""``jd.pure_callback`` against ``jax.pure_callback``: the same calls, side by side in one run.

Usage::

    python benchmarks/bench_callbacks.py              # full run, about two minutes on 2 cores
    python benchmarks/bench_callbacks.py --quick      # few rounds, about 30 s
    python benchmarks/bench_callbacks.py --markdown   # also prints the table for the README
    python benchmarks/bench_callbacks.py --no-chart   # JSON only

The callback is ``np.sin`` of 10 float64 values (the diffrax case: a 5 x 5 mat-vec), called
through each API with the same arguments; ``native`` is the same in ``jax.numpy``. Cases:

- ``eager``: one call outside any trace; ``eager, fresh lambda``: a new lambda each call
  (``jax.pure_callback`` compiles each one anew; jaxdecl keys it by code and closure).
- ``jit``: a jitted function of one call.
- ``vmap <method>``: ``jit(vmap)`` over 8 rows, for each ``vmap_method``.
- ``fori_loop``: 100 calls in a ``lax.fori_loop``, jitted; ``diffrax``: a Tsit5 solve whose
  vector field is the callback (the calls per solve are counted).
- ``grad, custom_vjp``: ``jax.grad`` through a ``jax.custom_vjp`` whose forward and
  backward are callbacks (sin, then cos), jitted.
- ``4 devices``: ``jit`` of one call on 40 values split over 4 host devices.

Every variant's result is checked against ``native`` before timing, then the variants of a
case are timed interleaved (:mod:`harness`). The report gives each case's ratio
``jd.pure_callback / jax.pure_callback`` against its target (eager and jit <= 0.15, loops
and diffrax <= 0.05 per call, sequential vmap <= 0.1). Results go to
``benchmarks/results_callbacks.json`` and a chart to ``benchmarks/results_callbacks.png``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
for _variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)
HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness  # noqa: E402

import jaxdecl as jd  # noqa: E402

try:
    import diffrax
except ImportError:  # pragma: no cover - an optional comparison
    diffrax = None

APIS = {"jaxdecl": jd.pure_callback, "pure_callback": jax.pure_callback}
#: case -> the ratio jd.pure_callback / jax.pure_callback it must stay under
TARGETS = {"eager": 0.15, "eager, fresh lambda": 0.15, "jit": 0.15,
           "vmap sequential": 0.1, "vmap sequential_unrolled": 0.1, "fori_loop": 0.05,
           "diffrax": 0.05}
X = jnp.linspace(0.1, 1.0, 10)
ROWS = jnp.linspace(0.1, 1.0, 80).reshape(8, 10)
CALLS = [0]


def counted_sin(x):
    CALLS[0] += 1
    return np.sin(x)


def _sds(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def eager_case():
    return {name: (lambda api=api: lambda: api(counted_sin, _sds(X), X))
            for name, api in APIS.items()} | {"native": lambda: lambda: jnp.sin(X)}


def fresh_lambda_case():
    return {name: (lambda api=api: lambda: api(lambda v: np.sin(v), _sds(X), X))
            for name, api in APIS.items()} | {"native": lambda: lambda: jnp.sin(X)}


def _jitted(program, *args):
    def make():
        f = jax.jit(program)
        return lambda: f(*args)
    return make


def jit_case():
    return {name: _jitted(lambda x, api=api: api(counted_sin, _sds(x), x), X)
            for name, api in APIS.items()} | {"native": _jitted(jnp.sin, X)}


def vmap_case(method):
    def case():
        row = jax.ShapeDtypeStruct((10,), X.dtype)
        return {name: _jitted(jax.vmap(lambda x, api=api: api(
            counted_sin, row, x, vmap_method=method)), ROWS) for name, api in APIS.items()} \
            | {"native": _jitted(jax.vmap(jnp.sin), ROWS)}
    return case


def fori_case():
    def program(sin):
        return lambda x: jax.lax.fori_loop(0, 100, lambda i, c: sin(c) + 0.5, x)

    return {name: _jitted(program(lambda c, api=api: api(counted_sin, _sds(c), c)), X)
            for name, api in APIS.items()} | {"native": _jitted(program(jnp.sin), X)}


A = jnp.asarray(np.random.default_rng(0).normal(size=(5, 5)) * 0.3)
Y0 = jnp.linspace(0.5, 1.0, 5)


def counted_matvec(a, y):
    CALLS[0] += 1
    return a @ y


def diffrax_case():
    def program(matvec):
        def solve(a, y0):
            term = diffrax.ODETerm(lambda t, y, a: matvec(a, y))
            sol = diffrax.diffeqsolve(term, diffrax.Tsit5(), 0.0, 5.0, 0.1, y0, args=a,
                                      stepsize_controller=diffrax.PIDController(
                                          rtol=1e-6, atol=1e-8))
            return jnp.sum(sol.ys[-1] ** 2)
        return solve

    return {name: _jitted(program(lambda a, y, api=api: api(counted_matvec, _sds(y), a, y)),
                          A, Y0) for name, api in APIS.items()} \
        | {"native": _jitted(program(lambda a, y: a @ y), A, Y0)}


def _wrapped(api):
    @jax.custom_vjp
    def sin(x):
        return api(np.sin, _sds(x), x)

    sin.defvjp(lambda x: (sin(x), x), lambda x, g: (g * api(np.cos, _sds(x), x),))
    return sin


def _summed(f):
    return lambda x: f(x).sum()


def grad_case():
    return {name: _jitted(jax.grad(_summed(_wrapped(api))), X) for name, api in APIS.items()} \
        | {"native": _jitted(jax.grad(_summed(jnp.sin)), X)}


def devices_case():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("d",))
    x = jax.device_put(jnp.linspace(0.1, 1.0, 40), jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec("d")))
    return {name: _jitted(lambda v, api=api: api(counted_sin, _sds(v), v), x)
            for name, api in APIS.items()} | {"native": _jitted(jnp.sin, x)}


CASES = {"eager": eager_case, "eager, fresh lambda": fresh_lambda_case, "jit": jit_case,
         **{f"vmap {m}": vmap_case(m) for m in ("sequential", "sequential_unrolled",
                                                "expand_dims", "broadcast_all")},
         "fori_loop": fori_case, "diffrax": diffrax_case, "grad, custom_vjp": grad_case,
         "4 devices": devices_case}


def calls_per_run(variant) -> int:
    jax.block_until_ready(variant())
    CALLS[0] = 0
    jax.block_until_ready(variant())
    return CALLS[0]


def run_case(name, make, *, rounds, target_s, max_seconds, min_rounds, warmup):
    variants, skipped = harness.build_variants(make(), rtol=1e-9)
    calls = calls_per_run(variants["jaxdecl"]) if "jaxdecl" in variants else None
    stats = harness.time_case(variants, rounds=rounds, target_s=target_s, warmup=warmup,
                              max_seconds=max_seconds, min_rounds=min_rounds, settle=1)
    to_callback = harness.ratios(stats, "pure_callback")
    to_callback_min = harness.ratios(stats, "pure_callback", key="min")
    to_native = harness.ratios(stats, "native")
    harness.print_case(name, stats, {"/ jax.pure_callback": to_callback, "/ native": to_native},
                       skipped)
    ratio = to_callback.get("jaxdecl")
    target = TARGETS.get(name)
    entry = {"title": name, "skipped": skipped, "host_calls_per_run": calls,
             "target": target, "ratio": ratio, "ratio_min": to_callback_min.get("jaxdecl"),
             "met": None if target is None or ratio is None else ratio <= target,
             "variants": {v: {**s.as_dict(), "vs_pure_callback": to_callback.get(v),
                              "vs_native": to_native.get(v)} for v, s in stats.items()}}
    if target is not None and ratio is not None:
        print(f"  jd / jax: {ratio:.3f} (target <= {target}: "
              f"{'met' if entry['met'] else 'MISSED'})")
    return entry


def markdown(report) -> str:
    lines = ["| case | jd.pure_callback µs | jax.pure_callback µs | ratio (medians) | target |",
             "|---|---:|---:|---:|---:|"]
    for entry in report["cases"].values():
        v = entry["variants"]
        jd_s, jax_s = v.get("jaxdecl"), v.get("pure_callback")
        if jd_s is None or jax_s is None:
            continue
        target = "" if entry["target"] is None else f"≤ {entry['target']}"
        lines.append(f"| {entry['title']} | {jd_s['median_s'] * 1e6:,.1f} | "
                     f"{jax_s['median_s'] * 1e6:,.1f} | {entry['ratio']:.3f} | {target} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds, seconds")
    parser.add_argument("--out", default=str(HERE / "results_callbacks"),
                        help="prefix of the .json and .png outputs")
    parser.add_argument("--no-chart", action="store_true", help="skip the PNG")
    parser.add_argument("--markdown", action="store_true", help="also print the table")
    parser.add_argument("--cases", nargs="*", default=None, help="only these cases")
    args = parser.parse_args(argv)
    rounds = 3 if args.quick else 101
    target_s = 0.0005 if args.quick else 0.002
    max_seconds = 0.5 if args.quick else 8.0
    min_rounds = 3 if args.quick else 11
    report = {"meta": {"python": platform.python_version(), "jax": jax.__version__,
                       "numpy": np.__version__, "jaxdecl": jd.__version__,
                       "diffrax": getattr(diffrax, "__version__", None),
                       "cpus": os.cpu_count(), "quick": args.quick,
                       "method": "interleaved rounds (harness.time_case), one untimed call "
                                 "before each batch; block_until_ready after every call"},
              "cases": {}, "skipped_cases": {}}
    start = time.perf_counter()
    for name, make in CASES.items():
        if args.cases and name not in args.cases:
            continue
        if name == "diffrax" and diffrax is None:
            report["skipped_cases"][name] = "diffrax is not installed"
            continue
        report["cases"][name] = run_case(name, make, rounds=rounds, target_s=target_s,
                                         max_seconds=max_seconds, min_rounds=min_rounds,
                                         warmup=1 if args.quick else 3)
    report["meta"]["wall_s"] = time.perf_counter() - start
    missed = [n for n, e in report["cases"].items() if e["met"] is False]
    report["targets_missed"] = missed
    harness.write_json(args.out + ".json", report)
    if not args.no_chart:
        harness.draw_chart(args.out + ".png", report["cases"],
                           title=f"jd.pure_callback vs jax.pure_callback (jax "
                                 f"{jax.__version__}, {os.cpu_count()} CPUs; bars median, "
                                 f"ticks min)")
    if args.markdown:
        print("\n" + markdown(report))
    print(f"\ntargets missed: {missed or 'none'}; wrote {args.out}.json "
          f"({report['meta']['wall_s']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
