"""Recipes: what a compiled call carries so that any process can rebuild its kernel.

Every ``jaxdecl_dispatch`` custom call names its kernel by fingerprint (the
fast path: a kernel this process already has) and carries a *recipe*: the
op's class (module and qualified name), its configuration saved by value
(:mod:`jaxdecl._op.configuration`: restoring never unpickles and never
imports), the rule and the shapes. A process that loads the program
(``jax.export``, ``serialize_executable``, the persistent compilation cache)
and lacks the kernel rebuilds it from the recipe when XLA instantiates the
program. The kernel registry is a cache that can always be refilled, not an
owner that must outlive every program.

Example:
    >>> from jaxdecl._transforms.recipes import FORMAT, read
    >>> read(b'{"format": %d, "jaxdecl": "0.1.0"}' % FORMAT)["jaxdecl"]
    '0.1.0'
"""

from __future__ import annotations

import json
import weakref

import jax
import numpy as np

from .. import _dtypes
from .._errors import ExportError
from .._host.registry import SPLIT_TARGET, TARGET
from .._op.configuration import Unsaveable, configuration, decode, encode, find, restore
from .._op.equation import Equation
from .._op.handle import BoundOp
from .._op.identity import handle_of
from .._spec.interface import TreeAval
from .._version import __version__ as VERSION

#: The newest recipe format this jaxdecl writes and reads, and the oldest it reads
#: (the rule is in docs/concepts/saving.md). A new format comes when what a recipe
#: holds or how its values are encoded changes (a field, a value tag, even an added
#: one); every recipe is written in the oldest format that describes it
#: (:func:`format_of`), so that a program that uses nothing newer loads in the
#: jaxdecls of that format too. A change of the kernel ABI (``_op._KERNEL_ABI``)
#: makes OLDEST the new format: a recipe rebuilds the kernel of a program compiled
#: against the ABI of its own time, so a recipe of another ABI must be refused,
#: not rebuilt.
FORMAT = 2
OLDEST = 1
#: Outside ``jax.export``, a configuration that saves to more text than this is
#: left out of compiled programs (it would weigh on every compilation); its
#: programs then run only in this process. Exported programs always carry it.
LARGEST_IMPLICIT = 1 << 20

def _signature_form(signature) -> list:
    form = []
    for entry in signature:
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


def _signature_of(form) -> tuple:
    def aval(item):
        return (tuple(item[0]), _dtypes.numpy_dtype(item[1]))

    return tuple(TreeAval(_restored_tree(e[1]), tuple(aval(a) for a in e[2]))
                 if e and e[0] == "tree" else aval(e) for e in form)


def format_of(eqn) -> int:
    """The oldest recipe format that describes `eqn`: 2 for an equation that carries some of
    the tangents or returns some of the cotangents (its ``active`` leaves), else 1."""
    return OLDEST if eqn.active is None else FORMAT


def recipe(eqn, in_shapes: tuple, *, required: bool) -> str:
    """The recipe of `eqn`'s kernel at `in_shapes`; "" when it has none (or, when
    `required`, an :class:`~jaxdecl.ExportError` saying why and what to change)."""
    op = eqn.op
    path, text = configuration(op.handle, op.instance)
    if path is not None:
        try:
            signature = _signature_form(eqn.signature)
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
    fields = {
        "format": format_of(eqn), "jaxdecl": VERSION, "class": path, "state": "@STATE@",
        # ("primals": the format's name for the signature, kept: format 1 reads it)
        "rule": eqn.rule, "wrt": eqn.wrt, "primals": signature, "batch": list(eqn.batch),
        "in_shapes": [list(s) for s in in_shapes]}
    if eqn.active is not None:  # (format 2: a format 1 recipe is one without it)
        fields["active"] = list(eqn.active)
    return json.dumps(fields, separators=(",", ":")).replace('"@STATE@"', text)


def read(data: bytes) -> dict:
    """A recipe's fields; :class:`~jaxdecl.ExportError` unless its format is one this
    jaxdecl reads (:data:`OLDEST` to :data:`FORMAT`).

    The refusal names the jaxdecl and the format that saved the program, this
    jaxdecl and its format, and what to do: an older format cannot be read any
    more, a newer one not yet.

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
    if type(saved) is int and OLDEST <= saved <= FORMAT:
        return fields
    known = isinstance(found, str) and bool(found)
    by = f"jaxdecl {found}" if known else "an unknown jaxdecl"
    saver = by if known else "the jaxdecl that saved it"
    if type(saved) is not int:
        raise ExportError(
            f"this program was saved by {by} (no recipe format); this is jaxdecl {VERSION} "
            f"(recipe format {FORMAT}), which reads formats {OLDEST} to {FORMAT}: save the "
            f"program again with jaxdecl {VERSION}")
    if saved < OLDEST:
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
    active = fields.get("active")
    eqn = Equation(op, fields["rule"], _signature_of(fields["primals"]),
                   tuple(fields["batch"]), fields["wrt"],
                   None if active is None else tuple(active))
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


