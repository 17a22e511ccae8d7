"""Sharding on 4 host devices: a row FFT vs JAXbind, undeclared ops, eager calls, compile time.

Usage::

    python benchmarks/bench_sharding.py              # every section, ~2 min on 2 cores
    python benchmarks/bench_sharding.py --quick      # small arrays, N = 1 and 10, ~7 s
    python benchmarks/bench_sharding.py --markdown   # also prints the tables for README.md

The script gives XLA 4 host CPU devices (``XLA_FLAGS``, set before JAX is
imported). The first section, a row-wise FFT, shards the rows of a complex
array over them. Variants, each ``jax.jit`` of the transform along axis 1, one
DUCC thread per call:

- ``jaxdecl``: ``jaxdecl.contrib.ducc.c2c(axes=(1,))``, which declares the rows
  independent: each device transforms its own 16 rows, no gather;
- ``jaxbind``: ``jaxbind.contrib.jaxducc0.c2c``, an opaque custom call: XLA
  gathers the array and every device transforms all 64 rows;
- ``jnp.fft``: ``jnp.fft.fft(x, axis=1)``, XLA's own FFT, per shard;
- ``jaxdecl[1 device]``: the jaxdecl op on the same array held whole on one
  device (the unsharded baseline).

Before timing, the results are checked against each other (and ``jnp.fft``
against NumPy), and the compiled HLO of each variant is searched for
``all-gather``. Variants are timed in interleaved rounds (:mod:`harness`).

More sections, on the same 4 devices (rows sharded, Auto mesh axes):

- **An op without a declaration against** ``jax.pure_callback`` (:func:`undeclared`):
  the same NumPy work under ``jit``; an undeclared op gathers its input, runs
  once on one device and hands the result to all. Also counts the rule calls
  per evaluation (1 each), with a declared op (per shard) and ``jax.numpy`` for
  contrast.
- **Eager calls on a sharded array** (:func:`eager`): ``2 * x`` without ``jit``
  on a 64 x 1024 float64 array: ``x * 2`` in ``jax.numpy`` (the reference), a
  jaxdecl op declared ``"n m -> n m"`` (runs per shard), the same op undeclared
  (gathers, runs once), ``jax.pure_callback`` and JAXbind. Results are checked
  against NumPy and for where they live (jaxdecl's stay on the mesh).
- **Compile time of chained ops** (:func:`compile_times`): 1, 10, 50, 200 calls
  of an elementwise op declared ``"b n -> b n"`` against the same program in
  ``jax.numpy``, one instance called N times (``[same]``) and N instances of
  distinct configuration (``[distinct]``), forward and ``grad``; trace, lowering
  and XLA compile timed apart, every round a fresh program (nothing cached).
  Elementwise over every dim, the op is one call that XLA splits itself.
  References: the same op declaring ``replicate=("n",)`` (``[callback]``: each
  call goes through a partition callback, as every op whose factors are not all
  shared does); the same chain as plain ``custom_partitioning`` ops around
  ``x * c`` (no jaxdecl: the cost of that mechanism); the jaxdecl chain inside a
  full-manual ``shard_map``; and, compiled for one device, the jaxdecl chain and
  the same chain of ``jax.pure_callback`` calls (what N opaque calls cost JAX and
  XLA with no sharding at all, with jaxdecl and without). At the largest N,
  :func:`compile_breakdown` splits one compile of ``[callback]`` into XLA's
  partition callbacks (Python, on XLA's thread) and the rest.

Results go to ``benchmarks/results_sharding.json``.
"""


from __future__ import annotations

import argparse
import collections
import cProfile
import itertools
import os
import pathlib
import platform
import pstats
import sys
import time
import weakref

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# 4 devices need the flag before JAX starts; any other XLA flags the caller set stay.
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split()
     if not f.startswith("--xla_force_host_platform_device_count")]
    + ["--xla_force_host_platform_device_count=4"])

import ducc0
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

jax.config.update("jax_enable_x64", True)

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness

import jaxdecl as jd
from jaxdecl import _compat
from jaxdecl.contrib import ducc

try:
    import jaxbind
    from jaxbind.contrib import jaxducc0
except ImportError:  # the comparison runs without JAXbind's column
    jaxbind = jaxducc0 = None

NDEV = 4
TARGET = 0.5  # jaxdecl / JAXbind, ratio of medians
COMPILE_TARGET = 1.5  # jaxdecl / jax.numpy compile time at the largest N
EAGER_TARGET = 1.5  # jaxdecl[declared] / jax.numpy, eager calls, ratio of medians
BREAKDOWN = "jaxdecl[callback]"  # the variant whose compile is split into its steps


def _time_against(reference, variants, skipped, title, rounds, target_s):
    """``(stats, median ratios, min ratios)`` of `variants` timed interleaved, printed
    against `reference`."""
    stats = harness.time_case(variants, rounds=rounds, target_s=target_s)
    median_ratios = harness.ratios(stats, reference)
    min_ratios = harness.ratios(stats, reference, key="min")
    harness.print_case(title, stats, {f"/{reference}": median_ratios,
                                      f"mins /{reference}": min_ratios}, skipped)
    return stats, median_ratios, min_ratios


def _collectives(function, *args) -> list[str]:
    text = function.lower(*args).compile().as_text()
    return [w for w in ("all-gather", "all-to-all", "all-reduce") if w in text]


