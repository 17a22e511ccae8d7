"""The README's self-contained examples (Python blocks that start with an import) run."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).parent.parent / "README.md"
BLOCKS = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
          if b.startswith("import")]


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code):
    if "contrib import ducc" in code:
        pytest.importorskip("ducc0")
    if "contrib.finufft" in code:
        pytest.importorskip("finufft")
    exec(compile(code, str(README), "exec"), {})


def test_readme_has_examples():
    assert len(BLOCKS) >= 2
