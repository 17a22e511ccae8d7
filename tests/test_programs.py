"""Generated programs: random sharded programs over jaxdecl ops against their jax.numpy twins.

``helpers_programs_draw.py`` draws, from a seed alone, a mesh and its axis types (in one
process, or over two with ``jax.distributed``), inputs laid out over it, a program of 1-3
op applications mixed with ``jax.numpy`` and 0-3 nested transforms (``jit``, ``grad``,
``jvp``, ``vjp``, ``linearize``, ``vmap``, ``lax.scan``, ``checkpoint``, ``shard_map``);
``helpers_programs.py`` runs each program and its twin (the same program with the ops'
``jax.numpy`` twins) and compares values, devices and, under Explicit axes, sharding types.

The default run checks a fixed sample of draws; ``pytest -m generated_programs`` checks
``JAXDECL_PROGRAM_DRAWS`` of them (default 2000). The draws of a group (``GROUPS``) run in
one subprocess (two for the "processes" group; a fresh one every 100 draws), so JAX starts
a few times; ``JAXDECL_PROGRAM_WORKERS`` (default: 2, or 1 on one core) such series run
side by side. A failing draw is listed with its failure class, the command that re-runs it
verbosely and prints it as a standalone script, and a one-line rendering of the program.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import hashlib
import json
import os
import queue
import re
import socket
import subprocess
import sys
import tempfile
import threading

import pytest
from conftest import subprocess_env
from helpers_programs_draw import GROUPS, OPS, PLACEMENTS, TRANSFORMS, draw, group_of

HELPER = os.path.join(os.path.dirname(__file__), "helpers_programs.py")

SAMPLE = range(100)
DRAWS = int(os.environ.get("JAXDECL_PROGRAM_DRAWS", "2000"))
DRAW_TIMEOUT = 300  # seconds one draw may take before its process is killed (a hang)
PER_PROCESS = 100  # draws per process: compiled programs pile up (about 1 GB per 100)
WORKERS = int(os.environ.get("JAXDECL_PROGRAM_WORKERS", min(2, os.cpu_count() or 1)))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _merge(results: list) -> dict:
    """One draw's result from the results of its processes (the worst outcome)."""
    if len(results) == 1:
        return results[0]
    worst = max(results, key=lambda r: _SEVERITY.index(r["outcome"]))
    details = [f"process {i}: {r['detail']}" for i, r in enumerate(results) if r["detail"]]
    if len({(r["outcome"], r["detail"]) for r in results}) == 1:
        details = [worst["detail"]] if worst["detail"] else []
    return dict(worst, detail="; ".join(details), seconds=max(r["seconds"] for r in results),
                cpu=max(r["cpu"] for r in results))


_SEVERITY = ("ok", "skip", "refused", "wrong", "error")


def _stream(seeds: list, processes: int) -> tuple:
    """Runs `seeds` in one helper process, or in two meeting over jax.distributed.

    Returns ``({seed: result}, stopped)``: ``stopped`` is the result of the draw that
    killed or hung the processes (None if none did): an error if its program was
    running, a skip if its twin was (JAX itself crashing on a valid-looking program).
    """
    command = [sys.executable, HELPER, "--seeds", ",".join(map(str, seeds))]
    if processes > 1:
        port = str(_free_port())
        commands = [command + ["--process", str(i), "--port", port] for i in range(processes)]
    else:
        commands = [command]
    lines: queue.Queue = queue.Queue()
    seen = collections.defaultdict(dict)  # seed -> {process: result}
    twin_ran = collections.defaultdict(set)  # seed -> processes whose twin has run
    results, why = {}, ""
    with contextlib.ExitStack() as stack:
        children = []
        for i, args in enumerate(commands):
            stderr = stack.enter_context(tempfile.TemporaryFile("w+"))
            child = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                     env=subprocess_env())
            children.append((child, stderr))
            threading.Thread(target=_read, args=(child.stdout, i, lines), daemon=True).start()
        running = len(children)
        while running:
            try:
                i, line = lines.get(timeout=DRAW_TIMEOUT)
            except queue.Empty:
                why = f"no result within {DRAW_TIMEOUT} s (a hang); the processes were killed"
                break
            if line is None:
                running -= 1
            elif line.startswith("{"):
                result = json.loads(line)
                if "phase" in result:
                    twin_ran[result["seed"]].add(i)
                    continue
                seen[result["seed"]][i] = result
                if len(seen[result["seed"]]) == len(children):
                    by_process = seen[result["seed"]]
                    results[result["seed"]] = _merge([by_process[k] for k in sorted(by_process)])
        for child, _ in children:
            if child.poll() is None:
                child.kill()
            child.wait()
        missing = [s for s in seeds if s not in results]
        if not missing:
            return results, None
        if not why:
            crashes = []
            for child, stderr in children:
                stderr.seek(0)
                crashes.append(f"exit {child.returncode}: {_crash(stderr.read())}")
            why = "the process died (" + "; ".join(crashes) + ")"
    seed = missing[0]
    program = len(twin_ran[seed]) == len(children)
    return results, {"seed": seed, "outcome": "error" if program else "skip",
                     "detail": why if program else f"the twin stopped the process: {why}",
                     "seconds": 0.0, "cpu": 0.0}