def _mesh():
    """A 1D mesh of the 4 host devices, axis "d" of type Auto."""
    if jax.device_count() < NDEV:
        raise SystemExit(f"needs {NDEV} devices, found {jax.device_count()}: XLA_FLAGS="
                         f"{os.environ.get('XLA_FLAGS')!r} was set after JAX started?")
    return jax.make_mesh((NDEV,), ("d",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:NDEV])


def _spec_text(spec) -> str:
    """A partition spec as ``P('d',)`` on every JAX (before 0.9 its repr is
    ``PartitionSpec('d',)``); anything else as its own text."""
    if isinstance(spec, jax.sharding.PartitionSpec):
        return f"P{tuple(spec)!r}"
    return str(spec)


def _spec(value) -> str:
    return _spec_text(getattr(value.sharding, "spec", value.sharding))


def build(rows: int, cols: int):
    """The variants (as makers for :func:`harness.build_variants`) and what their HLO holds."""
    mesh = _mesh()
    rng = np.random.default_rng(0)
    host = rng.standard_normal((rows, cols)) + 1j * rng.standard_normal((rows, cols))
    sharded = jax.device_put(host, NamedSharding(mesh, P("d")))
    whole = jax.device_put(host, jax.devices()[0])

    jaxdecl_fft = jax.jit(ducc.c2c(axes=(1,), nthreads=1))
    native_fft = jax.jit(lambda x: jnp.fft.fft(x, axis=1))
    functions = {"jaxdecl": (jaxdecl_fft, sharded),
                 "jnp.fft": (native_fft, sharded),
                 "jaxdecl[1 device]": (jaxdecl_fft, whole)}
    if jaxducc0 is not None:
        jaxbind_fft = jax.jit(lambda x: jaxducc0.c2c(x, axes=(1,), forward=True, inorm=0,
                                                     nthreads=1)[0])
        functions["jaxbind"] = (jaxbind_fft, sharded)
    # An independent reference for the first variant; the harness checks the rest against it.
    np.testing.assert_allclose(jaxdecl_fft(sharded), np.fft.fft(host, axis=1), rtol=1e-10,
                               atol=1e-8 * np.sqrt(cols))
    collectives = {name: _collectives(f, x) for name, (f, x) in functions.items()}
    if collectives["jaxdecl"]:
        raise SystemExit(f"jaxdecl's sharded FFT compiles with {collectives['jaxdecl']}")
    order = ["jaxdecl", "jaxbind", "jnp.fft", "jaxdecl[1 device]"]
    candidates = {name: None if name not in functions else
                  (lambda f=functions[name][0], x=functions[name][1]: lambda: f(x))
                  for name in order}
    shardings = {name: _spec(f(x)) for name, (f, x) in functions.items()}
    return candidates, collectives, shardings


def markdown(stats, median_ratios, min_ratios, collectives) -> str:
    lines = ["| variant | median ms | min ms | / JAXbind (median) | / JAXbind (min) | "
             "collectives in the HLO |",
             "|---|---:|---:|---:|---:|---|"]
    for name, s in stats.items():
        rm = median_ratios.get(name)
        rn = min_ratios.get(name)
        lines.append(
            f"| {name} | {s.median * 1e3:.3f} | {s.min * 1e3:.3f} | "
            f"{'' if rm is None else f'{rm:.2f}'} | {'' if rn is None else f'{rn:.2f}'} | "
            f"{', '.join(collectives.get(name, [])) or 'none'} |")
    return "\n".join(lines)


def fft_section(quick: bool) -> dict:
    """The row-wise FFT (jaxdecl, JAXbind, jnp.fft): the report's original keys."""
    if quick:
        rows, cols, rounds, target_s = 16, 1024, 5, 0.01
    else:
        rows, cols, rounds, target_s = 64, 8192, 31, 0.2
    candidates, collectives, shardings = build(rows, cols)
    # One DUCC call and jnp.fft run the same FFT lengths; they agree to rounding.
    variants, skipped = harness.build_variants(candidates, rtol=1e-9, atol=1e-12)
    if "jaxdecl" not in variants or any(why == "wrong result" for why in skipped.values()):
        raise SystemExit(f"cannot compare: {skipped}")
    title = f"row FFT, {rows} x {cols} complex128, rows sharded over {NDEV} host devices"
    stats, median_ratios, min_ratios = _time_against("jaxbind", variants, skipped, title,
                                                     rounds, target_s)
    print("\ncollectives in the compiled HLO:",
          {name: names or "none" for name, names in collectives.items()})
    print("result shardings:", shardings)
    ratio = median_ratios.get("jaxdecl")
    verdict = None if ratio is None else ("PASS" if ratio <= TARGET else "MISS")
    if ratio is not None:
        print(f"\njaxdecl / jaxbind = {ratio:.2f} (mins {min_ratios['jaxdecl']:.2f}); "
              f"target <= {TARGET}: {verdict}")
    return {
        "shape": [rows, cols],
        "variants": {name: s.as_dict() for name, s in stats.items()},
        "skipped": skipped,
        "ratio_median": median_ratios,
        "ratio_min": min_ratios,
        "collectives": collectives,
        "result_shardings": shardings,
        "target": {"limit": TARGET, "ratio": ratio, "verdict": verdict},
        "markdown": markdown(stats, median_ratios, min_ratios, collectives),
    }


