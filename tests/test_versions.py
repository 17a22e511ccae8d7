"""The README's version table against what runs, what pyproject.toml says and what CI builds.

The table ("Supported Python and JAX versions") is the one list of supported Pythons, their
wheels, the newest JAX each gets and what the test extra leaves out there. These tests hold
pyproject.toml's classifiers and markers and .ci/run's wheels and legs to it, and fail, naming
the update, when the running JAX or Python is newer than the newest the table lists: a new
release is then one red test in the leg that installs the newest of everything.
"""

import pathlib
import platform
import re
import sys
import warnings

import jax
import jaxlib
import pytest
from conftest import DEPRECATIONS_ARE_ERRORS
from helpers_extras import canonical, extra_requirements
from packaging.version import Version
from test_readme import supported_pythons

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
CI = ROOT / ".ci"
HOW_TO_UPDATE = ("run `bash tools/sweep` on it, then add it to README.md's version table "
                 "(\"Supported Python and JAX versions\"), to tools/sweep's list and to "
                 ".ci/run's legs")


def _table() -> dict:
    """Python X.Y -> (wheel tag, newest JAX, the names the test extra leaves out)."""
    head = "| Python | release wheel | newest JAX it gets | the test extra leaves out |"
    rows = README.split(head, 1)[1].split("\n\n", 1)[0].strip().splitlines()[1:]
    table = {}
    for row in rows:
        python, wheel, newest, left_out = (cell.strip() for cell in row.strip("|").split("|"))
        version = re.match(r"3\.\d+t?", python)[0]
        names = {canonical(n) for n in re.findall(r"[A-Za-z][\w-]*", left_out.split(":")[0])}
        table[version] = (wheel, Version(newest), names - {"tensorstore"})
    return table


TABLE = _table()
PYTHONS = [p for p in TABLE if not p.endswith("t")]  # the free-threaded rows are untested


def test_the_table_has_a_row_for_every_supported_python():
    assert PYTHONS == supported_pythons()
    assert all(TABLE[p][0] == f"cp{p.replace('.', '')}" for p in PYTHONS), TABLE


def test_pyproject_classifies_every_supported_python():
    text = (ROOT / "pyproject.toml").read_text()
    classified = re.findall(r'"Programming Language :: Python :: (3\.\d+)"', text)
    assert classified == PYTHONS
    assert f'requires-python = ">={PYTHONS[0]}"' in text


def test_what_the_test_extra_leaves_out_is_what_the_table_says():
    marked = [r for r in extra_requirements("test") if r.marker]
    for python in PYTHONS:
        out = {canonical(r.name) for r in marked
               if not r.marker.evaluate({"python_version": python, "extra": "test"})}
        assert out == TABLE[python][2], (python, out)


def test_ci_builds_and_installs_a_wheel_for_every_supported_python():
    if not CI.is_dir():
        pytest.skip(".ci/ is part of the checkout")
    run = (CI / "run").read_text()
    # (`leg` or `beside`: a leg in the foreground or in the lane beside it)
    built = re.search(r"^(?:leg|beside) wheels (?:env \S+ )*bash tools/build-dist (.*?)\n(?!\s)",
                      run, re.M | re.S)[1]
    assert re.findall(r"python_for (3\.\d+)", built) == PYTHONS
    legs = re.findall(r"^(?:leg|beside) cp(\d+) wheel_leg (3\.\d+)$", run, re.M)
    assert sorted(python for _, python in legs) == PYTHONS
    # The README's command runs on the newest Python, which gets the newest of everything.
    readme_legs = re.findall(r"^leg \S+ readme_leg (3\.\d+)$", run, re.M)
    assert PYTHONS[-1] in readme_legs


def test_the_running_python_is_one_the_table_lists():
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert here in PYTHONS, (
        f"Python {platform.python_version()} is not in README.md's version table "
        f"({', '.join(PYTHONS)}): {HOW_TO_UPDATE}, with a wheel for it in tools/build-dist's "
        "list in .ci/run")


@pytest.mark.parametrize("module", [jax, jaxlib], ids=["jax", "jaxlib"])
def test_the_installed_jax_is_no_newer_than_the_table_lists(module):
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    installed = Version(module.__version__)
    newest = TABLE[here][1] if here in TABLE else max(row[1] for row in TABLE.values())
    assert installed <= newest, (
        f"{module.__name__} {installed} is newer than the newest JAX README.md's version table "
        f"lists for Python {here} ({newest}): {HOW_TO_UPDATE}")


def test_a_deprecation_fails_the_test_that_reaches_it():
    """From JAX 0.9 on, so wherever the newest Python runs with the newest JAX and NumPy, a
    DeprecationWarning that jaxdecl, its tests or their libraries reach is an error: a name
    that Python 3.16 or NumPy 3 removes shows up now, as a failing test."""
    if not DEPRECATIONS_ARE_ERRORS:
        pytest.skip("JAX < 0.9 deprecates what later releases changed; jaxdecl uses it there")
    with pytest.raises(DeprecationWarning, match="removed in 3.16"):
        warnings.warn("removed in 3.16", DeprecationWarning, stacklevel=1)
