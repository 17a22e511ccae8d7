"""Which op instances are one configuration, and the handle each configuration has.

Two instances share compiled code when their configurations are equal: by the
class's own ``__eq__``/``__hash__`` where it defines them, else by their
attributes (``__dict__`` and set ``__slots__``, typed: 1, 1.0 and True differ)
when those are hashable, else by identity. Keys never keep an instance alive. A class
whose configuration cannot be hashed warns at its second instance (once): each new
instance then builds its kernels anew, and the fix is the user's.
:func:`handle_of` gives an instance its configuration's
:class:`~jaxdecl._op.handle.OpHandle` (made on first use, with its
fingerprint), and keeps it while an instance of that configuration lives.

Example:
    >>> class Scale:  # (any class: the key reads only the configuration)
    ...     def __init__(self, factor):
    ...         self.factor = factor
    >>> config_key(Scale(2.0))[0] == config_key(Scale(2.0))[0]
    True
    >>> config_key(Scale(2.0))[0] == config_key(Scale(2))[0]  # typed
    False
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
import weakref

import jax
import numpy as np

from .. import _compat
from . import fingerprint as _fingerprint
from .handle import OpHandle

_by_fingerprint: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class _WeakKey:
    """A dict key that stands for an instance without keeping it alive.

    By identity, or by the class's own ``__eq__``/``__hash__``. A key whose
    instance is gone equals nothing, so a reused ``id`` never finds the handle
    of a dead op.
    """

    __slots__ = ("ref", "hash", "by_identity")

    def __init__(self, instance, by_identity: bool):
        self.ref = weakref.ref(instance)
        self.by_identity = by_identity
        self.hash = id(instance) if by_identity else hash((type(instance), instance))

    def __hash__(self):
        return self.hash

    def __eq__(self, other):
        if type(other) is not _WeakKey or other.by_identity != self.by_identity:
            return False
        a, b = self.ref(), other.ref()
        if a is None or b is None:
            return False
        if self.by_identity:
            return a is b
        return type(a) is type(b) and bool(a == b)


def _weak_or_strong_key(instance, by_identity: bool):
    try:
        return _WeakKey(instance, by_identity)
    except TypeError:  # no __weakref__: such instances are kept for good (see _anchor)
        return ("id", id(instance)) if by_identity else ("eq", type(instance), instance)


_declared_slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # class -> names


def declared_slots(cls) -> tuple:
    """The (mangled) names of every ``__slots__`` entry of `cls` and its bases."""
    names = _declared_slots.get(cls)
    if names is None:
        names = []
        for klass in cls.__mro__:
            slots = vars(klass).get("__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if name in ("__dict__", "__weakref__"):
                    continue
                if name.startswith("__") and not name.endswith("__"):
                    name = f"_{klass.__name__.lstrip('_')}{name}"  # name mangling
                names.append(name)
        names = _declared_slots[cls] = tuple(names)
    return names


def attributes(instance) -> dict | None:
    """The instance's configuration: its ``__dict__`` and the ``__slots__`` it has set."""
    names = declared_slots(type(instance))
    attributes = getattr(instance, "__dict__", None)
    if not names:
        return attributes
    merged = dict(attributes or {})
    for name in names:
        try:
            merged[name] = getattr(instance, name)
        except AttributeError:  # a slot not set
            pass
    return merged


def config_key(instance):
    """``(key, items)``: equal keys <=> instances share compiled code.

    A class's own ``__eq__``/``__hash__`` decide where it defines them;
    otherwise the instance attributes are compared when they are all hashable,
    and identity is used when they are not.

    `items` are the (name, type, value) triples of the configuration, for the
    fingerprint; None when the op is keyed by identity.
    """
    cls = type(instance)
    values = attributes(instance)
    items = None
    if values is not None:
        # Typed, so that 1, 1.0 and True are different configurations.
        items = tuple(sorted((name, type(value), value) for name, value in values.items()))
        if any(getattr(value, "__self__", None) is instance for _, _, value in items):
            # A bound method of the op itself: a value key would hold the op for good.
            return _weak_or_strong_key(instance, True), None
    if cls.__eq__ is not object.__eq__ or cls.__hash__ is not object.__hash__:
        try:
            hash(instance)
        except TypeError:
            return _weak_or_strong_key(instance, True), None
        return _weak_or_strong_key(instance, False), items
    if items is None:
        return _weak_or_strong_key(instance, True), None
    try:
        hash(items)
    except TypeError:
        return _weak_or_strong_key(instance, True), None
    return ("attrs", cls, items), items


