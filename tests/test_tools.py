"""The release script, tools/build-dist: one wheel per interpreter, whatever its path.

Building real wheels takes minutes (``.ci/run``'s wheels leg and ``tools/sweep`` do); here
its plan (``--plan``: which interpreter builds which wheel, in which work folder) is checked
with interpreters laid out as in the manylinux images, where every one is ``.../bin/python``.
"""

import os
import pathlib
import platform
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUILD_DIST = ROOT / "tools" / "build-dist"
if not BUILD_DIST.exists():  # (the tests of an installed copy, without the checkout)
    pytest.skip("tools/build-dist is part of the checkout", allow_module_level=True)

HERE = f"cp{sys.version_info[0]}{sys.version_info[1]}"


def _another_python():
    """``(path, tag)`` of an installed CPython 3.10-3.15 other than this one, or None:
    on PATH, under pyenv or made by tools/get-python."""
    pyenv = pathlib.Path(os.environ.get("PYENV_ROOT", pathlib.Path.home() / ".pyenv"))
    made = pathlib.Path(os.environ.get("JAXDECL_PYTHONS",
                                       pathlib.Path.home() / ".cache" / "jaxdecl-pythons"))
    for minor in range(10, 16):
        if minor == sys.version_info[1]:
            continue
        found = [shutil.which(f"python3.{minor}")]
        found += sorted(pyenv.glob(f"versions/3.{minor}.*/bin/python3.{minor}"), reverse=True)
        found.append(made / f"3.{minor}" / "usr" / "bin" / f"python3.{minor}")
        for path in (p for p in found if p and os.path.exists(p)):
            if subprocess.run([path, "-c", ""], capture_output=True).returncode == 0:
                return str(path), f"cp3{minor}"
    return None


def _as_bin_python(folder: pathlib.Path, interpreter: str) -> str:
    """`interpreter` reached as ``folder/bin/python``, as in a manylinux image."""
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "python").symlink_to(interpreter)
    return str(folder / "bin" / "python")


def _plan(*pythons):
    return subprocess.run(["bash", str(BUILD_DIST), "--plan", *pythons], capture_output=True,
                          text=True, timeout=120)


def test_interpreters_that_share_a_file_name_each_build_their_own_wheel(tmp_path):
    other = _another_python()
    if other is None:
        pytest.skip("needs a second CPython 3.10-3.15 installed")
    path, tag = other
    version = subprocess.run([path, "-c", "import platform; print(platform.python_version())"],
                             capture_output=True, text=True, check=True).stdout.strip()
    a = _as_bin_python(tmp_path / "a", sys.executable)
    b = _as_bin_python(tmp_path / "b", path)
    done = _plan(a, b)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"{HERE} wheel: built by {a} (Python {platform.python_version()}) in <tools>/{HERE}",
        f"{tag} wheel: built by {b} (Python {version}) in <tools>/{tag}",
    ]


def test_two_interpreters_of_one_version_are_an_error(tmp_path):
    a = _as_bin_python(tmp_path / "a", sys.executable)
    b = _as_bin_python(tmp_path / "b", sys.executable)
    done = _plan(a, b)
    assert done.returncode == 1
    assert done.stderr.strip() == (f"build-dist: {b} and {a} are both Python "
                                   f"{platform.python_version()} ({HERE}): name one "
                                   f"interpreter per wheel")
    assert not done.stdout


def test_an_interpreter_that_does_not_run_is_named(tmp_path):
    done = _plan(str(tmp_path / "bin" / "python"))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"build-dist: {tmp_path / 'bin' / 'python'} does not run")
