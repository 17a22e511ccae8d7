"""Scenarios that must run in a fresh interpreter, reported as one JSON line on stdout.

Run as ``python helpers_subprocess.py SCENARIO [ARGS...]``. The tests start
this script with a timeout, so a scenario that hangs fails its test instead of
the whole session. Each scenario prints ``{"results": [...]}``, one entry per
call: ``"ok"``, ``"wrong"`` (a result that differs from NumPy), or
``"error: <type>: <message>"``.
"""

import json
import os
import sys
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from ops import Negate, Scale  # noqa: E402

import jaxdecl as jd  # noqa: E402


def _outcome(call, expected) -> str:
    try:
        result = np.asarray(call())
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"error: {type(exc).__name__}: {exc}"
    if result.shape != expected.shape or result.dtype != expected.dtype:
        return "wrong"
    return "ok" if np.allclose(result, expected, rtol=1e-5, atol=1e-6) else "wrong"


def x64_off() -> list:
    """Ops with JAX's default 32-bit types (JAX_ENABLE_X64=0)."""
    assert not jax.config.jax_enable_x64
    twice = Scale(2)
    results = []
    for dtype in ("float32", "int32", "complex64", "float16"):
        x = (np.arange(7) - 3).astype(dtype)
        expected = 2 * x
        results.append(_outcome(lambda x=x: twice(jnp.asarray(x)), expected))
        results.append(_outcome(lambda x=x: jax.jit(twice)(jnp.asarray(x)), expected))
    # NumPy float64 input is canonicalised to float32 before the rule sees it.
    x = np.linspace(0, 1, 5)
    results.append(_outcome(lambda: twice(x), (2 * x).astype(np.float32)))
    results.append(_outcome(lambda: twice(1.5), np.float32(3.0)))
    return results


class _JaxInRule(jd.Primitive):
    """A rule that itself calls JAX: sin through jax.numpy or a nested jax.jit."""

    _inner = staticmethod(jax.jit(jnp.sin))

    def __init__(self, how):
        self.how = how

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        values = np.asarray(x)
        if self.how == "jnp":
            return np.asarray(jnp.sin(values))
        return np.asarray(self._inner(values))


def reentrant_threads(how: str, size: int, rounds: int = 1) -> list:
    """Four Python threads call a jitted op whose rule calls JAX."""
    f = jax.jit(_JaxInRule(how))
    base = np.linspace(0.0, 1.0, size)
    results = []
    for _ in range(rounds):
        slots = [None] * 4

        def work(i, slots=slots):
            x = base + i
            slots[i] = _outcome(lambda: f(jnp.asarray(x)), np.sin(x))

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        results.extend(slots)
    return results


def reentrant_shard_map(how: str, size: int) -> list:
    """The op under shard_map over the two host devices (rule on XLA's worker threads)."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), ("i",))
    x = np.linspace(0.0, 1.0, size)
    xs = jax.device_put(jnp.asarray(x), jax.NamedSharding(mesh, P("i")))
    f = jax.jit(jax.shard_map(_JaxInRule(how), mesh=mesh, in_specs=P("i"), out_specs=P("i")))
    # Compiled first, so that the call after the re-entrant one registers no new kernel.
    g = jax.jit(jax.shard_map(Negate(), mesh=mesh, in_specs=P("i"), out_specs=P("i")))
    results = [_outcome(lambda: g(xs), -x), _outcome(lambda: f(xs), np.sin(x))]
    # The process keeps working afterwards.
    results.append(_outcome(lambda: g(xs), -x))
    return results


def register_while_running() -> list:
    """Another thread registers new kernels while a rule runs (and keeps a view)."""
    kept = []

    class Slow(jd.Primitive):
        @jd.abstract
        def shapes(self, x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)

        @jd.forward
        def apply(self, x):
            time.sleep(1.0)
            kept.append(x)
            return -x

    slot = []

    def work():
        slot.append(_outcome(lambda: Slow()(jnp.ones(3)), -np.ones(3)))

    thread = threading.Thread(target=work)
    thread.start()
    time.sleep(0.3)
    results = []
    for i in range(40):
        op = _Shift(float(i))
        results.append(_outcome(lambda op=op: op(jnp.ones(2)), np.full(2, 1.0 + i)))
    thread.join()
    kept.clear()
    return slot + results


class _Shift(jd.Primitive):
    def __init__(self, shift):
        self.shift = shift

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        return x + self.shift


class _Table(jd.Primitive):
    """Holds an array in its configuration: keyed by identity, as nifty.re models are."""

    def __init__(self, table):
        self.table = table

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, *, out):
        np.add(x, self.table[: x.size].reshape(x.shape), out=out)


def _seeded_op():
    """An op whose class is importable by name in any process (for serialized code)."""
    return _Shift(2.0)


def serialize(path: str) -> list:
    """Compiles jit(_Shift(2.0)) and writes the serialized executable to `path`."""
    import pickle

    from jax.experimental import serialize_executable

    compiled = jax.jit(lambda v: _seeded_op()(v)).lower(jnp.arange(4.0)).compile()
    with open(path, "wb") as file:
        pickle.dump(serialize_executable.serialize(compiled), file)
    return ["ok"]


def run_serialized(path: str, prepare: str) -> list:
    """Loads `path` and runs it after registering other ops ("other") or the same op ("same")."""
    import pickle

    from jax.experimental import serialize_executable

    x = jnp.arange(4.0)
    # Other ops first, so that any process-local numbering differs from the writer's.
    for i in range(5):
        _Table(np.full(8, -float(i)))(x)
        _Shift(-float(i))(x)
    op = _seeded_op() if prepare == "same" else None  # alive while the executable runs
    if op is not None:
        op(x)
    with open(path, "rb") as file:
        payload, in_tree, out_tree = pickle.load(file)
    compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    return [_outcome(lambda: compiled(x), np.arange(4.0) + 2.0)]


def hlo_text(order: str) -> list:
    """The HLO of jit(_Shift(2.0)) after using other ops in `order` ("none" or "many")."""
    x = jnp.arange(4.0)
    if order == "many":
        for i in range(7):
            jax.jit(lambda v, i=i: _Shift(float(i))(v))(x)
    return [jax.jit(lambda v: _seeded_op()(v)).lower(x).as_text()]


def cached_run(cache_dir: str, order: str) -> list:
    """jit(_Shift(2.0)) with the persistent compilation cache in `cache_dir`.

    Returns [outcome, whether compiling it wrote a new cache entry ("new"/"hit")].
    """
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    x = jnp.arange(4.0)
    if order == "many":
        for i in range(5):
            jax.jit(lambda v, i=i: _Shift(-float(i))(v))(x)
    before = set(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else set()
    outcome = _outcome(lambda: jax.jit(lambda v: _seeded_op()(v))(x), np.arange(4.0) + 2.0)
    return [outcome, "new" if set(os.listdir(cache_dir)) - before else "hit"]


SCENARIOS = {
    "cached_run": cached_run,
    "serialize": serialize,
    "run_serialized": run_serialized,
    "hlo_text": hlo_text,
    "x64_off": x64_off,
    "reentrant_threads": reentrant_threads,
    "reentrant_shard_map": reentrant_shard_map,
    "register_while_running": register_while_running,
}


def main(argv) -> None:
    name, *args = argv
    if name != "x64_off":
        jax.config.update("jax_enable_x64", True)
    parsed = [int(a) if a.isdigit() else a for a in args]
    print(json.dumps({"results": SCENARIOS[name](*parsed)}))


if __name__ == "__main__":
    main(sys.argv[1:])
