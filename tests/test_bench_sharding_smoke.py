"""Smoke test of benchmarks/bench_sharding.py: the quick run completes, checks and reports."""

import json
import pathlib
import subprocess
import sys

import pytest
from conftest import subprocess_env

pytest.importorskip("jaxbind")

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_quick_run_reports_every_variant(tmp_path):
    out = tmp_path / "results_sharding.json"
    # The script sets 4 host devices itself, replacing this session's device count.
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_sharding.py"), "--quick",
         "--out", str(out)],
        check=False, capture_output=True, text=True, timeout=120, env=subprocess_env(),
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["variants"]) == {"jaxdecl", "jaxbind", "jnp.fft", "jaxdecl[1 device]"}
    assert report["skipped"] == {}  # every variant ran and agreed with the others
    assert report["collectives"]["jaxdecl"] == []
    assert "all-gather" in report["collectives"]["jaxbind"]
    assert report["result_shardings"]["jaxdecl"] == "P('d',)"
    for name, entry in report["variants"].items():
        assert entry["median_s"] >= entry["min_s"] > 0, name
    assert report["ratio_median"]["jaxbind"] == pytest.approx(1.0)
    assert report["target"]["verdict"] in ("PASS", "MISS")
