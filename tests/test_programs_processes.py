"""Generated programs over a job of several local processes (``jax.distributed``, gloo).

The draws of the "processes" group (``helpers_programs_draw``) over a mesh of every
device of every process, 1-D and 2-D, Auto and Explicit axes, run by every process of
a job (``helpers_programs_jobs.py``, started by ``helpers_processes.run_job``):

- each result equals its jax.numpy twin's (gathered with ``process_allgather``), under
  every transform the draw nests (jit, grad, vmap, scan, shard_map, ..., or none: eager
  calls on global arrays, made from each process's own blocks);
- the same program exported by process 0 (``jax.export``) and run by every process
  equals it too (its twin jitted, so that both results lie where a compiled program puts
  them);
- each process's rules run on its own blocks only: the rule calls of all processes
  together (each rule and the shapes it saw) are exactly those of the same draws run in
  one process over as many devices (an eager call on values each process holds for
  itself, such as an eager ``grad``'s seed cotangent, runs in each of the P processes,
  and counts 1/P in each);
- every process ends by itself, with status 0, within the job's bound (else the job's
  processes are killed and the test fails).

``pytest -m processes`` runs it (CI's "processes" leg: 4 processes x 2 devices); the
geometry and the number of draws come from ``JAXDECL_JOB_GEOMETRY`` ("4,2": processes,
devices each) and ``JAXDECL_JOB_DRAWS`` (16; ``tools/sweep`` runs 8 x 1 and 8 x 2). The
first draws are chosen to cover every op kind, transform and mesh the group has.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import pytest
from conftest import subprocess_env
from helpers_processes import run_job
from helpers_programs_draw import Geometry, draw, group_of

HELPER = os.path.join(os.path.dirname(__file__), "helpers_programs_jobs.py")
GEOMETRY = Geometry(*(int(v) for v in os.environ.get("JAXDECL_JOB_GEOMETRY", "4,2").split(",")))
DRAWS = int(os.environ.get("JAXDECL_JOB_DRAWS", "16"))
#: Seconds a job may take per draw (beyond its start) before it counts as hung.
PER_DRAW, START = 120, 120

#: What the chosen draws must cover between them.
WANTED = ({f"op:{op}" for op in ("Quad", "Mul", "Tanh", "SinRes", "Scale", "MatVec", "CumSum")}
          | {f"transform:{t}" for t in ("jit", "grad", "vmap", "scan", "shard_map", "eager")}
          | {f"mesh:{a}-{m}" for a in ("auto", "explicit") for m in ("1d", "2d")})


def chosen_seeds(count: int, geometry: Geometry = GEOMETRY, pool: int = 4000) -> list:
    """`count` draws of the "processes" group: first a few that cover WANTED between them
    (each the draw covering most of what is still missing), then the first others."""
    seeds = [s for s in range(pool) if group_of(s) == "processes"]
    features = {s: draw(s, geometry).features & WANTED for s in seeds}
    chosen, missing = [], set(WANTED)
    while missing and len(chosen) < count:
        best = max(seeds, key=lambda s: (len(features[s] & missing), -s))
        if not features[best] & missing:
            break
        chosen.append(best)
        missing -= features[best]
    chosen += [s for s in seeds if s not in chosen][:count - len(chosen)]
    return sorted(chosen)


def _lines(stdout: str) -> dict:
    return {line["seed"]: line for line in map(json.loads, (
        text for text in stdout.splitlines() if text.startswith("{")))}


def _calls(lines) -> dict:
    """{"seen": Counter, "seen_export": Counter} of (rule, shapes) over `lines`."""
    found = {"seen": collections.Counter(), "seen_export": collections.Counter()}
    for line in lines:
        for key, counter in found.items():
            for rule, shapes, calls in line.get(key, []):
                counter[(rule, json.dumps(shapes))] += calls
    return found


def _failures(seed: int, lines: list, reference: dict) -> list:
    problems = []
    for i, line in enumerate(lines):
        for key, detail in (("outcome", "detail"), ("export", "export_detail")):
            if line.get(key) in ("error", "wrong"):
                problems.append(f"process {i}, {key}: {line[key]}: {line[detail][:600]}")
    if problems or "skip" in (lines[0]["outcome"], reference["outcome"]):
        return problems
    job, alone = _calls(lines), _calls([reference])
    for key in ("seen", "seen_export"):
        if job[key] != alone[key]:
            problems.append(
                f"{key}: the processes' rules ran {sorted((job[key] - alone[key]).items())} "
                f"beyond, and {sorted((alone[key] - job[key]).items())} short of, the calls "
                f"of one process over the same devices")
    return problems


@pytest.mark.processes
def test_generated_programs_over_processes(tmp_path):
    seeds = chosen_seeds(DRAWS)
    covered = set().union(*(draw(s, GEOMETRY).features for s in seeds))
    assert WANTED <= covered, sorted(WANTED - covered)
    args = ["--seeds", ",".join(map(str, seeds)), "--export"]
    for folder in ("job", "alone"):
        (tmp_path / folder).mkdir()
    ended = run_job([sys.executable, HELPER, *args, str(tmp_path / "job")],
                    processes=GEOMETRY.processes, devices=GEOMETRY.local,
                    timeout=START + PER_DRAW * len(seeds), env=subprocess_env())
    for process in ended:
        assert process.returncode == 0, (process.process, process.returncode,
                                         process.stderr[-3000:])
    alone = subprocess.run(
        [sys.executable, HELPER, *args, str(tmp_path / "alone"), "--geometry",
         f"{GEOMETRY.processes},{GEOMETRY.local}"], capture_output=True, text=True,
        timeout=START + PER_DRAW * len(seeds), env=subprocess_env())
    assert alone.returncode == 0, alone.stderr[-3000:]
    reference = _lines(alone.stdout)
    by_process = [_lines(process.stdout) for process in ended]
    failing = {}
    for seed in seeds:
        lines = [found[seed] for found in by_process]
        problems = _failures(seed, lines, reference[seed])
        if problems:
            failing[seed] = problems
    outcomes = collections.Counter(found[s]["outcome"] for found in by_process[:1] for s in seeds)
    assert not failing, f"{len(failing)} of {len(seeds)} draws failed ({dict(outcomes)}):\n" + \
        "\n".join(f"-- draw {seed}: {'; '.join(p)}\n   {draw(seed, GEOMETRY).summary}"
                  for seed, p in failing.items())
    assert outcomes["ok"] >= 0.8 * len(seeds), dict(outcomes)  # (few invalid programs)


def test_the_chosen_draws_cover_the_group():
    """The draws a job runs cover every op kind, transform and mesh, at any geometry."""
    for geometry in (Geometry(4, 2), Geometry(8, 1), Geometry(8, 2)):
        seeds = chosen_seeds(16, geometry)
        covered = set().union(*(draw(s, geometry).features for s in seeds))
        assert WANTED <= covered, (geometry, sorted(WANTED - covered))
        for seed in seeds:  # every draw's program splits over the geometry's mesh
            compile(draw(seed, geometry).source, f"<draw {seed}>", "exec")
