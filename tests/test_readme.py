"""The README's self-contained examples (Python blocks that start with an import) run."""

import pathlib
import re

import pytest
from helpers_extras import extra_requirements

README = pathlib.Path(__file__).parent.parent / "README.md"
BLOCKS = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
          if b.startswith("import")]


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code):
    if "contrib import ducc" in code:
        pytest.importorskip("ducc0")
    if "contrib.finufft" in code:
        pytest.importorskip("finufft")
    exec(compile(code, str(README), "exec"), {})


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


# --- the set-up commands: CI runs them on the oldest and the newest Python ---------------

CI = README.parent / ".ci"


def _legs_variable(name: str) -> str:
    """A single-quoted variable of .ci/legs.sh."""
    return re.search(rf"^{name}='(.*)'$", (CI / "legs.sh").read_text(), re.M)[1]


def supported_pythons() -> list:
    """The README's range, ``CPython **3.10 to 3.15**``, as ["3.10", ..., "3.15"]."""
    low, high = re.search(r"CPython \*\*3\.(\d+) to 3\.(\d+)\*\*", README.read_text()).groups()
    return [f"3.{minor}" for minor in range(int(low), int(high) + 1)]


def test_the_readme_set_up_commands_are_the_ones_ci_runs():
    if not CI.is_dir():
        pytest.skip(".ci/ is part of the checkout")
    commands = re.findall(r"```bash\n(python3 -m venv .*)\n```", README.read_text())
    assert commands == [_legs_variable("README_QUICKSTART"), _legs_variable("README_TESTS")]
    legs = re.findall(r"^leg (\S+) readme_leg ?(\S*)$", (CI / "run").read_text(), re.M)
    pythons = supported_pythons()
    # The oldest and the newest supported Python (the one between them: tools/sweep).
    assert sorted(python for _, python in legs) == [pythons[0], pythons[-1]], legs
    assert ">=" + pythons[0] in (README.parent / "pyproject.toml").read_text()


def test_what_a_supported_python_cannot_install_is_left_out_there_and_named():
    # Without a marker pip searches every release of everything else for one that fits
    # (the test command then never ends); with one, the README says what is missing where.
    readme = " ".join(README.read_text().split())
    pythons = supported_pythons()
    marked = [r for r in extra_requirements("test")
              if r.marker and "python_version" in str(r.marker)]
    assert marked, "flax >= 0.11 needs Python >= 3.11"
    for requirement in marked:
        without = [p for p in pythons
                   if not requirement.marker.evaluate({"python_version": p, "extra": "test"})]
        assert without, requirement
        assert f"on Python {', '.join(without)}, {requirement.name}" in readme, requirement
