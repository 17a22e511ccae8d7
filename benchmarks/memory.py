"""Memory bounded by what is alive: create, call and drop many ops, measure the growth.

Each op holds an array in its configuration, so it is keyed by identity, as
nifty.re models are: every op is a new configuration with its own kernel. The
script warms up (JAX's caches, the shared eager executable), then runs
`--eager` ops called eagerly and `--jit` ops called through a fresh
``jax.jit`` each, checking every result, and reports the resident-set growth,
the ops still alive and the kernels still registered, as JSON.

    python benchmarks/memory.py --eager 20000 --jit 1000
    XLA_FLAGS=--xla_force_host_platform_device_count=4 \
        python benchmarks/memory.py --eager 20000 --jit 1000 --sharded

With ``--sharded`` the input is split over every device and the op declares
``sharding="n -> n"``: each call runs per shard (eager calls through the
shared per-shard executables, jitted ones through a split program).
Also reported: ``call_sites``, the compiled call sites still holding a kernel.

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
from jaxdecl._host import _dispatch


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


class ShardedTable(Table, sharding="n -> n"):
    """Table declared independent along its dim: it runs on each device's block."""


def settle() -> None:
    """Frees what is garbage now: cycles, and what dropped executables left to release."""
    for _ in range(2):
        gc.collect()
        _dispatch.release_pending()


def churn(eager: int, jitted: int, table_size: int = 1000, sharded: bool = False) -> dict:
    """Runs the create-call-drop cycles; returns what is left behind."""
    x = jnp.arange(4.0)
    kind = Table
    if sharded:
        mesh = jax.make_mesh((len(jax.devices()),), ("d",),
                             axis_types=(jax.sharding.AxisType.Auto,))
        x = jax.device_put(jnp.arange(4.0 * len(jax.devices())),
                           jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
        kind = ShardedTable
    expected = np.asarray(x)
    wrong = 0

    def cycle(i, jit):
        nonlocal wrong
        op = kind(np.full(table_size, float(i)))
        result = (jax.jit(lambda v: op(v)) if jit else op)(x)
        # A reused id or registry slot must never run another op's table.
        if not np.array_equal(np.asarray(result), expected + i):
            wrong += 1
        return weakref.ref(op)

    for i in range(50):
        cycle(i, False)
        cycle(i, True)
    settle()
    kernels, sites = _dispatch.kernel_count(), _dispatch.call_site_count()
    rss, start = rss_mb(), time.perf_counter()
    refs = [cycle(i, False) for i in range(eager)]
    refs += [cycle(i, True) for i in range(jitted)]
    settle()
    return {
        "eager_ops": eager,
        "jit_ops": jitted,
        "rss_growth_mb": round(rss_mb() - rss, 1),
        "ops_alive": sum(ref() is not None for ref in refs),
        "kernels_left": _dispatch.kernel_count() - kernels,
        "call_sites_left": _dispatch.call_site_count() - sites,
        "wrong_results": wrong,
        "seconds": round(time.perf_counter() - start, 1),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eager", type=int, default=20000, help="ops called eagerly")
    parser.add_argument("--jit", type=int, default=1000, help="ops called through jax.jit")
    parser.add_argument("--sharded", action="store_true",
                        help="split the input over every device (set XLA_FLAGS first)")
    args = parser.parse_args(argv)
    report = churn(args.eager, args.jit, sharded=args.sharded)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