# --- An op without a sharding declaration against jax.pure_callback --------------------

RULE_CALLS: collections.Counter = collections.Counter()  # variant -> rule calls
RULE_SHAPES: dict = collections.defaultdict(list)  # variant -> shapes the rule saw


def _work(x):
    """The NumPy work every host variant does: elementwise, a few passes over the array."""
    return np.sin(x) * 2.0 + x


def _count(name: str, x) -> None:
    RULE_CALLS[name] += 1
    RULE_SHAPES[name].append(tuple(x.shape))


class Undeclared(jd.Primitive):
    """`_work` without a sharding declaration: under jit it runs once, on gathered input."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        _count("jaxdecl[undeclared]", x)
        return _work(x)


class Declared(jd.Primitive, sharding="b n -> b n"):
    """The same rule declared elementwise: every device runs it on its own rows."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        _count("jaxdecl[declared]", x)
        return _work(x)


def _callback(x):
    _count("pure_callback", x)
    return _work(x)


def undeclared(quick: bool) -> dict:
    """An undeclared op vs jax.pure_callback under jit, rows sharded over 4 devices."""
    if quick:
        rows, cols, rounds, target_s = 16, 1024, 5, 0.01
    else:
        rows, cols, rounds, target_s = 256, 4096, 21, 0.1
    mesh = _mesh()
    host = np.random.default_rng(1).standard_normal((rows, cols))
    x = jax.device_put(host, NamedSharding(mesh, P("d")))
    functions = {
        "jaxdecl[undeclared]": jax.jit(Undeclared()),
        "pure_callback": jax.jit(lambda v: jax.pure_callback(
            _callback, jax.ShapeDtypeStruct(v.shape, v.dtype), v)),
        "jaxdecl[declared]": jax.jit(Declared()),
        "jnp": jax.jit(lambda v: jnp.sin(v) * 2.0 + v),
    }
    reference = _work(host)
    np.testing.assert_allclose(functions["jaxdecl[undeclared]"](x), reference, rtol=1e-13)
    candidates = {name: (lambda f=f: lambda: f(x)) for name, f in functions.items()}
    # NumPy's and XLA's sin may differ in the last bits.
    variants, skipped = harness.build_variants(candidates, rtol=1e-12, atol=1e-15)
    if {"jaxdecl[undeclared]", "pure_callback"} - set(variants):
        raise SystemExit(f"cannot compare the undeclared op: {skipped}")
    # Rule calls of one evaluation (each function is compiled and has run already).
    RULE_CALLS.clear()
    RULE_SHAPES.clear()
    results = {}
    for name, f in functions.items():
        results[name] = jax.block_until_ready(f(x))
    calls = {name: RULE_CALLS[name] for name in functions if name != "jnp"}
    shapes = {name: list(RULE_SHAPES[name]) for name in calls}
    for name in ("jaxdecl[undeclared]", "pure_callback"):
        if calls[name] != 1:
            raise SystemExit(f"{name} ran its rule {calls[name]} times in one evaluation")
    collectives = {name: _collectives(f, x) for name, f in functions.items()}
    shardings = {name: _spec(r) for name, r in results.items()}
    title = (f"sin(x)*2+x, {rows} x {cols} float64 rows sharded over {NDEV} devices: "
             f"an op without a declaration vs jax.pure_callback")
    stats, median_ratios, min_ratios = _time_against("pure_callback", variants, skipped, title,
                                                     rounds, target_s)
    print("rule calls per evaluation:", {n: f"{calls[n]} x {shapes[n][0]}" for n in calls})
    print("collectives in the compiled HLO:",
          {name: names or "none" for name, names in collectives.items()})
    print("result shardings:", shardings)
    return {
        "title": title, "shape": [rows, cols], "dtype": "float64",
        "variants": {name: s.as_dict() for name, s in stats.items()},
        "skipped": skipped,
        "ratio_median": median_ratios, "ratio_min": min_ratios,
        "rule_calls_per_evaluation": calls,
        "rule_shapes": {name: [list(s) for s in v] for name, v in shapes.items()},
        "collectives": collectives,
        "result_shardings": shardings,
    }



# --- Eager calls on a sharded array -----------------------------------------------------

#: Shapes the rules saw, recorded only while one evaluation is counted (None: not counting).
_EAGER_SHAPES: list | None = None


def _record(x) -> None:
    if _EAGER_SHAPES is not None:
        _EAGER_SHAPES.append(tuple(x.shape))


class EagerDoubleUndeclared(jd.Primitive):
    """2 x into the result buffer, no sharding declaration: eager calls gather the input."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, *, out):
        _record(x)
        np.multiply(x, 2, out=out)


class EagerDouble(EagerDoubleUndeclared, sharding="n m -> n m"):
    """The same rule declared elementwise: eager calls run it on each device's block."""


def _host_double(a):
    _record(a)
    return np.multiply(a, 2)


def _jaxbind_kernel(out, args, kwargs_dump):
    _record(args[0])
    np.multiply(args[0], 2, out=out[0])


def _jaxbind_double(x):
    """A maker for :func:`harness.build_variants`: JAXbind's ``2 * x`` called on `x`."""
    call = jaxbind.get_nonlinear_call(
        _jaxbind_kernel, (None, None), lambda *args, **kwargs: ((args[0].shape, args[0].dtype),),
        None)
    return lambda: call(x)[0]


