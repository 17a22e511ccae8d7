"""`jit(grad)` of ops whose forward is expensive: residuals against rerunning the forward.

Usage::

    python benchmarks/bench_residuals.py              # about a minute on 2 cores
    python benchmarks/bench_residuals.py --quick      # smaller problems, a few seconds
    python benchmarks/bench_residuals.py --markdown   # also prints the table for README.md

Three cases, each ``jax.jit(jax.grad(loss))`` of one op:

- ``solve``: x = A⁻¹ b (SciPy LU, n × n). The forward factorises A (cost T);
  the vjp needs the factors. Variants: ``jaxdecl`` (``@jd.residuals`` keeps
  the LU and pivots, the vjp reads them and ``result``), ``jaxdecl[rerun]``
  (the same op without residuals: the vjp factorises again), ``jaxbind``
  (``get_nonlinear_call``: the vjp sees only the inputs, so it factorises
  again), ``custom_vjp+pure_callback`` (``jax.custom_vjp`` whose forward
  returns the factors as residuals, through ``pure_callback``), and the two
  halves timed alone: ``forward alone`` (``jit`` of the plain op) and ``vjp
  alone`` (``jit`` of an op that runs just the vjp's work on given factors).
- ``sleep``: a "simulator" whose forward sleeps T = 20 ms (2 ms with
  ``--quick``) and keeps cos x for the vjp; the same variants.
- ``kdtree``: the nearest-neighbour op of ``tutorials/09_pytrees.py`` (SciPy
  cKDTree), its rules reading ``result=`` (``jaxdecl``) against the same op
  whose rules query the tree again (``jaxdecl[rerun]``).

Targets (ratio of medians): ``jaxdecl`` <= 1.1 × (``forward alone`` + ``vjp
alone``), and, reported, ``jaxdecl`` / ``jaxbind`` (about 0.55 when T
dominates). Each variant's gradient is checked against the first's before
timing (:mod:`harness`). BLAS runs on one thread (set before NumPy loads),
so that T does not depend on what else the machine runs. Results go to
``benchmarks/results_residuals.json``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
for _variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg
from scipy.spatial import cKDTree

jax.config.update("jax_enable_x64", True)

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness

import jaxdecl as jd

try:
    import jaxbind
except ImportError:  # the comparison runs without JAXbind's column
    jaxbind = None

TARGET = 1.1  # jaxdecl / (forward alone + vjp alone)


def _sds(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


# ---------------------------------------------------------------------------
# solve: x = A⁻¹ b
# ---------------------------------------------------------------------------


def _factor_solve(a, b, into=None):
    """``(lu, piv, x)``, the factors written into `into` (a fresh array if None).

    LAPACK factorises a column-major matrix in place: the transpose of a
    row-major buffer is one, so the factors of A land in ``into.T`` with no
    copy beyond loading A (the kept factors are read back as ``into.T``).
    Every variant factorises this way, so all of them pay the same T.
    """
    into = np.empty(a.shape, a.dtype) if into is None else into
    into.T[...] = a
    lu, piv = scipy.linalg.lu_factor(into.T, overwrite_a=True, check_finite=False)
    return lu, piv, scipy.linalg.lu_solve((lu, piv), b, check_finite=False)


def _solve_vjp(lu, piv, x, ct):
    """(ct_A, ct_b) of x = A⁻¹ b from the factors: λ = A⁻ᵀ ct, ct_A = -λ xᵀ."""
    lam = scipy.linalg.lu_solve((lu, piv), ct, trans=1, check_finite=False)
    return -np.outer(lam, x), lam


class Solve(jd.Primitive):
    @jd.abstract
    def shapes(self, a, b):
        return _sds(b)

    @jd.residuals
    def keeps(self, a, b):
        return {"lu": _sds(a), "piv": jax.ShapeDtypeStruct(a.shape[:1], np.int32)}

    @jd.forward
    def apply(self, a, b, *, out, saved=None):
        if saved is None:
            _, _, out[...] = _factor_solve(a, b)
        else:  # factorised straight into the residual's buffer
            _, saved["piv"][...], out[...] = _factor_solve(a, b, into=saved["lu"])

    @jd.vjp
    def pull(self, a, b, ct, *, out, saved, result):
        out[0][...], out[1][...] = _solve_vjp(saved["lu"].T, saved["piv"], result, ct)


class SolveRerun(jd.Primitive):
    @jd.abstract
    def shapes(self, a, b):
        return _sds(b)

    @jd.forward
    def apply(self, a, b, *, out):
        _, _, out[...] = _factor_solve(a, b)

    @jd.vjp
    def pull(self, a, b, ct, *, out):
        lu, piv, x = _factor_solve(a, b)
        out[0][...], out[1][...] = _solve_vjp(lu, piv, x, ct)


class SolveVjpAlone(jd.Primitive):
    """Just the vjp's work, on factors computed beforehand: the 'vjp' of T + vjp."""

    @jd.abstract
    def shapes(self, lu, piv, x, ct):
        return _sds(lu), _sds(x)

    @jd.forward
    def apply(self, lu, piv, x, ct, *, out):
        out[0][...], out[1][...] = _solve_vjp(lu.T, piv, x, ct)


