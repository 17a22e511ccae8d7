"""Saved configurations and recipes (jaxdecl/_transforms/recipes.py): values round-trip by
value, nothing else does, and a recipe of another format is refused by name."""

import dataclasses
import enum
import json
import pathlib
import re
import subprocess
import sys
import typing

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import subprocess_env

import jaxdecl as jd
from jaxdecl._op import configuration as _configuration
from jaxdecl._op import handle as _op
from jaxdecl._transforms import recipes as _recipes

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # ops_saved, the ops' module
import ops_saved  # noqa: E402


class Color(enum.Enum):
    RED = 1


class Pair(typing.NamedTuple):
    a: int
    b: float


@dataclasses.dataclass(frozen=True)
class Frozen:
    n: int
    w: tuple


VALUES = [
    None, True, 3, -2**70, 0.1, float("inf"), 1 + 2j, "text", b"\x00\xff",
    np.float32(1.5), np.int8(-3), np.dtype("complex64"), np.dtype(ml_dtypes.bfloat16),
    np.arange(6.0).reshape(2, 3), np.array([1 + 1j], np.complex64), np.zeros((0, 2), np.int32),
    np.arange(3).astype(ml_dtypes.bfloat16),
    (1, (2.0, "x")), [1, [2]], {"k": 1, 2: "v"}, {1, 2}, frozenset({"a"}),
    Color.RED, Pair(1, 2.0), Frozen(3, (1.0,)), np.sin, Frozen,
]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_values_round_trip_exactly(value):
    back = _configuration.decode(_configuration.encode(value, "Op", "Op.x"))
    assert type(back) is type(value)
    if isinstance(value, np.ndarray):
        assert back.dtype == value.dtype and back.shape == value.shape
        np.testing.assert_array_equal(back, value)
    else:
        assert back == value or (back is value)


def test_jax_arrays_come_back_as_numpy():
    back = _configuration.decode(_configuration.encode(jnp.arange(3.0), "Op", "Op.x"))
    assert isinstance(back, np.ndarray) and back.tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("value", [object(), lambda x: x, np.array([object()]), {1: object()}])
def test_what_has_no_saved_form_is_named(value):
    with pytest.raises(_configuration.Unsaveable) as caught:
        _configuration.encode({"inner": value}, "Op", "Op.config")
    assert caught.value.where.startswith("Op.config[")


def test_restoring_never_imports():
    data = _configuration.encode(Frozen(1, ()), "Op", "Op.x")
    data[1] = "a_module_nobody_imported:Frozen"
    with pytest.raises(_recipes.ExportError, match="import a_module_nobody_imported"):
        _configuration.decode(data)
    assert "a_module_nobody_imported" not in sys.modules


# --- the recipe format (docs/concepts/saving.md, "How long a saved program loads") -------
#
# A jaxdecl writes one recipe format and reads only that one; a program saved in another is
# refused with a message naming the jaxdecl and the format on both sides and what to do.

ROOT = pathlib.Path(__file__).resolve().parent.parent
VERSION, FORMAT, OLDEST = jd.__version__, _recipes.FORMAT, _recipes.OLDEST

#: Every recipe format and the kernel ABI its recipes rebuild kernels for. A new kernel ABI
#: needs a new format (a recipe of the old one would rebuild a kernel in the new order for a
#: program compiled against the old order), which becomes the oldest read: add the pair here
#: when you bump both. Formats 1 and 2 share one ABI: 2 adds the active leaves.
FORMATS = {1: "jaxdecl-kernel-1", 2: "jaxdecl-kernel-1"}

OLDER = ("this program was saved by jaxdecl {saved_by} (recipe format {saved}); this is "
         "jaxdecl {version} (recipe format {format}), which no longer reads format {saved}: "
         "save the program again with jaxdecl {version}, or load it with jaxdecl {saved_by}")
NEWER = ("this program was saved by jaxdecl {saved_by} (recipe format {saved}); this is "
         "jaxdecl {version} (recipe format {format}), which cannot read the newer format "
         "{saved}: load the program with jaxdecl {saved_by}, or save it again with jaxdecl "
         "{version}")
MISSING = ("this program was saved by jaxdecl {saved_by} (no recipe format); this is jaxdecl "
           "{version} (recipe format {format}), which reads formats {oldest} to {format}: save "
           "the program again with jaxdecl {version}")


def _refusal(template, saved_by, saved=None):
    return template.format(saved_by=saved_by, saved=saved, version=VERSION, format=FORMAT,
                           oldest=OLDEST)


def test_a_new_kernel_abi_comes_with_a_new_recipe_format():
    assert FORMATS.get(FORMAT) == _op._KERNEL_ABI, (
        "the recipe format and the kernel ABI changed apart: bump _recipes.FORMAT with "
        "_op._KERNEL_ABI and add the pair to FORMATS")
    # every format read rebuilds kernels of this ABI
    assert {FORMATS[f] for f in range(OLDEST, FORMAT + 1)} == {_op._KERNEL_ABI}


def test_a_recipe_is_written_in_the_oldest_format_that_describes_it():
    """An equation of every derivative leaf has format 1's recipe (an older jaxdecl loads
    the program); one that carries some of them needs format 2, which names them."""
    op = ops_saved.Wave()
    x = jnp.linspace(0.1, 0.8, 4)
    for f, wanted in ((lambda x: op(x, x), OLDEST), (jax.grad(lambda x: op(x, 2 * x).sum()),
                                                      OLDEST),
                      (jax.grad(lambda x: op(x, jnp.ones(4)).sum()), FORMAT)):
        text = jax.jit(f).lower(x).as_text()
        formats = {int(m) for m in re.findall(r"\\22format\\22:(\d+)", text)}
        assert max(formats) == wanted, (formats, text[:300])
    assert "active" not in jax.jit(lambda x: op(x, x)).lower(x).as_text()


