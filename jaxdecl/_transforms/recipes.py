"""Recipes: what a compiled call carries so that any process can rebuild its kernel.

Every ``jaxdecl_dispatch`` custom call names its kernel by fingerprint (the
fast path: a kernel this process already has) and carries a *recipe*: the
op's class (module and qualified name), its configuration saved by value,
the rule and the shapes. A process that loads the program (``jax.export``,
``serialize_executable``, the persistent compilation cache) and lacks the
kernel rebuilds it from the recipe when XLA instantiates the program. The
kernel registry is a cache that can always be refilled, not an owner that
must outlive every program.

Safe by default: restoring never unpickles and never imports. A recipe's
classes must already be imported by the loading process (importing the op's
module is the trust boundary); values restore by value: ``None``, numbers,
strings, bytes, NumPy arrays, scalars and dtypes (JAX arrays come back as
NumPy arrays), tuples, lists, dicts, sets, enums, named tuples and
dataclasses of those, and classes or functions by their import path. A class
holding anything else says how it is saved with ``__getstate__`` (any value
above) and ``__setstate__``: the hooks ``pickle`` uses.

Example:
    >>> import numpy as np
    >>> from jaxdecl._transforms.recipes import decode, encode
    >>> value = {"n": 3, "w": np.arange(3.0), "tag": ("a", 1.5)}
    >>> back = decode(encode(value, "Op", "config"))
    >>> back["n"], back["w"].tolist(), back["tag"]
    (3, [0.0, 1.0, 2.0], ('a', 1.5))
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import json
import sys
import types
import weakref

import jax
import numpy as np

from .. import _dtypes
from .._errors import ExportError
from .._host.registry import SPLIT_TARGET, TARGET
from .._op.equation import Equation
from .._op.handle import BoundOp, handle_of
from .._op.identity import attributes
from .._spec.layout import TreeAval
from .._version import __version__ as VERSION

#: The recipe format this jaxdecl writes, and the only one it reads (the rule is
#: in docs/concepts/saving.md). Bumped when what a recipe holds or how its values
#: are encoded changes (a field, a value tag, even an added one), and with every
#: change of the kernel ABI (``_op._KERNEL_ABI``): a recipe rebuilds the kernel of
#: a program compiled against the ABI of its own time, so a recipe of another ABI
#: must be refused, not rebuilt.
FORMAT = 1
#: Outside ``jax.export``, a configuration that saves to more text than this is
#: left out of compiled programs (it would weigh on every compilation); its
#: programs then run only in this process. Exported programs always carry it.
LARGEST_IMPLICIT = 1 << 20

_OBJECT_GETSTATE = getattr(object, "__getstate__", None)


class Unsaveable(Exception):
    """A configuration value with no saved form: ``where`` names it."""

    def __init__(self, where: str, value):
        super().__init__(where)
        self.where = where
        self.value = value


# --- values ------------------------------------------------------------------------------


def _path(obj) -> str | None:
    """``module:qualname`` of a class or function that a process can find by name."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not module or not qualname or "<locals>" in qualname or "<lambda>" in qualname:
        return None
    if module == "__main__":
        # A script run with `python -m package.module` is importable by that name.
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        module = getattr(spec, "name", None)
        if not module or module == "__main__":
            return None
    return f"{module}:{qualname}"


def _array(value: np.ndarray) -> list:
    value = np.asarray(value, order="C")  # (ascontiguousarray would make 0-d arrays 1-d)
    return ["a", value.dtype.name, list(value.shape),
            base64.b64encode(value.tobytes()).decode("ascii")]


