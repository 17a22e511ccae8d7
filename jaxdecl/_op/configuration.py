"""An op's configuration, saved by value: what a recipe carries of the op.

A compiled call carries its op's class (by module and qualified name) and its
configuration as JSON, never as a pickle. Safe by default: restoring never
unpickles and never imports. A recipe's classes must already be imported by
the loading process (importing the op's module is the trust boundary); values
restore by value: ``None``, numbers, strings, bytes, NumPy arrays, scalars and
dtypes (JAX arrays come back as NumPy arrays), tuples, lists, dicts, sets,
enums, named tuples and dataclasses of those, and classes or functions by
their import path. A class holding anything else says how it is saved with
``__getstate__`` (any value above) and ``__setstate__``: the hooks ``pickle``
uses. :mod:`jaxdecl._transforms.recipes` puts it in compiled programs.

Example:
    >>> import numpy as np
    >>> from jaxdecl._op.configuration import decode, encode
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

import jax
import numpy as np

from .. import _dtypes
from .._errors import ExportError
from .identity import attributes

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
