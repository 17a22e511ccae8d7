"""The one decision of how a call runs (jaxdecl/_sharded/strategy.py), by itself and end to end.

The chooser is a pure function, checked case by case and against the table in
``docs/concepts/sharding.md``; the seams between modes that once took
different code paths run in subprocesses with 4 host devices and with two
processes (``helpers_seams.py``), each against ``jax.numpy``.
"""

import os
import pathlib
import subprocess
import sys

import pytest
from conftest import needs_split, run_helper, run_two_processes, subprocess_env

from jaxdecl._sharded.strategy import CallFacts, Strategy, choose

HELPER = os.path.join(os.path.dirname(__file__), "helpers_seams.py")
DOCS = pathlib.Path(__file__).parent.parent / "docs" / "concepts" / "sharding.md"

#: Each row of the docs' table, as the facts it stands for.
DOC_ROWS = {
    "a traceable rule (`traceable=True`)": CallFacts(traceable=True, devices=4),
    "one device": CallFacts(devices=1, declared=True),
    "inside `shard_map`": CallFacts(devices=4, manual=True),
    "eager, inputs on one mesh": CallFacts(devices=4, eager=True, common_mesh=True),
    "eager, inputs on no common mesh": CallFacts(devices=4, eager=True),
    "eager, no declaration, no vmapped dim split, one process": CallFacts(
        devices=4, eager=True, common_mesh=True, splits=False),
    "eager, Explicit axes, no declaration, JAX < 0.9": CallFacts(
        devices=4, eager=True, common_mesh=True, explicit=True, explicit_reductions=False),
    "`jit`, Explicit axes": CallFacts(devices=4, explicit=True),
    "`jit`, Explicit axes, no declaration, JAX < 0.9": CallFacts(
        devices=4, explicit=True, explicit_reductions=False),
    "`jit`, Auto axes, an elementwise declaration": CallFacts(
        devices=4, declared=True, elementwise=True),
    "`jit`, Auto axes, any other declaration or none": CallFacts(devices=4),
    "`jit`, Auto axes, a declaration, JAX < 0.7 or Shardy off": CallFacts(
        devices=4, declared=True, elementwise=True, splits_per_shard=False),
}


def _doc_table() -> dict:
    """``{case: strategy}`` from the docs' "How a call runs" table."""
    text = DOCS.read_text().split("## How a call runs", 1)[1]
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 2 and cells[0] not in ("the call", "---"):
            rows[cells[0]] = cells[1].split(":")[0]
    return rows


def test_docs_table_matches_the_chooser():
    table = _doc_table()
    assert set(table) == set(DOC_ROWS)
    for case, facts in DOC_ROWS.items():
        assert table[case] == choose(facts).value, case


@pytest.mark.parametrize("declared", [False, True])
@pytest.mark.parametrize("explicit", [False, True])
def test_eager_and_traced_agree_on_one_device(declared, explicit):
    for eager in (False, True):
        facts = CallFacts(devices=1, declared=declared, explicit=explicit, eager=eager)
        assert choose(facts) is Strategy.DIRECT


def test_traceable_rules_always_inline():
    for devices in (1, 4):
        for manual in (False, True):
            assert choose(CallFacts(traceable=True, devices=devices, manual=manual)) \
                is Strategy.INLINE


def test_explicit_axes_need_no_partitioner():
    """Under Explicit axes the types place every block: a declared op runs per shard
    even where this JAX's partitioner cannot split it (JAX < 0.7 or Shardy off)."""
    facts = CallFacts(devices=4, declared=True, explicit=True, splits_per_shard=False,
                      explicit_reductions=False)
    assert choose(facts) is Strategy.PER_SHARD_MAP


def test_undeclared_ops_take_the_declared_paths():
    """No separate mechanism for ops without a declaration: their implied plan."""
    assert choose(CallFacts(devices=4)) is Strategy.PARTITIONED
    assert choose(CallFacts(devices=4, explicit=True)) is Strategy.PER_SHARD_MAP
    assert choose(CallFacts(devices=4, eager=True, common_mesh=True)) is Strategy.PER_SHARD_MAP
    # Several processes hold the operands: run once per block there too, not on one device.
    assert choose(CallFacts(devices=4, eager=True, common_mesh=True, splits=False,
                            addressable=False)) is Strategy.PER_SHARD_MAP


def test_implied_plan_of_an_undeclared_op_splits_only_vmapped_dims():
    from jaxdecl._op.equation import undeclared_factors
    from jaxdecl._sharded.plan import make_plan

    factors = undeclared_factors((8,), [(8, 16), (1, 16)], [(8, 16)], [(16,), (16,)])
    p = make_plan(factors, [("d", "e"), (None, "e")], {"d": 2, "e": 2})
    assert p.operand_specs == (("d", None), (None, None))
    assert p.result_specs == (("d", None),)
    assert p.idle == ("e",)  # runs once along it
    assert p.summed == ((),)


_PARTLY_MANUAL = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P
jax.config.update("jax_use_shardy_partitioner", False)
from helpers_seams import Scale
# Auto axes: over Explicit ones (make_mesh's default from JAX 0.7) JAX itself checks
# in_specs against the input's sharding type first (JAX 0.12), before the op is reached.
Auto = jax.sharding.AxisType.Auto
mesh = jax.make_mesh((2, 2), ("x", "y"), axis_types=(Auto, Auto))
f = jax.jit(jax.shard_map(lambda v: Scale(2.0)(v), mesh=mesh, in_specs=P("x"),
                          out_specs=P("x"), axis_names={"x"}))
try:
    f(jnp.arange(8.0))
except jax.errors.JaxRuntimeError as error:
    raise SystemExit(f"XLA error: {error}")
except Exception as error:
    print(type(error).__name__, error)
"""


def test_partly_manual_shard_map_without_shardy_is_refused():
    """Without Shardy, XLA's partitioner aborts the process on a custom call inside a
    shard_map over only some mesh axes (JAX 0.6's default): the op refuses by name."""
    done = subprocess.run([sys.executable, "-c", _PARTLY_MANUAL], capture_output=True,
                          text=True, timeout=300, cwd=os.path.dirname(HELPER),
                          env=subprocess_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ShardingTypeError Scale: called inside a shard_map over "
                                  "only some mesh axes"), done.stdout
    assert "needs JAX >= 0.7 with Shardy" in done.stdout


@needs_split
def test_seams_on_four_devices():
    checks = run_helper([sys.executable, HELPER, "devices"])
    failed = {name: value for name, value in checks.items() if value is not True}
    assert not failed, failed
    assert len(checks) >= 20


@needs_split
def test_seams_across_two_processes():
    for process, checks in enumerate(run_two_processes([sys.executable, HELPER, "processes"])):
        failed = {name: value for name, value in checks.items() if value is not True}
        assert not failed, (process, failed)