def test_the_documented_formats_are_the_known_ones():
    page = (ROOT / "docs" / "concepts" / "saving.md").read_text()
    rows = re.findall(r"^\| recipe format (\d+) \| `([\w-]+)` \|", page, re.M)
    assert {int(f): abi for f, abi in rows} == FORMATS


@pytest.mark.parametrize("fields, template, saved_by, saved", [
    ({"format": OLDEST - 1, "jaxdecl": "0.0.1"}, OLDER, "0.0.1", OLDEST - 1),
    ({"format": FORMAT + 1, "jaxdecl": "99.0"}, NEWER, "99.0", FORMAT + 1),
    ({"jaxdecl": "0.0.1"}, MISSING, "0.0.1", None),
    ({"format": str(FORMAT), "jaxdecl": "0.0.1"}, MISSING, "0.0.1", None),  # not a number
    ({"format": True, "jaxdecl": "0.0.1"}, MISSING, "0.0.1", None),  # (True == 1)
], ids=["older", "newer", "missing", "text", "bool"])
def test_a_recipe_of_another_format_is_refused_before_anything_is_rebuilt(
        fields, template, saved_by, saved):
    fields = {**fields, "class": "a_module_nobody_imported:Op"}
    with pytest.raises(jd.ExportError) as caught:
        _recipes.resolve(json.dumps(fields).encode())
    assert str(caught.value) == _refusal(template, saved_by, saved)
    assert "a_module_nobody_imported" not in sys.modules


def test_a_recipe_without_a_version_or_not_a_recipe_at_all_is_refused():
    with pytest.raises(jd.ExportError) as caught:
        _recipes.resolve(json.dumps({"format": FORMAT + 1}).encode())
    assert str(caught.value).startswith(
        f"this program was saved by an unknown jaxdecl (recipe format {FORMAT + 1}); ")
    assert str(caught.value).endswith(
        f"load the program with the jaxdecl that saved it, or save it again with jaxdecl "
        f"{VERSION}")
    for data in (b"not json", b"[1, 2]"):
        with pytest.raises(jd.ExportError, match=rf"recipe is not readable \(this is jaxdecl "
                                                  rf"{re.escape(VERSION)}, recipe format "
                                                  rf"{FORMAT}\)"):
            _recipes.resolve(data)


# End to end: programs exported here under another format (this process's jaxdecl set to
# write it), their recipes rewritten, loaded by a fresh process that imports the ops' module.
LOADER = """
import json, sys
sys.path.insert(0, {tests!r})
import jax, jax.export, jax.numpy as jnp, numpy as np
import jaxdecl, ops_saved
results = {{}}
for name in {names!r}:
    with open(name + ".exported", "rb") as file:
        exported = jax.export.deserialize(bytearray(file.read()))
    try:
        results[name] = np.asarray(exported.call(jnp.arange(3.0, dtype=jnp.float32))).tolist()
    except Exception as error:
        results[name] = type(error).__name__ + ": " + str(error)
print(json.dumps(results))
"""

# name: (the format written, the jaxdecl written, Scale's factor). One op each, of factors no
# other test uses: the lowerings made under another format must not serve anyone else.
CASES = {"current": (FORMAT, VERSION, 2.25), "oldest": (OLDEST, VERSION, 9.25),
         "older": (OLDEST - 1, "0.0.1", 3.25), "newer": (FORMAT + 1, "99.0", 5.25),
         "missing": (FORMAT, VERSION, 7.25)}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers")
    import jax
    import jax.export
    import ops_saved

    folder = tmp_path_factory.mktemp("formats")
    with pytest.MonkeyPatch.context() as patch:
        for name, (written, version, factor) in CASES.items():
            patch.setattr(_recipes, "format_of", lambda eqn, written=written: written)
            patch.setattr(_recipes, "VERSION", version)
            exported = jax.export.export(jax.jit(ops_saved.Scale(factor)),
                                         disabled_checks=jd.disabled_checks())(
                jnp.ones(3, jnp.float32))
            data = bytes(exported.serialize())
            field = b'"format":%d,"jaxdecl":"%s"' % (written, version.encode())
            assert data.count(field) == 1, name  # (a lowering from before the patch, reused?)
            if name == "missing":  # the same length, so the serialized module stays valid
                data = data.replace(b'"format":%d,' % written, b'"formit":%d,' % written)
            (folder / f"{name}.exported").write_bytes(data)
    code = LOADER.format(tests=str(ROOT / "tests"), names=list(CASES))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=subprocess_env(), cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_program_of_a_format_it_reads_loads_in_a_fresh_process(loaded):
    assert loaded["current"] == [0.0, 2.25, 4.5]
    assert loaded["oldest"] == [0.0, 9.25, 18.5]


@pytest.mark.parametrize("name, template", [("older", OLDER), ("newer", NEWER),
                                            ("missing", MISSING)])
def test_a_program_of_another_format_is_refused_naming_both_versions(loaded, name, template):
    written, version, _ = CASES[name]
    message = loaded[name]
    assert not isinstance(message, list), f"a program of format {written} ran"
    # The loading process names the op and its rule, then the reason.
    assert "Scale.apply (@forward)" in message and "could not be rebuilt" in message, message
    expected = _refusal(template, version, None if name == "missing" else written)
    assert "ExportError: " + expected in message, message