def _placement(value) -> dict:
    """A result's spec (or, without one, its HLO sharding) and how many devices it spans."""
    sharding = value.sharding
    spec = getattr(sharding, "spec", None)
    if spec is None:  # pure_callback's GSPMDSharding: "{maximal device=0}" says where it is
        to_hlo = getattr(sharding, "_to_xla_hlo_sharding", None)
        spec = sharding if to_hlo is None else to_hlo(value.ndim)
    return {"spec": _spec_text(spec), "devices": len(sharding.device_set)}


def eager(quick: bool, shape=(64, 1024)) -> dict:
    """Un-jitted ``2 * x`` on rows sharded over 4 devices: jaxdecl, jax.numpy, callbacks."""
    global _EAGER_SHAPES
    rounds, target_s = (5, 0.005) if quick else (31, 0.05)
    mesh = _mesh()
    host = np.random.default_rng(4).standard_normal(shape)
    x = jax.device_put(host, NamedSharding(mesh, P("d")))
    declared, undeclared_op = EagerDouble(), EagerDoubleUndeclared()
    sds = jax.ShapeDtypeStruct(x.shape, x.dtype)
    # One callable for every call: a new one per call would retrace and recompile it.
    candidates = {
        "jax.numpy": lambda: lambda: x * 2,
        "jaxdecl[declared]": lambda: lambda: declared(x),
        "jaxdecl[undeclared]": lambda: lambda: undeclared_op(x),
        "pure_callback": lambda: lambda: jax.pure_callback(_host_double, sds, x),
        "jaxbind": None if jaxbind is None else (lambda: _jaxbind_double(x)),
    }
    variants, skipped = harness.build_variants(candidates, rtol=0.0)
    if {"jax.numpy", "jaxdecl[declared]", "jaxdecl[undeclared]"} - set(variants):
        raise SystemExit(f"cannot compare eager calls: {skipped}")
    expected = 2 * np.asarray(x)
    placements, calls = {}, {}
    for name, fn in variants.items():
        if name != "jax.numpy":
            _EAGER_SHAPES = []
        try:
            result = jax.block_until_ready(fn())
        finally:
            shapes, _EAGER_SHAPES = _EAGER_SHAPES, None
        np.testing.assert_array_equal(np.asarray(result), expected, err_msg=name)
        placements[name] = _placement(result)
        if shapes is not None:
            calls[name] = [list(s) for s in shapes]
        if name.startswith("jaxdecl") and result.sharding.device_set != set(mesh.devices.flat):
            raise SystemExit(f"{name} left the mesh: {result.sharding}")
    if placements["jaxdecl[declared]"]["spec"] != _spec(x):
        raise SystemExit(f"jaxdecl[declared] lost the rows' sharding: {placements}")
    title = (f"eager 2 * x, {shape[0]} x {shape[1]} float64 rows sharded over {NDEV} devices "
             f"(no jit), {rounds} rounds")
    stats, median_ratios, min_ratios = _time_against("jax.numpy", variants, skipped, title,
                                                     rounds, target_s)
    print("rule calls per evaluation:",
          {n: f"{len(s)} x {tuple(s[0])}" for n, s in calls.items()})
    print("result placements:", {n: f"{p['spec']} on {p['devices']}" for n, p in
                                 placements.items()})
    ratio = median_ratios["jaxdecl[declared]"]
    verdict = "PASS" if ratio <= EAGER_TARGET else "MISS"
    print(f"\njaxdecl[declared] / jax.numpy = {ratio:.2f} "
          f"(mins {min_ratios['jaxdecl[declared]']:.2f}); target <= {EAGER_TARGET}: {verdict}")
    return {
        "title": title, "shape": list(shape), "dtype": "float64",
        "variants": {name: s.as_dict() for name, s in stats.items()},
        "skipped": skipped,
        "ratio_median": median_ratios, "ratio_min": min_ratios,
        "rule_shapes": calls,
        "result_placements": placements,
        "target": {"limit": EAGER_TARGET, "ratio": ratio, "verdict": verdict},
    }


def eager_markdown(report: dict) -> str:
    lines = ["| variant | median µs | min µs | / jax.numpy (median) | / jax.numpy (min) | "
             "rule calls | result |",
             "|---|---:|---:|---:|---:|---|---|"]
    for name, v in report["variants"].items():
        shapes = report["rule_shapes"].get(name)
        rule = f"{len(shapes)} × {tuple(shapes[0])}" if shapes else ""
        place = report["result_placements"][name]
        lines.append(
            f"| {name} | {v['median_s'] * 1e6:,.0f} | {v['min_s'] * 1e6:,.0f} | "
            f"{report['ratio_median'][name]:.2f} | {report['ratio_min'][name]:.2f} | {rule} | "
            f"`{place['spec']}` on {place['devices']} |")
    return "\n".join(lines)

# --- Compile time of chained ops ---------------------------------------------------------


class Scale(jd.Primitive, sharding="b n -> b n"):
    """x * factor, a NumPy rule declared elementwise (both dims split freely).

    Elementwise over every dim: XLA splits the call itself (no partition callback).
    """

    def __init__(self, factor):
        self.factor = factor

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        return x * self.factor

    @jd.vjp
    def pull(self, x, ct):
        return ct * self.factor


