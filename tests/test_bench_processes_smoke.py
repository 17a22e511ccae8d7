"""Smoke test of benchmarks/bench_processes.py: the quick run (1 and 2 processes)
completes, checks both gradients in every process and reports every count."""

import json
import pathlib
import subprocess
import sys

import pytest
from conftest import subprocess_env

pytestmark = pytest.mark.slow  # (`pytest -m slow`; CI runs them once, on the newest Python)

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_quick_run_reports_every_count(tmp_path):
    out = tmp_path / "results_processes.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_processes.py"), "--quick",
         "--out", str(out)],
        check=False, capture_output=True, text=True, timeout=300, env=subprocess_env(),
        cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [entry["processes"] for entry in report["counts"]] == [1, 2]
    for entry in report["counts"]:
        assert entry["checks"] is True, entry  # both gradients right in every process
        assert entry["median_s"]["jaxdecl"] > 0 and entry["median_s"]["jnp"] > 0, entry
        assert entry["ratio"] > 0 and entry["worst_ratio"] >= entry["ratio"], entry
        assert 0 < entry["initialize_s"] <= entry["compiled_s"], entry
    assert report["target"]["verdict"] in ("PASS", "MISS")
