"""Padded points with ``mask=`` against the unpadded call and against padding without a mask.

A caller under ``jit`` pads a varying number of points to a fixed size. Three ways to get
the transform of the kept points, side by side in one run (interleaved rounds,
``harness.time_case``), jitted, ``Opts(nthreads=1)``:

- ``unpadded``: the kept points alone (what the padding stands in for: the floor);
- ``mask=``: the padded points with ``mask`` False at the padding (finufft never sees it);
- ``padding, no mask``: the padded points with the padding moved onto a kept point and its
  strength zero (type 1) or its value dropped after the call (type 2): what a caller does
  without a mask, and what jax-finufft offers.

Cases: 1-D type 1 and type 2, 10⁴ kept points of 10⁵ slots (and of 2 × 10⁴), 1024 modes;
forward and the gradient with respect to the strengths (or modes) and the points.

    python benchmarks/bench_masked.py            # prints the table, writes results_masked.json
    python benchmarks/bench_masked.py --quick    # small sizes, few rounds (a smoke run)
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

jax.config.update("jax_enable_x64", True)
from jaxdecl.contrib import finufft as nf  # noqa: E402

ONE = nf.Opts(nthreads=1)
EPS = 1e-9


def _inputs(rng, kept: int, slots: int):
    x = rng.uniform(-np.pi, np.pi, kept)
    mask = np.zeros(slots, bool)
    mask[:kept] = True
    padded = np.concatenate([x, np.full(slots - kept, x[0])])  # no-mask padding: a real point
    return x, padded, mask


def case(nufft_type: int, mode: str, kept: int, slots: int, modes: int) -> dict:
    rng = np.random.default_rng(kept + slots + nufft_type)
    x, padded, mask = _inputs(rng, kept, slots)
    c = rng.standard_normal(kept) + 1j * rng.standard_normal(kept)
    c_padded = np.concatenate([c, np.zeros(slots - kept, complex)])
    f = rng.standard_normal(modes) + 1j * rng.standard_normal(modes)
    w = rng.standard_normal(slots) * mask  # type 2's loss weights: zero at the padding

    if nufft_type == 1:
        def fn(c, x, mask=None):
            return nf.nufft1(modes, c, x, eps=EPS, opts=ONE, mask=mask)
        args = {"unpadded": (c, x), "mask=": (c_padded, padded), "padding, no mask": (c_padded,
                                                                                      padded)}
    else:
        def fn(f, x, mask=None):
            return nf.nufft2(f, x, eps=EPS, opts=ONE, mask=mask)
        args = {"unpadded": (f, x), "mask=": (f, padded), "padding, no mask": (f, padded)}
    masks = {"unpadded": None, "mask=": mask, "padding, no mask": None}
    weights = {"unpadded": w[:kept], "mask=": w, "padding, no mask": w}

    def maker(name):
        a, b = (jnp.asarray(v) for v in args[name])
        m, weight = masks[name], weights[name]
        if mode == "forward":
            call = jax.jit(lambda a, b: fn(a, b, m))
            if nufft_type == 2:  # compare the kept points' values
                call = jax.jit(lambda a, b: fn(a, b, m)[:kept])
            return lambda: call(a, b)

        def loss(a, b):
            out = fn(a, b, m)
            out = out if nufft_type == 1 else out * weight
            return jnp.sum(jnp.abs(out) ** 2)
        grad = jax.jit(jax.grad(loss, argnums=1))  # the points' gradient runs every transform
        return lambda: grad(a, b)[:kept]
    variants, skipped = harness.build_variants({n: (lambda n=n: maker(n)) for n in args},
                                               rtol=1e-6)
    stats = harness.time_case(variants, rounds=ROUNDS, target_s=0.002, max_seconds=MAX_S)
    title = (f"1-D type {nufft_type}, {kept:,} points in {slots:,} slots, N = {modes}: {mode}")
    harness.print_case(title, stats, {"/unpadded": harness.ratios(stats, "unpadded")}, skipped)
    return {"title": title, "variants": {n: s.as_dict() for n, s in stats.items()},
            "ratio_to_unpadded": harness.ratios(stats, "unpadded"), "skipped": skipped}


def main() -> None:
    global ROUNDS, MAX_S
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).with_name(
        "results_masked.json")))
    args = parser.parse_args()
    ROUNDS, MAX_S = (5, 0.5) if args.quick else (31, 4.0)
    sizes = [(200, 2000, 64)] if args.quick else [(10_000, 100_000, 1024),
                                                  (10_000, 20_000, 1024)]
    cases = {}
    for kept, slots, modes in sizes:
        for nufft_type in (1, 2):
            for mode in ("forward", "grad-points"):
                key = f"type{nufft_type}_{kept}_of_{slots}_{mode}"
                cases[key] = case(nufft_type, mode, kept, slots, modes)
    print("\n| case | mask= / unpadded | padding, no mask / unpadded |\n|---|---:|---:|")
    for c in cases.values():
        r = c["ratio_to_unpadded"]
        print(f"| {c['title']} | {r.get('mask=', float('nan')):.2f} | "
              f"{r.get('padding, no mask', float('nan')):.2f} |")
    meta = {"python": platform.python_version(), "jax": jax.__version__,
            "cpus": os.cpu_count(), "quick": args.quick}
    harness.write_json(args.out, {"meta": meta, "cases": cases})
    print(f"\nwrote {args.out}")


ROUNDS, MAX_S = 31, 4.0

if __name__ == "__main__":
    main()
