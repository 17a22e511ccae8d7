"""Stress as a dimension of the call-context matrix: ops used the way programs run.

Mirrors the lifetime guarantees of jaxdecl/_host/registry.py and csrc/call_site.cc (a
compiled program owns the kernels it calls until its last run has finished),
jaxdecl/_transforms/lowering.py (split programs never load another's cache entry) and
the eager per-shard path of jaxdecl/_transforms/eager.py.

Each cell runs ``helpers_stress.py`` in fresh interpreters, several times:
ops built inside a temporary ``jax.jit`` called once (async dispatch drops
the executable before XLA runs it), arrays large enough for XLA's worker
threads, 1 and 4 devices, garbage collection at every allocation, both cores
kept busy by other processes, the persistent cache with ``jax.clear_caches()``
between rounds. A race that passes once has not been tested: every round of
every repeat must be right.
"""

import json
import os
import subprocess
import sys

import pytest
from conftest import subprocess_env

pytestmark = pytest.mark.slow  # (`pytest -m slow`; CI runs them once, on the newest Python)

HELPER = os.path.join(os.path.dirname(__file__), "helpers_stress.py")
REPEATS = 2


@pytest.fixture
def busy_cores():
    """Keeps every core busy with spinning processes while the test runs."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(os.cpu_count() or 2)]
    yield
    for spinner in spinners:
        spinner.kill()
        spinner.wait()


def _run(scenario: str, *, devices: int, elements: int, rounds: int, collect=False) -> dict:
    env = subprocess_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    args = [sys.executable, HELPER, scenario, str(elements), str(rounds)] + \
        (["gc"] if collect else [])
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{scenario} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])["results"]


def _assert_all_ok(results: dict):
    failures = {form: [r for r in outcomes if r != "ok"] for form, outcomes in results.items()}
    failures = {form: bad for form, bad in failures.items() if bad}
    assert not failures, json.dumps(failures, indent=1)[:4000]


# (devices, elements, collect at every allocation, busy cores): chosen so that each
# way the lifetimes once failed is met, within the suite's time budget.
CELLS = [
    pytest.param(1, 1_000_000, False, True, id="1dev-1M-busy"),
    pytest.param(1, 100_000, True, True, id="1dev-100k-gc-busy"),
    pytest.param(4, 1_000_000, False, True, id="4dev-1M-busy"),
    pytest.param(4, 100_000, True, False, id="4dev-100k-gc"),
]


@pytest.mark.parametrize("devices,elements,collect,busy", CELLS)
def test_temporary_jit_with_fresh_ops(request, devices, elements, collect, busy):
    if busy:
        request.getfixturevalue("busy_cores")
    for _ in range(REPEATS):
        results = _run("forms", devices=devices, elements=elements, rounds=3,
                       collect=collect)
        assert ("sharded" in results) == ("sharded_callback" in results) == (devices > 1)
        _assert_all_ok(results)


def test_persistent_cache_with_cleared_caches(busy_cores):
    # Enough rounds for Python to hand out a freed id() again: the split
    # program's HLO then repeated a cached one whose kernels were never built.
    for _ in range(REPEATS):
        _assert_all_ok(_run("cache", devices=4, elements=400_000, rounds=30))


@pytest.mark.parametrize("devices", [1, 4])
def test_rule_exception_on_every_device_is_itself(devices):
    for _ in range(REPEATS):
        _assert_all_ok(_run("raise", devices=devices, elements=400_000, rounds=10))
