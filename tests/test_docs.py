"""The documentation's examples run, and the repository refers to nothing outside itself.

Every Python block of ``docs/`` that starts with an import is a complete example
(the convention of the README): it runs here, in a fresh namespace. The site
itself is built by ``.ci/run`` (``sphinx-build -W -n``), which also runs the
tutorials and checks every link.
"""

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest
from conftest import subprocess_env
from helpers_extras import need

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md")
               if "_build" not in p.parts and not re.match(r"\d\d_", p.name))


def _blocks():
    for page in PAGES:
        for index, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S)):
            if code.startswith("import"):
                yield pytest.param(code, id=f"{page.relative_to(DOCS)}#{index}")


# Optional libraries: an example that imports one is skipped where it is not installed.
OPTIONAL = {"ducc0", "jaxbind", "scipy", "equinox", "optax", "flax", "lineax", "optimistix",
            "diffrax", "numpyro"}


def _imported(code) -> set:
    """The top-level packages that `code` imports."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("code", list(_blocks()))
def test_docs_example_runs(code, tmp_path):
    for library in sorted(_imported(code) & OPTIONAL):
        need(library)
    if "contrib.finufft" in code:  # (its kernels load finufft's library)
        need("finufft")
    # A fresh interpreter: examples set jax options and define classes freely. It runs
    # outside the checkout (as a reader's script would), so that `import jaxdecl` finds the
    # installed package, not the unbuilt source tree.
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, env=subprocess_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]


def test_docs_have_examples_and_pages():
    assert len(list(_blocks())) >= 20
    names = {p.relative_to(DOCS).as_posix() for p in PAGES}
    for page in ["index.md", "getting-started.md", "troubleshooting.md", "api.md",
                 "coming-from-jaxbind.md", "coming-from-custom-vjp.md", "tutorials/index.md",
                 "ecosystem.md"]:
        assert page in names, page
    for concept in ["declaring", "derivatives", "batching", "pytrees", "sharding", "saving",
                    "residuals", "c-kernels", "gpu", "checking", "errors-and-debugging",
                    "performance"]:
        assert f"concepts/{concept}.md" in names, concept


def _repository_files():
    """The checkout's text files (.ci's too). Git's folder, virtual environments (CI's
    .venv-readme315 and the like), build output and caches are pruned, not walked: a virtual
    environment holds some 100 000 files."""
    skip = {".git", "build", "dist", "_build", "__pycache__", ".pytest_cache", ".ruff_cache",
            ".hypothesis"}
    suffixes = {".py", ".md", ".txt", ".toml", ".cfg", ".h", ".cc", ".cpp", ".pyi", ".css",
                ".yml", ".yaml", ""}
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [name for name in subfolders
                         if name not in skip and not name.endswith(".egg-info") and
                         not os.path.exists(os.path.join(folder, name, "pyvenv.cfg"))]
        for name in files:
            path = pathlib.Path(folder, name)
            if path.suffix in suffixes:
                yield path


def test_no_file_refers_to_documents_outside_the_repository():
    # Spelled in pieces, so that this file does not match itself.
    forbidden = ["API" + ".md", "../" + "shared", "FACTS" + ".md", "STYLE" + ".md"]
    found = []
    for path in _repository_files():
        text = path.read_text(errors="replace")
        found += [f"{path.relative_to(ROOT)}: {word}" for word in forbidden if word in text]
    assert not found, found