class ScaleRows(Scale, sharding="b n -> b n", replicate=("n",)):
    """Scale declaring its rows whole (``replicate=``): the partition-callback path."""


def _partitioned(function, rule: str):
    """`function` as a bare custom_partitioning op that runs per shard (no jaxdecl)."""
    wrapped = custom_partitioning(function)

    def partition(mesh, arg_shapes, result_shape):
        sharding = arg_shapes[0].sharding
        return mesh, function, sharding, (sharding,) * len(arg_shapes)

    wrapped.def_partition(partition=partition, sharding_rule=rule)
    return wrapped


def _partitioned_scale(factor):
    """The reference: Scale's forward and vjp as custom_partitioning calls of x * factor."""
    forward = _partitioned(lambda x: x * factor, "b n -> b n")
    backward = _partitioned(lambda x, ct: ct * factor, "b n, b n -> b n")

    @jax.custom_vjp
    def scale(x):
        return forward(x)

    scale.defvjp(lambda x: (forward(x), x), lambda x, ct: (backward(x, ct),))
    return scale


def _callback_scale(factor):
    """x * factor as ``jax.pure_callback`` calls (forward and, under ``custom_vjp``,
    backward): JAX's own opaque host call, the reference for what N opaque calls cost."""
    def host(x):
        return x * factor

    def call(x):
        return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    scale = jax.custom_vjp(call)
    scale.defvjp(lambda x: (call(x), None), lambda _, ct: (call(ct),))
    return scale


def _chain(ops):
    def program(v):
        for op in ops:
            v = op(v)
        return v
    return program


def _factors(n: int, distinct: bool, fresh: int) -> list[float]:
    """n factors near 1 (200 of them multiply to O(1)); `fresh` makes each round's new."""
    base = 1.0 + 1e-7 * fresh
    return [base + (1e-3 * i if distinct else 0.0) for i in range(n)]


def _programs(n: int, mesh) -> dict:
    """name -> make(fresh) -> the forward program; each call builds new ops and closures."""

    def scale(c):
        return lambda v: v * c

    def same(make_op):
        def make(fresh):
            op = make_op(_factors(1, False, fresh)[0])
            return _chain([op] * n)
        return make

    def distinct(make_op):
        return lambda fresh: _chain([make_op(c) for c in _factors(n, True, fresh)])

    def in_shard_map(fresh):
        return jax.shard_map(_chain([Scale(c) for c in _factors(n, True, fresh)]), mesh=mesh,
                             in_specs=P("d"), out_specs=P("d"))

    return {"jaxdecl[same]": same(Scale), "jnp[same]": same(scale),
            "jaxdecl[distinct]": distinct(Scale), "jnp[distinct]": distinct(scale),
            "jaxdecl[callback]": distinct(ScaleRows),
            "custom_partitioning[distinct]": distinct(_partitioned_scale),
            "jaxdecl[shard_map]": in_shard_map,
            "jaxdecl[1 device]": distinct(Scale),
            "pure_callback[1 device]": distinct(_callback_scale)}


#: Variants compiled for one device (the input unsharded): what the op calls
#: themselves cost XLA, with no sharding at all.
_ONE_DEVICE = {"jaxdecl[1 device]", "pure_callback[1 device]"}


def _baseline(name: str) -> str:
    """The jax.numpy program each variant is compared with."""
    return "jnp[same]" if name.endswith("[same]") else "jnp[distinct]"


def _with_grad(program):
    return jax.grad(lambda v: program(v).sum())


def _compile_once(program, x) -> tuple:
    """``(compiled, (trace_s, lower_s, compile_s))`` of ``jax.jit(program)`` on `x`."""
    t0 = time.perf_counter()
    traced = jax.jit(program).trace(x)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    return compiled, (t1 - t0, t2 - t1, t3 - t2)


def _compile_variant(make, grad: bool, x, key: str, last: dict, phases: dict):
    """A variant for :func:`harness.time_case`: compiles a fresh program on every call,
    keeping the executable in ``last[key]`` and the phases' seconds in ``phases[key]``."""
    fresh = itertools.count()

    def variant():
        program = make(next(fresh))
        if grad:
            program = _with_grad(program)
        last[key], times = _compile_once(program, x)
        phases[key].append(times)

    return variant


