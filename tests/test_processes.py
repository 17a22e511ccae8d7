"""Jobs of several processes (``jax.distributed``, gloo, 127.0.0.1): each process runs its
own shards, eager calls follow any mesh, and a rule that raises in one process ends the
job instead of hanging it.

Each test starts a job of 4 processes x 2 CPU devices (``helpers_processes.run_job``)
running a scenario of ``helpers_processes_scenarios.py``; every process must end by
itself within the test's bound (a process still running then is killed, and fails it).
"""

import json
import os
import sys

import pytest
from conftest import _splits_per_shard, needs_split, subprocess_env
from helpers_processes import run_job

pytestmark = pytest.mark.slow  # (`pytest -m slow`; CI runs them once, on the newest Python)

SCENARIOS = os.path.join(os.path.dirname(__file__), "helpers_processes_scenarios.py")
PROCESSES, DEVICES = 4, 2
GRACE = 5  # JAXDECL_FAILURE_GRACE_SECONDS in the failure tests
SPLITS = _splits_per_shard()


def _job(*args, timeout=240, **variables):
    return run_job([sys.executable, SCENARIOS, *args], processes=PROCESSES, devices=DEVICES,
                   timeout=timeout, env=subprocess_env(**variables))


def _checks(*args, **variables) -> dict:
    """Runs scenarios; every process must end with status 0. Returns each check's
    outcomes, one per process."""
    ended = _job(*args, **variables)
    found = {}
    for process in ended:
        assert process.returncode == 0, (process.process, process.returncode,
                                         process.stderr[-3000:])
        for name, value in process.last_json()["checks"].items():
            found.setdefault(name, []).append(value)
    return found


@pytest.fixture(scope="module")
def per_shard(tmp_path_factory):
    """The checks of the scenarios that run without errors, in one job."""
    scenarios = ["eager_meshes", "callback_device"]
    if SPLITS:
        scenarios += ["undeclared_layout", f"export_plan={tmp_path_factory.mktemp('export')}",
                      f"outputs_and_pytrees={tmp_path_factory.mktemp('outputs')}"]
    return _checks(*scenarios)


def _passed(checks: dict, scenario: str) -> None:
    mine = {name: values for name, values in checks.items() if name.startswith(scenario)}
    failed = {name: values for name, values in mine.items()
              if any(value is not True for value in values)}
    assert mine and not failed, failed


def test_eager_calls_follow_each_mesh_across_processes(per_shard):
    """An op called eagerly under ``jax.set_mesh(A)``, then on arrays of mesh B (the same
    devices in reverse order), over Auto and Explicit axes, declared or not: values, the
    results' mesh, and the blocks each process's rules ran on."""
    _passed(per_shard, "eager_meshes")


def test_a_callback_runs_once_on_its_device_across_processes(per_shard):
    """jd.pure_callback under jit on split rows: once, in the process of the mesh's first
    device, or of the device its sharding= names; vmapped too; Auto and Explicit axes."""
    _passed(per_shard, "callback_device")


@needs_split
def test_an_undeclared_result_is_laid_out_like_its_input_across_processes(per_shard):
    """jit over Auto axes: the undeclared op's result keeps its input's rows split, the
    compiled program gathers only its input, and the declared op after it runs on each
    device's rows."""
    _passed(per_shard, "undeclared_layout")


@needs_split
def test_an_exported_program_keeps_the_jit_programs_blocks_across_processes(per_shard):
    """jit(grad) of an op with reduce= on split rows, and the same program exported in
    process 0 and run by every process: the same rows per rule call, no gather."""
    _passed(per_shard, "export_plan")


@needs_split
def test_ops_with_several_results_and_pytrees_across_processes(per_shard):
    """Two results, and dicts in and out, declared by rows: eager, jit, jit(grad), vmap,
    scan, shard_map and an exported jit(grad), each rule call on one device's rows."""
    _passed(per_shard, "outputs_and_pytrees")


def _failure(how):
    ended = _job(f"failure={how}", JAXDECL_FAILURE_GRACE_SECONDS=str(GRACE))
    starts = [json.loads(line)["failing_at"] for process in ended
              for line in process.stdout.splitlines() if line.startswith('{"failing_at"')]
    assert len(starts) == PROCESSES, [(p.process, p.returncode, p.stdout[-500:],
                                       p.stderr[-1500:]) for p in ended]
    return ended, max(starts)


@pytest.mark.parametrize("how", ["jit-one", "jit-all", "eager"])
def test_a_rule_that_raises_in_one_process_ends_the_job(how):
    """The failing process raises the rule's error (or, stuck in a collective, prints it);
    the three others end within seconds with an error naming process 1, the op, the rule
    and the error, and nothing hangs."""
    ended, failing_at = _failure(how)
    rule = "Boom.apply (@forward) raised ValueError: boom in process 1"
    for process in ended:
        assert process.returncode == 1, (process.process, process.returncode,
                                         process.stderr[-3000:])
        # every process ends soon after the failure: the failing one within its grace
        assert process.ended_at - failing_at < GRACE + 20, (
            process.process, process.ended_at - failing_at)
        if process.process == 1:
            assert "ValueError: boom in process 1" in process.stderr, process.stderr[-3000:]
        else:
            assert f"jaxdecl: process 1 of {PROCESSES} failed: {rule}. Process " \
                   f"{process.process} stops" in process.stderr, process.stderr[-3000:]
    if how == "jit-one" and SPLITS:  # its other device waits in a collective: the grace
        # ends it (where JAX cannot split the call, both devices run the rule, and raise)
        assert "the process still runs" in ended[1].stderr, ended[1].stderr[-3000:]


def test_a_rule_that_raises_on_a_process_own_arrays_leaves_the_job_alone():
    """Process 1's eager call on its own arrays raises there, and the job goes on."""
    _passed(_checks("failure=local", JAXDECL_FAILURE_GRACE_SECONDS=str(GRACE)), "failure")
