"""A sharded op under ``jit(grad)`` over 1, 2, 4 and 8 local processes, against jax.numpy.

Usage::

    python benchmarks/bench_processes.py              # 1, 2, 4, 8 processes, ~3 min on 2 cores
    python benchmarks/bench_processes.py --quick      # 1 and 2 processes, small blocks, ~40 s
    python benchmarks/bench_processes.py --markdown   # also prints the table for README.md

Each count is one job of that many processes on this machine (``jax.distributed`` on
127.0.0.1, gloo collectives), one CPU device each. The work per process is fixed: every
process holds a 256 x 1024 float64 block of the rows of ``a`` (the whole ``a`` grows with
the processes) and the whole vector ``x``. Variants, both ``jax.jit(jax.grad(loss,
argnums=(0, 1)))`` of ``loss(a, x) = sum(sin(a @ x))``:

- ``jaxdecl``: ``a @ x`` as an op declared ``"b k, k -> b"``, ``reduce=("k",)``, with
  NumPy rules (the product and its two transposes): each process's rules run on its own
  rows, and the cotangent of ``x`` is summed across the processes (an all-reduce);
- ``jnp``: ``a @ x`` in ``jax.numpy`` (XLA's own dot), the same collective.

Every process times both, interleaved (``harness.time_case``), with the same number of
calls per batch and the same order, so that the processes call the same programs in
lockstep; both gradients are checked against NumPy first. NumPy's BLAS and XLA's kernels
run on one thread each. A process's ratio is the median over rounds of the ratio of the
round's two batches (run back to back). Past 2 processes this machine's
2 cores are shared (8 processes: 4 per core), so the times grow with the count and only
the ratio ``jaxdecl / jnp`` at each count says something: target <= 1.2 at every count.
Also reported per count: the start-up cost of a process (from its launch until
``jax.distributed.initialize`` returns, then until both variants are compiled).

Results go to ``benchmarks/results_processes.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = 1.2


# ---------------------------------------------------------------------------------------
# One process of a job
# ---------------------------------------------------------------------------------------

def process_main(args) -> None:
    """Times both variants in this process of the job; prints a JSON report line."""
    launched = float(os.environ["BENCH_LAUNCHED"])
    processes, process, port = (int(v) for v in os.environ["BENCH_JOB"].split(","))
    import jax

    jax.config.update("jax_enable_x64", True)
    if processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=processes,
                                   process_id=process)
    initialized = time.time()
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxdecl as jd

    sys.path.insert(0, HERE)
    import harness

    class MatVec(jd.Primitive, multilinear=True, sharding="b k, k -> b", reduce=("k",)):
        @jd.abstract
        def shapes(self, a, x):
            return jax.ShapeDtypeStruct(a.shape[:1], a.dtype)

        @jd.forward
        def apply(self, a, x, *, out):  # (zero-copy: written into XLA's buffer)
            np.matmul(a, x, out=out)

        @jd.transpose(wrt="a")
        def t_a(self, x, ct, *, out):
            np.outer(ct, x, out=out)

        @jd.transpose(wrt="x")
        def t_x(self, a, ct, *, out):
            np.matmul(ct, a, out=out)

    rows, cols = args.rows, args.cols
    rng = np.random.default_rng(0)
    a_whole = rng.standard_normal((rows * processes, cols)) / cols ** 0.5
    x_whole = rng.standard_normal(cols)
    mesh = jax.make_mesh((processes,), ("d",), axis_types=(AxisType.Auto,))
    mine = slice(rows * process, rows * (process + 1))
    a = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d", None)),
                                               a_whole[mine], a_whole.shape)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P()), x_whole,
                                               x_whole.shape)
    matvec = MatVec()
    grads = {"jaxdecl": jax.jit(jax.grad(lambda a, x: jnp.sum(jnp.sin(matvec(a, x))),
                                         argnums=(0, 1))),
             "jnp": jax.jit(jax.grad(lambda a, x: jnp.sum(jnp.sin(a @ x)), argnums=(0, 1)))}
    y = a_whole @ x_whole
    want_a, want_x = np.outer(np.cos(y), x_whole)[mine], a_whole.T @ np.cos(y)
    checks = {}
    for name, grad in grads.items():
        got_a, got_x = grad(a, x)
        local = np.concatenate([np.asarray(s.data) for s in sorted(
            got_a.addressable_shards, key=lambda s: s.index[0].start or 0)])
        checks[name] = bool(np.allclose(local, want_a, rtol=1e-10, atol=1e-12) and np.allclose(
            np.asarray(got_x.addressable_shards[0].data), want_x, rtol=1e-10, atol=1e-12))
    compiled = time.time()
    variants = {name: (lambda grad=grad: grad(a, x)) for name, grad in grads.items()}
    # The same calls per batch and the same order in every process (no calibration):
    # the processes run the same programs in lockstep.
    stats = harness.time_case(variants, rounds=args.rounds, target_s=0, number=args.number)
    # Each round runs both back to back: the ratio of a round's pair is the least
    # disturbed by the other processes sharing the cores.
    paired = [d / j for d, j in zip(stats["jaxdecl"].samples, stats["jnp"].samples)]
    print(json.dumps({
        "process": process, "checks": checks,
        "initialize_s": initialized - launched, "compiled_s": compiled - launched,
        "median_s": {name: s.median for name, s in stats.items()},
        "min_s": {name: s.min for name, s in stats.items()},
        "ratio": statistics.median(paired)}), flush=True)
    if processes > 1:
        jax.distributed.shutdown()


# ---------------------------------------------------------------------------------------
# The jobs
# ---------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_job(processes: int, args, timeout: float = 900) -> list:
    """Runs one job of `processes` processes; returns each one's report."""
    port = _free_port()
    command = [sys.executable, os.path.abspath(__file__), "--process",
               "--rows", str(args.rows), "--cols", str(args.cols),
               "--rounds", str(args.rounds), "--number", str(args.number)]
    # One thread each for NumPy's BLAS and XLA's own kernels: the same work per process.
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1 "
               "--xla_cpu_multi_thread_eigen=false", OPENBLAS_NUM_THREADS="1",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    children, outputs = [], []
    start = time.monotonic()
    try:
        for i in range(processes):
            out = tempfile.TemporaryFile("w+")
            outputs.append(out)
            children.append(subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, text=True,
                env=dict(env, BENCH_JOB=f"{processes},{i},{port}",
                         BENCH_LAUNCHED=repr(time.time()))))
        for child in children:
            child.wait(timeout=max(1.0, timeout - (time.monotonic() - start)))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    reports = []
    for i, (child, out) in enumerate(zip(children, outputs)):
        out.seek(0)
        text = out.read()
        lines = [line for line in text.splitlines() if line.startswith('{"process"')]
        if child.returncode != 0 or not lines:
            raise RuntimeError(f"process {i} of {processes} failed (exit {child.returncode}):"
                               f"\n{text[-3000:]}")
        reports.append(json.loads(lines[-1]))
    return reports


