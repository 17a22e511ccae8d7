"""Per-call cost of an op called inside XLA loops: ``fori_loop``, its ``grad``, a diffrax solve.

Usage::

    python benchmarks/bench_loops.py              # full run, about a minute on 2 cores
    python benchmarks/bench_loops.py --quick      # few rounds, about 15 s (most of it compiling)
    python benchmarks/bench_loops.py --markdown   # also prints the table for README.md
    python benchmarks/bench_loops.py --no-chart   # JSON only

One op, ``y = A @ y`` on float64 with n = 5, called many times inside one
compiled program, in four forms: ``native`` (``jax.numpy``), ``jaxdecl`` (a
``multilinear=True`` op, every rule writing into ``out``: forward ``np.matmul(a, y,
out=out)``, ``@transpose(wrt="a")`` the outer product ``ct yᵀ``, ``@transpose(wrt="y")``
``np.matmul(a.T, ct, out=out)``), ``jaxbind`` (``get_linear_call`` with one transpose
per input, the same NumPy rules writing into its buffers) and
``pure_callback`` (under ``jax.custom_vjp``, its vjp one more ``pure_callback`` that
returns both cotangents). Four cases:

- ``fori``: ``lax.fori_loop`` of 100 iterations ``y = A @ y``, jitted.
- ``fori_grad``: ``jax.grad`` of ``sum(y_100 ** 2)`` with respect to (A, y0), jitted.
- ``diffrax`` / ``diffrax_grad``: ``diffrax.diffeqsolve`` of dy/dt = A y (Tsit5, PID
  controller, rtol 1e-6, atol 1e-8, t from 0 to 5) returning ``sum(y(5) ** 2)``, jitted,
  and its ``jax.grad`` with respect to (A, y0), jitted (diffrax's default adjoint,
  recursive checkpointing, which runs the forward again).

Every variant's result (every leaf) is checked against native before timing; then
the variants of a case are timed interleaved (:mod:`harness`, as ``run.py``), each
batch after one untimed run of its variant (the first run of a program after another
one ran for tens of ms is slower, by up to 1 ms here), and the median and min per-run
times are reported with the ratios to native. Every host rule increments a counter;
one untimed run of each variant reads how many host calls a run makes, and
``(t_variant - t_native) / calls`` is the cost of one host call over what XLA spends
on the native op (the NumPy rules' own cost, timed alone in Python, is reported next
to it). Results go to ``benchmarks/results_loops.json`` and a chart of the per-run
times to ``benchmarks/results_loops.png`` (``--out`` changes the prefix). BLAS runs
on one thread (set before NumPy loads).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import pathlib
import platform
import sys
import time
import timeit

os.environ.setdefault("JAX_PLATFORMS", "cpu")
for _variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

jax.config.update("jax_enable_x64", True)

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness

import jaxdecl as jd

try:
    import jaxbind
except ImportError:  # the benchmark runs without JAXbind's variants
    jaxbind = None

try:
    import diffrax
except ImportError:  # the loop cases run without diffrax
    diffrax = None

N = 5
ITERATIONS = 100
HOST_VARIANTS = ("jaxdecl", "jaxbind", "pure_callback")

#: Host calls per (library, rule), counted by every rule; read outside the timing.
CALLS: collections.Counter = collections.Counter()


def problem(n: int = N):
    """The matrix A and the start vector y0 of every case."""
    a = -jnp.eye(n) + 0.1 * jnp.arange(n * n, dtype=jnp.float64).reshape(n, n) / n**2
    y0 = jnp.linspace(1.0, 2.0, n)
    return a, y0


def _sds(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


# ---------------------------------------------------------------------------
# The op, once per library; the same NumPy rules in each.
# ---------------------------------------------------------------------------


def outer_into(ct, y, out):
    """``np.outer(ct, y)`` written into `out` (np.outer itself has no ``out=``)."""
    np.multiply(ct[:, None], y[None, :], out=out)


class MatVec(jd.Primitive, multilinear=True):
    """y = a @ x: linear in a and in x."""

    @jd.abstract
    def shapes(self, a, y):
        return jax.ShapeDtypeStruct(a.shape[:1], a.dtype)

    @jd.forward
    def apply(self, a, y, *, out):
        CALLS["jaxdecl", "forward"] += 1
        np.matmul(a, y, out=out)

    @jd.transpose(wrt="a")
    def transpose_a(self, y, ct, *, out):
        CALLS["jaxdecl", "transpose a"] += 1
        outer_into(ct, y, out)

    @jd.transpose(wrt="y")
    def transpose_y(self, a, ct, *, out):
        CALLS["jaxdecl", "transpose y"] += 1
        np.matmul(a.T, ct, out=out)


# JAXbind: kernels take (out, args, kwargs_dump); a transpose's args are the other
# inputs, then the cotangent.
def _jb_matvec(out, args, kwargs_dump):
    CALLS["jaxbind", "forward"] += 1
    np.matmul(args[0], args[1], out=out[0])


def _jb_transpose_a(out, args, kwargs_dump):
    CALLS["jaxbind", "transpose a"] += 1
    y, ct = args
    outer_into(ct, y, out[0])


def _jb_transpose_y(out, args, kwargs_dump):
    CALLS["jaxbind", "transpose y"] += 1
    a, ct = args
    np.matmul(a.T, ct, out=out[0])


def _jb_abstract(a, y, **kwargs):
    return ((a.shape[:1], a.dtype),)


def _jb_abstract_transpose_a(y, ct, **kwargs):
    return (((ct.shape[0], y.shape[0]), y.dtype),)


def _jb_abstract_transpose_y(a, ct, **kwargs):
    return ((a.shape[1:], a.dtype),)


def jaxbind_matvec():
    call = jaxbind.get_linear_call(
        _jb_matvec, (_jb_transpose_a, _jb_transpose_y), _jb_abstract,
        (_jb_abstract_transpose_a, _jb_abstract_transpose_y))
    return lambda a, y: call(a, y)[0]


# pure_callback: host functions at module level (JAX keys its callbacks by the callable).
def _host_matvec(a, y):
    CALLS["pure_callback", "forward"] += 1
    return np.matmul(a, y)


def _host_matvec_vjp(a, y, ct):
    CALLS["pure_callback", "vjp"] += 1
    return np.outer(ct, y), a.T @ ct


@jax.custom_vjp
def pure_matvec(a, y):
    return jax.pure_callback(_host_matvec, _sds(y), a, y, vmap_method="sequential")


def _pure_matvec_fwd(a, y):
    return pure_matvec(a, y), (a, y)


def _pure_matvec_bwd(residuals, ct):
    a, y = residuals
    return jax.pure_callback(_host_matvec_vjp, (_sds(a), _sds(y)), a, y, ct,
                             vmap_method="sequential")


pure_matvec.defvjp(_pure_matvec_fwd, _pure_matvec_bwd)


def matvecs() -> dict:
    """name -> the op as a function (a, y) -> a @ y; None where the library is missing."""
    return {"native": jnp.matmul, "jaxdecl": MatVec(),
            "jaxbind": None if jaxbind is None else jaxbind_matvec(),
            "pure_callback": pure_matvec}


# ---------------------------------------------------------------------------
# Cases: each returns (title, program, details); program(matvec) is the jitted function
# of (A, y0), details what the report says of the case besides the timings.
# ---------------------------------------------------------------------------


def fori_program(matvec):
    def run(a, y0):
        return lax.fori_loop(0, ITERATIONS, lambda i, y: matvec(a, y), y0)

    return run


def fori_case():
    return (f"fori_loop, {ITERATIONS} × (y = A @ y), n = {N}", lambda mv: jax.jit(fori_program(mv)),
            {"iterations": ITERATIONS})


def fori_grad_case():
    def program(matvec):
        run = fori_program(matvec)
        return jax.jit(jax.grad(lambda a, y0: jnp.sum(run(a, y0) ** 2), argnums=(0, 1)))

    return f"grad of the fori_loop wrt (A, y0), {ITERATIONS} iterations", program, \
        {"iterations": ITERATIONS}


def diffrax_final(matvec, *, stats=False):
    term = diffrax.ODETerm(lambda t, y, a: matvec(a, y))

    def final(a, y0):
        solution = diffrax.diffeqsolve(
            term, diffrax.Tsit5(), 0.0, 5.0, 0.1, y0, args=a,
            stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-8))
        value = jnp.sum(solution.ys[-1] ** 2)
        return (value, solution.stats) if stats else value

    return final


@functools.cache
def _diffrax_steps() -> dict:
    """The native solve's step counts (the same for every variant: the values agree)."""
    a, y0 = problem()
    _, stats = jax.jit(diffrax_final(jnp.matmul, stats=True))(a, y0)
    return {key: int(stats[key]) for key in ("num_steps", "num_accepted_steps",
                                              "num_rejected_steps")}


