"""Residuals: what the forward keeps so that a derivative does not run it again.

An op declares with ``@jd.residuals`` the arrays its forward keeps; its
``@forward`` takes a keyword-only ``saved``; any ``@jvp``/``@vjp`` may take the
keyword-only ``saved`` (those arrays, read only) and ``result`` (the forward's
output, as the op returns it). How the values travel:

- A plain call binds the ``forward`` rule: the forward gets ``saved=None`` and
  nothing is allocated for it.
- When a derivative is taken (the jvp rule of a ``forward`` equation sees a
  tangent), :mod:`jaxdecl._transforms.autodiff` binds ``forward_saving`` instead: the
  same forward, whose results are followed by the residual leaves, which the
  rule fills through ``saved`` (writable views). The ``jvp`` equation then
  takes, after its usual operands, the forward's outputs (when some rule takes
  ``result``) and the residuals. Transposing ``jvp`` into ``vjp`` (and back)
  passes those extras along unchanged, so under ``grad`` the one
  ``forward_saving`` equation is the known part that runs once, and the
  ``vjp`` reads what it kept. ``jax.checkpoint`` recomputes it as JAX
  recomputes any primal value. An op whose rules take only ``result`` binds
  the plain forward and passes its outputs along.
- Kernels deal in flat arrays: :func:`kernel_rule` and :func:`traceable_rule`
  turn the extras back into the keyword arguments each rule asks for
  (:class:`~jaxdecl._spec.layout.Keyword`).

This module also validates the declaration (:func:`declare`), at class creation.

Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxdecl as jd
    >>> calls = []
    >>> class Exp(jd.Primitive):
    ...     @jd.abstract
    ...     def shapes(self, x):
    ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
    ...     @jd.forward
    ...     def apply(self, x):
    ...         calls.append("forward")
    ...         return np.exp(x)
    ...     @jd.vjp
    ...     def pull(self, x, ct, *, result):  # d/dx exp(x) = exp(x): the forward's result
    ...         return ct * result
    >>> float(jax.grad(Exp())(1.0)) == float(np.exp(1.0)), calls
    (True, ['forward'])
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping

import jax.numpy as jnp
import numpy as np

from .. import _compat
from .._errors import DeclarationError, RuleError
from .._spec.cfunction import CFunction
from .._spec.layout import OPERANDS, RESULTS, RuleIO
from . import kernels as _kernels
from . import structure as _structure

KEYWORDS = ("saved", "result")
_DERIVATIVES = ("jvp", "vjp")


@dataclasses.dataclass(frozen=True)
class Keeps:
    """What an op's rules take besides their operands, collected at class creation."""

    method: str | None  # the @jd.residuals method's name (None: the rules take result only)
    takes: Mapping  # rule kind ("forward", "jvp", "vjp") -> the keywords it takes
    result: bool  # jvp/vjp equations carry the forward's outputs
    saved: bool  # the op keeps residuals: jvp/vjp equations carry them


def takes_of(rule) -> frozenset:
    """The keyword-only parameters among `saved`/`result` that a rule accepts."""
    function = rule.function
    if isinstance(function, CFunction):
        return function.takes
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(name for name in KEYWORDS if name in parameters
                     and parameters[name].kind is inspect.Parameter.KEYWORD_ONLY)


def _fix(kind: str) -> str:
    return {"forward": "`def apply(self, ..., *, saved=None)`",
            "jvp": "`def push(self, ..., *, saved)`",
            "vjp": "`def pull(self, ..., *, saved)`"}[kind]


