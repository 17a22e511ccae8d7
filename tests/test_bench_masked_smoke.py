"""Smoke test of benchmarks/bench_masked.py: the quick run completes, checks and reports."""

import json
import pathlib
import subprocess
import sys

import pytest
from conftest import subprocess_env

pytestmark = pytest.mark.slow  # (`pytest -m slow`; CI runs them once, on the newest Python)

pytest.importorskip("finufft", reason="contrib.finufft needs finufft: pip install '.[finufft]'")

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_quick_run_reports_every_case(tmp_path):
    out = tmp_path / "results_masked.json"
    env = subprocess_env()
    env.pop("XLA_FLAGS", None)  # one host device, as users run it
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_masked.py"), "--quick", "--out",
         str(out)], check=False, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["cases"]) == {f"type{t}_200_of_2000_{mode}" for t in (1, 2)
                                    for mode in ("forward", "grad-points")}
    for key, case in report["cases"].items():
        # Every variant ran and agreed with the unpadded call on the kept points.
        assert case["skipped"] == {}, (key, case["skipped"])
        assert set(case["variants"]) == {"unpadded", "mask=", "padding, no mask"}
        for entry in case["variants"].values():
            assert entry["median_s"] >= entry["min_s"] > 0
    assert "| case | mask= / unpadded |" in done.stdout
