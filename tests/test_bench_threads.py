"""benchmarks/bench_threads.py: its quick run completes, and the pages quote its committed run.

The batching page (docs/concepts/batching.md, "Rows in parallel") and the performance page
quote the committed ``benchmarks/results_threads.json``: its speed-ups over the sequential
run, against the by-hand floor and on 4 devices, and any target it missed.
"""

import json
import pathlib
import subprocess
import sys

import pytest
from conftest import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results_threads.json"
VARIANTS = {"jaxdecl[C, pool]", "jaxdecl[C, sequential]", "jaxdecl[NumPy rule]",
            "pure_callback", "native", "by hand[1 thread]"}


def _figures(report) -> dict:
    """case -> (pool speed-up over sequential, pool speed / floor speed), to 2 places."""
    found = {}
    for name, case in report["cases"].items():
        pool = case["variants"]["jaxdecl[C, pool]"]
        found[name] = (f"{1 / pool['vs_sequential']:.2f}", f"{1 / pool['vs_floor']:.2f}")
    return found


def test_the_pages_quote_the_committed_run_and_its_misses():
    report = json.loads(RESULTS.read_text())
    assert len(report["cases"]) == 6 and len(report["targets"]) == 4
    devices = report["devices"]["speedup_4_over_1"]
    assert len(devices) == 3
    figures = _figures(report)
    batching = (ROOT / "docs" / "concepts" / "batching.md").read_text()
    performance = (ROOT / "docs" / "concepts" / "performance.md").read_text()
    for rows in ("8", "64"):
        speedup, floor = figures[f"{rows} rows x 1 MiB"]
        assert speedup in batching and floor in batching, (rows, speedup, floor)
        assert speedup in performance, (rows, speedup)
    for target in report["targets"]:  # a target missed is said to be missed
        if not target["met"]:
            assert f"{target['value']:.2f}" in batching and "missed its target" in batching
    for speedup in devices.values():
        assert f"{speedup:.2f}" in batching and f"{speedup:.2f}" in performance, speedup


def test_quick_run_reports_every_case(tmp_path):
    prefix = tmp_path / "results_threads"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_threads.py"), "--quick",
         "--no-chart", "--out", str(prefix)],
        check=False, capture_output=True, text=True, timeout=300, env=subprocess_env(),
        cwd=ROOT)
    if done.returncode != 0 and "No such file" in done.stderr and "cc" in done.stderr:
        pytest.skip("no C compiler")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "results_threads.json").read_text())
    assert set(report["cases"]) == set(json.loads(RESULTS.read_text())["cases"])
    devices = report["devices"]
    assert devices["skipped"] == {} and len(devices["speedup_4_over_1"]) == 3, devices
    for name, case in report["cases"].items():
        # every variant agreed with the C kernel's result before it was timed
        assert case["skipped"] == {}, (name, case["skipped"])
        assert VARIANTS <= set(case["variants"]), name
        assert all(v["median_s"] >= v["min_s"] > 0 for v in case["variants"].values()), name