def _jb_solve(out, args, kwargs_dump):
    _, _, out[0][...] = _factor_solve(args[0], args[1])


def _jb_solve_vjp(out, args, kwargs_dump):
    a, b, ct = args
    lu, piv, x = _factor_solve(a, b)  # JAXbind's vjp sees the inputs only
    out[0][...], out[1][...] = _solve_vjp(lu, piv, x, ct)


# JAXbind's shape functions take (*inputs) (and more for its derivatives) as shape/dtype pairs.
def _jb_abstract(*args, **kwargs):
    return ((args[1].shape, args[1].dtype),)


def _jb_abstract_reverse(*args, **kwargs):
    return ((args[0].shape, args[0].dtype), (args[1].shape, args[1].dtype))


# pure_callback's host functions receive jax.Arrays, which SciPy before 1.16 (the newest on
# Python 3.10) does not convert before its LAPACK wrappers read their `.flags`; np.asarray
# is a view of a CPU jax.Array, no copy.
def _host_solve(a, b):
    return _factor_solve(np.asarray(a), np.asarray(b))[2]


def _host_factor(a, b):
    lu, piv, x = _factor_solve(np.asarray(a), np.asarray(b))
    return lu, piv.astype(np.int32), x


def _host_lam(lu, piv, ct):
    return scipy.linalg.lu_solve((np.asarray(lu), np.asarray(piv)), np.asarray(ct), trans=1,
                                 check_finite=False)


@jax.custom_vjp
def pure_solve(a, b):
    return jax.pure_callback(_host_solve, _sds(b), a, b, vmap_method="sequential")


def _pure_solve_fwd(a, b):
    piv = jax.ShapeDtypeStruct(a.shape[:1], np.int32)
    lu, piv, x = jax.pure_callback(_host_factor, (_sds(a), piv, _sds(b)), a, b,
                                   vmap_method="sequential")
    return x, (lu, piv, x)


def _pure_solve_bwd(residuals, ct):
    lu, piv, x = residuals
    lam = jax.pure_callback(_host_lam, _sds(ct), lu, piv, ct, vmap_method="sequential")
    return -jnp.outer(lam, x), lam


pure_solve.defvjp(_pure_solve_fwd, _pure_solve_bwd)


def solve_case(quick: bool):
    n = 200 if quick else 1200
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((n, n)) + np.sqrt(n) * np.eye(n))
    b = jnp.asarray(rng.standard_normal(n))

    def grad_of(solve):
        grad = jax.jit(jax.grad(lambda a, b: jnp.sum(solve(a, b) ** 2), (0, 1)))
        return lambda: grad(a, b)

    lu, piv, x = _host_factor(np.asarray(a), np.asarray(b))
    parts = (jnp.asarray(lu.T), jnp.asarray(piv), jnp.asarray(x), jnp.asarray(2 * x))
    forward = jax.jit(Solve())
    vjp_alone = jax.jit(SolveVjpAlone())
    candidates = {
        "jaxdecl": lambda: grad_of(Solve()),
        "jaxdecl[rerun]": lambda: grad_of(SolveRerun()),
        "jaxbind": None if jaxbind is None else lambda: grad_of(
            lambda a, b: jaxbind.get_nonlinear_call(
                _jb_solve, (None, _jb_solve_vjp), _jb_abstract, _jb_abstract_reverse)(a, b)[0]),
        "custom_vjp+pure_callback": lambda: grad_of(pure_solve),
        "forward alone": lambda: lambda: forward(a, b),
        "vjp alone": lambda: lambda: vjp_alone(*parts),
    }
    return f"jit(grad) of x = A⁻¹b, n = {n} (SciPy LU)", candidates


# ---------------------------------------------------------------------------
# sleep: a simulator whose forward takes T
# ---------------------------------------------------------------------------


