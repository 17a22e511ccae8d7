"""contrib.finufft's public surface is jax-finufft 1.3.1's, by construction.

Code written for jax-finufft calls its functions by keyword (``unpack_opts(opts,
finufft_type=1, forward=True)``), builds its options by field name and reads its enums'
values. So every public function, class and enum of ``jax_finufft`` and
``jax_finufft.options`` has a namesake in contrib with the same parameter names, kinds, order
and defaults, the same dataclass fields (order and defaults), the same public methods and
the same enum members and values.

The surface of jax-finufft 1.3.1 is recorded in ``tests/data/jax_finufft_1.3.1_surface.json``
(``python tests/test_contrib_finufft_surface.py --record`` rewrites it from the installed
package): contrib is held to the record on every Python, and the record to the installed
jax-finufft wherever it is installed, so neither can drift. A difference names the function,
the field or the member.
"""

import dataclasses
import enum
import importlib
import inspect
import json
import pathlib
import sys

import pytest

RECORD = pathlib.Path(__file__).parent / "data" / "jax_finufft_1.3.1_surface.json"
#: jax-finufft's public modules -> contrib's namesakes.
MODULES = {"jax_finufft": "jaxdecl.contrib.finufft",
           "jax_finufft.options": "jaxdecl.contrib.finufft.options"}
#: What contrib deliberately leaves out (docs/contrib-finufft.md, "What differs").
LEFT_OUT = {("jax_finufft", "__version__")}
#: What contrib deliberately adds (docs/contrib-finufft.md, "Masked points"): keyword-only
#: parameters after all of jax-finufft's, defaulting to None, so that every call written for
#: jax-finufft means the same.
ADDED = {("jax_finufft", "nufft1"): ["mask"], ("jax_finufft", "nufft2"): ["mask"]}


def _signature(function) -> list:
    """A signature as [name, kind, default] rows; annotations left out (contrib's are
    modern spellings of the same types)."""
    rows = []
    for p in inspect.signature(function).parameters.values():
        default = None if p.default is p.empty else _value(p.default)
        rows.append([p.name, p.kind.name, default])
    return rows


def _value(value):
    """A default as the record writes it: an int (an IntEnum member too) by its value, the
    rest by repr (``GpuMethod.Auto`` and ``0`` are the same default to a caller)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    return repr(value)


def describe(obj) -> dict:
    """What the record holds of one public name."""
    if isinstance(obj, type) and issubclass(obj, enum.Enum):
        return {"kind": "enum", "members": {m.name: int(m.value) for m in obj}}
    if isinstance(obj, type) and dataclasses.is_dataclass(obj):
        fields = [[f.name, _value(f.default)] for f in dataclasses.fields(obj)]
        methods = {name: _signature(member) for name, member in vars(obj).items()
                   if inspect.isfunction(member) and not name.startswith("_")}
        return {"kind": "dataclass", "fields": fields, "methods": methods}
    if callable(obj):
        return {"kind": "function", "signature": _signature(obj)}
    return {"kind": type(obj).__name__}


def public_names(module) -> list:
    """A module's public names: its ``__all__``, else what it defines itself."""
    if hasattr(module, "__all__"):
        return sorted(module.__all__)
    return sorted(name for name, obj in vars(module).items() if not name.startswith("_")
                  and getattr(obj, "__module__", None) == module.__name__)


def surface(modules) -> dict:
    found = {}
    for name in modules:
        module = importlib.import_module(name)
        found[name] = {n: describe(getattr(module, n)) for n in public_names(module)}
    return found


def _differences(ours: dict, theirs: dict, where: str = "") -> list:
    """Where two descriptions differ, as ``fields[3]: ours [...], jax-finufft's [...]``."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return [line for key in sorted(set(ours) | set(theirs), key=str)
                for line in _differences(ours.get(key), theirs.get(key), f"{where}{key}.")]
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        # (a row of a signature or of the fields is named by its first entry, the name)
        return [line for i, (a, b) in enumerate(zip(ours, theirs))
                for line in _differences(a, b, f"{where}{b[0] if _named(b) else i}.")]
    if ours == theirs:
        return []
    return [f"{where.rstrip('.')}: ours {ours!r}, jax-finufft's {theirs!r}"]


def _named(row) -> bool:
    return isinstance(row, list) and bool(row) and isinstance(row[0], str)


RECORDED = json.loads(RECORD.read_text()) if RECORD.exists() else {}
CASES = [(module, name) for module, names in RECORDED.items() for name in names
         if (module, name) not in LEFT_OUT]


@pytest.mark.parametrize("module, name", CASES, ids=[f"{m}.{n}" for m, n in CASES])
def test_contrib_has_jax_finufft_s_name_with_its_parameters_fields_and_members(module, name):
    pytest.importorskip("finufft")  # (contrib's ops need finufft's library)
    theirs = RECORDED[module][name]
    ours_module = importlib.import_module(MODULES[module])
    assert hasattr(ours_module, name), f"{MODULES[module]} has no {name} (jax-finufft has)"
    ours = describe(getattr(ours_module, name))
    added = ADDED.get((module, name), [])
    if added:
        rows = ours["signature"]
        assert rows[-len(added):] == [[a, "KEYWORD_ONLY", "None"] for a in added], rows
        ours = {**ours, "signature": rows[:-len(added)]}
    assert not _differences(ours, theirs), (
        f"{MODULES[module]}.{name} differs from {module}.{name}: "
        + "; ".join(_differences(ours, theirs)))


def test_the_record_is_the_installed_jax_finufft_s_surface():
    from helpers_extras import need

    peer = need("jax_finufft")
    if peer.__version__ != "1.3.1":
        pytest.skip(f"the record is of jax-finufft 1.3.1, this is {peer.__version__}")
    assert surface(MODULES) == RECORDED


def test_a_caller_passing_jax_finufft_s_keywords_gets_jax_finufft_s_choice():
    pytest.importorskip("finufft")
    from jaxdecl.contrib.finufft.options import NestedOpts, Opts, unpack_opts

    one, two, back = Opts(modeord=True), Opts(nthreads=2), Opts(nthreads=3)
    nested = NestedOpts(type1=one, type2=two, backward=back)
    assert unpack_opts(nested, finufft_type=1, forward=True) is one
    assert unpack_opts(nested, finufft_type=2, forward=True) is two
    assert unpack_opts(opts=nested, finufft_type=3, forward=True) is None
    assert unpack_opts(nested, finufft_type=1, forward=False) is back
    assert unpack_opts(NestedOpts(forward=two), finufft_type=1, forward=True) is two
    assert unpack_opts(one, finufft_type=1, forward=False) is one
    assert unpack_opts(None, finufft_type=2, forward=True) is None
    native = Opts(nthreads=1, spread_sort=1, upsampfac=1.25).to_finufft_opts()
    assert (native.nthreads, native.spread_sort, native.upsampfac) == (1, 1, 1.25)


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    RECORD.write_text(json.dumps(surface(MODULES), indent=1, sort_keys=True) + "\n")
