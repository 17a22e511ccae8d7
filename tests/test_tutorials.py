"""Every tutorial runs to completion as a script."""

import pathlib
import subprocess
import sys

import pytest
from conftest import needs_split, subprocess_env

TUTORIALS = sorted((pathlib.Path(__file__).parent.parent / "tutorials").glob("*.py"))
# The sharding tutorial shows the compiled program free of gathers.
SCRIPTS = [pytest.param(t, marks=needs_split) if t.name == "08_sharding.py" else t
           for t in TUTORIALS]


@pytest.mark.parametrize("script", SCRIPTS, ids=[t.name for t in TUTORIALS])
def test_tutorial_runs(script, tmp_path):
    env = subprocess_env(MPLBACKEND="Agg")
    env.pop("XLA_FLAGS", None)  # tutorials run as a reader would: default devices
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stdout.strip(), "a tutorial prints what a reader should look at"
