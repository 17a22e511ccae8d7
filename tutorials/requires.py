"""What a tutorial needs beyond ``pip install .``, checked before it imports it.

Every tutorial runs after the install the README documents (``pip install .``),
or names what more it needs in its first line, the package it imports and the
extra that installs it::

    # requires: flatbuffers (pip install ".[saving]")

and calls ``requires.check(__file__)`` before its imports. Without the package
the tutorial stops there with one line that names the extra and the command,
rather than with an ``ImportError`` from deep inside a library.

Example:
    >>> import pathlib, tempfile
    >>> script = pathlib.Path(tempfile.mkdtemp()) / "12_example.py"
    >>> _ = script.write_text('# requires: json (pip install ".[json]")\\nimport json\\n')
    >>> declared(script)
    (['json'], 'json')
    >>> check(script)  # json is installed: nothing happens
    >>> message(script, ["json"], "json")
    '12_example.py needs json, which is not installed: pip install ".[json]"'
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import sys

#: What to install before an extra whose plain install is not the one to make, printed on
#: the line before the stop line.
BEFORE = {"torch": "the CPU build of PyTorch is enough, and much smaller than PyPI's default "
                   "CUDA build; install it first: "
                   "pip install torch --index-url https://download.pytorch.org/whl/cpu"}

#: The one form of the line: import names, then the pip command that installs them.
LINE = re.compile(r'^# requires: (?P<modules>[A-Za-z_][\w ]*?) '
                  r'\(pip install "\.\[(?P<extra>[a-z][a-z0-9-]*)\]"\)$')


def declared(script) -> tuple[list[str], str] | None:
    """``(modules, extra)`` that `script`'s ``# requires:`` line names; None without one.

    Only the comment lines before the script's docstring count. A ``# requires:``
    line in another form is a ``ValueError``, so that a typo cannot hide a need.
    """
    for line in pathlib.Path(script).read_text().splitlines():
        if not line.startswith("#"):
            return None
        if line.startswith("# requires:"):
            match = LINE.match(line)
            if match is None:
                raise ValueError(f"{pathlib.Path(script).name}: {line!r} is not of the form "
                                 f"'# requires: module ... (pip install \".[extra]\")'")
            return match["modules"].split(), match["extra"]
    return None


def missing(modules) -> list[str]:
    """The `modules` that this Python cannot import (found without importing them)."""
    absent = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            absent.append(name)
    return absent


def message(script, absent, extra) -> str:
    """The line a tutorial stops with when it lacks `absent`."""
    names = " and ".join(absent)
    verb = "is" if len(absent) == 1 else "are"
    return (f"{pathlib.Path(script).name} needs {names}, which {verb} not installed: "
            f'pip install ".[{extra}]"')


def check(script) -> None:
    """Stops `script` (exit status 1), naming its extra, if a package it requires is missing
    (after what to install first, for an extra in :data:`BEFORE`)."""
    need = declared(script)
    if need is None:
        return
    modules, extra = need
    absent = missing(modules)
    if absent:
        if extra in BEFORE:
            print(f"{pathlib.Path(script).name}: {BEFORE[extra]}", file=sys.stderr)
        sys.exit(message(script, absent, extra))
