"""Every docstring example in the package runs and shows what it says."""

import doctest
import importlib
import pkgutil

import pytest

import jaxdecl

MODULES = sorted(
    info.name for info in pkgutil.walk_packages(jaxdecl.__path__, prefix="jaxdecl.")
    if not info.name.endswith("_dispatch")
) + ["jaxdecl"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    if name.startswith("jaxdecl.contrib.ducc"):
        pytest.importorskip("ducc0")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
