"""A row-wise FFT on an array sharded over 4 host devices: jaxdecl, JAXbind, jnp.fft.

Usage::

    python benchmarks/bench_sharding.py              # 64 x 8192 complex128, ~20 s on 2 cores
    python benchmarks/bench_sharding.py --quick      # a smaller array, a few seconds
    python benchmarks/bench_sharding.py --markdown   # also prints the table for README.md

The script gives XLA 4 host CPU devices (``XLA_FLAGS``, set before JAX is
imported) and shards the rows of the array over them. Variants, each
``jax.jit`` of the transform along axis 1, one DUCC thread per call:

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
Results go to ``benchmarks/results_sharding.json``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys

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
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

jax.config.update("jax_enable_x64", True)

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness

from jaxdecl.contrib import ducc

try:
    import jaxbind
    from jaxbind.contrib import jaxducc0
except ImportError:  # the comparison runs without JAXbind's column
    jaxbind = jaxducc0 = None

NDEV = 4
TARGET = 0.5  # jaxdecl / JAXbind, ratio of medians


def _collectives(function, *args) -> list[str]:
    text = function.lower(*args).compile().as_text()
    return [w for w in ("all-gather", "all-to-all", "all-reduce") if w in text]


def build(rows: int, cols: int):
    """The variants (as makers for :func:`harness.build_variants`) and what their HLO holds."""
    if jax.device_count() < NDEV:
        raise SystemExit(f"needs {NDEV} devices, found {jax.device_count()}: XLA_FLAGS="
                         f"{os.environ.get('XLA_FLAGS')!r} was set after JAX started?")
    mesh = jax.make_mesh((NDEV,), ("d",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:NDEV])
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
    shardings = {name: str(getattr(f(x).sharding, "spec", f(x).sharding))
                 for name, (f, x) in functions.items()}
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small array, few rounds")
    parser.add_argument("--markdown", action="store_true", help="print the README table")
    parser.add_argument("--out", default=str(HERE / "results_sharding.json"))
    args = parser.parse_args()

    if args.quick:
        rows, cols, rounds, target_s = 16, 1024, 5, 0.01
    else:
        rows, cols, rounds, target_s = 64, 8192, 31, 0.2
    candidates, collectives, shardings = build(rows, cols)
    # One DUCC call and jnp.fft run the same FFT lengths; they agree to rounding.
    variants, skipped = harness.build_variants(candidates, rtol=1e-9, atol=1e-12)
    if "jaxdecl" not in variants or any(why == "wrong result" for why in skipped.values()):
        raise SystemExit(f"cannot compare: {skipped}")
    stats = harness.time_case(variants, rounds=rounds, target_s=target_s)
    median_ratios = harness.ratios(stats, "jaxbind")
    min_ratios = harness.ratios(stats, "jaxbind", key="min")
    title = f"row FFT, {rows} x {cols} complex128, rows sharded over {NDEV} host devices"
    harness.print_case(title, stats, {"/jaxbind": median_ratios, "mins /jaxbind": min_ratios},
                       skipped)
    print("\ncollectives in the compiled HLO:",
          {name: names or "none" for name, names in collectives.items()})
    print("result shardings:", shardings)
    ratio = median_ratios.get("jaxdecl")
    verdict = None if ratio is None else ("PASS" if ratio <= TARGET else "MISS")
    if ratio is not None:
        print(f"\njaxdecl / jaxbind = {ratio:.2f} (mins {min_ratios['jaxdecl']:.2f}); "
              f"target <= {TARGET}: {verdict}")
    report = {
        "meta": {"quick": args.quick, "python": platform.python_version(),
                 "jax": jax.__version__, "ducc0": ducc0.__version__,
                 "jaxbind": None if jaxbind is None else jaxbind.__version__,
                 "cpus": os.cpu_count(), "devices": NDEV, "shape": [rows, cols],
                 "dtype": "complex128", "nthreads": 1,
                 "ratio": "variant time / jaxbind time (below 1: faster)"},
        "variants": {name: s.as_dict() for name, s in stats.items()},
        "skipped": skipped,
        "ratio_median": median_ratios,
        "ratio_min": min_ratios,
        "collectives": collectives,
        "result_shardings": shardings,
        "target": {"limit": TARGET, "ratio": ratio, "verdict": verdict},
    }
    harness.write_json(args.out, report)
    if args.markdown:
        print()
        print(markdown(stats, median_ratios, min_ratios, collectives))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
