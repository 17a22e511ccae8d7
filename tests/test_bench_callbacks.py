"""benchmarks/bench_callbacks.py: its quick run completes, and the pages quote its committed run.

The comparison page (docs/coming-from-custom-vjp.md) prints the ``--markdown`` table of
``benchmarks/results_callbacks.json``: a re-run without the page, or a page edited by hand,
fails here.
"""

import json
import pathlib
import subprocess
import sys

import pytest
from conftest import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results_callbacks.json"
PAGE = ROOT / "docs" / "coming-from-custom-vjp.md"


def _markdown(report) -> str:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_callbacks
    finally:
        sys.path.pop(0)
    return bench_callbacks.markdown(report)


def test_the_page_quotes_the_committed_run():
    table = _markdown(json.loads(RESULTS.read_text()))
    assert table in PAGE.read_text(), (
        f"{PAGE.relative_to(ROOT)} does not print {RESULTS.relative_to(ROOT)}'s table: re-run "
        f"`python benchmarks/bench_callbacks.py --markdown` and paste it")


def test_the_committed_run_has_every_case():
    report = json.loads(RESULTS.read_text())
    assert not report["skipped_cases"]
    for name, case in report["cases"].items():
        assert set(case["variants"]) == {"jaxdecl", "pure_callback", "native"}, name


@pytest.mark.slow
def test_quick_run_checks_and_reports_every_case(tmp_path):
    pytest.importorskip("diffrax")
    prefix = tmp_path / "results_callbacks"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_callbacks.py"), "--quick",
         "--no-chart", "--out", str(prefix)],
        check=False, capture_output=True, text=True, timeout=300, env=subprocess_env(),
        cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "results_callbacks.json").read_text())
    committed = json.loads(RESULTS.read_text())
    assert set(report["cases"]) == set(committed["cases"])
    for name, case in report["cases"].items():
        # every variant agreed with jax.numpy before it was timed
        assert case["skipped"] == {}, (name, case["skipped"])
        assert all(v["median_s"] >= v["min_s"] > 0 for v in case["variants"].values()), name
