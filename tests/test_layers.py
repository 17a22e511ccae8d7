"""The package's rooms, as ARCHITECTURE.md maps them: each imports only itself, the rooms
below it and the ground; no import circle; every module is on the map."""

import ast
import pathlib
import re

import pytest

import jaxdecl

# The source tree beside these tests (an installed copy lacks ARCHITECTURE.md), else the
# installed package.
ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxdecl" if (ROOT / "jaxdecl").is_dir() else pathlib.Path(jaxdecl.__file__).parent
MAP = ROOT / "ARCHITECTURE.md"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> list:
    """``(module, how)`` for each jaxdecl module `path` imports, at any depth of its code:
    `how` is ``"name"`` for ``from X import name`` and ``"module"`` for importing X itself."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                found.append((f"{module}.{alias.name}", "module"))
            if node.module:
                found.append((module, "name"))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, "module") for alias in node.names)
    return [(m, how) for m, how in found if m.startswith("jaxdecl") and m != name]


def _modules() -> dict:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _graph() -> dict:
    modules = _modules()
    return {name: {m for m, _ in _imports(path) if m in modules}
            for name, path in modules.items()}


def _rooms() -> list:
    """``(room, [module names])``, top to bottom, from ARCHITECTURE.md's table."""
    text = MAP.read_text()
    table = text[text.index("## The rooms, top to bottom"):].split("\n\n")[1]
    rooms = []
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        room = cells[0].strip("`").rstrip("/")
        files = re.findall(r"`([\w./]+)`", cells[1])
        prefix = "jaxdecl" if room in ("faces", "ground") else f"jaxdecl.{room}"
        names = []
        for file in files:
            if file.endswith("/"):  # a package of the ground: it and its modules
                package = f"{prefix}.{file.rstrip('/')}"
                names += [package] + [f"{package}.{p.stem}" for p in
                                      (PACKAGE / file).glob("*.py") if p.stem != "__init__"]
                continue
            stem = file[:-3] if file.endswith(".py") else file
            names.append(prefix if stem == "__init__" else f"{prefix}.{stem}")
        rooms.append((room, names, cells[3]))
    return rooms


def _room_of() -> dict:
    return {module: rank for rank, (_, names, _) in enumerate(_rooms()) for module in names}


def test_every_module_is_on_the_map_and_nothing_else():
    on_map = set(_room_of())
    modules = {m for m in _modules() if not m.startswith("jaxdecl.contrib")}
    room_packages = {f"jaxdecl.{room}" for room, _, _ in _rooms()
                     if room not in ("faces", "ground")}
    assert modules - on_map - room_packages == set(), "modules missing from ARCHITECTURE.md"
    assert on_map - modules - {"jaxdecl._host._dispatch"} == set(), "the map names no module"


def test_the_map_says_which_rooms_each_may_import():
    rooms = _rooms()
    for rank, (room, _, imports) in enumerate(rooms):
        below = [r for r, _, _ in rooms[rank + 1:]]
        if room == "faces":
            assert imports == "every room"
        elif room == "ground":
            assert imports == "nothing but itself"
        else:
            assert imports == ", ".join(f"`{r}`" if r != "ground" else r for r in below), room


def test_each_room_imports_only_itself_and_rooms_below():
    room_of = _room_of()
    rooms = _rooms()
    ground = len(rooms) - 1
    offenders = []
    for name, targets in _graph().items():
        own = room_of.get(name)
        if own is None:  # contrib, or a room package's __init__ (wiring its modules)
            continue
        for target in targets:
            rank = room_of.get(target)
            if rank is None:
                continue  # a room package itself
            within = target.rsplit(".", 1)[0] == name.rsplit(".", 1)[0] != "jaxdecl" or \
                target.startswith(name + ".")  # a package of the ground and its modules
            if (own == ground and not within) or (0 < own and rank < own):  # faces: anything
                offenders.append(f"{name} ({rooms[own][0]}) imports {target} "
                                 f"({rooms[rank][0]})")
    assert not offenders, offenders


@pytest.mark.parametrize("room", ["_spec", "_host", "_op", "_sharded", "_transforms"])
def test_each_room_has_a_readme_that_lists_its_modules(room):
    readme = PACKAGE / room / "README.md"
    assert readme.exists(), f"{room} has no README.md"
    text = readme.read_text()
    for heading in ("## Invariants", "## Who may import it"):
        assert heading in text, (room, heading)
    for path in (PACKAGE / room).glob("*.py"):
        if path.name != "__init__.py":
            assert f"`{path.name}`" in text, (room, path.name)


def test_only_the_host_room_touches_the_extension_by_name():
    """The extension is imported by name inside `_host`: through the package, a missing
    build would read as a circular import."""
    offenders = {}
    for name, path in _modules().items():
        for module, how in _imports(path):
            if module == "jaxdecl._host._dispatch":
                if not name.startswith("jaxdecl._host.") or how != "name":
                    offenders.setdefault(name, []).append((module, how))
    assert not offenders, offenders


def test_no_import_circle():
    graph = _graph()
    # A package imports its own submodules to re-export them; that is wiring, not a layer.
    for name in graph:
        graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}
    state: dict = {}

    def visit(node, path):
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                raise AssertionError("import circle: " + " -> ".join(path + [node, target]))
            if target not in state:
                visit(target, path + [node])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_strategy_is_a_pure_decision():
    """The strategy chooser looks at facts only: it imports nothing that runs or lowers."""
    assert _graph()["jaxdecl._sharded.strategy"] <= {"jaxdecl._compat"}


