"""Smoke test of benchmarks/bench_loops.py: the quick run completes, checks, reports, charts."""

import json
import pathlib
import subprocess
import sys

import pytest
from conftest import subprocess_env

pytestmark = pytest.mark.slow  # (`pytest -m slow`; CI runs them once, on the newest Python)

pytest.importorskip("diffrax")

ROOT = pathlib.Path(__file__).resolve().parent.parent
CASES = {"fori", "fori_grad", "diffrax", "diffrax_grad"}


def test_quick_run_reports_every_case(tmp_path):
    prefix = tmp_path / "results_loops"
    env = subprocess_env()
    env.pop("XLA_FLAGS", None)  # one host device, as users run it
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_loops.py"), "--quick", "--markdown",
         "--out", str(prefix)],
        check=False, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "results_loops.json").read_text())
    assert set(report["cases"]) == CASES
    assert report["meta"]["jax"] and report["meta"]["cpus"]
    expected = {"native", "jaxdecl", "pure_callback", "jaxbind"}
    for key, case in report["cases"].items():
        variants = case["variants"]
        # Every variant agreed with native (the script checks each leaf before timing);
        # only a library that is not installed may be missing.
        assert all(why == "not installed" for why in case["skipped"].values()), (key, case)
        assert set(variants) | set(case["skipped"]) == expected, key
        for name, entry in variants.items():
            assert entry["median_s"] >= entry["min_s"] > 0, (key, name)
            assert entry["vs_native"] > 0, (key, name)
            if name == "native":
                assert entry["calls"] is None
            else:
                assert entry["calls"] > 0 and entry["overhead_per_call_s"] is not None, (key, name)
        if key.startswith("fori"):
            assert case["iterations"] == 100
            assert all("per_iteration_s" in entry for entry in variants.values())
        else:
            assert case["num_steps"] > 0
    fori, fori_grad = report["cases"]["fori"]["variants"], report["cases"]["fori_grad"]["variants"]
    # One host call per iteration; under grad one transpose per input per iteration too.
    assert fori["jaxdecl"]["calls_by_rule"] == {"forward": 100}
    assert fori_grad["jaxdecl"]["calls_by_rule"]["transpose a"] == 100
    assert fori_grad["jaxdecl"]["calls_by_rule"]["transpose y"] == 100
    # The solve evaluates the vector field as often whichever library runs it.
    solve = report["cases"]["diffrax"]["variants"]
    assert solve["jaxdecl"]["calls"] == solve["pure_callback"]["calls"]
    assert set(report["rule_costs_s"]) and all(v > 0 for v in report["rule_costs_s"].values())
    assert "| fori_loop" in done.stdout
    # The chart is written next to the JSON, under the same prefix.
    assert (tmp_path / "results_loops.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
