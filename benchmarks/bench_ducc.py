"""jaxdecl.contrib.ducc against JAXbind's ``jaxbind.contrib.jaxducc0``: c2c and HEALPix synthesis.

Usage::

    python benchmarks/bench_ducc.py           # full sizes (about a minute on 2 cores)
    python benchmarks/bench_ducc.py --quick   # small sizes, a few seconds

Both libraries call the same DUCC routine with one thread; each op is
``jax.jit(jax.vmap(op))`` over 16 maps, compiled and warmed up before the
variants are timed in interleaved rounds (:mod:`harness`) in one process.
Each variant gets its input in its own layout (JAXbind takes HEALPix a_lm as
a real vector, jaxdecl the complex a_lm), built outside the timed call, and
the results are checked against each other before timing.

A subprocess first tries JAXbind's and jaxdecl's HEALPix op with
``jax_enable_x64`` off (eager, jit, vmap); the comparison itself runs with
x64 on, in double precision. Results go to ``benchmarks/results_ducc.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import ducc0
import jax
import jax.numpy as jnp
import jaxbind
import numpy as np
from jaxbind.contrib import jaxducc0

jax.config.update("jax_enable_x64", True)

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness

from jaxdecl.contrib import ducc

NMAPS = 16

# Runs in a fresh process with x64 off: each attempt prints one JSON line.
PROBE = """
import json, jax, jax.numpy as jnp, numpy as np
assert not jax.config.jax_enable_x64
from jaxdecl.contrib import ducc
from jaxbind.contrib import jaxducc0
nside, lmax = 4, 8
jaxbind_op = jaxducc0.get_healpix_sht(nside, lmax, lmax, 0)
jaxdecl_op = ducc.healpix_synthesis(nside, lmax)
real_alm = jnp.ones((1, 2 * ducc.nalm(lmax) - lmax - 1), jnp.float32)
complex_alm = jnp.ones((1, ducc.nalm(lmax)), jnp.complex64)
attempts = {
    "jaxbind": (lambda a: jaxbind_op(a)[0], real_alm),
    "jaxdecl": (jaxdecl_op, complex_alm),
}
for library, (op, alm) in attempts.items():
    for mode, fn, arg in [("eager", op, alm), ("jit", jax.jit(op), alm),
                          ("vmap", jax.jit(jax.vmap(op)), jnp.stack([alm] * 3))]:
        try:
            out = jax.block_until_ready(fn(arg))
            result = {"ok": True, "dtype": str(out.dtype)}
        except Exception as error:  # the finding is the error itself
            result = {"ok": False, "error": f"{type(error).__name__}: {str(error)[:200]}"}
        print(json.dumps({"library": library, "mode": mode, **result}))
"""


def probe_without_x64() -> list[dict]:
    env = dict(os.environ)
    env.pop("JAX_ENABLE_X64", None)
    env["PYTHONPATH"] = str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                            text=True, timeout=300, check=False)
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0:
        lines.append({"probe_failed": result.stderr[-500:]})
    return lines


def c2c_case(rng, fft_shape):
    """16 complex128 images, the 2-D FFT of each."""
    x = jnp.asarray(rng.standard_normal((NMAPS, *fft_shape))
                    + 1j * rng.standard_normal((NMAPS, *fft_shape)))
    jaxdecl_fft = jax.jit(jax.vmap(ducc.c2c(axes=(0, 1), forward=True, nthreads=1)))
    jaxbind_fft = jax.jit(jax.vmap(
        lambda y: jaxducc0.c2c(y, axes=(0, 1), forward=True, inorm=0, nthreads=1)[0]))
    # An independent reference for the first variant; the harness checks the other against it.
    np.testing.assert_allclose(jaxdecl_fft(x), np.fft.fftn(x, axes=(1, 2)), rtol=1e-10,
                               atol=1e-8)
    candidates = {"jaxdecl": lambda: lambda: jaxdecl_fft(x),
                  "jaxbind": lambda: lambda: jaxbind_fft(x)}
    return candidates, {"shape": [NMAPS, *fft_shape], "dtype": "complex128"}


def healpix_case(rng, nside, lmax):
    """16 spin-0 HEALPix maps from their a_lm."""
    nalm = ducc.nalm(lmax)
    alm = rng.standard_normal((NMAPS, 1, nalm)) + 1j * rng.standard_normal((NMAPS, 1, nalm))
    alm[..., : lmax + 1] = alm[..., : lmax + 1].real
    # JAXbind's layout: Re a_l0, then (Re, Im) of each m > 0 coefficient times sqrt(2).
    real_alm = np.concatenate(
        [alm[..., : lmax + 1].real,
         np.sqrt(2) * alm[..., lmax + 1:].view(np.float64)], axis=-1)
    alm, real_alm = jnp.asarray(alm), jnp.asarray(real_alm)
    jaxdecl_sht = jax.jit(jax.vmap(ducc.healpix_synthesis(nside, lmax, nthreads=1)))
    jaxbind_op = jaxducc0.get_healpix_sht(nside, lmax, lmax, 0, nthreads=1)
    jaxbind_sht = jax.jit(jax.vmap(lambda a: jaxbind_op(a)[0]))
    candidates = {"jaxdecl": lambda: lambda: jaxdecl_sht(alm),
                  "jaxbind": lambda: lambda: jaxbind_sht(real_alm)}
    return candidates, {"nside": nside, "lmax": lmax, "maps": NMAPS,
                        "dtype": "complex128 a_lm -> float64 maps"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds")
    parser.add_argument("--out", default=str(HERE / "results_ducc.json"))
    args = parser.parse_args()

    findings = {"healpix_without_x64": probe_without_x64()}

    if args.quick:
        fft_shape, nside, lmax, rounds, target_s = (64, 64), 16, 32, 5, 0.02
    else:
        fft_shape, nside, lmax, rounds, target_s = (256, 256), 64, 128, 15, 0.2
    rng = np.random.default_rng(0)
    cases = {"c2c": c2c_case(rng, fft_shape),
             "healpix_synthesis": healpix_case(rng, nside, lmax)}

    report = {
        "meta": {"quick": args.quick, "python": platform.python_version(),
                 "jax": jax.__version__, "ducc0": ducc0.__version__,
                 "jaxbind": jaxbind.__version__, "cpus": os.cpu_count(),
                 "x64": True, "nthreads": 1,
                 "ratio": "jaxdecl time / jaxbind time (below 1: jaxdecl faster)"},
        "findings": findings,
        "cases": {},
    }
    for name, (candidates, config) in cases.items():
        # Both libraries call the same DUCC routine: their results agree to rounding.
        variants, skipped = harness.build_variants(candidates, rtol=1e-9, atol=1e-9)
        if skipped:
            raise SystemExit(f"{name}: cannot compare, {skipped}")
        stats = harness.time_case(variants, rounds=rounds, target_s=target_s)
        median_ratios = harness.ratios(stats, "jaxbind")
        min_ratios = harness.ratios(stats, "jaxbind", key="min")
        report["cases"][name] = {
            "config": config,
            "variants": {v: s.as_dict() for v, s in stats.items()},
            "ratio_median": median_ratios["jaxdecl"],
            "ratio_min": min_ratios["jaxdecl"],
        }
        harness.print_case(name, stats, {"/jaxbind": median_ratios, "mins /jaxbind": min_ratios})
    print()
    for line in findings["healpix_without_x64"]:
        print("x64 off:", json.dumps(line))
    harness.write_json(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