def diffrax_case():
    details = _diffrax_steps()
    return (f"diffrax Tsit5 + PID, t 0 → 5, {details['num_steps']} steps",
            lambda mv: jax.jit(diffrax_final(mv)), details)


def diffrax_grad_case():
    details = _diffrax_steps()
    return (f"grad of the diffrax solve wrt (A, y0), {details['num_steps']} steps",
            lambda mv: jax.jit(jax.grad(diffrax_final(mv), argnums=(0, 1))), details)


CASES = {"fori": fori_case, "fori_grad": fori_grad_case,
         "diffrax": diffrax_case, "diffrax_grad": diffrax_grad_case}


# ---------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------


def build_checked(program, rtol=1e-9, atol=1e-12):
    """name -> zero-argument variant, compiled, run once and checked leaf by leaf against native.

    Returns (variants, skipped): skipped names the variants left out and why.
    """
    a, y0 = problem()
    candidates = {}
    for name, matvec in matvecs().items():
        if matvec is None:
            candidates[name] = None
            continue

        def make(matvec=matvec):
            compiled = program(matvec)
            return lambda: compiled(a, y0)

        candidates[name] = make
    # The harness compiles and runs each once; every leaf is compared here.
    variants, skipped = harness.build_variants(candidates, unchecked=tuple(candidates))
    if "native" not in variants:
        raise RuntimeError(f"the native variant failed: {skipped.get('native')}")
    reference = jax.tree_util.tree_leaves(variants["native"]())
    for name in list(variants):
        leaves = jax.tree_util.tree_leaves(variants[name]())
        close = len(leaves) == len(reference) and all(
            np.allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=atol)
            for got, want in zip(leaves, reference))
        if not close:
            skipped[name] = "wrong result"
            del variants[name]
    return variants, skipped


