"""jaxdecl against JAXbind, jax.pure_callback, buffer_callback and native jax.numpy.

Usage::

    python benchmarks/run.py            # full run (a couple of minutes on 2 cores)
    python benchmarks/run.py --quick    # smoke run, a few seconds
    python benchmarks/run.py --profile  # adds empty-rule variants (dispatcher overhead)
    python benchmarks/run.py --markdown # also prints the table for README.md

Every case builds (compiles and warms up) all its variants first, then times
them interleaved in one process (:mod:`harness`). Results go to
``benchmarks/results.json`` and ``benchmarks/results.png`` (``--out`` changes
the prefix). Every variant runs the same NumPy rule on the same data.
"""

from __future__ import annotations

import argparse
import functools
import inspect
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

import jaxdecl as jd

try:
    import jaxbind
except ImportError:  # the suite still runs, without the JAXbind column
    jaxbind = None

try:
    from jax.experimental.buffer_callback import buffer_callback
except ImportError:
    buffer_callback = None

F64 = np.float64

# ---------------------------------------------------------------------------
# The rules: plain NumPy functions shared by every variant.
# ---------------------------------------------------------------------------


def double_into(x, out):
    np.multiply(x, 2, out=out)


def sum_double_into(xs, out):
    np.add(xs[0], xs[1], out=out)
    for x in xs[2:]:
        np.add(out, x, out=out)
    np.multiply(out, 2, out=out)


def mulsq_into(x1, x2, out):
    np.multiply(x2, x2, out=out)
    np.multiply(out, x1, out=out)


def mulsq_jvp_into(x1, x2, dx1, dx2, out):
    # dx1 * x2**2 + 2 * x1 * x2 * dx2
    np.multiply(x2, x2, out=out)
    np.multiply(out, dx1, out=out)
    out += 2 * x1 * x2 * dx2


def mulsq_vjp_into(x1, x2, ct, out1, out2):
    np.multiply(x2, x2, out=out1)
    np.multiply(out1, ct, out=out1)
    np.multiply(x1, x2, out=out2)
    np.multiply(out2, ct, out=out2)
    np.multiply(out2, 2, out=out2)


def empty_rule(*args, **kwargs):
    """Writes nothing: isolates the cost of getting into and out of the rule."""


def _sds(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


# ---------------------------------------------------------------------------
# jaxdecl ops.
# ---------------------------------------------------------------------------


class Double(jd.Primitive):
    @jd.abstract
    def shapes(self, x):
        return _sds(x)

    @jd.forward
    def apply(self, x, *, out):
        double_into(x, out)


class DoubleVectorized(Double, batch="vectorized"):
    pass


class DoubleEmpty(jd.Primitive):
    @jd.abstract
    def shapes(self, x):
        return _sds(x)

    @jd.forward
    def apply(self, x, *, out):
        pass


_C_SOURCE = r"""
#include "jaxdecl.h"
int double_into(const jaxdecl_buffer* in, int64_t n_in, const jaxdecl_buffer* out,
                int64_t n_out, char* message, int64_t message_size) {
  int64_t n = 1;
  for (int64_t i = 0; i < in[0].rank; ++i) n *= in[0].dims[i];
  const double* x = (const double*)in[0].data;
  double* y = (double*)out[0].data;
  for (int64_t i = 0; i < n; ++i) y[i] = 2 * x[i];
  return 0;
}
"""


@functools.cache
def double_c_class():
    """The case-1 op with a C kernel (jd.cfunction): no Python on the call path.

    Compiled here with the system C compiler; None when there is none.
    """
    import ctypes
    import shutil
    import subprocess
    import tempfile

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    folder = pathlib.Path(tempfile.mkdtemp(prefix="jaxdecl_bench_"))
    (folder / "double.c").write_text(_C_SOURCE)
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", f"-I{jd.include_dir()}",
                    str(folder / "double.c"), "-o", str(folder / "libdouble.so")], check=True)
    library = ctypes.CDLL(str(folder / "libdouble.so"))

    class DoubleC(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            return _sds(x)

        apply = jd.forward(jd.cfunction(library.double_into, keepalive=library))

    return DoubleC


def sum_double_class(n: int):
    """A jaxdecl op with `n` named inputs x0..x{n-1}: out = 2 * sum(x)."""
    names = [f"x{i}" for i in range(n)]
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    inputs = [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in names]
    out = inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY)

    def shapes(self, *xs):
        return _sds(xs[0])

    def apply(self, *xs, out):
        sum_double_into(xs, out)

    # jaxdecl reads input names from the signature; *xs hides them, so state them.
    shapes.__signature__ = inspect.Signature([self_param, *inputs])
    apply.__signature__ = inspect.Signature([self_param, *inputs, out])
    namespace = {"shapes": jd.abstract(shapes), "apply": jd.forward(apply)}
    return type(f"SumDouble{n}", (jd.Primitive,), namespace)