def claim_fingerprint(handle, cls, items) -> str:
    """The configuration part of kernel fingerprints, unique among live handles."""
    text = _fingerprint.configuration_token(cls, items)
    owner = _by_fingerprint.get(text)
    if owner is not None and owner is not handle:
        # Another live handle has the same text (two classes with one qualified
        # name, or a class whose __eq__ tells apart what its attributes do not).
        text = f"{text}|{_fingerprint.process_unique()}"
    _by_fingerprint[text] = handle
    return text


def _is_traced(value) -> bool:
    """`value` is a JAX tracer, or a pytree (list, dict, Module, ...) holding one."""
    if isinstance(value, _compat.Tracer):
        return True
    if isinstance(value, (int, float, complex, str, bytes, np.ndarray, jax.Array, type)) \
            or value is None:
        return False
    try:
        return any(isinstance(leaf, _compat.Tracer) for leaf in jax.tree_util.tree_leaves(value))
    except Exception:  # noqa: BLE001 - an exotic object is no pytree of tracers
        return False


def check_static(spec, instance) -> None:
    """Raises TypeError when the op's configuration, or a rule's closure, holds a tracer.

    The rules run on the host, outside the trace, and read the configuration
    there: a traced value (an array field of an equinox.Module op passed
    through ``eqx.filter_jit``, an op built from a traced value, a rule closing
    over one) cannot be read, and would fail later inside XLA.
    """
    for name, value in (attributes(instance) or {}).items():
        if _is_traced(value):
            raise TypeError(
                f"{spec.name}: the op's configuration attribute {name!r} is a JAX tracer: "
                f"it is traced by the function that calls the op (jax.jit or "
                f"eqx.filter_jit over an op with an array field, or an op built from a "
                f"traced value). Configuration is static (the rules read it on the host), so "
                f"either pass {name!r} as an input of the op (a parameter of @abstract and "
                f"the rules; list it in nondiff= if it is not differentiated: the way for "
                f"large arrays), or mark it static (`{name}: ... = eqx.field(static=True)` "
                f"on an equinox field; or close over the op instead of passing it to the "
                f"traced function)")
    for rule in list(spec.rules.values()) + list(spec.transposes_wrt.values()):
        code = getattr(rule.function, "__code__", None)
        cells = getattr(rule.function, "__closure__", None) or ()
        for variable, cell in zip(getattr(code, "co_freevars", ()), cells):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if _is_traced(value):
                raise TypeError(
                    f"{spec.name}.{rule.name} (@{rule.kind}) closes over {variable!r}, a "
                    f"JAX tracer of the function being traced; the rule runs on the host "
                    f"and cannot read it. Either pass {variable!r} as an input of the op "
                    f"(list it in nondiff= if it is not differentiated), or make it static: "
                    f"a NumPy array or Python value computed outside the traced function")


# ---------------------------------------------------------------------------------------
# The handle of an instance's configuration
# ---------------------------------------------------------------------------------------

_lock = threading.RLock()
_live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # config key -> handle
_anchors: dict = {}  # id(instance) -> (its handle, its attributes then), while it lives
_unanchorable: list = []  # instances that cannot be weakly referenced: kept for good


def spec_of(op):
    """The OpSpec of a jaxdecl op (instance) or class; TypeError otherwise."""
    spec = getattr(op, "__jaxdecl_spec__", None)
    if spec is None:
        raise TypeError(f"{op!r} is not a jaxdecl primitive (subclass jd.Primitive or use "
                        f"@jd.primitive)")
    return spec


def _anchor(instance, handle: OpHandle, values) -> None:
    """Keeps `handle` alive while `instance` lives, and no longer; remembers the
    attribute values it was keyed by (see :func:`handle_of`)."""
    first = id(instance) not in _anchors
    # Only values that cannot refer back to the instance are remembered (a bound
    # method of the op would keep it alive for good); other configurations take
    # the slow path each time.
    # (A class may vouch for its instances, as jd.pure_callback's ops do: their attributes
    # are set once, in __init__, and none refers back to the op.)
    simple = values is not None and (getattr(type(instance), "_jaxdecl_fixed_", False)
                                     or all(_simple(v) for v in values.values()))
    # The class, when its instances' __dict__ is their whole configuration: then
    # handle_of reads that dict directly (see attributes).
    cls = type(instance)
    plain = cls if not declared_slots(cls) and hasattr(instance, "__dict__") else None
    _anchors[id(instance)] = (handle, dict(values) if simple else None, plain)
    if first:
        try:
            finalizer = weakref.finalize(instance, _anchors.pop, id(instance), None)
            finalizer.atexit = False
        except TypeError:  # cannot be weakly referenced
            _unanchorable.append(instance)


