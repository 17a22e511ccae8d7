"""Ops used the way programs really run, in a fresh interpreter; one JSON line on stdout.

Run as ``python helpers_stress.py SCENARIO ELEMENTS ROUNDS [gc]``, with
``XLA_FLAGS`` choosing the number of host devices. Every round builds its ops
*inside* the traced function, with a configuration no earlier round used, and
calls a temporary ``jax.jit`` of it once: the jitted function, its executable
and the ops are garbage as soon as the call returns, while XLA (asynchronous
dispatch, worker threads for large arrays) may not have run the program yet.
With ``gc``, ``gc.set_threshold(1)`` collects at every allocation meanwhile.

Scenarios (each reports ``{"results": {form: [outcome per round]}}``, an
outcome being ``"ok"``, ``"wrong"`` or ``"error: <type>: <message>"``):

- ``forms``: the op forms of the call-context matrix (zero-copy, return form,
  ``grad`` of a nonlinear op, ``grad`` and ``linear_transpose`` of a linear op,
  pytrees, a ``vmap``) and, on several devices, declared ops under ``jit`` with
  a sharded input (each device runs its block), one split by XLA itself and one
  through a partition callback;
- ``cache``: the persistent compilation cache on, ``jax.clear_caches()`` and a
  dropped op between rounds, an equal op made anew each round, in programs
  split across devices both ways;
- ``raise``: a declared op whose rule raises, called eagerly on an array
  sharded over every device: the caller must get the rule's ``ValueError``.
"""

import gc
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from ops import Scale

import jaxdecl as jd

jax.config.update("jax_enable_x64", True)


class ScaleReturning(Scale):
    @jd.forward
    def apply(self, x):
        return self.factor * x


class Power(jd.Primitive):
    def __init__(self, p):
        self.p = p

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        return x ** self.p

    @jd.jvp
    def push(self, x, dx):
        return self.p * x ** (self.p - 1) * dx

    @jd.vjp
    def pull(self, x, ct):
        return self.p * x ** (self.p - 1) * ct


class LinearScale(Scale, linear=True):
    @jd.transpose
    def back(self, ct, *, out):
        np.multiply(ct, self.factor, out=out)


class Affine(jd.Primitive):
    """A pytree in (a dict) and out (a tuple)."""

    def __init__(self, shift):
        self.shift = shift

    @jd.abstract
    def shapes(self, p):
        return (jax.ShapeDtypeStruct(p["x"].shape, p["x"].dtype),
                jax.ShapeDtypeStruct(p["x"].shape, p["x"].dtype))

    @jd.forward
    def apply(self, p):
        return p["a"] * p["x"] + self.shift, p["x"] - self.shift


class RowScale(Scale, sharding="n -> n"):
    """Declared independent along its only dim: each device runs its block (XLA splits
    the call itself)."""


class ShiftedScale(jd.Primitive, sharding="n, k -> n", replicate=("k",)):
    """c * x + w.sum(): w has no n, so each call is split by a partition callback."""

    def __init__(self, factor):
        self.factor = factor

    @jd.abstract
    def shapes(self, x, w):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, w):
        return self.factor * x + w.sum()


class Fails(jd.Primitive, sharding="n -> n"):
    def __init__(self, code):
        self.code = code

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        raise ValueError(f"rule failed with code {self.code}")


def outcome(call, expected) -> str:
    try:
        got = jax.tree_util.tree_map(np.asarray, call())
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"error: {type(exc).__name__}: {str(exc)[:400]}"
    got, expected = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)
    same = len(got) == len(expected) and all(
        g.shape == e.shape and np.allclose(g, e, rtol=1e-12) for g, e in zip(got, expected))
    return "ok" if same else "wrong"