class MulSq(jd.Primitive):
    @jd.abstract
    def shapes(self, x1, x2):
        return _sds(x1)

    @jd.forward
    def apply(self, x1, x2, *, out):
        mulsq_into(x1, x2, out)

    @jd.jvp
    def push(self, x1, x2, dx1, dx2, *, out):
        mulsq_jvp_into(x1, x2, dx1, dx2, out)

    @jd.vjp
    def pull(self, x1, x2, ct, *, out):
        mulsq_vjp_into(x1, x2, ct, *out)


# ---------------------------------------------------------------------------
# JAXbind ops (kernels take (out, args, kwargs_dump)).
# ---------------------------------------------------------------------------


def _jb_abstract_first(*args, **kwargs):
    return ((args[0].shape, args[0].dtype),)


def _jb_abstract_first_two(*args, **kwargs):
    return ((args[0].shape, args[0].dtype), (args[1].shape, args[1].dtype))


def _jb_double(out, args, kwargs_dump):
    double_into(args[0], out[0])


def _jb_sum_double(out, args, kwargs_dump):
    sum_double_into(args, out[0])


def _jb_empty(out, args, kwargs_dump):
    pass


def _jb_mulsq(out, args, kwargs_dump):
    mulsq_into(args[0], args[1], out[0])


def _jb_mulsq_jvp(out, args, kwargs_dump):
    mulsq_jvp_into(*args, out[0])


def _jb_mulsq_vjp(out, args, kwargs_dump):
    mulsq_vjp_into(*args, out[0], out[1])


def jaxbind_call(kernel, derivatives=(None, None), abstract_reverse=None):
    return jaxbind.get_nonlinear_call(kernel, derivatives, _jb_abstract_first,
                                      abstract_reverse)


def jb_single(f):
    """JAXbind calls return a list of outputs; the benchmarks compare single arrays."""
    return lambda *args: f(*args)[0]


# ---------------------------------------------------------------------------
# jax.pure_callback and buffer_callback.
# ---------------------------------------------------------------------------


# Host functions live at module level: JAX caches an eager callback's compiled
# code by the callable, so a fresh lambda per call would recompile every call.
def _host_double(a):
    return np.multiply(a, 2)


def _host_sum_double(*arrays):
    out = np.empty_like(arrays[0])
    sum_double_into(arrays, out)
    return out


def pure_double(x, vmap_method="sequential"):
    return jax.pure_callback(_host_double, _sds(x), x, vmap_method=vmap_method)


def pure_sum_double(*xs):
    return jax.pure_callback(_host_sum_double, _sds(xs[0]), *xs, vmap_method="sequential")


def _bc_double(ctx, out, x):
    double_into(np.asarray(x), np.asarray(out))


def _bc_sum_double(ctx, out, *xs):
    sum_double_into([np.asarray(x) for x in xs], np.asarray(out))


def buffer_double(x):
    return buffer_callback(_bc_double, _sds(x), vmap_method="sequential")(x)


def buffer_sum_double(*xs):
    return buffer_callback(_bc_sum_double, _sds(xs[0]), vmap_method="sequential")(*xs)


