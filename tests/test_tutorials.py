"""Every tutorial runs to completion as a script.

A tutorial that needs an optional package says so in a ``# requires: name``
line among its first comment lines; without the package its test is skipped,
naming it.
"""

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest
from conftest import needs_split, subprocess_env

# The numbered scripts; a module beside them (tutorials/saving_ops.py) is imported by one.
TUTORIALS = sorted((pathlib.Path(__file__).parent.parent / "tutorials").glob("[0-9]*.py"))
# The sharding tutorial shows the compiled program free of gathers.
SCRIPTS = [pytest.param(t, marks=needs_split) if t.name == "08_sharding.py" else t
           for t in TUTORIALS]


def _requires(script: pathlib.Path) -> list[str]:
    head = script.read_text().split('"""', 1)[0]  # the comment lines before the docstring
    return [name for line in re.findall(r"^# requires: (.+)$", head, re.M)
            for name in line.split()]


@pytest.mark.parametrize("script", SCRIPTS, ids=[t.name for t in TUTORIALS])
def test_tutorial_runs(script, tmp_path):
    for name in _requires(script):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{script.name} needs {name}: pip install '.[{name}]'")
    env = subprocess_env(MPLBACKEND="Agg")
    env.pop("XLA_FLAGS", None)  # tutorials run as a reader would: default devices
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stdout.strip(), "a tutorial prints what a reader should look at"


def test_torch_tutorial_declares_its_requirement():
    assert _requires(pathlib.Path(__file__).parent.parent / "tutorials" / "10_torch.py") == \
        ["torch"]