def forms(x: jax.Array, rounds: int, sharded) -> dict:
    """Every form, each round with fresh ops inside a temporary jitted function."""
    xn = np.asarray(x)
    cases = {
        "zero_copy": lambda c: (lambda v: Scale(c)(v) + Scale(c)(v), 2 * c * xn),
        "return": lambda c: (lambda v: ScaleReturning(c)(ScaleReturning(c + 1)(v)),
                             c * (c + 1) * xn),
        "grad": lambda c: (jax.grad(lambda v: Power(c)(v).sum()), c * xn ** (c - 1)),
        "linear_grad": lambda c: (jax.grad(lambda v: (LinearScale(c)(v) ** 2).sum()),
                                  2 * c * c * xn),
        "linear_transpose": lambda c: (
            lambda v: jax.linear_transpose(LinearScale(c), v)(v)[0], c * xn),
        "pytree": lambda c: (lambda v: Affine(c)({"a": 2.0 * jnp.ones_like(v), "x": v}),
                             (2 * xn + c, xn - c)),
        "vmap": lambda c: (jax.vmap(lambda row: Scale(c)(row)),
                           c * xn.reshape(4, -1)),
    }
    if sharded is not None:
        cases["sharded"] = lambda c: (lambda v: RowScale(c)(v) + 1.0, c * xn + 1.0)
        cases["sharded_callback"] = lambda c: (lambda v: ShiftedScale(c)(v, jnp.ones(3)),
                                               c * xn + 3.0)
    results = {name: [] for name in cases}
    for r in range(rounds):
        for name, make in cases.items():
            c = 2.0 + r + 0.25 * len(results[name])  # a configuration no round used
            expected = make(c)[1]
            arg = x.reshape(4, -1) if name == "vmap" else (
                sharded if name.startswith("sharded") else x)
            # The function, its jit and its ops are made inside the call and are
            # garbage once it returns, before XLA has run the program.
            results[name].append(outcome(
                lambda make=make, c=c, arg=arg: jax.jit(make(c)[0])(arg), expected))
    return results


def cache(x: jax.Array, rounds: int) -> dict:
    """Equal ops re-created after clear_caches, persistent cache on, a split program."""
    directory = tempfile.mkdtemp(prefix="jaxdecl-cache-")
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    xn = np.asarray(x)
    results = {"split_by_xla": [], "split_by_callback": []}
    for _ in range(rounds):
        op, shifted = RowScale(3.0), ShiftedScale(3.0)
        results["split_by_xla"].append(
            outcome(lambda op=op: jax.jit(lambda v: op(v) * 2.0)(x), 6.0 * xn))
        results["split_by_callback"].append(
            outcome(lambda op=shifted: jax.jit(lambda v: op(v, jnp.ones(2)) * 2.0)(x),
                    6.0 * xn + 4.0))
        del op, shifted
        jax.clear_caches()
        gc.collect()
    return results


def raising(x: jax.Array, rounds: int) -> dict:
    results = []
    for r in range(rounds):
        try:
            Fails(r)(x).block_until_ready()
            results.append("error: no exception")
        except ValueError as exc:
            expected = f"rule failed with code {r}"
            results.append("ok" if str(exc).startswith(expected) else
                           f"error: ValueError: {str(exc)[:400]}")
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results.append(f"error: {type(exc).__name__}: {str(exc)[:400]}")
    return {"raise": results}


def main(scenario: str, elements: int, rounds: int, collect: bool) -> dict:
    x = jnp.linspace(0.5, 1.5, elements)
    devices = jax.devices()
    sharded = None
    if len(devices) > 1:
        mesh = jax.make_mesh((len(devices),), ("d",),
                             axis_types=(jax.sharding.AxisType.Auto,))
        rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
        sharded = jax.device_put(x, rows)
    if collect:
        gc.set_threshold(1)
    if scenario == "forms":
        return forms(x, rounds, sharded)
    if scenario == "cache":
        return cache(sharded if sharded is not None else x, rounds)
    if scenario == "raise":
        return raising(sharded if sharded is not None else x, rounds)
    raise SystemExit(f"unknown scenario {scenario}")


if __name__ == "__main__":
    name, size, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    report = main(name, size, count, "gc" in sys.argv[4:])
    gc.set_threshold(700)
    sys.stdout.write(json.dumps({"results": report, "pid": os.getpid()}) + "\n")
    sys.stdout.flush()
    # The scenarios test what happens while programs run; every result is in. JAX 0.6's
    # CPU client was seen to hang at interpreter exit, joining an idle worker thread of
    # its pool (1 in 6 runs with 4 devices, GC at every allocation and busy cores), so
    # the process ends here rather than through interpreter finalization.
    os._exit(0)
