"""Sphinx configuration of jaxdecl's documentation.

Build (strict: any warning, broken cross-reference or failing tutorial fails):

    pip install ".[docs]"
    sphinx-build -W --keep-going -n -b html docs docs/_build/html

The pages are MyST Markdown (readable on a code host too); the API reference is
generated from the docstrings of every name in ``jaxdecl.__all__``; the
tutorials are run at build time (``_ext/jaxdecl_docs.py``), their printed
output and figures shown under their code.
"""

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_ext"))

import jaxdecl  # noqa: E402 - the package the pages document

project = "jaxdecl"
author = "jaxdecl contributors"
copyright = "jaxdecl contributors, BSD-3-Clause"  # noqa: A001 - Sphinx's name
release = jaxdecl.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_parser",
    "jaxdecl_docs",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md"]

# Markdown: ::: fences for directives, definition lists, heading anchors for
# links such as troubleshooting.md#at-class-creation.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# Docstrings: Google style, as in the package; the lists of decorators and
# class options in jd.Primitive and jd.primitive are sections of their own.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_custom_sections = ["Decorators", "Class options"]
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True

# Strict mode (-n): every cross-reference must resolve. References to other
# projects' objects (no network at build time, so no intersphinx) are plain text.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jaxlib|numpy|np|ml_dtypes|ctypes|equinox|typing|collections)(\..*)?"),
    (r"py:class", r"(int|float|str|bool|tuple|dict|list|object|type|callable|None)"),
    # jd.pure_callback carries jax.pure_callback's own signature, whose annotations
    # name JAX's classes without their module.
    (r"py:class", r"(Sharding|Callable|Any)"),
]

html_theme = "furo"
html_title = f"jaxdecl {release}"
html_static_path = ["_static"]
html_css_files = ["jaxdecl.css"]
html_show_sourcelink = False
pygments_style = "friendly"
pygments_dark_style = "monokai"

# Tutorials run at build time (see _ext/jaxdecl_docs.py).
jaxdecl_tutorials_dir = os.path.join(ROOT, "tutorials")
jaxdecl_tutorial_timeout = 300