def compile_times(ns, rounds: int, shape=(64, 128)) -> dict:
    """Compile time of N chained ops, jaxdecl against jax.numpy, per N (see module docstring)."""
    mesh = _mesh()
    host = np.random.default_rng(2).standard_normal(shape)
    x = jax.device_put(host, NamedSharding(mesh, P("d")))
    x_one = jax.device_put(host, jax.devices()[0])
    inputs = {}
    report = {}
    for k, n in enumerate(ns):
        makers = _programs(n, mesh)
        phases: dict = collections.defaultdict(list)
        last: dict = {}
        variants = {}
        for mode in ("forward", "grad"):
            for name, make in makers.items():
                key = f"{name} {mode}"
                inputs[key] = x_one if name in _ONE_DEVICE else x
                variants[key] = _compile_variant(make, mode == "grad", inputs[key], key, last,
                                                 phases)
        # Every variant compiles a fresh program per round (new ops, new closures, new
        # configuration), interleaved; one untimed round first, at the smallest N only.
        stats = harness.time_case(variants, rounds=rounds, target_s=0.0, number=1,
                                  warmup=1 if k == 0 else 0)
        # The last round of every variant used the same factors: check the programs agree.
        checks = {}
        for key, compiled in last.items():
            name, mode = key.rsplit(" ", 1)
            value = np.asarray(compiled(inputs[key]))
            base = np.asarray(last[f"{_baseline(name)} {mode}"](x))
            checks[key] = bool(np.allclose(value, base, rtol=1e-12, atol=0.0))
        if not all(checks.values()):
            raise SystemExit(f"compiled programs disagree at N={n}: "
                             f"{[k for k, ok in checks.items() if not ok]}")
        collectives = [w for w in ("all-gather", "all-to-all")
                       if w in last["jaxdecl[distinct] forward"].as_text()]
        entry = {"collectives_jaxdecl_forward": collectives,
                 "op_calls_forward": {v: _call_kinds(last[f"{v} forward"])
                                      for v in ("jaxdecl[distinct]", "jaxdecl[callback]")}}
        for mode in ("forward", "grad"):
            rows = {}
            for name in makers:
                key = f"{name} {mode}"
                trace, lower, comp = (float(np.median(p)) for p in zip(*phases[key]))
                rows[name] = {**stats[key].as_dict(), "trace_s": trace, "lower_s": lower,
                              "compile_s": comp}
            for name, row in rows.items():
                base = rows[_baseline(name)]
                row["vs_jnp"] = row["median_s"] / base["median_s"]
                row["vs_jnp_compile_only"] = row["compile_s"] / base["compile_s"]
                row["vs_custom_partitioning"] = (
                    row["median_s"] / rows["custom_partitioning[distinct]"]["median_s"])
            entry[mode] = rows
        report[str(n)] = entry
        _print_compile(n, entry, rounds)
    return report


def _call_kinds(compiled) -> dict:
    """How the op calls of a compiled program were split: ``{"split": n, "callback": m}``.

    Calls XLA split itself keep their target (``jaxdecl_dispatch_split``); a
    partition callback returns a per-shard program whose call is a plain
    ``jaxdecl_dispatch``.
    """
    text = compiled.as_text()
    return {"split": text.count('custom_call_target="jaxdecl_dispatch_split"'),
            "callback": text.count('custom_call_target="jaxdecl_dispatch"')}


def _print_compile(n: int, entry: dict, rounds: int) -> None:
    print(f"\ncompile time, {n} chained op call(s), {NDEV} devices, median of {rounds} "
          f"round(s): trace + lower + XLA compile")
    print(f"  {'variant':30s} {'mode':8s} {'total':>11s} {'trace':>11s} {'lower':>11s} "
          f"{'compile':>11s} {'/jnp':>6s} {'/cp':>6s}")
    for mode in ("forward", "grad"):
        for name, row in entry[mode].items():
            print(f"  {name:30s} {mode:8s} {harness.format_time(row['median_s'])} "
                  f"{harness.format_time(row['trace_s'])} {harness.format_time(row['lower_s'])} "
                  f"{harness.format_time(row['compile_s'])} {row['vs_jnp']:6.2f} "
                  f"{row['vs_custom_partitioning']:6.2f}")


def compile_summary(report: dict) -> dict:
    """jaxdecl / jnp per N, the verdict at the largest N, and what bounds the ratio.

    The verdict covers the declared elementwise op (``[same]``, ``[distinct]``),
    which XLA splits itself. Beside it: the same op declaring ``replicate=``
    (``[callback]``, a partition callback per call) and the sharded chain
    against the identical chain on one device (what sharding adds at all).
    """
    table = {n: {f"{mode} {case}": entry[mode][f"jaxdecl[{case}]"]["vs_jnp"]
                 for mode in ("forward", "grad") for case in ("same", "distinct", "callback")}
             for n, entry in report.items()}
    largest = max(report, key=int)
    worst = max(v for k, v in table[largest].items() if not k.endswith("callback"))
    verdict = "PASS" if worst <= COMPILE_TARGET else "MISS"
    one_device = {mode: report[largest][mode]["jaxdecl[distinct]"]["median_s"]
                  / report[largest][mode]["jaxdecl[1 device]"]["median_s"]
                  for mode in ("forward", "grad")}
    floor = {mode: report[largest][mode]["jaxdecl[1 device]"]["vs_jnp"]
             for mode in ("forward", "grad")}
    callbacks = {mode: report[largest][mode]["pure_callback[1 device]"]["vs_jnp"]
                 for mode in ("forward", "grad")}
    print("\njaxdecl / jnp compile time (trace + lower + compile, ratio of medians):")
    print(f"  {'N':>4s}" + "".join(f" {k:>17s}" for k in table[largest]))
    for n, row in table.items():
        print(f"  {n:>4s}" + "".join(f" {v:17.2f}" for v in row.values()))
    print(f"at N={largest}: worst (same, distinct) {worst:.2f}; target <= {COMPILE_TARGET}: "
          f"{verdict}")
    print("  the same chain on one device / jnp (no sharding at all): "
          + ", ".join(f"{mode} {v:.2f}" for mode, v in floor.items()))
    print("  the same chain of jax.pure_callback calls on one device / jnp: "
          + ", ".join(f"{mode} {v:.2f}" for mode, v in callbacks.items()))
    print("  4 devices / 1 device, jaxdecl[distinct]: "
          + ", ".join(f"{mode} {v:.2f}" for mode, v in one_device.items()))
    return {"ratios_vs_jnp": table,
            "target": {"limit": COMPILE_TARGET, "n": int(largest), "worst_ratio": worst,
                       "verdict": verdict},
            "one_device_vs_jnp": floor, "pure_callback_one_device_vs_jnp": callbacks,
            "sharded_vs_one_device": one_device}


