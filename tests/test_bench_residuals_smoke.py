"""Smoke test of benchmarks/bench_residuals.py: the quick run completes, checks and reports."""

import json
import pathlib
import subprocess
import sys

import pytest
from conftest import subprocess_env
from helpers_extras import need

pytestmark = pytest.mark.slow  # (`pytest -m slow`; CI runs them once, on the newest Python)

need("jaxbind")
pytest.importorskip("scipy")

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_quick_run_reports_every_case(tmp_path):
    out = tmp_path / "results_residuals.json"
    env = subprocess_env()
    env.pop("XLA_FLAGS", None)  # one host device, as users run it
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_residuals.py"), "--quick",
         "--out", str(out)],
        check=False, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["cases"]) == {"solve", "sleep", "kdtree"}
    for key, case in report["cases"].items():
        # Every variant ran and its gradient agreed with jaxdecl's (the harness checks).
        assert case["skipped"] == {}, (key, case["skipped"])
        for entry in case["variants"].values():
            assert entry["median_s"] >= entry["min_s"] > 0
    assert set(report["cases"]["solve"]["variants"]) == {
        "jaxdecl", "jaxdecl[rerun]", "jaxbind", "custom_vjp+pure_callback", "forward alone",
        "vjp alone"}
    assert {t["case"] for t in report["targets"]} == {"solve", "sleep"}
    assert all(t["verdict"] in ("PASS", "MISS") for t in report["targets"])
