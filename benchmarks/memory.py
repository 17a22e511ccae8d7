"""Memory bounded by what is alive: create, call and drop many ops, measure the growth.

Each op holds an array in its configuration, so it is keyed by identity, as
nifty.re models are: every op is a new configuration with its own kernel. The
script warms up (JAX's caches, the shared eager executable), then runs
`--eager` ops called eagerly and `--jit` ops called through a fresh
``jax.jit`` each, checking every result, and reports the resident-set growth,
the ops still alive and the kernels still registered, as JSON.

    python benchmarks/memory.py --eager 20000 --jit 1000

(`tests/test_lifetime.py` runs it with smaller counts.)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np

import jaxdecl as jd
from jaxdecl import _dispatch


def rss_mb() -> float:
    """Resident set size of this process, in MiB (Linux)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Table(jd.Primitive):
    """out = x + table[:x.size]; the table makes the op identity-keyed."""

    def __init__(self, table):
        self.table = table

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, *, out):
        np.add(x, self.table[: x.size].reshape(x.shape), out=out)


def churn(eager: int, jitted: int, table_size: int = 1000) -> dict:
    """Runs the create-call-drop cycles; returns what is left behind."""
    x = jnp.arange(4.0)
    wrong = 0

    def cycle(i, jit):
        nonlocal wrong
        op = Table(np.full(table_size, float(i)))
        result = (jax.jit(lambda v: op(v)) if jit else op)(x)
        # A reused id or registry slot must never run another op's table.
        if not np.array_equal(np.asarray(result), np.arange(4.0) + i):
            wrong += 1
        return weakref.ref(op)

    for i in range(50):
        cycle(i, False)
        cycle(i, True)
    gc.collect()
    kernels, rss, start = _dispatch.kernel_count(), rss_mb(), time.perf_counter()
    refs = [cycle(i, False) for i in range(eager)]
    refs += [cycle(i, True) for i in range(jitted)]
    gc.collect()
    return {
        "eager_ops": eager,
        "jit_ops": jitted,
        "rss_growth_mb": round(rss_mb() - rss, 1),
        "ops_alive": sum(ref() is not None for ref in refs),
        "kernels_left": _dispatch.kernel_count() - kernels,
        "wrong_results": wrong,
        "seconds": round(time.perf_counter() - start, 1),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eager", type=int, default=20000, help="ops called eagerly")
    parser.add_argument("--jit", type=int, default=1000, help="ops called through jax.jit")
    args = parser.parse_args(argv)
    report = churn(args.eager, args.jit)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