@jax.custom_vjp
def pure_mulsq(x1, x2):
    def host(a, b):
        out = np.empty_like(a)
        mulsq_into(a, b, out)
        return out

    return jax.pure_callback(host, _sds(x1), x1, x2, vmap_method="sequential")


def _pure_mulsq_fwd(x1, x2):
    return pure_mulsq(x1, x2), (x1, x2)


def _pure_mulsq_bwd(residuals, ct):
    x1, x2 = residuals

    def host(a, b, c):
        g1, g2 = np.empty_like(a), np.empty_like(b)
        mulsq_vjp_into(a, b, c, g1, g2)
        return g1, g2

    return jax.pure_callback(host, (_sds(x1), _sds(x2)), x1, x2, ct, vmap_method="sequential")


pure_mulsq.defvjp(_pure_mulsq_fwd, _pure_mulsq_bwd)


# ---------------------------------------------------------------------------
# Cases: each returns (variants, skipped) with every variant compiled and run once.
# ---------------------------------------------------------------------------


def _build(candidates):
    """Compiles and checks each candidate; a missing or failing one is skipped, not fatal."""
    variants, skipped, reference = {}, {}, None
    for name, make in candidates.items():
        if make is None:
            skipped[name] = "not installed"
            continue
        try:
            fn = make()
            result = jax.block_until_ready(fn())
        except Exception as error:  # noqa: BLE001 - report and carry on
            skipped[name] = f"{type(error).__name__}: {error}"[:300]
            continue
        value = np.asarray(jax.tree_util.tree_leaves(result)[0])
        if reference is None:
            reference = value
        elif not np.allclose(value, reference, rtol=1e-12, atol=0):
            skipped[name] = "wrong result"
            continue
        variants[name] = fn
    return variants, skipped


def _jitted(f, *args):
    g = jax.jit(f)
    return lambda: g(*args)


def _double_candidates(x):
    """Every variant of `out = 2 x` on `x`, jitted (cases 1 and 4)."""
    return {
        "native": lambda: _jitted(lambda a: a * 2, x),
        "jaxdecl": lambda: _jitted(Double(), x),
        "jaxdecl[C]": double_c_class() and (lambda: _jitted(double_c_class()(), x)),
        "jaxbind": jaxbind and (lambda: _jitted(jb_single(jaxbind_call(_jb_double)), x)),
        "pure_callback": lambda: _jitted(pure_double, x),
        "buffer_callback": buffer_callback and (lambda: _jitted(buffer_double, x)),
    }


def case_jit_1input(n=10, profile=False):
    x = jnp.arange(n, dtype=F64)
    candidates = _double_candidates(x)
    if profile:
        # Same dispatch, no work: what remains is the cost of reaching the rule.
        candidates["jaxdecl[empty]"] = lambda: _jitted(DoubleEmpty(), x)
        candidates["jaxbind[empty]"] = jaxbind and (
            lambda: _jitted(jb_single(jaxbind_call(_jb_empty)), x))
    variants, skipped = _build({k: v for k, v in candidates.items() if "[empty]" not in k})
    extra, _ = _build_unchecked({k: v for k, v in candidates.items() if "[empty]" in k})
    variants.update(extra)
    return variants, skipped


def _build_unchecked(candidates):
    """Like _build without the value check: empty rules leave their output unwritten."""
    variants, skipped = {}, {}
    for name, make in candidates.items():
        if make is None:
            skipped[name] = "not installed"
            continue
        fn = make()
        jax.block_until_ready(fn())
        variants[name] = fn
    return variants, skipped


def case_jit_ninputs(k, n=10):
    xs = [jnp.arange(n, dtype=F64) + i for i in range(k)]
    op = sum_double_class(k)()
    candidates = {
        "native": lambda: _jitted(lambda *a: functools.reduce(jnp.add, a) * 2, *xs),
        "jaxdecl": lambda: _jitted(op, *xs),
        "jaxbind": jaxbind and (lambda: _jitted(jb_single(jaxbind_call(_jb_sum_double)), *xs)),
        "pure_callback": lambda: _jitted(pure_sum_double, *xs),
        "buffer_callback": buffer_callback and (lambda: _jitted(buffer_sum_double, *xs)),
    }
    return _build(candidates)


