"""Rules that take ``saved=`` or ``result=``, as functions of flat values.

A ``jvp``/``vjp`` equation of an op with residuals (or whose rules read the
forward's ``result``) carries extras after its usual operands, and a
``forward_saving`` equation fills the residuals after its outputs (see
:mod:`jaxdecl._spec.residuals` for how they travel). Kernels and traceable
rules deal in flat values; :func:`kernel_rule` and :func:`traceable_rule` hand
each rule the keyword arguments it asks for, and :func:`settle` checks what a
forward wrote into ``saved``. A C rule is never wrapped: :func:`c_operands`
says which operands the dispatcher passes it.

Example:
    >>> from jaxdecl._host.keyword_rules import c_operands
    >>> from jaxdecl._spec.rule_io import RuleIO
    >>> c_operands(RuleIO(in_names=("x", "ct"), out_names=("ct_x",), out_avals=(),
    ...                   single_result=True, real_results=(False,)))
    ()
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import _compat
from .._errors import RuleError
from .._spec.rule_io import OPERANDS, RESULTS, VALUE, RuleIO
from . import kernels as _kernels
from . import structure as _structure


def _keyword_values(keywords, operands, outs) -> dict:
    values = {}
    for keyword in keywords:
        if keyword.source is None or keyword.source == VALUE:
            values[keyword.name] = keyword.value
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
        expected = group.tree.unflatten(["*"] * len(group.positions))
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
    n_real = len(io.out_names) - (len(saving.groups[0].positions) if saving else 0)

    if saving is not None:
        real_io = dataclasses.replace(
            io, out_names=io.out_names[:n_real], out_avals=io.out_avals[:n_real],
            real_results=io.real_results[:n_real], single_result=False, keywords=())
        group = saving.groups[0]
        names = [io.out_names[s] for s in group.positions]

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
            settle(saved, group, [out[s] for s in group.positions], names, context, batch_rank)
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
        keep += [s for g in keyword.groups for s in g.positions]
    return () if len(keep) == len(io.in_names) else tuple(keep)


def traceable_rule(function, io: RuleIO, context: str, symbolic: bool = False):
    """A traceable rule with keyword arguments or extras as ``f(*flat operands) -> list of
    flat results`` (None results left None where `symbolic`, else zeros)."""
    keywords = io.keywords

    def evaluate(*operands):
        operands = _compat.plain_values(operands)
        returned = function(*_structure.pack(io.args, operands),
                            **_keyword_values(keywords, operands, None))
        return _structure.filled(_structure.unpack(io, returned, context), io, symbolic)

    return evaluate
