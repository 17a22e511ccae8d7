"""Per-call cost of a jitted jaxdecl op against native jax.numpy (case 1 of :mod:`run`).

Usage::

    python benchmarks/bench_dispatch.py                      # the jaxdecl that imports
    PYTHONPATH=/path/to/other/checkout python benchmarks/bench_dispatch.py

Case 1 alone: ``jax.jit`` of ``out = 2 x`` on 10 × float64, one input, as
native ``jax.jit(lambda x: 2 * x)``, as the jaxdecl op of :mod:`implementations`
(rule fills ``out`` zero-copy) and as the same op with a rule that returns
``2 * x``. The variants are timed in interleaved rounds of about 1 ms batches
in one process (:func:`harness.time_case`, ``block_until_ready`` after every
call). Prints which jaxdecl was imported (to compare two builds, run this once
per build, alternating), the ratios jaxdecl / native of the medians and of the
minima, then the whole result as JSON on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp

jax.config.update("jax_enable_x64", True)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import harness
from implementations import Double

import jaxdecl as jd


class DoubleReturn(Double):
    @jd.forward
    def apply(self, x):
        return 2 * x


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41, help="timed rounds per variant")
    parser.add_argument("--target", type=float, default=0.001, help="seconds per batch")
    args = parser.parse_args(argv)

    x = jnp.arange(10, dtype=jnp.float64)
    jitted = {"native": jax.jit(lambda a: 2 * a), "jaxdecl[out]": jax.jit(Double()),
              "jaxdecl[return]": jax.jit(DoubleReturn())}
    variants, skipped = harness.build_variants(
        {name: (lambda f=f: lambda: f(x)) for name, f in jitted.items()})
    stats = harness.time_case(variants, rounds=args.rounds, target_s=args.target)
    medians, minima = harness.ratios(stats, "native"), harness.ratios(stats, "native", key="min")
    harness.print_case(f"jit, 10 × f64, 1 input (jaxdecl from {jd.__file__})", stats,
                       {"/native": medians, "/native(min)": minima}, skipped)
    print(json.dumps({"jaxdecl_file": jd.__file__, "jax": jax.__version__, "skipped": skipped,
                      "ratio_median": medians, "ratio_min": minima,
                      "stats": {name: s.as_dict() for name, s in stats.items()}}))


if __name__ == "__main__":
    main()