def test_only_compat_knows_jax_internals_and_versions():
    """Version knowledge lives in _compat/: no other module imports jax._src or reads a
    version, so supporting another JAX means changing that package alone."""
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "_compat":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            found = None
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax._src"):
                found = node.module
            elif isinstance(node, ast.Import):
                found = next((a.name for a in node.names if a.name.startswith("jax._src")), None)
            elif isinstance(node, ast.Attribute) and node.attr in ("__version__", "_src",
                                                                   "version_info"):
                found = ast.unparse(node)
            if found:
                offenders.setdefault(_module_name(path), []).append(found)
    assert not offenders, offenders


def test_no_private_module_is_over_400_lines():
    long = {_module_name(p): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def _unbuilt_copy(folder: pathlib.Path) -> pathlib.Path:
    """A copy of the package's sources without the compiled extension, in `folder`."""
    import shutil

    shutil.copytree(PACKAGE, folder / "jaxdecl",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    return folder / "jaxdecl"


def test_a_source_tree_without_the_extension_says_how_to_build_it(tmp_path):
    from jaxdecl._host import registry

    source = _unbuilt_copy(tmp_path)
    # Nothing else on the path: build it, or install jaxdecl.
    message = registry._not_built(ImportError("No module named '_dispatch'"),
                                  str(source / "_host" / "registry.py"), [str(tmp_path)])
    assert message.startswith("jaxdecl's compiled extension"), message
    assert "run `pip install -e .` in the source tree" in message
    assert "No module named '_dispatch'" in message


def test_a_source_tree_shadowing_an_installed_jaxdecl_names_both(tmp_path):
    """The README's plain install, then ``python -c "import jaxdecl"`` in the checkout:
    the current folder comes first on the path, and holds the unbuilt sources."""
    import subprocess
    import sys

    source = _unbuilt_copy(tmp_path)
    installed = pathlib.Path(jaxdecl.__file__).resolve().parent  # built
    done = subprocess.run([sys.executable, "-c", "import jaxdecl"], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path,
                          env={"PATH": "", "PYTHONPATH": str(installed.parent)})
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ImportError: jaxdecl was imported from the source tree {source}, "
                           f"whose compiled extension"), last
    assert f"while an installed jaxdecl is at {installed}:" in last, last
    assert "run from another folder (out of the checkout) to use the installed jaxdecl" in last
    assert f"run `pip install -e .` in {tmp_path}" in last
    assert "circular" not in done.stderr, done.stderr
    # From another folder the same command imports the installed copy.
    done = subprocess.run([sys.executable, "-c", "import jaxdecl; print(jaxdecl.__file__)"],
                          capture_output=True, text=True, timeout=300, cwd=source / "_host",
                          env={"PATH": "", "PYTHONPATH": str(installed.parent)})
    assert done.stdout.strip() == str(installed / "__init__.py"), done.stderr[-3000:]


_FIRST_CALL = """
import collections, gc, os, sys
import jax, jax.numpy as jnp, numpy as np
import jaxdecl as jd

class Mul(jd.Primitive):
    @jd.abstract
    def shapes(self, x1, x2):
        return jax.ShapeDtypeStruct(x1.shape, x1.dtype)
    @jd.forward
    def apply(self, x1, x2, *, out):
        np.multiply(x1, x2**2, out=out)
    @jd.jvp
    def push(self, x1, x2, dx1, dx2):
        return x2**2 * dx1 + 2 * x1 * x2 * dx2
    @jd.vjp
    def pull(self, x1, x2, ct):
        return x2**2 * ct, 2 * x1 * x2 * ct

package = os.path.dirname(jd.__file__)
moves = collections.Counter()

def module(frame):
    name = frame.f_code.co_filename
    return os.path.relpath(name, package) if name.startswith(package) else None

def profile(frame, event, arg):
    if event != "call" or module(frame) is None:
        return
    caller = frame.f_back  # the nearest jaxdecl frame that led here (JAX's in between)
    while caller is not None and module(caller) is None:
        caller = caller.f_back
    if caller is not None and module(caller) != module(frame):
        moves[(module(caller), module(frame))] += 1

f = jax.jit(jax.grad(lambda a, b: jax.vmap(Mul())(a, b).sum()))
# A garbage collection that happens to fall inside the call runs finalizers there (when
# depends on what other threads allocated): the count is of the call's own path.
gc.disable()
sys.setprofile(profile)
jax.block_until_ready(f(jnp.ones((4, 3)), jnp.ones((4, 3))))
sys.setprofile(None)
gc.enable()
print(sum(moves.values()), dict(moves.most_common(5)))
"""


def test_a_first_traced_call_crosses_few_module_boundaries(tmp_path):
    """The first call of an op under jit(grad(vmap)): the moves between jaxdecl's modules
    (a call into another module, JAX's frames in between skipped). 106 in the flat
    layout; one object (the Equation) that carries what every stage reads keeps it at 53."""
    import subprocess
    import sys

    from conftest import subprocess_env

    done = subprocess.run([sys.executable, "-c", _FIRST_CALL], capture_output=True,
                          text=True, timeout=300, env=subprocess_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    count = int(done.stdout.split()[0])
    assert count <= 53, done.stdout
