"""jaxdecl against JAXbind, jax.pure_callback, buffer_callback and native jax.numpy.

Usage::

    python benchmarks/run.py            # full run (a couple of minutes on 2 cores)
    python benchmarks/run.py --quick    # smoke run, a few seconds
    python benchmarks/run.py --profile  # adds JAXbind's empty-rule variant to case 1
    python benchmarks/run.py --markdown # also prints the table for README.md

Every case builds (compiles and warms up) all its variants first, then times
them interleaved in one process (:mod:`harness`). Results go to
``benchmarks/results.json`` and ``benchmarks/results.png`` (``--out`` changes
the prefix). Every variant runs the same NumPy rule on the same data
(:mod:`implementations`).

A case is a function from the run's :class:`Options` to its candidates (name
-> a maker of the variant, None where the library is missing) plus a row of
:data:`CASES`; a row of :data:`TARGETS` gives it a target ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import pathlib
import platform
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness
from implementations import (
    Double,
    DoubleEmpty,
    DoubleReturning,
    DoubleVectorized,
    MulSq,
    buffer_callback,
    buffer_double,
    buffer_sum_double,
    double_c_class,
    double_into,
    jaxbind,
    jaxbind_double,
    jaxbind_empty,
    jaxbind_mulsq,
    jaxbind_sum_double,
    pure_double,
    pure_mulsq,
    pure_sum_double,
    sum_double_class,
)

import jaxdecl as jd

F64 = np.float64
LARGE = 10**7
LARGE_QUICK = 10**6


@dataclasses.dataclass(frozen=True)
class Options:
    """What a case may depend on; the case titles may name these fields ("{large}")."""

    quick: bool
    profile: bool
    large: int  # elements of case 4


# ---------------------------------------------------------------------------
# Cases: each returns its candidates, name -> maker of a zero-argument variant.
# ---------------------------------------------------------------------------


def _jitted(f, *args):
    g = jax.jit(f)
    return lambda: g(*args)


def _double_candidates(x):
    """Every variant of `out = 2 x` on `x`, jitted (cases 1 and 4)."""
    return {
        "native": lambda: _jitted(lambda a: a * 2, x),
        "jaxdecl": lambda: _jitted(Double(), x),
        "jaxdecl[C]": double_c_class() and (lambda: _jitted(double_c_class()(), x)),
        "jaxbind": jaxbind and (lambda: _jitted(jaxbind_double(), x)),
        "pure_callback": lambda: _jitted(pure_double, x),
        "buffer_callback": buffer_callback and (lambda: _jitted(buffer_double, x)),
    }


def _rule_per_row(x):
    """The rule called from a Python loop on each row's NumPy views: case 5's floor.

    No JAX at all (the views made by slicing, as a Python loop over the batch
    would). Cases 1 and 3 have no such variant: the harness's wait after every
    call (about 0.8 µs on a NumPy result) would outweigh the rule itself.
    """
    x = np.array(x)
    out = np.empty_like(x)

    def loop():
        for row, out_row in zip(x, out):
            double_into(row, out_row)
        return out
    return loop


def jit_one_input(opts, n=10):
    x = jnp.arange(n, dtype=F64)
    candidates = _double_candidates(x)
    # Same dispatch, no work: what remains is the cost of reaching the rule (a target).
    candidates["jaxdecl[empty]"] = lambda: _jitted(DoubleEmpty(), x)
    if opts.profile:
        candidates["jaxbind[empty]"] = jaxbind and (lambda: _jitted(jaxbind_empty(), x))
    return candidates


def jit_n_inputs(opts, k, n=10):
    xs = [jnp.arange(n, dtype=F64) + i for i in range(k)]
    op = sum_double_class(k)()
    return {
        "native": lambda: _jitted(lambda *a: functools.reduce(jnp.add, a) * 2, *xs),
        "jaxdecl": lambda: _jitted(op, *xs),
        "jaxbind": jaxbind and (lambda: _jitted(jaxbind_sum_double(), *xs)),
        "pure_callback": lambda: _jitted(pure_sum_double, *xs),
        "buffer_callback": buffer_callback and (lambda: _jitted(buffer_sum_double, *xs)),
    }


def eager(opts, n=10):
    x = jnp.arange(n, dtype=F64)
    op = Double()
    jb = jaxbind and jaxbind_double()
    return {
        "native": lambda: (lambda: x * 2),
        "jaxdecl": lambda: (lambda: op(x)),
        "jaxbind": jb and (lambda: (lambda: jb(x))),
        "pure_callback": lambda: (lambda: pure_double(x)),
        "buffer_callback": buffer_callback and (lambda: (lambda: buffer_double(x))),
    }


def jit_large(opts):
    return _double_candidates(jnp.arange(opts.large, dtype=F64))


def vmap_rows(opts, batch=64, n=10):
    x = jnp.arange(batch * n, dtype=F64).reshape(batch, n)
    jb = jaxbind and jaxbind_double()
    return {
        "native": lambda: _jitted(jax.vmap(lambda a: a * 2), x),
        "jaxdecl[loop]": lambda: _jitted(jax.vmap(Double()), x),
        # the same loop over a rule in the return form, and over a C kernel
        "jaxdecl[loop, return]": lambda: _jitted(jax.vmap(DoubleReturning()), x),
        "jaxdecl[loop, C]": double_c_class() and (
            lambda: _jitted(jax.vmap(double_c_class()()), x)),
        "jaxdecl[vectorized]": lambda: _jitted(jax.vmap(DoubleVectorized()), x),
        "jaxbind": jb and (lambda: _jitted(jax.vmap(jb), x)),
        "pure_callback[sequential]": lambda: _jitted(jax.vmap(pure_double), x),
        "pure_callback[expand_dims]": lambda: _jitted(
            jax.vmap(functools.partial(pure_double, vmap_method="expand_dims")), x),
        "buffer_callback[sequential]": buffer_callback and (
            lambda: _jitted(jax.vmap(buffer_double), x)),
        "rule alone": lambda: _rule_per_row(x),
    }


def jit_grad(opts, n=1000):
    x1 = jnp.linspace(-1.0, 1.0, n, dtype=F64)
    x2 = jnp.linspace(0.5, 2.0, n, dtype=F64)

    def grad_of(f):
        return _jitted(jax.grad(lambda a, b: jnp.sum(f(a, b)), argnums=(0, 1)), x1, x2)

    jb = jaxbind and jaxbind_mulsq()
    return {
        "native": lambda: grad_of(lambda a, b: a * b**2),
        "jaxdecl": lambda: grad_of(MulSq()),
        "jaxbind": jb and (lambda: grad_of(jb)),
        "pure_callback": lambda: grad_of(pure_mulsq),
    }


# (key, title, candidates) of every case, in order.
CASES = [
    ("1_jit_10_1in", "1. jit, 10 × f64, 1 input", jit_one_input),
    ("2_jit_10_4in", "2. jit, 10 × f64, 4 inputs", functools.partial(jit_n_inputs, k=4)),
    ("2_jit_10_16in", "2. jit, 10 × f64, 16 inputs", functools.partial(jit_n_inputs, k=16)),
    ("3_eager_10_1in", "3. eager, 10 × f64, 1 input", eager),
    ("4_jit_large", "4. jit, {large:.0e} × f64", jit_large),
    ("5_vmap_64x10", "5. jit(vmap), 64 × (10 × f64)", vmap_rows),
    ("6_jit_grad_1000", "6. jit(grad), x1*x2**2 summed, 1000 × f64", jit_grad),
]

# (case, variant, reference, limit): variant/reference (medians) must be <= limit.
# The dispatch goals: reaching an empty Python rule costs no more than reaching a C
# kernel (case 1), and the ratios to JAXbind below.
TARGETS = [
    ("1_jit_10_1in", "jaxdecl[empty]", "native", 1.05),
    ("1_jit_10_1in", "jaxdecl", "jaxbind", 0.70),
    ("2_jit_10_16in", "jaxdecl", "jaxbind", 0.55),
    ("3_eager_10_1in", "jaxdecl", "jaxbind", 0.50),
    ("4_jit_large", "jaxdecl", "jaxbind", 1.0),
    ("5_vmap_64x10", "jaxdecl[loop]", "jaxbind", 0.22),
    ("6_jit_grad_1000", "jaxdecl", "jaxbind", 0.85),
]


# ---------------------------------------------------------------------------
# Running the table.
# ---------------------------------------------------------------------------


def _versions():
    info = {"python": platform.python_version(), "jax": jax.__version__,
            "numpy": np.__version__, "jaxdecl": jd.__version__,
            "jaxbind": getattr(jaxbind, "__version__", None),
            "buffer_callback": buffer_callback is not None,
            "machine": platform.machine(), "cpus": os.cpu_count()}
    return info


def run_case(title, candidates, *, quick, rounds, target_s, max_seconds):
    """Builds, times and prints one case; returns its report entry."""
    # Empty rules leave their output unwritten, so there is no result to check.
    variants, skipped = harness.build_variants(
        candidates, unchecked=[name for name in candidates if name.endswith("[empty]")])
    stats = harness.time_case(variants, rounds=rounds, target_s=target_s,
                              warmup=1 if quick else 3, max_seconds=max_seconds,
                              min_rounds=3 if quick else 15)
    to_native = harness.ratios(stats, "native")
    to_jaxbind = harness.ratios(stats, "jaxbind")
    entry = {"title": title, "skipped": skipped, "variants": {}}
    for name, s in stats.items():
        entry["variants"][name] = {**s.as_dict(), "vs_native": to_native.get(name),
                                   "vs_jaxbind": to_jaxbind.get(name)}
    harness.print_case(title, stats, {"/native": to_native, "/jaxbind": to_jaxbind}, skipped)
    return entry


def judge_targets(cases):
    """Each target's verdict on the ratio of medians, printed and returned."""
    print("\nTargets (verdict on the ratio of medians):")
    verdicts = []
    for case, variant, reference, limit in TARGETS:
        case_variants = cases[case]["variants"]
        if variant in case_variants and reference in case_variants:
            value = case_variants[variant]["median_s"] / case_variants[reference]["median_s"]
            best = case_variants[variant]["min_s"] / case_variants[reference]["min_s"]
            verdict = "PASS" if value <= limit else "MISS"
        else:
            value, best, verdict = None, None, "SKIP"
        verdicts.append({"case": case, "variant": variant, "reference": reference,
                         "limit": limit, "ratio": value, "ratio_of_mins": best,
                         "verdict": verdict})
        shown = "   n/a" if value is None else f"{value:6.3f} (mins: {best:6.3f})"
        print(f"  {verdict}  {case:16s} {variant + '/' + reference:24s} = {shown}  <= {limit}")
    return verdicts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run, a few seconds")
    parser.add_argument("--profile", action="store_true",
                        help="add JAXbind's empty-rule variant to case 1 (jaxdecl's is "
                             "always there)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per variant")
    parser.add_argument("--out", default=str(HERE / "results"),
                        help="prefix of the .json and .png outputs")
    parser.add_argument("--no-chart", action="store_true", help="skip the PNG")
    parser.add_argument("--markdown", action="store_true",
                        help="also print the results as a Markdown table")
    args = parser.parse_args(argv)

    opts = Options(quick=args.quick, profile=args.profile,
                   large=LARGE_QUICK if args.quick else LARGE)
    # A descheduled process spoils a whole batch; at 1 ms most batches escape it.
    rounds = args.rounds or (3 if args.quick else 301)
    target_s = 0.0005 if args.quick else 0.001
    max_seconds = 2.0 if args.quick else 25.0

    report = {"meta": {**_versions(), "quick": args.quick, "max_rounds": rounds,
                       "max_seconds_per_case": max_seconds,
                       "batch_target_s": target_s,
                       "method": "interleaved rounds; per-call time = batch time / calls, "
                                 "block_until_ready after every call"},
              "cases": {}, "targets": []}
    for key, title, candidates in CASES:
        report["cases"][key] = run_case(
            title.format(**dataclasses.asdict(opts)), candidates(opts), quick=args.quick,
            rounds=rounds, target_s=target_s, max_seconds=max_seconds)
    report["targets"] = judge_targets(report["cases"])

    harness.write_json(args.out + ".json", report)
    if not args.no_chart:
        harness.draw_chart(args.out + ".png", {e["title"]: e for e in report["cases"].values()},
                           title=f"jaxdecl benchmarks (jax {jax.__version__}, "
                                 f"{os.cpu_count()} CPUs; bars median, ticks min)")
    if args.markdown:
        print("\n" + harness.markdown_table(report["cases"]))
    print(f"\nwrote {args.out}.json" + ("" if args.no_chart else f" and {args.out}.png"))
    return report


if __name__ == "__main__":
    main()
