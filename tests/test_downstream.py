"""tests/downstream/jax_finufft_as_contrib.py: another project's tests run on contrib or fail.

Each case is a small project of its own, its tests run by pytest in a fresh interpreter with
the plugin, as tools/run-downstream runs jax-finufft's and jax-nufft's.
"""

import pathlib
import subprocess
import sys
import textwrap

import pytest
from conftest import subprocess_env

pytest.importorskip("finufft")  # (contrib's kernels need finufft's library)

PLUGIN_FOLDER = pathlib.Path(__file__).resolve().parent / "downstream"


def _run_project(tmp_path, test_source: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_caller.py").write_text(textwrap.dedent(test_source))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # (none of jaxdecl's options)
    env = subprocess_env()
    env["PYTHONPATH"] = f"{PLUGIN_FOLDER}:{env['PYTHONPATH']}"
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "jax_finufft_as_contrib", "-p",
         "no:cacheprovider", "-q", "test_caller.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_a_caller_of_jax_finufft_runs_on_contrib_and_the_run_says_what_ran(tmp_path):
    done = _run_project(tmp_path, """
        import numpy as np
        import jax_finufft
        from jax_finufft import nufft1, nufft2
        from jax_finufft.options import Opts, unpack_opts

        def test_calls():
            assert jax_finufft.__name__ == "jaxdecl.contrib.finufft"
            x = np.linspace(-3, 3, 7)
            f = nufft1(8, np.ones(7, np.complex128), x, eps=1e-9, opts=Opts(nthreads=1))
            c = nufft2(f, x, eps=1e-9)
            assert f.shape == (8,) and c.shape == (7,)
            assert unpack_opts(None, finufft_type=1, forward=True) is None
        """)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "contrib.finufft served jax_finufft: 2 executes (type 1: 1, 2: 1, 3: 0)" in done.stdout


def test_the_real_package_s_other_modules_are_refused_naming_them(tmp_path):
    done = _run_project(tmp_path, """
        import pytest

        def test_internal_module():
            with pytest.raises(ImportError, match="jax_finufft.shapes: this run resolves"):
                import jax_finufft.shapes  # noqa: F401
            from jax_finufft import nufft1
            import numpy as np
            nufft1(4, np.ones(3, np.complex128), np.zeros(3))
        """)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_run_that_never_reaches_contrib_fails(tmp_path):
    done = _run_project(tmp_path, """
        import pytest

        def test_skips_quietly():
            pytest.importorskip("a_module_that_is_not_there")
        """)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "contrib.finufft's kernels never ran" in done.stderr