def summary(processes: int, reports: list) -> dict:
    """One count's entry: per variant the median over processes of their medians, the
    ratio jaxdecl / jnp (each process's median over rounds of the ratio of the round's
    pair; the median and the worst over processes), the start-up costs."""
    ratios = [r["ratio"] for r in reports]
    return {
        "processes": processes,
        "checks": all(all(r["checks"].values()) for r in reports),
        "median_s": {name: statistics.median(r["median_s"][name] for r in reports)
                     for name in ("jaxdecl", "jnp")},
        "ratio": statistics.median(ratios), "worst_ratio": max(ratios),
        "initialize_s": statistics.median(r["initialize_s"] for r in reports),
        "compiled_s": statistics.median(r["compiled_s"] for r in reports),
    }


def markdown(entries: list) -> str:
    lines = ["| processes | jnp ms | jaxdecl ms | jaxdecl / jnp (worst process) | "
             "start-up: initialized, compiled (s) |", "|---:|---:|---:|---:|---:|"]
    for e in entries:
        lines.append(f"| {e['processes']} | {e['median_s']['jnp'] * 1e3:.2f} | "
                     f"{e['median_s']['jaxdecl'] * 1e3:.2f} | {e['ratio']:.2f} "
                     f"({e['worst_ratio']:.2f}) | {e['initialize_s']:.1f}, "
                     f"{e['compiled_s']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 and 2 processes, small blocks")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--out", default=os.path.join(HERE, "results_processes.json"))
    parser.add_argument("--counts", default=None, help="process counts, e.g. 1,2,4,8")
    parser.add_argument("--process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--number", type=int, default=20)
    args = parser.parse_args(argv)
    if args.process:
        process_main(args)
        return
    if args.quick:
        args.rows, args.cols, args.rounds, args.number = 32, 64, 5, 5
    counts = [int(c) for c in (args.counts or ("1,2" if args.quick else "1,2,4,8")).split(",")]
    entries = []
    for count in counts:
        entry = summary(count, run_job(count, args))
        entries.append(entry)
        print(f"{count} processes: jnp {entry['median_s']['jnp'] * 1e3:.3f} ms, jaxdecl "
              f"{entry['median_s']['jaxdecl'] * 1e3:.3f} ms, ratio {entry['ratio']:.2f} "
              f"(worst {entry['worst_ratio']:.2f}), initialized after "
              f"{entry['initialize_s']:.1f} s, compiled after {entry['compiled_s']:.1f} s, "
              f"checks {'pass' if entry['checks'] else 'FAIL'}", flush=True)
    verdict = "PASS" if all(e["ratio"] <= TARGET for e in entries) else "MISS"
    report = {"rows_per_process": args.rows, "cols": args.cols, "rounds": args.rounds,
              "calls_per_batch": args.number, "counts": entries,
              "target": {"ratio": TARGET, "verdict": verdict}}
    with open(args.out, "w") as file:
        json.dump(report, file, indent=1)
    print(f"target jaxdecl / jnp <= {TARGET} at every count: {verdict}")
    if args.markdown:
        print(markdown(entries))


if __name__ == "__main__":
    main()
