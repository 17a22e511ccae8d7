"""The package's layers: each module imports only modules below it (no import circle)."""

import ast
import pathlib

import jaxdecl

PACKAGE = pathlib.Path(jaxdecl.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set:
    """jaxdecl modules that `path` imports, at any depth of its code (lazy imports too)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            submodules = [f"{module}.{alias.name}" for alias in node.names]
            # `from . import _x` names submodules only; `from ._x import y`, the module.
            candidates = submodules if node.module is None else [module] + submodules
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found.update(c for c in candidates if c.startswith("jaxdecl") and c != name)
    return found


def _graph() -> dict:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules} for name, path in modules.items()}


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


def test_primitive_depends_on_nothing_above_it():
    graph = _graph()
    above = {"jaxdecl._autodiff", "jaxdecl._batching", "jaxdecl._op", "jaxdecl._declare",
             "jaxdecl._check", "jaxdecl"}
    assert not graph["jaxdecl._primitive"] & above, graph["jaxdecl._primitive"]


def test_sharding_modules_sit_below_the_primitive():
    """The factor logic, the plan, the strategy and the per-shard builders know nothing of
    ops, autodiff or batching."""
    graph = _graph()
    above = {"jaxdecl._primitive", "jaxdecl._autodiff", "jaxdecl._batching", "jaxdecl._op",
             "jaxdecl._declare", "jaxdecl._check", "jaxdecl"}
    assert graph["jaxdecl._sharding"] <= {"jaxdecl._errors"}, graph["jaxdecl._sharding"]
    for module in ("_plan", "_strategy", "_shardmap", "_lowering", "_eager", "_equation"):
        assert not graph[f"jaxdecl.{module}"] & above, (module, graph[f"jaxdecl.{module}"])


def test_strategy_is_a_pure_decision():
    """The strategy chooser looks at facts only: it imports nothing that runs or lowers."""
    assert _graph()["jaxdecl._strategy"] <= {"jaxdecl._compat"}



def test_rule_decorators_sit_below_the_declaration():
    """Marking a method needs no spec, op or primitive: _declare builds the spec on the marks."""
    graph = _graph()
    assert graph["jaxdecl._rules"] <= {"jaxdecl._cfunction", "jaxdecl._errors"}, \
        graph["jaxdecl._rules"]
    assert "jaxdecl._rules" in graph["jaxdecl._declare"]


def test_kernels_and_their_registry_sit_below_the_op():
    """_kernels builds host kernels from rules and _runtime registers them; the op joins the
    two. Neither knows ops, declarations or the primitive, and the registry knows no rules."""
    graph = _graph()
    above = {"jaxdecl._op", "jaxdecl._declare", "jaxdecl._rules", "jaxdecl._primitive",
             "jaxdecl._partition", "jaxdecl._eager", "jaxdecl._autodiff", "jaxdecl._batching",
             "jaxdecl._check", "jaxdecl"}
    for name in ("jaxdecl._kernels", "jaxdecl._failures"):
        assert not graph[name] & (above | {"jaxdecl._runtime"}), (name, graph[name])
    assert graph["jaxdecl._runtime"] <= {"jaxdecl._cfunction", "jaxdecl._compat",
                                         "jaxdecl._dtypes"}, graph["jaxdecl._runtime"]

def test_only_compat_knows_jax_internals_and_versions():
    """Version knowledge lives in _compat.py: no other module imports jax._src or reads a
    version, so supporting another JAX means changing one file."""
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name == "_compat.py":
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
