"""Every tutorial runs to completion as a script, or stops at once naming what it needs.

The rule: a tutorial runs after the documented install (``pip install .``), or
names each package it needs beyond it, and the extra that installs it, in its
first line (``# requires: flatbuffers (pip install ".[saving]")``), and stops
with that command when the package is missing (``tutorials/requires.py``).
Imports inside ``try: ... except ImportError`` are optional (a figure skipped
without matplotlib) and need no such line. ``tools/run-tutorials`` checks the
same after a fresh ``pip install``.
"""

import ast
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest
from conftest import needs_split, subprocess_env

pytestmark = pytest.mark.slow  # (`pytest -m slow`; CI runs them once, on the newest Python)

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOLDER = ROOT / "tutorials"
# The numbered scripts; modules beside them (saving_ops.py, requires.py) are imported by them.
TUTORIALS = sorted(FOLDER.glob("[0-9]*.py"))
MODULES = sorted(set(FOLDER.glob("*.py")) - set(TUTORIALS))
# The sharding tutorial shows the compiled program free of gathers.
SCRIPTS = [pytest.param(t, marks=needs_split) if t.name == "08_sharding.py" else t
           for t in TUTORIALS]

_spec = importlib.util.spec_from_file_location("tutorials_requires", FOLDER / "requires.py")
requires = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(requires)

#: Imports that need a package they do not name: jaxdecl's DUCC ops import ducc0.
IMPLIED = {"jaxdecl.contrib.ducc": "ducc0"}


def _declared(script) -> tuple:
    return requires.declared(script) or ([], None)


def _like_a_checkout(folder: pathlib.Path) -> pathlib.Path:
    """`folder` with an unbuilt copy of jaxdecl's sources in it, as a checkout's root is
    after a plain (non-editable) ``pip install .``."""
    import shutil

    import jaxdecl

    shutil.copytree(pathlib.Path(jaxdecl.__file__).parent, folder / "jaxdecl",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    return folder


@pytest.mark.parametrize("script", SCRIPTS, ids=[t.name for t in TUTORIALS])
def test_tutorial_runs(script, tmp_path):
    modules, extra = _declared(script)
    absent = requires.missing(modules)
    if absent:
        pytest.skip(requires.message(script, absent, extra))
    env = subprocess_env(MPLBACKEND="Agg")
    env.pop("XLA_FLAGS", None)  # tutorials run as a reader would: default devices
    # ... from a checkout's root, as the tutorials' page says (`python tutorials/01_...`):
    # whatever a tutorial runs there must import the installed jaxdecl, not the sources.
    result = subprocess.run([sys.executable, str(script)], cwd=_like_a_checkout(tmp_path),
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stdout.strip(), "a tutorial prints what a reader should look at"


# --- what a tutorial needs beyond the install ---------------------------------------------


def _core() -> set:
    """What ``pip install .`` brings for certain: the standard library, jaxdecl and the
    dependencies pyproject.toml names, and the modules beside the tutorials."""
    project = (ROOT / "pyproject.toml").read_text().split("[project]", 1)[1]
    dependencies = re.search(r"^dependencies = \[(.*?)\]", project, re.M | re.S)[1]
    names = {re.split(r"[<>=!~;\[ ]", d)[0] for d in re.findall(r'"([^"]+)"', dependencies)}
    assert {"jax", "numpy"} <= names, names
    return set(sys.stdlib_module_names) | names | {"jaxdecl"} | {m.stem for m in MODULES}


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(k, ast.Name) and k.id in ("ImportError", "ModuleNotFoundError")
               for k in kinds)


def _imports(tree) -> list:
    """``(dotted name, optional)`` of every import; optional: inside a ``try`` whose
    handlers catch ``ImportError``."""
    found = []

    def visit(node, optional):
        if isinstance(node, ast.Try):
            guarded = optional or any(_catches_import_error(h) for h in node.handlers)
            for child in node.body:
                visit(child, guarded)
            for child in node.handlers + node.orelse + node.finalbody:
                visit(child, optional)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, optional) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.module, optional))
            found.extend((f"{node.module}.{alias.name}", optional) for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child, optional)

    visit(tree, False)
    return found