_FATAL = re.compile(r"^F\d{4} |Check failed|Fatal Python error|Segmentation fault|Aborted")


def _crash(stderr: str) -> str:
    """What a crashed process said: its fatal lines, else the end of its output."""
    fatal = [line for line in stderr.splitlines() if _FATAL.search(line)]
    return " | ".join(fatal[:3]) if fatal else stderr[-800:]


def _read(stream, index: int, lines: queue.Queue) -> None:
    for line in stream:
        lines.put((index, line))
    lines.put((index, None))


def _run_share(seeds: list, processes: int) -> dict:
    """Runs `seeds` in a series of fresh processes (see :func:`run_draws`)."""
    results = {}
    pending = list(seeds)
    while pending:
        found, stopped = _stream(pending[:PER_PROCESS], processes)
        results.update(found)
        if stopped is not None:
            results[stopped["seed"]] = stopped
        pending = [s for s in pending if s not in results]
    return results


def run_draws(seeds) -> dict:
    """{seed: {"outcome", "detail", "seconds", "cpu"}}; a draw that kills or hangs its
    process(es) is an error (a skip if its twin did it), and the draws after it run in
    fresh ones. Draws of the "processes" group run in two processes, the others in one,
    ``WORKERS`` series of them side by side (a draw is mostly one busy thread)."""
    results = {}
    for processes in (1, 2):
        pending = [s for s in seeds if draw(s).processes == processes]
        # Draws over two processes already keep two cores busy.
        workers = WORKERS if processes == 1 else 1
        shares = [pending[i::workers] for i in range(workers) if pending[i::workers]]
        with concurrent.futures.ThreadPoolExecutor(max(len(shares), 1)) as pool:
            for found in pool.map(_run_share, shares, [processes] * len(shares)):
                results.update(found)
    return results


@functools.cache
def _group(group: str, count: int) -> dict:
    return run_draws([s for s in range(count) if group_of(s) == group])


def failure_class(result: dict) -> str:
    """What a failing draw has in common with others: its outcome, the exception type
    and the start of the message, numbers and partition specs masked."""
    detail = re.sub(r"\d+", "N", re.sub(r"P\([^)]*\)", "P(...)", result["detail"]))
    return f"{result['outcome']}: {detail.splitlines()[0] if detail else ''}"[:55]


def report(results: dict) -> str:
    """The failing draws grouped by class, each with its reproducer and its program."""
    failing = [r for r in results.values() if r["outcome"] in ("error", "wrong")]
    classes = collections.defaultdict(list)
    for result in failing:
        classes[failure_class(result)].append(result)
    counts = collections.Counter(r["outcome"] for r in results.values())
    seconds, cpu = (sum(r[key] for r in results.values()) / max(len(results), 1)
                    for key in ("seconds", "cpu"))
    lines = [f"{len(failing)} of {len(results)} draws failed ({dict(counts)}; {seconds:.2f} s, "
             f"{cpu:.2f} s of CPU per draw) in {len(classes)} classes:"]
    for name, members in sorted(classes.items(), key=lambda item: -len(item[1])):
        lines.append(f"\n== {name} ({len(members)} draws: "
                     f"{', '.join(str(r['seed']) for r in members)})")
        for result in members:
            lines += [f"-- draw {result['seed']}: {result['detail'][:400]}",
                      f"   reproduce: python tests/helpers_programs.py --seed {result['seed']}",
                      f"   {draw(result['seed']).summary}"]
    return "\n".join(lines)