def encode(value, op: str, where: str):
    """A JSON-able form of `value`; :class:`Unsaveable` naming ``where`` if it has none."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int) and type(value) is int:
        return ["i", str(value)]
    if type(value) is float:
        return ["f", value.hex()]
    if type(value) is complex:
        return ["c", value.real.hex(), value.imag.hex()]
    if isinstance(value, bytes):
        return ["b", base64.b64encode(value).decode("ascii")]
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise Unsaveable(where, value)
        return _array(value)
    if isinstance(value, np.generic):
        return ["s"] + _array(np.asarray(value))[1:]
    if isinstance(value, np.dtype):
        return ["dt", value.name]
    if isinstance(value, jax.Array):
        return _array(np.asarray(value))
    if isinstance(value, enum.Enum):
        path = _path(type(value))
        if path is None:
            raise Unsaveable(where, value)
        return ["e", path, value.name]
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):  # a named tuple
        path = _path(type(value))
        if path is None:
            raise Unsaveable(where, value)
        return ["nt", path, [encode(v, op, f"{where}.{f}")
                             for f, v in zip(type(value)._fields, value)]]
    if type(value) in (tuple, list, set, frozenset):
        tag = {tuple: "t", list: "l", set: "set", frozenset: "fs"}[type(value)]
        items = sorted(value, key=repr) if tag in ("set", "fs") else value
        return [tag, [encode(v, op, f"{where}[{k}]") for k, v in enumerate(items)]]
    if type(value) is dict:
        return ["d", [[encode(k, op, f"{where} (a key)"), encode(v, op, f"{where}[{k!r}]")]
                      for k, v in value.items()]]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        path = _path(type(value))
        if path is None:
            raise Unsaveable(where, value)
        return ["dc", path, [[f.name, encode(getattr(value, f.name), op, f"{where}.{f.name}")]
                             for f in dataclasses.fields(value)]]
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)) or \
            isinstance(value, np.ufunc):
        path = _path(value)
        if path is None:
            raise Unsaveable(where, value)
        return ["ref", path]
    raise Unsaveable(where, value)


def decode(data):
    """The value :func:`encode` saved (no pickling, no imports)."""
    if data is None or isinstance(data, (bool, str)):
        return data
    tag, rest = data[0], data[1:]
    if tag == "i":
        return int(rest[0])
    if tag == "f":
        return float.fromhex(rest[0])
    if tag == "c":
        return complex(float.fromhex(rest[0]), float.fromhex(rest[1]))
    if tag == "b":
        return base64.b64decode(rest[0])
    if tag in ("a", "s"):
        dtype, shape, raw = rest
        array = np.frombuffer(base64.b64decode(raw), dtype=_dtypes.numpy_dtype(dtype))
        array = array.reshape(shape).copy()
        return array[()] if tag == "s" else array
    if tag == "dt":
        return _dtypes.numpy_dtype(rest[0])
    if tag == "e":
        return getattr(find(rest[0]), rest[1])
    if tag == "nt":
        cls = find(rest[0])
        return tuple.__new__(cls, [decode(v) for v in rest[1]])
    if tag in ("t", "l", "set", "fs"):
        items = [decode(v) for v in rest[0]]
        return {"t": tuple, "l": list, "set": set, "fs": frozenset}[tag](items)
    if tag == "d":
        return {decode(k): decode(v) for k, v in rest[0]}
    if tag == "dc":
        obj = object.__new__(find(rest[0]))
        for name, value in rest[1]:
            object.__setattr__(obj, name, decode(value))
        return obj
    if tag == "ref":
        return find(rest[0])
    raise ExportError(f"jaxdecl cannot read a saved value tagged {tag!r}")


def find(path: str):
    """The class or function at ``module:qualname``, from modules already imported."""
    module_name, _, qualname = path.partition(":")
    module = sys.modules.get(module_name)
    if module is None:
        raise ExportError(
            f"the program calls {qualname} from module {module_name!r}, which this process "
            f"has not imported: `import {module_name}` before loading or running it (jaxdecl "
            f"never imports a module a program names: importing is your decision)")
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ExportError(f"module {module_name!r} has no {qualname}: the program was "
                              f"saved with another version of that module")
    return obj


# --- ops ---------------------------------------------------------------------------------


def state_of(instance):
    """An op's saved configuration: ``__getstate__()`` where the class defines it, else
    its attributes (``__dict__`` and set ``__slots__``)."""
    getstate = getattr(type(instance), "__getstate__", None)
    if getstate is not None and getstate is not _OBJECT_GETSTATE:
        return ("hook", instance.__getstate__())
    return ("attrs", dict(attributes(instance) or {}))


def restore(cls, state):
    """An instance of `cls` with the saved `state`; runs no ``__init__``."""
    kind, value = state
    instance = cls.__new__(cls)
    if kind == "hook" and hasattr(instance, "__setstate__"):
        instance.__setstate__(value)
        return instance
    for name, item in value.items():
        object.__setattr__(instance, name, item)
    return instance


def configuration(handle, instance) -> tuple:
    """``(class path, saved state as JSON text)`` of a handle's op, cached on the handle;
    ``(None, reason)`` when it has none."""
    if handle.saved is None:
        handle.saved = _configuration(type(instance), handle.spec.name, instance)
    return handle.saved


def _configuration(cls, name: str, instance) -> tuple:
    path = _path(cls)
    if path is None:
        where = ("inside a function" if "<locals>" in cls.__qualname__
                 else "in the __main__ script")
        return None, (f"{name} is defined {where}, so no other process can find its class. "
                      f"Define it at the top level of a module that the loading process "
                      f"imports")
    try:
        kind, value = state_of(instance)
    except Exception as error:  # noqa: BLE001 - a class may forbid saving this way
        # Every lowering asks (a recipe is optional outside jax.export), so a
        # __getstate__ that refuses only keeps the op's programs in this process.
        return None, f"{name}.__getstate__() raised {type(error).__name__}: {error}"
    what = "__getstate__()" if kind == "hook" else "attribute"
    try:
        if kind == "attrs":
            text = ["attrs", {k: encode(v, name, f"{name}.{k}") for k, v in value.items()}]
        else:
            text = ["hook", encode(value, name, f"{name}.__getstate__()")]
    except Unsaveable as error:
        return None, (f"{error.where} ({what}) holds a {type(error.value).__name__}, which a "
                      f"saved program cannot carry by value. Define __getstate__ on {name}, "
                      f"returning numbers, strings, arrays, tuples, lists, dicts or "
                      f"dataclasses of those, and __setstate__ to rebuild the op from them")
    return path, json.dumps(text, separators=(",", ":"))


def _primals_form(primals) -> list:
    form = []
    for entry in primals:
        if isinstance(entry, TreeAval):
            skeleton = jax.tree_util.tree_unflatten(entry.tree, [0] * len(entry.leaves))
            form.append(["tree", encode(skeleton, "", "input"),
                         [[list(s), np.dtype(d).name] for s, d in entry.leaves]])
            if _restored_tree(form[-1][1]) != entry.tree:
                raise Unsaveable("input", skeleton)
        else:
            shape, dtype = entry
            form.append([list(shape), np.dtype(dtype).name])
    return form


def _restored_tree(skeleton):
    return jax.tree_util.tree_structure(decode(skeleton))


def _primals_of(form) -> tuple:
    def aval(item):
        return (tuple(item[0]), _dtypes.numpy_dtype(item[1]))

    return tuple(TreeAval(_restored_tree(e[1]), tuple(aval(a) for a in e[2]))
                 if e and e[0] == "tree" else aval(e) for e in form)


def recipe(eqn, in_shapes: tuple, *, required: bool) -> str:
    """The recipe of `eqn`'s kernel at `in_shapes`; "" when it has none (or, when
    `required`, an :class:`~jaxdecl.ExportError` saying why and what to change)."""
    op = eqn.op
    path, text = configuration(op.handle, op.instance)
    if path is not None:
        try:
            primals = _primals_form(eqn.primals)
        except Unsaveable:
            path, text = None, (f"{eqn.name} takes a pytree input whose node types have no "
                                f"saved form (only tuples, lists, dicts, named tuples and "
                                f"dataclasses do)")
    if path is None:
        if required:
            raise ExportError(f"jaxdecl cannot save {eqn.name} in an exported program: "
                              f"{text}")
        return ""
    if not required and len(text) > LARGEST_IMPLICIT:
        return ""
    return json.dumps({
        "format": FORMAT, "jaxdecl": VERSION, "class": path, "state": "@STATE@",
        "rule": eqn.rule, "wrt": eqn.wrt, "primals": primals, "batch": list(eqn.batch),
        "in_shapes": [list(s) for s in in_shapes]}, separators=(",", ":")
    ).replace('"@STATE@"', text)


def read(data: bytes) -> dict:
    """A recipe's fields; :class:`~jaxdecl.ExportError` unless it is of :data:`FORMAT`.

    A jaxdecl reads only its own format. The refusal names the jaxdecl and the
    format that saved the program, this jaxdecl and its format, and what to do:
    an older format cannot be read any more, a newer one not yet.

    Example:
        >>> from jaxdecl._transforms.recipes import FORMAT, read
        >>> read(b'{"format": %d, "jaxdecl": "0.1.0"}' % FORMAT)["jaxdecl"]
        '0.1.0'
        >>> read(b'{"format": 0, "jaxdecl": "0.0.1"}')  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        jaxdecl._errors.ExportError: this program was saved by jaxdecl 0.0.1 (recipe format 0)...
    """
    try:
        fields = json.loads(data)
    except ValueError:
        fields = None
    if not isinstance(fields, dict):
        raise ExportError(f"this program carries a jaxdecl call whose recipe is not readable "
                          f"(this is jaxdecl {VERSION}, recipe format {FORMAT}): save the "
                          f"program again with jaxdecl {VERSION}")
    saved, found = fields.get("format"), fields.get("jaxdecl")
    if type(saved) is int and saved == FORMAT:
        return fields
    known = isinstance(found, str) and bool(found)
    by = f"jaxdecl {found}" if known else "an unknown jaxdecl"
    saver = by if known else "the jaxdecl that saved it"
    if type(saved) is not int:
        raise ExportError(
            f"this program was saved by {by} (no recipe format); this is jaxdecl {VERSION} "
            f"(recipe format {FORMAT}), which reads only format {FORMAT}: save the program "
            f"again with jaxdecl {VERSION}")
    if saved < FORMAT:
        raise ExportError(
            f"this program was saved by {by} (recipe format {saved}); this is jaxdecl "
            f"{VERSION} (recipe format {FORMAT}), which no longer reads format {saved}: save "
            f"the program again with jaxdecl {VERSION}, or load it with {saver}")
    raise ExportError(
        f"this program was saved by {by} (recipe format {saved}); this is jaxdecl {VERSION} "
        f"(recipe format {FORMAT}), which cannot read the newer format {saved}: load the "
        f"program with {saver}, or save it again with jaxdecl {VERSION}")


_restored: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def resolve(data: bytes) -> tuple:
    """``(slot, op instance)`` of the kernel a recipe describes, rebuilt in this process.

    The C++ call site calls it (the GIL held) when it has no live kernel for
    its fingerprint, and holds the instance (and so its kernels) for as long
    as XLA keeps the executable. Equal recipes share one restored op while it
    lives.
    """
    fields = read(data)
    cls = find(fields["class"])
    key = (fields["class"], json.dumps(fields["state"], separators=(",", ":")))
    instance = _restored.get(key)
    if instance is None:
        kind, value = fields["state"]
        state = (kind, {k: decode(v) for k, v in value.items()} if kind == "attrs"
                 else decode(value))
        instance = restore(cls, state)
        try:
            _restored[key] = instance
        except TypeError:  # cannot be weakly referenced: not shared
            pass
    op = BoundOp(handle_of(instance), instance)
    eqn = Equation(op, fields["rule"], _primals_of(fields["primals"]),
                   tuple(fields["batch"]), fields["wrt"])
    kernel, _ = eqn.kernel(tuple(tuple(s) for s in fields["in_shapes"]))
    return kernel.slot, instance


def disabled_checks() -> list:
    """What to pass as ``jax.export.export(..., disabled_checks=...)`` for jaxdecl's ops.

    JAX exports an FFI call only when its target is allowed explicitly; this
    allows jaxdecl's compiled targets (and nothing else).

    Example:
        >>> import jax, jax.export, jax.numpy as jnp, jaxdecl as jd
        >>> class Twice(jd.Primitive):  # (in a module of yours, for another process)
        ...     @jd.abstract
        ...     def shapes(self, x):
        ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
        ...     @jd.forward
        ...     def apply(self, x):
        ...         return 2 * x
        >>> twice = Twice()
        >>> exported = jax.export.export(jax.jit(twice), disabled_checks=jd.disabled_checks())(
        ...     jnp.ones(2))
        >>> exported.call(jnp.arange(2.0)).tolist()
        [0.0, 2.0]
    """
    from jax import export  # (older JAX does not import it with jax)

    return [export.DisabledSafetyCheck.custom_call(t) for t in (TARGET, SPLIT_TARGET)]