def case_eager(n=10):
    x = jnp.arange(n, dtype=F64)
    op = Double()
    jb = jaxbind and jb_single(jaxbind_call(_jb_double))
    candidates = {
        "native": lambda: (lambda: x * 2),
        "jaxdecl": lambda: (lambda: op(x)),
        "jaxbind": jb and (lambda: (lambda: jb(x))),
        "pure_callback": lambda: (lambda: pure_double(x)),
        "buffer_callback": buffer_callback and (lambda: (lambda: buffer_double(x))),
    }
    return _build(candidates)


def case_large(n):
    return _build(_double_candidates(jnp.arange(n, dtype=F64)))


def case_vmap(batch=64, n=10):
    x = jnp.arange(batch * n, dtype=F64).reshape(batch, n)
    jb = jaxbind and jb_single(jaxbind_call(_jb_double))
    candidates = {
        "native": lambda: _jitted(jax.vmap(lambda a: a * 2), x),
        "jaxdecl[loop]": lambda: _jitted(jax.vmap(Double()), x),
        "jaxdecl[vectorized]": lambda: _jitted(jax.vmap(DoubleVectorized()), x),
        "jaxbind": jb and (lambda: _jitted(jax.vmap(jb), x)),
        "pure_callback[sequential]": lambda: _jitted(jax.vmap(pure_double), x),
        "pure_callback[expand_dims]": lambda: _jitted(
            jax.vmap(functools.partial(pure_double, vmap_method="expand_dims")), x),
        "buffer_callback[sequential]": buffer_callback and (
            lambda: _jitted(jax.vmap(buffer_double), x)),
    }
    return _build(candidates)


def case_grad(n=1000):
    x1 = jnp.linspace(-1.0, 1.0, n, dtype=F64)
    x2 = jnp.linspace(0.5, 2.0, n, dtype=F64)

    def grad_of(f):
        return _jitted(jax.grad(lambda a, b: jnp.sum(f(a, b)), argnums=(0, 1)), x1, x2)

    jb = jaxbind and jb_single(jaxbind.get_nonlinear_call(
        _jb_mulsq, (_jb_mulsq_jvp, _jb_mulsq_vjp), _jb_abstract_first, _jb_abstract_first_two))
    candidates = {
        "native": lambda: grad_of(lambda a, b: a * b**2),
        "jaxdecl": lambda: grad_of(MulSq()),
        "jaxbind": jb and (lambda: grad_of(jb)),
        "pure_callback": lambda: grad_of(pure_mulsq),
    }
    return _build(candidates)


# (key, title, builder) of every case, in order.
def case_table(quick: bool, profile: bool):
    return [
        ("1_jit_10_1in", "1. jit, 10 × f64, 1 input",
         functools.partial(case_jit_1input, profile=profile)),
        ("2_jit_10_4in", "2. jit, 10 × f64, 4 inputs", functools.partial(case_jit_ninputs, 4)),
        ("2_jit_10_16in", "2. jit, 10 × f64, 16 inputs", functools.partial(case_jit_ninputs, 16)),
        ("3_eager_10_1in", "3. eager, 10 × f64, 1 input", case_eager),
        ("4_jit_large", f"4. jit, {LARGE_QUICK if quick else LARGE:.0e} × f64",
         functools.partial(case_large, LARGE_QUICK if quick else LARGE)),
        ("5_vmap_64x10", "5. jit(vmap), 64 × (10 × f64)", case_vmap),
        ("6_jit_grad_1000", "6. jit(grad), x1*x2**2 summed, 1000 × f64", case_grad),
    ]


LARGE = 10**7
LARGE_QUICK = 10**6

# (case, variant, reference, limit): variant/reference (medians) must be <= limit.
TARGETS = [
    ("1_jit_10_1in", "jaxdecl", "native", 1.35),
    ("1_jit_10_1in", "jaxdecl", "jaxbind", 0.80),
    ("2_jit_10_16in", "jaxdecl", "jaxbind", 0.65),
    ("3_eager_10_1in", "jaxdecl", "jaxbind", 0.75),
    ("4_jit_large", "jaxdecl", "jaxbind", 1.0),
    ("5_vmap_64x10", "jaxdecl[loop]", "jaxbind", 0.35),
    ("6_jit_grad_1000", "jaxdecl", "jaxbind", 0.85),
]