#: Draws that fail for a reason not fixed yet, each named: listed in every report, and
#: a draw here that passes fails the run, so that the list only shrinks.
KNOWN_GAPS: dict = {}


def _check(results: dict) -> None:
    known = {seed: r for seed, r in results.items() if seed in KNOWN_GAPS}
    fixed = [seed for seed, r in known.items() if r["outcome"] in ("ok", "skip")]
    failing = {seed: r for seed, r in results.items()
               if r["outcome"] in ("error", "wrong") and seed not in KNOWN_GAPS}
    for seed, r in known.items():
        print(f"known gap, draw {seed} ({r['outcome']}): {KNOWN_GAPS[seed]}")
    if failing or fixed:
        message = report(results)
        if fixed:
            message += f"\n\ndraws listed in KNOWN_GAPS that pass now: {fixed}: remove them"
        pytest.fail(message, pytrace=False)


@pytest.mark.parametrize("group", GROUPS)
def test_generated_programs_sample(group):
    _check(_group(group, len(SAMPLE)))


@pytest.mark.generated_programs
@pytest.mark.parametrize("group", GROUPS)
def test_generated_programs(group):
    _check(_group(group, DRAWS))


def test_generated_programs_are_mostly_valid_jax():
    """Fewer than 10% of the sample's draws are programs whose twin JAX refuses."""
    results = {}
    for group in GROUPS:
        results.update(_group(group, len(SAMPLE)))
    skipped = [r for r in results.values() if r["outcome"] == "skip"]
    assert len(skipped) < 0.1 * len(results), "\n".join(
        f"draw {r['seed']}: {r['detail'][:300]}" for r in skipped)


def _features(seeds) -> set:
    return set().union(*(draw(seed).features for seed in seeds))


def _digest(seeds) -> str:
    return hashlib.sha256("".join(draw(s).source + draw(s).summary for s in seeds).encode()
                          ).hexdigest()


def test_every_op_kind_takes_a_split_scan_carry_under_explicit_axes():
    """Each op kind is the first op on a ``lax.scan`` carry split over Explicit mesh
    axes: the step's new carry must keep that type (JAX refuses the scan otherwise)."""
    explicit = [s for s in range(1200) if "split_carry" in draw(s).features
                and {"mesh:explicit-1d", "mesh:explicit-2d"} & draw(s).features]
    wanted = {f"scan_carry:{op}" for op in OPS}
    assert wanted <= _features(explicit), sorted(wanted - _features(explicit))
    for seed in explicit:  # the program's first line: the op (made there or reused) on a
        op = next(f for f in draw(seed).features if f.startswith("scan_carry:"))[11:]
        first = rf"\bt1 = ({op}\([^)]*\)|{op.lower()}\d?)\(a\b"
        assert re.search(first, draw(seed).source), (seed, draw(seed).summary)


def test_generator_is_reproducible_and_covers_its_space():
    seeds = range(0, 2000, 97)
    for seed in seeds:
        compile(draw(seed).script(os.path.dirname(HELPER)), f"<draw {seed}>", "exec")
    # Another process, with other string hashes, draws the same programs.
    code = f"from test_programs import _digest; print(_digest({seeds!r}))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           cwd=os.path.dirname(HELPER), timeout=120,
                           env=subprocess_env(PYTHONHASHSEED="12345"))
    assert other.stdout.strip() == _digest(seeds), other.stderr[-2000:]
    # The default sample has every group, op, transform, placement and dtype ...
    wanted = ({f"group:{g}" for g in GROUPS} | {f"op:{o}" for o in OPS}
              | {f"transform:{t}" for t in TRANSFORMS} | {"transform:eager"}
              | {f"placement:{p}" for p in PLACEMENTS}
              | {f"dtype:{d}" for d in ("float32", "float64", "complex128")}
              | {f"mesh:{a}-{m}" for a in ("auto", "explicit") for m in ("1d", "2d")})
    assert wanted <= _features(SAMPLE), sorted(wanted - _features(SAMPLE))
    # ... and the whole run the rarer combinations too.
    wanted |= ({f"kind:{k}" for k in ("full", "last", "first")} | {f"depth:{k}" for k in range(4)}
               | {"set_mesh", "no_set_mesh", "temporary", "reused", "pair", "two_results",
                  "in_axes_none", "partial_shard_map"})
    assert wanted <= _features(range(2000)), sorted(wanted - _features(range(2000)))
