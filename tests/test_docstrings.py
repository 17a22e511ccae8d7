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
    if name.startswith("jaxdecl.contrib.finufft"):
        pytest.importorskip("finufft")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def _public_objects():
    """The public names that are functions or classes (not data such as SUPPORTED_DTYPES)."""
    for name in jaxdecl.__all__:
        obj = getattr(jaxdecl, name)
        if callable(obj):
            yield name, obj


@pytest.mark.parametrize("name, obj", [pytest.param(name, obj, id=name)
                                       for name, obj in _public_objects()])
def test_every_public_name_has_an_example_that_the_doctests_run(name, obj):
    module = importlib.import_module(obj.__module__)
    found = {test.name: test for test in doctest.DocTestFinder().find(module)}
    test = found.get(f"{module.__name__}.{obj.__name__}") or found.get(f"{module.__name__}.{name}")
    assert test is not None and test.examples, f"jd.{name} has no docstring example"


@pytest.mark.parametrize("obj", [jaxdecl.Primitive, jaxdecl.primitive], ids=["class", "decorator"])
def test_help_lists_every_decorator_and_class_option(obj):
    import pydoc

    text = pydoc.render_doc(obj, renderer=pydoc.plaintext)
    decorators = ["abstract", "forward", "jvp", "vjp", "transpose", "adjoint", "batch",
                  "sharding", "residuals"]
    for decorator in decorators:
        assert f"@jd.{decorator}`" in text, decorator
    for option in ["linear=True", "multilinear=True", "nondiff=", 'batch="loop"',
                   'batch="vectorized"', "sharding=", "replicate=", "reduce=", "residuals="]:
        assert f"``{option}" in text, option
    from jaxdecl._spec.declaration import OPTIONS as _OPTIONS
    from jaxdecl._spec.rules import RULE_KINDS

    assert set(RULE_KINDS) == set(decorators)  # a new decorator must be documented here
    assert {"linear", "multilinear", "nondiff", "batch", "sharding", "replicate",
            "reduce", "residuals"} == set(_OPTIONS)