def _versions():
    info = {"python": platform.python_version(), "jax": jax.__version__,
            "numpy": np.__version__, "jaxdecl": jd.__version__,
            "jaxbind": getattr(jaxbind, "__version__", None),
            "buffer_callback": buffer_callback is not None,
            "machine": platform.machine(), "cpus": os.cpu_count()}
    return info


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run, a few seconds")
    parser.add_argument("--profile", action="store_true",
                        help="add empty-rule variants to case 1 (dispatcher overhead)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per variant")
    parser.add_argument("--out", default=str(HERE / "results"),
                        help="prefix of the .json and .png outputs")
    parser.add_argument("--no-chart", action="store_true", help="skip the PNG")
    parser.add_argument("--markdown", action="store_true",
                        help="also print the results as a Markdown table")
    args = parser.parse_args(argv)

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
    for key, title, build in case_table(args.quick, args.profile):
        variants, skipped = build()
        stats = harness.time_case(variants, rounds=rounds, target_s=target_s,
                                  warmup=1 if args.quick else 3, max_seconds=max_seconds,
                                  min_rounds=3 if args.quick else 15)
        to_native = harness.ratios(stats, "native")
        to_jaxbind = harness.ratios(stats, "jaxbind")
        entry = {"title": title, "skipped": skipped, "variants": {}}
        for name, s in stats.items():
            entry["variants"][name] = {**s.as_dict(), "vs_native": to_native.get(name),
                                       "vs_jaxbind": to_jaxbind.get(name)}
        report["cases"][key] = entry
        _print_case(title, entry)

    print("\nTargets (verdict on the ratio of medians):")
    for case, variant, reference, limit in TARGETS:
        case_variants = report["cases"][case]["variants"]
        if variant in case_variants and reference in case_variants:
            value = case_variants[variant]["median_s"] / case_variants[reference]["median_s"]
            best = case_variants[variant]["min_s"] / case_variants[reference]["min_s"]
            verdict = "PASS" if value <= limit else "MISS"
        else:
            value, best, verdict = None, None, "SKIP"
        report["targets"].append({"case": case, "variant": variant, "reference": reference,
                                  "limit": limit, "ratio": value, "ratio_of_mins": best,
                                  "verdict": verdict})
        shown = "   n/a" if value is None else f"{value:6.3f} (mins: {best:6.3f})"
        print(f"  {verdict}  {case:16s} {variant + '/' + reference:24s} = {shown}  <= {limit}")

    harness.write_json(args.out + ".json", report)
    if not args.no_chart:
        harness.draw_chart(args.out + ".png", {e["title"]: e for e in report["cases"].values()},
                           title=f"jaxdecl benchmarks (jax {jax.__version__}, "
                                 f"{os.cpu_count()} CPUs; bars median, ticks min)")
    if args.markdown:
        print("\n" + harness.markdown_table(report["cases"]))
    print(f"\nwrote {args.out}.json" + ("" if args.no_chart else f" and {args.out}.png"))
    return report


def _print_case(title, entry):
    print(f"\n{title}")
    print(f"  {'variant':28s} {'median':>11s} {'min':>11s} {'/native':>8s} {'/jaxbind':>9s}")
    for name, v in entry["variants"].items():
        rn = "" if v["vs_native"] is None else f"{v['vs_native']:8.2f}"
        rb = "" if v["vs_jaxbind"] is None else f"{v['vs_jaxbind']:9.2f}"
        print(f"  {name:28s} {harness.format_time(v['median_s'])} "
              f"{harness.format_time(v['min_s'])} {rn:>8s} {rb:>9s}")
    for name, why in entry["skipped"].items():
        print(f"  {name:28s} skipped: {why}")


if __name__ == "__main__":
    main()
