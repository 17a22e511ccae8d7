"""Smoke test of benchmarks/bench_sharding.py: the quick run completes, checks and reports."""

import json
import pathlib
import subprocess
import sys

import pytest
from conftest import needs_split, subprocess_env
from helpers_extras import need

from jaxdecl import _compat

pytestmark = pytest.mark.slow  # (`pytest -m slow`; CI runs them once, on the newest Python)

need("jaxbind")

ROOT = pathlib.Path(__file__).resolve().parent.parent


@needs_split  # (the script refuses to time a gathering op as a per-shard one)
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

    # An op without a declaration against jax.pure_callback: each runs its rule once.
    undeclared = report["undeclared"]
    assert set(undeclared["variants"]) == {"jaxdecl[undeclared]", "pure_callback",
                                           "jaxdecl[declared]", "jnp"}
    assert undeclared["skipped"] == {}  # every variant agreed with the others
    assert undeclared["rule_calls_per_evaluation"] == {
        "jaxdecl[undeclared]": 1, "pure_callback": 1, "jaxdecl[declared]": 4}
    assert undeclared["rule_shapes"]["jaxdecl[undeclared]"] == [[16, 1024]]  # gathered
    assert undeclared["collectives"]["jaxdecl[declared]"] == []
    assert undeclared["ratio_median"]["pure_callback"] == pytest.approx(1.0)

    # Eager calls on a sharded array: declared per shard, undeclared once on gathered input.
    eager = report["eager"]
    eager_names = {"jax.numpy", "jaxdecl[declared]", "jaxdecl[undeclared]", "pure_callback",
                   "jaxbind"}
    assert set(eager["variants"]) | set(eager["skipped"]) == eager_names
    assert {"jax.numpy", "jaxdecl[declared]", "jaxdecl[undeclared]"} <= set(eager["variants"])
    assert "wrong result" not in eager["skipped"].values()
    assert eager["rule_shapes"]["jaxdecl[declared]"] == [[16, 1024]] * 4
    assert eager["rule_shapes"]["jaxdecl[undeclared]"] == [[64, 1024]]
    assert eager["result_placements"]["jaxdecl[declared]"] == {"spec": "P('d',)", "devices": 4}
    assert eager["result_placements"]["jaxdecl[undeclared]"]["devices"] == 4
    for name, entry in eager["variants"].items():
        assert entry["median_s"] >= entry["min_s"] > 0, name
    assert eager["ratio_median"]["jax.numpy"] == pytest.approx(1.0)
    assert eager["target"]["verdict"] in ("PASS", "MISS")
    assert "jaxdecl[declared] / jax.numpy" in done.stdout

    # Compile time of chained ops, jaxdecl against jax.numpy, at N = 1 and 10.
    compile_time = report["compile_time"]
    assert set(compile_time["by_n"]) == {"1", "10"}
    names = {"jaxdecl[same]", "jnp[same]", "jaxdecl[distinct]", "jnp[distinct]",
             "jaxdecl[callback]", "custom_partitioning[distinct]", "jaxdecl[shard_map]",
             "jaxdecl[1 device]", "pure_callback[1 device]"}
    for n, entry in compile_time["by_n"].items():
        assert entry["collectives_jaxdecl_forward"] == [], n  # the chain runs per shard
        # XLA splits the elementwise op itself; replicate= goes through callbacks.
        assert entry["op_calls_forward"] == {
            "jaxdecl[distinct]": {"split": int(n), "callback": 0},
            "jaxdecl[callback]": {"split": 0, "callback": int(n)}}, n
        for mode in ("forward", "grad"):
            assert set(entry[mode]) == names, (n, mode)
            for name, row in entry[mode].items():
                assert row["rounds"] == 2 and row["number"] == 1, (n, mode, name)
                assert min(row["trace_s"], row["lower_s"], row["compile_s"]) > 0, (n, mode)
                assert row["vs_jnp"] > 0, (n, mode, name)
            assert entry[mode]["jnp[same]"]["vs_jnp"] == pytest.approx(1.0)
    assert set(compile_time["ratios_vs_jnp"]["10"]) == {
        f"{mode} {case}" for mode in ("forward", "grad")
        for case in ("same", "distinct", "callback")}
    assert set(compile_time["sharded_vs_one_device"]) == {"forward", "grad"}
    assert compile_time["target"]["n"] == 10
    assert compile_time["target"]["verdict"] in ("PASS", "MISS")

    # Where one compile at the largest N goes (skipped only where JAX's internals differ).
    breakdown = report["compile_breakdown"]
    assert breakdown["n"] == 10 and breakdown["variant"] == "jaxdecl[callback]"
    if "skipped" not in breakdown:
        # One partition callback per op call; grad needs no forward of the last op.
        assert breakdown["forward"]["partition_callbacks"] == 10
        assert breakdown["grad"]["partition_callbacks"] == 19
        for mode in ("forward", "grad"):
            entry = breakdown[mode]
            assert 0 < entry["callbacks_s"] < entry["compile_s"], mode
            assert entry["callback_steps_s"], mode


@pytest.mark.skipif(_compat.SPLITS_PER_SHARD, reason="JAX >= 0.7 runs the benchmark (above)")
def test_on_older_jax_it_stops_naming_the_jax_it_needs(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_sharding.py"), "--quick",
         "--out", str(tmp_path / "results_sharding.json")],
        check=False, capture_output=True, text=True, timeout=120, env=subprocess_env(),
        cwd=ROOT)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "bench_sharding.py times ops that run per shard under jit, which needs JAX >= 0.7" \
        in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "results_sharding.json").exists()
