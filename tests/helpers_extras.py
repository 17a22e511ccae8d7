"""The optional libraries the tests use, and why one is missing: read from pyproject.toml.

A library that some supported Python cannot install carries an environment marker in the
test extra (``"flax>=0.11; python_version >= '3.11' and python_version < '3.15'"``). A test
that needs it imports it through :func:`need`, which skips with that marker as the reason
where the extra leaves it out: the reason is the one pip acted on, never a second copy.

    >>> need("numpy").__name__
    'numpy'
    >>> sorted(r.name for r in extra_requirements("ducc"))
    ['ducc0']
"""

import functools
import importlib
import pathlib
import platform
import re

import pytest
from packaging.requirements import Requirement

PYPROJECT = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"


@functools.cache
def extras() -> dict:
    """pyproject.toml's optional dependencies: extra -> its requirement strings."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: pytest's own dependency
        import tomli as tomllib
    return tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]


def extra_requirements(name: str = "test") -> list:
    """The requirements of extra `name`, the jaxdecl extras it names expanded."""
    found, todo = [], [name]
    while todo:
        for text in extras()[todo.pop()]:
            requirement = Requirement(text)
            if requirement.name == "jaxdecl":
                todo.extend(requirement.extras)
            else:
                found.append(requirement)
    return found


def canonical(name: str) -> str:
    """A distribution's or module's name as pip compares them (jax_finufft is jax-finufft)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def left_out(distribution: str):
    """The test extra's marker that leaves `distribution` out on this Python, or None where
    the extra installs it."""
    for requirement in extra_requirements("test"):
        if canonical(requirement.name) == canonical(distribution) and requirement.marker:
            if not requirement.marker.evaluate():
                return requirement.marker
    return None


def why_missing(module: str, error: Exception | None = None) -> str:
    """Why `module` cannot be imported here, in the words of pyproject.toml's marker."""
    distribution = canonical(module)
    marker = left_out(distribution)
    if marker is not None:
        return (f"the test extra leaves {distribution} out on Python "
                f"{platform.python_version()} (pyproject.toml: {marker}): it has no build "
                f"for this Python")
    return (f"{distribution} is not installed here"
            f"{f' ({error})' if error else ''}: pip install '.[test]'")


def need(module: str, minversion: str | None = None):
    """Import `module`, or skip the test (or the module) saying why it is missing here."""
    try:
        importlib.import_module(module)
    except ImportError as error:
        pytest.skip(why_missing(module.split(".")[0], error), allow_module_level=True)
    return pytest.importorskip(module, minversion=minversion)