def _needs(path: pathlib.Path) -> set:
    """The packages beyond the install that `path` cannot run without."""
    source = path.read_text()
    core = _core()
    needs = set()
    for name, optional in _imports(ast.parse(source)):
        package = IMPLIED.get(name, name.split(".")[0])
        if not optional and package not in core:
            needs.add(package)
    if "jax.export" in source and ".serialize()" in source:
        needs.add("flatbuffers")  # Exported.serialize imports it inside JAX
    return needs


@pytest.mark.parametrize("script", TUTORIALS, ids=[t.name for t in TUTORIALS])
def test_a_tutorial_names_in_its_first_line_what_it_needs_beyond_the_install(script):
    modules, _ = _declared(script)  # (a malformed `# requires:` line raises here)
    assert sorted(modules) == sorted(_needs(script)), (
        f'{script.name}: its first line must be `# requires: '
        f'{" ".join(sorted(_needs(script)))} (pip install ".[extra]")`')
    body = ast.parse(script.read_text()).body
    statements = [ast.unparse(node) for node in body[1:3]]
    if modules:  # the check runs before anything is imported
        assert statements == ["import requires", "requires.check(__file__)"], statements
    else:
        assert "import requires" not in statements


@pytest.mark.parametrize("module", MODULES, ids=[m.name for m in MODULES])
def test_the_modules_beside_the_tutorials_need_only_the_install(module):
    assert _needs(module) == set()
    assert requires.declared(module) is None


def test_each_named_extra_installs_what_the_line_names():
    tomllib = pytest.importorskip("tomllib")  # (Python >= 3.11)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    declared = [requires.declared(t) for t in TUTORIALS if requires.declared(t)]
    assert len(declared) >= 5
    for modules, extra in declared:
        assert extra in extras, extra
        distributions = {re.split(r"[<>=!~;\[ ]", r)[0].lower().replace("_", "-")
                         for r in extras[extra]}
        for module in modules:  # (each of these installs under its import name)
            assert module.replace("_", "-") in distributions, (extra, module)
    assert _declared(FOLDER / "10_torch.py") == (["torch"], "torch")
    assert _declared(FOLDER / "11_saving.py") == (["flatbuffers"], "saving")


@pytest.mark.parametrize("line", [
    "# requires: torch",  # the command is part of the form
    "# requires: flatbuffers (pip install flatbuffers)",
    '# requires: flatbuffers (pip install ".[Saving]")',
    '# requires: (pip install ".[saving]")',
])
def test_a_requires_line_of_another_form_is_an_error(line, tmp_path):
    script = tmp_path / "12_example.py"
    script.write_text(f'{line}\n"""An example."""\n')
    with pytest.raises(ValueError, match="is not of the form"):
        requires.declared(script)


# A tutorial run with some packages made unimportable, as if they were not installed.
WITHOUT = """
import importlib.abc, os, runpy, sys

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

script, BLOCKED = sys.argv[1], set(sys.argv[2:])
sys.meta_path.insert(0, NotInstalled())
sys.argv = [script]
sys.path[0] = os.path.dirname(os.path.abspath(script))
runpy.run_path(script, run_name="__main__")
"""

NEEDS = [(t, m) for t in TUTORIALS for m in _declared(t)[0]]


@pytest.mark.parametrize("script, module", NEEDS, ids=[f"{t.name}-without-{m}"
                                                       for t, m in NEEDS])
def test_a_tutorial_without_its_package_stops_naming_the_extra(script, module, tmp_path):
    modules, extra = _declared(script)
    absent = [m for m in modules if m == module or requires.missing([m])]
    if requires.missing([module]):  # not installed here: run it as it is
        command = [sys.executable, str(script)]
    else:
        command = [sys.executable, "-c", WITHOUT, str(script), module]
    result = subprocess.run(command, cwd=tmp_path, env=subprocess_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == requires.message(script, absent, extra), \
        result.stderr[-3000:]
    assert f'pip install ".[{extra}]"' in result.stderr
    if extra in requires.BEFORE:  # what to install first: PyTorch's CPU build
        assert result.stderr.strip().splitlines()[-2] == f"{script.name}: " \
            f"{requires.BEFORE[extra]}", result.stderr[-3000:]
    assert not result.stdout, "it stops before doing anything"