def handle_of(instance) -> OpHandle:
    """The shared handle of an op instance's configuration (created on first use).

    Looked up from the configuration on every call rather than cached on the
    instance: a cache attribute would change the pytree and equality of
    dataclass-like ops (equinox, nifty.re), and configuration set after a first
    use (nifty.re models evaluate themselves inside __init__) must count. The
    common case is an instance whose attributes are the very objects its
    handle was found by: then the handle is its anchor's, with no key to build.
    """
    anchored = _anchors.get(id(instance))
    if anchored is None:
        values = attributes(instance)
    else:
        handle, seen, plain = anchored
        values = instance.__dict__ if type(instance) is plain else attributes(instance)
        if seen is not None and values is not None and len(seen) == len(values):
            # A plain loop: this runs on every eager call, and a generator costs more.
            for name, value in seen.items():
                if values.get(name, _MISSING) is not value:
                    break
            else:
                return handle
    key, items = config_key(instance)
    handle = _live.get(key)
    if handle is None:
        spec = spec_of(instance)
        with _lock:
            handle = _live.get(key)
            if handle is None:
                check_static(spec, instance)
                handle = OpHandle(spec)
                handle.fingerprint = claim_fingerprint(handle, type(instance), items)
                _live[key] = handle
                if items is None:
                    _identity_keyed(spec, instance)
    _anchor(instance, handle, values)
    return handle


# ---------------------------------------------------------------------------------------
# Configurations that cannot be hashed
# ---------------------------------------------------------------------------------------

_by_identity: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # class -> handles made


def _identity_keyed(spec, instance) -> None:
    """Counts the handles made for instances of a class keyed by identity, and warns
    once per class, at the second: each new instance is then a configuration of its
    own, although its attributes may be the same as the first's."""
    cls = type(instance)
    made = _by_identity[cls] = _by_identity.get(cls, 0) + 1
    if made != 2:
        return
    cause, arrays = _unhashable(instance)
    if cause is None:  # keyed by identity by design (a bound method of the op itself)
        return
    as_input = (" (an array can also be an input of the op, listed in nondiff=)"
                if arrays else "")
    warnings.warn(
        f"{spec.name}: {cause}, so jaxdecl tells its instances apart by identity: every new "
        f"instance is a configuration of its own, whose kernels are built again (an eager "
        f"call of a new instance takes several times as long as one of a reused instance) "
        f"and whose jitted programs compile again. Define __eq__ and __hash__ on "
        f"{cls.__name__} (over what the rules read), or create the op once and reuse the "
        f"instance{as_input}", UserWarning, stacklevel=_caller_level())


def _unhashable(instance) -> tuple:
    """``(what keeps `instance`'s configuration from being hashed, in words, or None;
    whether an array attribute does)``."""
    cls = type(instance)
    values = attributes(instance) or {}
    arrays = any(isinstance(v, (np.ndarray, jax.Array)) for v in values.values())
    if cls.__eq__ is not object.__eq__ or cls.__hash__ is not object.__hash__:
        if cls.__hash__ is None:
            return f"{cls.__name__} defines __eq__ but no __hash__", arrays
        try:
            hash(instance)
        except TypeError as error:
            return f"hash() of a {cls.__name__} raises TypeError ({error})", arrays
        return None, arrays
    names = []
    for name, value in values.items():
        try:
            hash(value)
        except TypeError:
            names.append(f"{name!r} (a {type(value).__name__})")
    if not names:
        return None, arrays
    return (f"its configuration attribute{'s' if len(names) > 1 else ''} "
            f"{', '.join(names)} cannot be hashed"), arrays


_OWN_FILES = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # jaxdecl
              os.path.dirname(os.path.abspath(jax.__file__)) + os.sep)


def _caller_level() -> int:
    """The ``stacklevel`` that points a warning at the user's code, past jaxdecl and JAX."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_FILES):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


_MISSING = object()
_ATOMS = (int, float, complex, str, bytes, type(None), np.ndarray, np.generic, np.dtype,
          jax.Array)


def _simple(value) -> bool:
    """A value that holds no reference to other Python objects (bar its own data)."""
    if isinstance(value, tuple):
        return all(_simple(v) for v in value)
    return isinstance(value, _ATOMS) and not isinstance(value, _compat.Tracer) and \
        not (isinstance(value, np.ndarray) and value.dtype.hasobject)