def declare(name: str, rules: dict, transposes_wrt: dict, params: tuple, linear: bool,
            input_names: Callable) -> Keeps | None:
    """Validates residuals and ``saved=``/``result=`` parameters; None when nothing uses them.

    Raises DeclarationError naming the class and the rule. `input_names` reads
    a rule's inputs as :mod:`jaxdecl._declare` does.
    """
    method = rules.get("residuals")
    takes = {kind: takes_of(rules[kind]) for kind in ("forward",) + _DERIVATIVES
             if kind in rules}
    if linear:
        if method is not None:
            raise DeclarationError(
                f"{name}.{method.name} (@residuals): {name} is linear (or multilinear), so its "
                f"derivatives are the op itself and its transpose, which need nothing the "
                f"forward could keep; remove @jd.residuals")
        for rule in [r for k, r in rules.items() if k in ("forward", "transpose", "adjoint")] \
                + list(transposes_wrt.values()):
            asked = takes_of(rule)
            if asked:
                raise DeclarationError(
                    f"{name}.{rule.name} (@{rule.kind}) takes {' and '.join(sorted(asked))}, "
                    f"but {name} is linear (or multilinear): its transpose needs nothing from "
                    f"the forward; remove the parameter")
        return None
    for kind, asked in takes.items():
        rule = rules[kind]
        if kind == "forward" and "result" in asked:  # pragma: no cover - input_names refuses it
            raise DeclarationError(f"{name}.{rule.name} (@forward) cannot take `result`")
        if "saved" in asked and method is None:
            raise DeclarationError(
                f"{name}.{rule.name} (@{kind}) takes `saved`, but {name} has no @jd.residuals "
                f"method declaring what the forward keeps; add one, e.g. `@jd.residuals def "
                f"keeps(self, {', '.join(params)}): return {{'name': "
                f"jax.ShapeDtypeStruct(shape, dtype)}}`")
    if method is not None:
        method_params = input_names(name, method)
        if method_params != params:
            raise DeclarationError(
                f"{name}.{method.name} (@residuals) takes inputs {method_params}, but the op's "
                f"inputs are {params}; they must match")
        forward = rules["forward"]
        if "saved" not in takes["forward"]:
            raise DeclarationError(
                f"{name} declares residuals ({name}.{method.name}), but {name}.{forward.name} "
                f"(@forward) does not accept `saved`: add the keyword-only parameter, "
                f"{_fix('forward')}, and fill saved[...] when it is not None")
        if not any("saved" in takes.get(kind, ()) for kind in _DERIVATIVES):
            raise DeclarationError(
                f"{name} declares residuals ({name}.{method.name}), but no @jvp or @vjp takes "
                f"`saved`: add it to the rule that uses them, e.g. {_fix('vjp')}, or remove "
                f"@jd.residuals")
    result = any("result" in takes.get(kind, ()) for kind in _DERIVATIVES)
    if method is None and not result:
        return None
    return Keeps(None if method is None else method.name, takes, result, method is not None)


# ---------------------------------------------------------------------------------------
# Kernels and traceable rules: keyword arguments from flat values
# ---------------------------------------------------------------------------------------

def _keyword_values(keywords, operands, outs) -> dict:
    values = {}
    for keyword in keywords:
        if keyword.source is None:
            values[keyword.name] = None
            continue
        packed = _structure.pack(keyword.groups, operands if keyword.source == OPERANDS
                                 else outs)
        values[keyword.name] = packed[0] if keyword.single else tuple(packed)
    return values


def settle(value, group, views, names, context: str, batch_rank: int = 0) -> None:
    """Copies residuals the rule rebound (``saved["lu"] = lu``) into their views.

    A leaf that is still the view was written in place. Anything else must have
    the declared shape and dtype; the error names the residual's key path
    (`names`, one per view, in `group`'s leaf order).
    """
    if group.tree is None:
        return  # a bare view cannot be rebound, only written
    try:
        leaves = _structure.leaves_or_none(group, value)
    except ValueError:
        expected = group.tree.unflatten(["*"] * len(group.slots))
        raise RuleError(
            f"{context} changed the structure of `saved`: it must stay like {expected} "
            f"(@residuals); write into its arrays instead") from None
    for leaf, view, name in zip(leaves, views, names):
        if leaf is view:
            continue
        array = np.asarray(leaf) if leaf is not None else None
        if array is None or not (array.shape == view.shape or _kernels._broadcasts(
                array.shape, view.shape, batch_rank)) or array.dtype != view.dtype:
            got = "None" if array is None else f"shape {array.shape} {array.dtype}"
            raise RuleError(
                f"{context} put {got} at {name}, but @residuals declared shape "
                f"{view.shape[batch_rank:]} {view.dtype}; write into the view instead "
                f"({name}[...] = value) or fix the declaration")
        np.copyto(view, array, casting="no")


