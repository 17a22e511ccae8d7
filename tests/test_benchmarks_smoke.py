"""Smoke test of benchmarks/run.py: the quick run completes and reports every case."""

import json
import pathlib
import subprocess
import sys

import pytest
from conftest import subprocess_env
from helpers_extras import need

need("jaxbind")

ROOT = pathlib.Path(__file__).resolve().parent.parent
CASES = {"1_jit_10_1in", "2_jit_10_4in", "2_jit_10_16in", "3_eager_10_1in", "4_jit_large",
         "5_vmap_64x10", "6_jit_grad_1000"}


def test_quick_run_reports_every_case(tmp_path):
    prefix = tmp_path / "results"
    env = subprocess_env()
    env.pop("XLA_FLAGS", None)  # the benchmark runs on one host device, as users do
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--no-chart",
         "--out", str(prefix)],
        check=False, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    assert set(report["cases"]) == CASES
    for key, case in report["cases"].items():
        variants = case["variants"]
        # The three that must always be there; the callbacks may be skipped.
        for required in ("native", "jaxbind"):
            assert required in variants, (key, case["skipped"])
        assert any(name.startswith("jaxdecl") for name in variants), key
        # run.py checks every variant against native jax.numpy and skips a wrong one.
        assert "wrong result" not in case["skipped"].values(), (key, case["skipped"])
        for name, entry in variants.items():
            assert entry["median_s"] >= entry["min_s"] > 0, (key, name)
        assert variants["jaxbind"]["vs_jaxbind"] == pytest.approx(1.0)
    assert {t["case"] for t in report["targets"]} <= CASES
    assert all(t["verdict"] in ("PASS", "MISS") for t in report["targets"])
    assert "PASS" in done.stdout or "MISS" in done.stdout