def compile_markdown(report: dict) -> str:
    columns = ["jaxdecl[same]", "jnp[same]", "jaxdecl[distinct]", "jnp[distinct]",
               "jaxdecl[callback]", "custom_partitioning[distinct]", "jaxdecl[shard_map]",
               "jaxdecl[1 device]", "pure_callback[1 device]"]
    lines = ["| N | mode | " + " | ".join(f"{c} ms" for c in columns)
             + " | same / jnp | distinct / jnp |",
             "|---:|---|" + "---:|" * (len(columns) + 2)]
    for n, entry in report.items():
        for mode in ("forward", "grad"):
            r = entry[mode]
            cells = [f"{r[c]['median_s'] * 1e3:.0f}" for c in columns]
            lines.append(f"| {n} | {mode} | " + " | ".join(cells)
                         + f" | {r['jaxdecl[same]']['vs_jnp']:.2f} | "
                         f"{r['jaxdecl[distinct]']['vs_jnp']:.2f} |")
    return "\n".join(lines)


# --- Where one compile's time goes ----------------------------------------------------

# Functions whose cumulative time the breakdown reports: (label, file suffix, name).
# The first four are the callback's steps, one after another; the last two lie inside them.
_STEPS = [
    ("jaxdecl partition callback (plan, local equation, kernel)", "jaxdecl/_transforms/lowering.py",
     "partition"),
    ("JAX traces the per-shard function (make_jaxpr)", "jax/_src/api.py", "make_jaxpr_f"),
    ("JAX lowers it to a module (build_mlir_module_helper)", "interpreters/mlir.py",
     "build_mlir_module_helper"),
    ("JAX serializes the module (module_to_bytecode)", "interpreters/mlir.py",
     "module_to_bytecode"),
]
_INSIDE = [
    ("of the lowering: a new MLIR context (make_ir_context)", "interpreters/mlir.py",
     "make_ir_context"),
    ("of jaxdecl's callback: building kernels (eqn.kernel)", "jaxdecl/_op/equation.py",
     "kernel"),
]


class _CallbackClock:
    """Times JAX's custom_partitioning partition callback, which XLA runs on its own thread.

    Instruments JAX internals (``jax._src.custom_partitioning``): the callback starts by
    looking its op up in ``_sharding_callbacks`` and ends with ``mlir.module_to_bytecode``.
    With `profile`, a cProfile covers every callback (enabled on XLA's thread).
    """

    def __init__(self, profile: bool):
        from jax._src import custom_partitioning as cp

        self.cp, self.seconds, self.calls, self.lookups = cp, 0.0, 0, 0
        self.profiler = cProfile.Profile() if profile else None
        self._start = None
        clock = self

        class Lookup(weakref.WeakValueDictionary):
            def __getitem__(self, key):
                clock.lookups += 1
                if clock._start is None:
                    clock._start = time.perf_counter()
                    if clock.profiler is not None:
                        clock.profiler.enable()
                return super().__getitem__(key)

        class Mlir:
            def __getattr__(self, name):
                return getattr(clock.mlir, name)

            def module_to_bytecode(self, module):
                out = clock.mlir.module_to_bytecode(module)
                if clock._start is not None:
                    if clock.profiler is not None:
                        clock.profiler.disable()
                    clock.seconds += time.perf_counter() - clock._start
                    clock.calls += 1
                    clock._start = None
                return out

        self._lookup, self._mlir_proxy = Lookup, Mlir

    def __enter__(self):
        self.callbacks, self.mlir = self.cp._sharding_callbacks, self.cp.mlir
        lookup = self._lookup()
        lookup.update(self.callbacks)
        self.cp._sharding_callbacks, self.cp.mlir = lookup, self._mlir_proxy()
        return self

    def __exit__(self, *exc):
        self.cp._sharding_callbacks, self.cp.mlir = self.callbacks, self.mlir

    def steps(self) -> dict:
        """label -> share of the profiled callback time."""
        stats = pstats.Stats(self.profiler)
        total = stats.total_tt or 1.0

        def cumulative(suffix, name):
            return sum(v[3] for (path, _, func), v in stats.stats.items()
                       if func == name and path.replace(os.sep, "/").endswith(suffix))

        shares = {label: cumulative(s, n) / total for label, s, n in _STEPS}
        shares["JAX, the rest (shardings to and from XLA, ...)"] = max(
            0.0, 1.0 - sum(shares.values()))
        shares.update({label: cumulative(s, n) / total for label, s, n in _INSIDE})
        return shares