def kernel_rule(function, io: RuleIO, zero_copy: bool, context: str, n_head: int,
                batch_rank: int) -> tuple:
    """``(rule, zero_copy, io)``: `function` as a rule of flat operands and results.

    Like :func:`jaxdecl._host.structure.structured_rule`, for rules with keyword
    arguments or extras (see the module docstring); the returned `io` is what
    the kernel checks results against. A ``forward_saving`` rule in the return
    form becomes a zero-copy one here: it writes its residual views itself, so
    its results are stored after it returns (`batch_rank` leading dims may
    broadcast, as :func:`jaxdecl._host.kernels.make_kernel` allows).
    """
    args_groups, result_groups, keywords = io.args, io.results, io.keywords
    single = io.single_result
    pack = _structure.pack
    saving = next((k for k in keywords if k.source == RESULTS), None)
    n_real = len(io.out_names) - (len(saving.groups[0].slots) if saving else 0)

    if saving is not None:
        real_io = dataclasses.replace(
            io, out_names=io.out_names[:n_real], out_avals=io.out_avals[:n_real],
            real_results=io.real_results[:n_real], single_result=False, keywords=())
        group = saving.groups[0]
        names = [io.out_names[s] for s in group.slots]

        def rule(*operands, out):
            head, flat = operands[:n_head], operands[n_head:]
            saved = _keyword_values(keywords, flat, out)["saved"]
            args = pack(args_groups, flat)
            if zero_copy:
                outs = pack(result_groups, out)
                returned = function(*head, *args, saved=saved,
                                    out=outs[0] if single else tuple(outs))
            else:
                returned = function(*head, *args, saved=saved)
            settle(saved, group, [out[s] for s in group.slots], names, context, batch_rank)
            if zero_copy:
                return returned
            _kernels._store(_structure.unpack(io, returned, context)[:n_real], out[:n_real],
                           real_io, context, batch_rank)
            return None

        return rule, True, dataclasses.replace(io, single_result=False)

    if zero_copy and single and not io.structured:
        # The kernel passes the one output bare, as the rule wants it.
        def rule(*operands, out):
            head, flat = operands[:n_head], operands[n_head:]
            return function(*head, *pack(args_groups, flat), out=out,
                            **_keyword_values(keywords, flat, None))

        return rule, True, io

    if zero_copy:
        def rule(*operands, out):
            head, flat = operands[:n_head], operands[n_head:]
            outs = pack(result_groups, out)
            return function(*head, *pack(args_groups, flat),
                            out=outs[0] if single else tuple(outs),
                            **_keyword_values(keywords, flat, None))

        return rule, True, dataclasses.replace(io, single_result=False)

    def rule(*operands):
        head, flat = operands[:n_head], operands[n_head:]
        returned = function(*head, *pack(args_groups, flat),
                            **_keyword_values(keywords, flat, None))
        return _structure.unpack(io, returned, context)

    return rule, False, dataclasses.replace(io, single_result=False)


def c_operands(io: RuleIO) -> tuple:
    """The operands a C rule takes: its own, then the extras it takes (result, then saved).

    ``()`` when it takes every operand the equation carries, in order; else
    their indices, for the dispatcher to pick (a C rule is never wrapped in
    Python).
    """
    if not io.n_extra:
        return ()
    n_positional = len(io.in_names) - io.n_extra
    keep = list(range(n_positional))
    for keyword in io.keywords:
        keep += [s for g in keyword.groups for s in g.slots]
    return () if len(keep) == len(io.in_names) else tuple(keep)


def traceable_rule(function, io: RuleIO, context: str):
    """A traceable rule with extras as ``f(*flat operands) -> list of flat results``."""
    keywords = io.keywords

    def evaluate(*operands):
        operands = _compat.plain_values(operands)
        returned = function(*_structure.pack(io.args, operands),
                            **_keyword_values(keywords, operands, None))
        flat = _structure.unpack(io, returned, context)
        return [jnp.zeros(*aval) if x is None else x for x, aval in zip(flat, io.out_avals)]

    return evaluate