class Simulate(jd.Primitive):
    """y = sin x after `seconds` of "simulation"; keeps cos x for the vjp."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    @jd.abstract
    def shapes(self, x):
        return _sds(x)

    @jd.residuals
    def keeps(self, x):
        return _sds(x)

    @jd.forward
    def apply(self, x, *, out, saved=None):
        time.sleep(self.seconds)
        np.sin(x, out=out)
        if saved is not None:
            np.cos(x, out=saved)

    @jd.vjp
    def pull(self, x, ct, *, out, saved):
        np.multiply(ct, saved, out=out)


class SimulateRerun(jd.Primitive):
    def __init__(self, seconds: float):
        self.seconds = seconds

    @jd.abstract
    def shapes(self, x):
        return _sds(x)

    @jd.forward
    def apply(self, x, *, out):
        time.sleep(self.seconds)
        np.sin(x, out=out)

    @jd.vjp
    def pull(self, x, ct, *, out):
        time.sleep(self.seconds)  # the simulation again, for its derivative
        np.multiply(ct, np.cos(x), out=out)


class SimulateVjpAlone(jd.Primitive):
    @jd.abstract
    def shapes(self, cos, ct):
        return _sds(ct)

    @jd.forward
    def apply(self, cos, ct, *, out):
        np.multiply(ct, cos, out=out)


def _jb_simulator(seconds):
    def forward(out, args, kwargs_dump):
        time.sleep(seconds)
        np.sin(args[0], out=out[0])

    def vjp(out, args, kwargs_dump):
        time.sleep(seconds)
        np.multiply(args[1], np.cos(args[0]), out=out[0])

    def same(*args, **kwargs):
        return ((args[0].shape, args[0].dtype),)

    call = jaxbind.get_nonlinear_call(forward, (None, vjp), same, same)
    return lambda x: call(x)[0]


def _pure_simulator(seconds):
    def host_forward(x):
        time.sleep(seconds)
        return np.sin(x)

    def host_forward_keeping(x):
        time.sleep(seconds)
        return np.sin(x), np.cos(x)

    @jax.custom_vjp
    def simulate(x):
        return jax.pure_callback(host_forward, _sds(x), x, vmap_method="sequential")

    def fwd(x):
        y, cos = jax.pure_callback(host_forward_keeping, (_sds(x), _sds(x)), x,
                                   vmap_method="sequential")
        return y, cos

    def bwd(cos, ct):
        return (ct * cos,)

    simulate.defvjp(fwd, bwd)
    return simulate


def sleep_case(quick: bool):
    seconds = 0.002 if quick else 0.02
    x = jnp.linspace(-1.0, 1.0, 1000)

    def grad_of(simulate):
        grad = jax.jit(jax.grad(lambda x: jnp.sum(simulate(x) ** 2)))
        return lambda: grad(x)

    forward = jax.jit(Simulate(seconds))
    vjp_alone = jax.jit(SimulateVjpAlone())
    cos, ct = jnp.cos(x), 2 * jnp.sin(x)
    candidates = {
        "jaxdecl": lambda: grad_of(Simulate(seconds)),
        "jaxdecl[rerun]": lambda: grad_of(SimulateRerun(seconds)),
        "jaxbind": None if jaxbind is None else lambda: grad_of(_jb_simulator(seconds)),
        "custom_vjp+pure_callback": lambda: grad_of(_pure_simulator(seconds)),
        "forward alone": lambda: lambda: forward(x),
        "vjp alone": lambda: lambda: vjp_alone(cos, ct),
    }
    return f"jit(grad) of a simulator whose forward sleeps {seconds * 1e3:g} ms", candidates


# ---------------------------------------------------------------------------
# kdtree: the tutorial's nearest-neighbour op, result= against querying again
# ---------------------------------------------------------------------------


class Nearest(jd.Primitive):
    """Distance (and index) from each query to the nearest of fixed points (SciPy cKDTree)."""

    def __init__(self, tree):
        self.tree = tree

    @jd.abstract
    def shapes(self, q):
        return (jax.ShapeDtypeStruct(q.shape[:1], q.dtype),
                jax.ShapeDtypeStruct(q.shape[:1], np.int32))

    @jd.forward
    def apply(self, q, *, out):
        distance, index = out
        distance[...], index[...] = self.tree.query(q)

    @jd.vjp
    def pull(self, q, ct, *, result):
        distance, index = result  # which point is nearest: no second query
        return ct[:, None] * (q - self.tree.data[index]) / distance[:, None]


class NearestRerun(Nearest):
    @jd.vjp
    def pull(self, q, ct):
        distance, index = self.tree.query(q)
        return ct[:, None] * (q - self.tree.data[index]) / distance[:, None]


def kdtree_case(quick: bool):
    n_points, n_queries = (20_000, 4_000) if quick else (100_000, 20_000)
    rng = np.random.default_rng(9)
    tree = cKDTree(rng.uniform(-1.0, 1.0, (n_points, 3)))
    q = jnp.asarray(rng.uniform(-1.0, 1.0, (n_queries, 3)))

    def grad_of(op):
        grad = jax.jit(jax.grad(lambda q: jnp.sum(op(q)[0] ** 2)))
        return lambda: grad(q)

    candidates = {"jaxdecl": lambda: grad_of(Nearest(tree)),
                  "jaxdecl[rerun]": lambda: grad_of(NearestRerun(tree))}
    return (f"jit(grad) of a cKDTree query, {n_queries:,} queries in {n_points:,} points",
            candidates)


# ---------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------

CASES = {"solve": solve_case, "sleep": sleep_case, "kdtree": kdtree_case}


def _ratio(stats, name, reference_names):
    if name not in stats or not all(r in stats for r in reference_names):
        return None
    return stats[name].median / sum(stats[r].median for r in reference_names)


def markdown(report) -> str:
    lines = ["| case | variant | median ms | min ms | / jaxdecl | / JAXbind |",
             "|---|---|---:|---:|---:|---:|"]
    for key, case in report["cases"].items():
        variants = case["variants"]
        base = variants["jaxdecl"]["median_s"]
        jb = variants.get("jaxbind", {}).get("median_s")
        for name, v in variants.items():
            vs_jaxbind = "" if jb is None else f"{v['median_s'] / jb:.2f}"
            lines.append(
                f"| {key} | {name} | {v['median_s'] * 1e3:.3f} | {v['min_s'] * 1e3:.3f} | "
                f"{v['median_s'] / base:.2f} | {vs_jaxbind} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller problems, few rounds")
    parser.add_argument("--markdown", action="store_true", help="print the Markdown table")
    parser.add_argument("--out", default=str(HERE / "results_residuals.json"))
    args = parser.parse_args(argv)
    rounds, target_s = (5, 0.02) if args.quick else (31, 0.25)
    report = {"machine": {"python": platform.python_version(), "jax": jax.__version__,
                          "cpus": os.cpu_count(), "quick": args.quick},
              "cases": {}, "targets": []}
    for key, make_case in CASES.items():
        title, candidates = make_case(args.quick)
        variants, skipped = harness.build_variants(
            candidates, unchecked=("forward alone", "vjp alone"), rtol=1e-8, atol=1e-10)
        stats = harness.time_case(variants, rounds=rounds, target_s=target_s, warmup=2)
        columns = {"/ jaxdecl": harness.ratios(stats, "jaxdecl"),
                   "/ JAXbind": harness.ratios(stats, "jaxbind")}
        harness.print_case(title, stats, columns, skipped)
        report["cases"][key] = {
            "title": title, "skipped": skipped,
            "variants": {name: s.as_dict() for name, s in stats.items()}}
        parts = _ratio(stats, "jaxdecl", ("forward alone", "vjp alone"))
        if parts is not None:
            verdict = "PASS" if parts <= TARGET else "MISS"
            report["targets"].append({"case": key, "ratio": parts, "limit": TARGET,
                                      "verdict": verdict,
                                      "vs_jaxbind": _ratio(stats, "jaxdecl", ("jaxbind",))})
    print("\nTargets: jaxdecl <= 1.1 x (forward alone + vjp alone), ratio of medians")
    for target in report["targets"]:
        vs = target["vs_jaxbind"]
        print(f"  {target['verdict']}  {target['case']:7s} {target['ratio']:.3f}"
              + ("" if vs is None else f"   (jaxdecl / JAXbind = {vs:.3f})"))
    if "kdtree" in report["cases"]:
        kd = report["cases"]["kdtree"]["variants"]
        if "jaxdecl[rerun]" in kd:
            print(f"  kdtree: result= / querying again = "
                  f"{kd['jaxdecl']['median_s'] / kd['jaxdecl[rerun]']['median_s']:.3f}")
    harness.write_json(args.out, report)
    if args.markdown:
        print("\n" + markdown(report))
    return report


if __name__ == "__main__":
    main()
