"""benchmarks/bench_gpu.py imports anywhere, refuses cleanly without a GPU, and judges its
targets by the ratios it is meant to (the run itself needs a GPU: tools/gpu-check)."""

import pathlib
import subprocess
import sys

import pytest
from conftest import subprocess_env
from helpers_gpu import has_gpu

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.skipif(has_gpu(), reason="a GPU is here: tools/gpu-check runs the benchmark")
def test_without_a_gpu_it_says_so_and_measures_nothing(tmp_path):
    env = subprocess_env(JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--quick",
                           "--out", str(tmp_path / "results_gpu")], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip() == (
        "bench_gpu: needs a CUDA GPU and JAX's CUDA plugin (pip install 'jax[cuda13]'); JAX "
        "sees only cpu here. Nothing measured.")
    assert list(tmp_path.iterdir()) == []


def test_the_targets_are_the_ratios_of_the_right_variants():
    import bench_gpu

    cases = {
        "forward_1e3": {"variants": {"jaxdecl[staged]": {"median_s": 30e-6},
                                     "pure_callback": {"median_s": 60e-6}}},
        "forward_1e7": {"variants": {"jaxdecl[staged,empty]": {"median_s": 3.3e-3}}},
        "forward_1e6": {"variants": {"jaxdecl[cupy]": {"median_s": 14e-6},
                                     "native": {"median_s": 10e-6}}},
    }
    found = bench_gpu.verdicts(cases, copies_1e7=3e-3)
    assert found["staged_vs_pure_callback_1e3"] == {"ratio": 0.5, "target": 0.7, "met": True}
    assert found["staged_vs_copies_1e7"]["ratio"] == pytest.approx(1.1)
    assert found["staged_vs_copies_1e7"]["met"] is True
    assert found["cupy_vs_jnp_1e6"]["ratio"] == pytest.approx(1.4)
    assert found["cupy_vs_jnp_1e6"]["met"] is False
    assert bench_gpu.verdicts({}, None)["staged_vs_copies_1e7"] == {
        "ratio": None, "target": 1.15, "met": None}