def count_calls(variant) -> dict:
    """Host calls of one untimed run, per library and rule."""
    jax.block_until_ready(variant())  # anything lazy happens before counting
    CALLS.clear()
    jax.block_until_ready(variant())
    return dict(CALLS)


def run_case(key, make_case, *, rounds, target_s, max_seconds, min_rounds, warmup):
    title, program, details = make_case()
    variants, skipped = build_checked(program)
    calls = {name: count_calls(variant) for name, variant in variants.items()}
    stats = harness.time_case(variants, rounds=rounds, target_s=target_s, warmup=warmup,
                              max_seconds=max_seconds, min_rounds=min_rounds, settle=1)
    to_native = harness.ratios(stats, "native")
    to_native_min = harness.ratios(stats, "native", key="min")
    native = stats["native"]
    entry = {"title": title, **details, "skipped": skipped, "variants": {}}
    for name, s in stats.items():
        by_rule = {rule: n for (library, rule), n in calls[name].items() if library == name}
        total = sum(by_rule.values())
        row = {**s.as_dict(), "vs_native": to_native[name],
               "vs_native_min": to_native_min[name],
               "calls": total if name in HOST_VARIANTS else None,
               "calls_by_rule": by_rule if name in HOST_VARIANTS else None,
               "overhead_per_call_s": ((s.median - native.median) / total
                                       if name in HOST_VARIANTS and total else None),
               "overhead_per_call_min_s": ((s.min - native.min) / total
                                           if name in HOST_VARIANTS and total else None)}
        if "iterations" in details:
            row["per_iteration_s"] = s.median / details["iterations"]
            row["per_iteration_min_s"] = s.min / details["iterations"]
        entry["variants"][name] = row
    print_case(entry)
    return entry


def _cell(value, scale=1e6, digits=2):
    return "" if value is None else f"{value * scale:,.{digits}f}"


def _overhead(v) -> str:
    if v["overhead_per_call_s"] is None:
        return ""
    return f"{_cell(v['overhead_per_call_s'])} ({_cell(v['overhead_per_call_min_s'])})"


def print_case(entry) -> None:
    print(f"\n{entry['title']}")
    print(f"  {'variant':14s} {'median':>11s} {'min':>11s} {'/native':>8s} {'per iter µs':>12s}"
          f" {'host calls':>10s} {'µs per call over native (mins)':>31s}")
    for name, v in entry["variants"].items():
        print(f"  {name:14s} {harness.format_time(v['median_s'])} "
              f"{harness.format_time(v['min_s'])} {v['vs_native']:8.2f} "
              f"{_cell(v.get('per_iteration_s')):>12s} "
              f"{'' if v['calls'] is None else v['calls']:>10} "
              f"{_overhead(v):>31s}")
    for name, why in entry["skipped"].items():
        print(f"  {name:14s} skipped: {why}")