def compile_breakdown(n: int, jnp_compile: dict, shape=(64, 128)) -> dict:
    """Where one compile of N distinct jaxdecl ops goes, forward and grad (see _CallbackClock).

    Two compiles per mode: one timed plainly (callbacks vs the rest), one under cProfile
    (the callback's steps, as shares applied to the plain callback time).
    """
    try:
        with _CallbackClock(profile=False):
            pass
    except (ImportError, AttributeError) as error:
        print(f"\ncompile breakdown skipped: this JAX's custom_partitioning differs ({error})")
        return {"skipped": str(error)}
    mesh = _mesh()
    x = jax.device_put(np.random.default_rng(3).standard_normal(shape),
                       NamedSharding(mesh, P("d")))
    make = _programs(n, mesh)[BREAKDOWN]
    report = {}
    for mode in ("forward", "grad"):
        entry = {}
        for profile in (False, True):
            program = make(10_000 + 2 * profile + (mode == "grad"))
            if mode == "grad":
                program = _with_grad(program)
            with _CallbackClock(profile=profile) as clock:
                _, (trace, lower, comp) = _compile_once(program, x)
            if not profile:
                callbacks = clock.seconds
                entry.update(trace_s=trace, lower_s=lower, compile_s=comp,
                             partition_callbacks=clock.calls, callback_lookups=clock.lookups,
                             callbacks_s=callbacks, xla_rest_s=comp - callbacks,
                             xla_rest_minus_jnp_s=comp - callbacks - jnp_compile[mode])
            else:
                entry["callback_steps_s"] = {label: share * callbacks
                                             for label, share in clock.steps().items()}
        entry["jnp_compile_s"] = jnp_compile[mode]
        entry["jaxdecl_share"] = (entry["callback_steps_s"][_STEPS[0][0]] / comp)
        report[mode] = entry
        _print_breakdown(n, mode, entry)
    return report


def _print_breakdown(n: int, mode: str, e: dict) -> None:
    calls = max(e["partition_callbacks"], 1)
    fmt = harness.format_time
    print(f"\nwhere one compile goes: {BREAKDOWN} {mode}, N={n}, {NDEV} devices")
    print(f"  trace {fmt(e['trace_s'])}, lower {fmt(e['lower_s'])}, XLA compile "
          f"{fmt(e['compile_s'])} (jnp[distinct] compile: {fmt(e['jnp_compile_s'])})")
    print(f"  partition callbacks: {e['partition_callbacks']} calls, {fmt(e['callbacks_s'])} "
          f"({e['callbacks_s'] / e['compile_s']:.0%} of the compile, "
          f"{e['callbacks_s'] / calls * 1e3:.2f} ms each)")
    inside = {label for label, _, _ in _INSIDE}
    for label, seconds in e["callback_steps_s"].items():
        indent = "      " if label in inside else "    "
        print(f"{indent}{label:{66 - len(indent)}s} {fmt(seconds)}  "
              f"{seconds / calls * 1e3:6.3f} ms/call")
    print(f"  XLA itself (C++, the rest of the compile): {fmt(e['xla_rest_s'])}; less jnp's "
          f"whole compile, {e['xla_rest_minus_jnp_s'] / calls * 1e3:.2f} ms per callback")
    print(f"  jaxdecl's own callback code: {e['jaxdecl_share']:.1%} of the compile")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small arrays, few rounds")
    parser.add_argument("--markdown", action="store_true", help="print the README tables")
    parser.add_argument("--out", default=str(HERE / "results_sharding.json"))
    args = parser.parse_args()
    if not _compat.SPLITS_PER_SHARD:
        raise SystemExit(
            f"bench_sharding.py times ops that run per shard under jit, which needs JAX >= "
            f"0.7 (this is JAX {jax.__version__}, where XLA gathers their inputs instead: "
            f"README.md, 'What needs a newer JAX')")

    fft = fft_section(args.quick)
    undeclared_report = undeclared(args.quick)
    eager_report = eager(args.quick)
    ns, rounds = ((1, 10), 2) if args.quick else ((1, 10, 50, 200), 5)
    compile_report = compile_times(ns, rounds)
    summary = compile_summary(compile_report)
    largest = str(max(ns))
    jnp_compile = {mode: compile_report[largest][mode]["jnp[distinct]"]["compile_s"]
                   for mode in ("forward", "grad")}
    breakdown = compile_breakdown(max(ns), jnp_compile)

    fft_markdown = fft.pop("markdown")
    report = {
        "meta": {"quick": args.quick, "python": platform.python_version(),
                 "jax": jax.__version__, "ducc0": ducc0.__version__,
                 "jaxbind": None if jaxbind is None else jaxbind.__version__,
                 "cpus": os.cpu_count(), "devices": NDEV, "shape": fft.pop("shape"),
                 "dtype": "complex128", "nthreads": 1,
                 "ratio": "variant time / jaxbind time (below 1: faster)"},
        **fft,
        "undeclared": undeclared_report,
        "eager": eager_report,
        "compile_time": {
            "meta": {"ns": list(ns), "rounds": rounds, "shape": [64, 128],
                     "dtype": "float64", "mesh": "4 devices, axis d Auto, input P('d')",
                     "op": "Scale(c): x * c, sharding='b n -> b n', NumPy forward and vjp",
                     "seconds": "trace + lower + XLA compile of a fresh program per round",
                     "ratio": "vs_jnp: median / the jax.numpy program's median"},
            "by_n": compile_report,
            **summary,
        },
        "compile_breakdown": {"n": max(ns), "variant": BREAKDOWN, **breakdown},
    }
    harness.write_json(args.out, report)
    if args.markdown:
        print()
        print(fft_markdown)
        print()
        print(eager_markdown(eager_report))
        print()
        print(compile_markdown(compile_report))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
