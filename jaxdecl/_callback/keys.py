"""Which callables are the same callback: the keys that let fresh lambdas share one op.

``jd.pure_callback(lambda x: x + c, ...)`` inside an eager loop makes a new
function object on every call. Keyed by identity, each would build a new op
and kernel. Two functions with the same code object, the same globals, the
same defaults and the very same objects in their closure cells compute the
same thing, so they share a key. A bound method is its function and its
``self`` (compared by identity). Any other callable (a ufunc, a
``functools.partial``, an object with ``__call__``) is keyed by identity.

A key holds no reference to what it names: it is built from ``id()``\\ s and
checked against the op's own callable on every hit (:func:`same`), so an id
reused after its object died can never match a dead op.

Example:
    >>> from jaxdecl._callback.keys import key_of, same
    >>> def scaled(c):
    ...     return lambda x: x * c
    >>> two = 2.0
    >>> a, b = scaled(two), scaled(two)          # two function objects, one computation
    >>> a is b, key_of(a) == key_of(b), same(a, b)
    (False, True, True)
    >>> same(a, scaled(3.0))                     # another closure: another op
    False
"""

from __future__ import annotations

import types


def key_of(callback) -> tuple:
    """A hashable key: equal for callables that compute the same thing (see module)."""
    kind = type(callback)
    if kind is types.FunctionType:
        return _function_key(callback)
    if kind is types.MethodType:
        func = callback.__func__
        inner = _function_key(func) if type(func) is types.FunctionType else ("id", id(func))
        return ("method", inner, id(callback.__self__))
    return ("id", id(callback))


def _function_key(func) -> tuple:
    cells = func.__closure__
    contents = () if cells is None else tuple(id(_content(c)) for c in cells)
    kwdefaults = func.__kwdefaults__
    return ("fn", id(func.__code__), id(func.__globals__), contents,
            _ids(func.__defaults__),
            None if kwdefaults is None else tuple((k, id(v)) for k, v in kwdefaults.items()))


def _ids(values) -> tuple | None:
    return None if values is None else tuple(id(v) for v in values)


_EMPTY = object()


def _content(cell):
    try:
        return cell.cell_contents
    except ValueError:  # a cell not yet bound (a function referring to itself, say)
        return _EMPTY


def same(a, b) -> bool:
    """Whether `a` and `b` compute the same thing, by the rules :func:`key_of` keys by
    (compared object by object, so that a stale key cannot match)."""
    if a is b:
        return True
    kind = type(a)
    if kind is not type(b):
        return False
    if kind is types.FunctionType:
        return _same_function(a, b)
    if kind is types.MethodType:
        return a.__self__ is b.__self__ and (
            a.__func__ is b.__func__ or (
                type(a.__func__) is types.FunctionType
                and type(b.__func__) is types.FunctionType
                and _same_function(a.__func__, b.__func__)))
    return False


def _same_function(a, b) -> bool:
    if a.__code__ is not b.__code__ or a.__globals__ is not b.__globals__:
        return False
    if not _same_items(a.__defaults__, b.__defaults__):
        return False
    ka, kb = a.__kwdefaults__, b.__kwdefaults__
    if (ka is None) != (kb is None) or (ka is not None and (
            ka.keys() != kb.keys() or any(ka[k] is not kb[k] for k in ka))):
        return False
    ca, cb = a.__closure__, b.__closure__
    if ca is None or cb is None:
        return ca is cb
    return len(ca) == len(cb) and all(
        x is y or _content(x) is _content(y) for x, y in zip(ca, cb))


def _same_items(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def describe(callback) -> str:
    """How messages name a callback: ``numpy.sin``, ``my_module.solve``,
    ``<lambda> (my_script.py:12)``, ``Model.rhs of <Model object>``."""
    if type(callback) is types.MethodType:
        return f"{describe(callback.__func__)} of {type(callback.__self__).__name__} object"
    qualname = getattr(callback, "__qualname__", None) or getattr(callback, "__name__", None)
    if qualname is None:
        text = repr(callback)
        return text if len(text) <= 80 else text[:77] + "..."
    module = getattr(callback, "__module__", None)
    name = f"{module}.{qualname}" if module and module != "builtins" else qualname
    code = getattr(callback, "__code__", None)
    if code is not None and ("<lambda>" in qualname or "<locals>" in qualname):
        return f"{qualname.rsplit('.', 1)[-1]} ({code.co_filename}:{code.co_firstlineno})"
    return name