def markdown(report) -> str:
    lines = ["| case | variant | median µs | min µs | / native | µs per iteration | host calls "
             "per run | µs per call over native: medians (mins) |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for case in report["cases"].values():
        for name, v in case["variants"].items():
            lines.append(
                f"| {case['title']} | {name} | {_cell(v['median_s'], digits=1)} | "
                f"{_cell(v['min_s'], digits=1)} | {v['vs_native']:.2f} | "
                f"{_cell(v.get('per_iteration_s'))} | "
                f"{'' if v['calls'] is None else v['calls']} | "
                f"{_overhead(v)} |")
        for name, why in case["skipped"].items():
            lines.append(f"| {case['title']} | {name} | skipped: {why} | | | | | |")
    return "\n".join(lines)


def rule_costs() -> dict:
    """Seconds per call of each NumPy rule alone, in Python (min of 7 × 10,000 calls)."""
    a, y = (np.asarray(x) for x in problem())
    out, out_a, ct = np.empty(N), np.empty((N, N)), y[::-1].copy()
    rules = {"np.matmul(a, y, out=out)": lambda: np.matmul(a, y, out=out),
             "outer_into(ct, y, out)": lambda: outer_into(ct, y, out_a),
             "np.matmul(a.T, ct, out=out)": lambda: np.matmul(a.T, ct, out=out),
             "np.outer(ct, y), a.T @ ct": lambda: (np.outer(ct, y), a.T @ ct)}
    return {name: min(timeit.repeat(rule, number=10_000, repeat=7)) / 10_000
            for name, rule in rules.items()}


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _versions() -> dict:
    return {"python": platform.python_version(), "jax": jax.__version__,
            "numpy": np.__version__, "jaxdecl": jd.__version__,
            "jaxbind": getattr(jaxbind, "__version__", None),
            "diffrax": getattr(diffrax, "__version__", None),
            "machine": platform.machine(), "cpu": _cpu_model(),
            "cpus": os.cpu_count()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds, seconds")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per variant")
    parser.add_argument("--out", default=str(HERE / "results_loops"),
                        help="prefix of the .json and .png outputs")
    parser.add_argument("--no-chart", action="store_true", help="skip the PNG")
    parser.add_argument("--markdown", action="store_true",
                        help="also print the results as a Markdown table")
    args = parser.parse_args(argv)

    rounds = args.rounds or (3 if args.quick else 301)
    target_s = 0.0005 if args.quick else 0.001
    max_seconds = 1.0 if args.quick else 25.0
    min_rounds = 3 if args.quick else 15
    warmup = 1 if args.quick else 3
    report = {"meta": {**_versions(), "quick": args.quick, "max_rounds": rounds,
                       "max_seconds_per_case": max_seconds, "batch_target_s": target_s,
                       "n": N, "dtype": "float64",
                       "method": "interleaved rounds, one untimed run of a variant before "
                                 "each of its batches; per-run time = batch time / runs, "
                                 "block_until_ready after every run; host calls counted "
                                 "in one untimed run"},
              "cases": {}, "skipped_cases": {}}
    start = time.perf_counter()
    for key, make_case in CASES.items():
        if key.startswith("diffrax") and diffrax is None:
            report["skipped_cases"][key] = "diffrax is not installed"
            print(f"\n{key}: skipped, diffrax is not installed")
            continue
        report["cases"][key] = run_case(key, make_case, rounds=rounds, target_s=target_s,
                                        max_seconds=max_seconds, min_rounds=min_rounds,
                                        warmup=warmup)
    report["rule_costs_s"] = rule_costs()
    print("\nThe NumPy rules alone (Python calls, n = 5):")
    for name, seconds in report["rule_costs_s"].items():
        print(f"  {name:28s} {seconds * 1e6:6.2f} µs")
    report["meta"]["wall_s"] = time.perf_counter() - start
    harness.write_json(args.out + ".json", report)
    if not args.no_chart:
        # One timed call is a whole program run (100 iterations, a solve), hence "per run".
        harness.draw_chart(args.out + ".png",
                           {e["title"]: e for e in report["cases"].values()},
                           title=f"y = A @ y (n = {N}) inside compiled loops (jax "
                                 f"{jax.__version__}, {os.cpu_count()} CPUs; "
                                 f"bars median, ticks min)",
                           ylabel="µs per run (median)")
    if args.markdown:
        print("\n" + markdown(report))
    written = f"{args.out}.json" + ("" if args.no_chart else f" and {args.out}.png")
    print(f"\nwrote {written} ({report['meta']['wall_s']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
