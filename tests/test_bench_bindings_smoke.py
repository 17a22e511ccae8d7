"""Smoke test of benchmarks/bench_bindings.py: the quick run completes, checks, reports, charts."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
from conftest import subprocess_env

pytestmark = pytest.mark.slow  # (`pytest -m slow`; CI runs them once, on the newest Python)

# The cases' own libraries; the peers (jax-finufft, s2fft) are optional columns.
pytest.importorskip("finufft", reason="the NUFFT cases need finufft: pip install '.[bench]'")
pytest.importorskip("scipy", reason="the KD-tree cases need SciPy: pip install '.[bench]'")
pytest.importorskip("ducc0", reason="the DUCC cases need ducc0: pip install '.[bench]'")

ROOT = pathlib.Path(__file__).resolve().parent.parent
GROUPS = {"nufft1d_small": "nufft", "nufft1d_large": "nufft", "nufft2d_large": "nufft",
          "kdtree_small": "kdtree", "kdtree_large": "kdtree", "fft_small": "fft",
          "fft_large": "fft", "sht_small": "sht", "sht_large": "sht"}
CASES = {f"{prefix}_{mode}" for prefix in GROUPS for mode in ("forward", "grad", "vmap")}
# jaxdecl.contrib.finufft against jax-finufft: the columns of its table.
CONTRIB = ("finufft_1d1_small", "finufft_1d1_large", "finufft_2d2_large", "finufft_3d3")
GROUPS.update(dict.fromkeys(CONTRIB, "contrib_finufft"))
CASES |= {f"{prefix}_{mode}" for prefix in CONTRIB
          for mode in ("forward", "grad", "grad-points", "jvp", "new-points")}
VARIANTS = {
    "nufft": {"direct", "direct[plan]", "jaxdecl", "jaxdecl[pytree]", "jaxdecl[C]",
              "jaxdecl[C+plan]", "jax-finufft"},
    "kdtree": {"direct", "jaxdecl", "pure_callback"},
    "fft": {"direct", "jaxdecl", "jnp.fft"},
    "sht": {"direct", "jaxdecl", "s2fft"},
    "contrib_finufft": {"direct", "contrib.finufft", "jax-finufft"},
}
PEERS = {"nufft": "jax_finufft", "kdtree": None, "fft": None, "sht": "s2fft",
         "contrib_finufft": "jax_finufft"}
OURS = {"nufft": "jaxdecl", "kdtree": "jaxdecl", "fft": "jaxdecl", "sht": "jaxdecl",
        "contrib_finufft": "contrib.finufft"}


def _allowed(name, why) -> bool:
    """A variant may be missing only for want of its library, a compiler, or the peer's bug."""
    if why == "not installed":
        return True
    if name.startswith("jaxdecl[C") and "compiler" in why:
        return True
    # jax-finufft 1.3.1's batching rule reads batching.not_mapped, gone from newer JAX.
    return name == "jax-finufft" and "not_mapped" in why


def test_quick_run_reports_every_case(tmp_path):
    prefix = tmp_path / "results_bindings"
    env = subprocess_env()
    env.pop("XLA_FLAGS", None)  # one host device, as users run it
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_bindings.py"), "--quick",
         "--markdown", "--out", str(prefix), "--finufft-out", str(tmp_path / "results_finufft")],
        check=False, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "results_bindings.json").read_text())
    contrib = json.loads((tmp_path / "results_finufft.json").read_text())
    targets = {t["case"]: t for t in report["targets"] + contrib["targets"]}
    report["cases"].update(contrib["cases"])
    assert set(report["cases"]) == CASES, report.get("skipped_cases")
    assert report["meta"]["jax"] and report["meta"]["cpus"] and report["meta"]["finufft"]
    for key, case in report["cases"].items():
        group = GROUPS[key.rsplit("_", 1)[0]]
        variants, skipped = case["variants"], case["skipped"]
        # Every variant agreed with the direct call (checked leaf by leaf before timing).
        assert all(_allowed(name, why) for name, why in skipped.items()), (key, skipped)
        assert VARIANTS[group] <= set(variants) | set(skipped), (key, sorted(variants))
        assert "direct" in variants and OURS[group] in set(variants) | set(skipped), key
        library = PEERS[group]
        if library is None or importlib.util.find_spec(library):
            assert case["peer"] in variants, (key, case["peer"])
        for name, entry in variants.items():
            assert entry["median_s"] >= entry["min_s"] > 0, (key, name)
            assert entry["vs_direct"] > 0, (key, name)
            assert case["peer"] is None or entry["vs_peer"] > 0, (key, name)
        if group == "nufft" and key.endswith("vmap") and importlib.util.find_spec("jax_finufft"):
            # Its native batch stands in where its vmap fails.
            assert "jax-finufft[n_trans]" in variants, key
    assert "nufft1d_small_forward" in targets, sorted(targets)
    assert "finufft_sharded_type2" in targets, contrib.get("sharded")  # (or why it is not)
    assert {f"{prefix}_{mode}" for prefix in CONTRIB
            for mode in ("forward", "grad", "grad-points", "jvp")} < set(targets)
    assert all(t["verdict"] in ("PASS", "MISS", "SKIP") for t in targets.values())
    sharded = contrib["sharded"]
    assert sharded["gathers_in_hlo"] == [] and sharded["ratio"] > 0, sharded
    assert "| contrib.finufft / jax-finufft (nthreads=1) |" in done.stdout
    assert "| 1-D NUFFT type 1, M = 1,000, N = 64: forward | direct |" in done.stdout
    assert "| jaxdecl / direct | jaxdecl / peer |" in done.stdout
    # The chart is written next to the JSON, under the same prefix.
    assert (tmp_path / "results_bindings.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "results_finufft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
