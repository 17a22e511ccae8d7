"""Which flat values flow in and out of each rule at one signature, checked.

Each rule of an op has a fixed order of flat operands and results (the
leaves of its :class:`~jaxdecl._spec.interface.Interface`):

==================  ============================================  ==========================
rule                operands                                      results
==================  ============================================  ==========================
``forward``         all input leaves                              all output leaves
``forward_saving``  all input leaves                              all output leaves, residuals
``jvp``             all input leaves, tangents of diff. leaves    tangents of float leaves
``vjp``             all input leaves, cotangents of float leaves  cotangents of diff. leaves
``transpose``       non-differentiable inputs, cotangents         cotangents of diff. leaves
``transpose_wrt``   all inputs but ``wrt``, cotangents            cotangent of ``wrt``
==================  ============================================  ==========================

"Differentiable" means floating or complex and not in an input listed in
``nondiff=``; "float" outputs are the floating or complex ones. "Residuals"
are the leaves of what ``@jd.residuals`` declares (see :mod:`jaxdecl._spec.residuals`).
An op whose derivative rules take ``result=`` or ``saved=`` has its ``jvp``
and ``vjp`` operands followed by *extras*: all output leaves (when some rule
takes ``result``), then the residuals (when the op declares them). The rules
receive them as keyword arguments, :class:`Keyword` says how.

A :class:`RuleIO` is one rule's: its operands' and results' names and avals,
how the rule's arguments are built from them (:class:`~jaxdecl._spec.interface.Group`)
and its keyword arguments (:class:`Keyword`). :func:`rule_io` makes one and
checks the user's rule against it (:func:`check_traced`): how many tangents
or cotangents a rule takes depends on the dtypes, so that count is checked
the first time a rule is traced at some input types.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .._errors import DeclarationError, RuleError
from .interface import (
    FORWARD,
    FORWARD_SAVING,
    JVP,
    TRANSPOSE,
    TRANSPOSE_WRT,
    VJP,
    Group,
    Interface,
    bare_group,
)
from .signatures import decorator_label, parameters, suggested_def


@dataclasses.dataclass(frozen=True)
class RuleIO:
    """Operands and results of one rule: flat names and avals, and their grouping."""

    in_names: tuple  # per flat operand
    out_names: tuple  # per flat result
    out_avals: tuple  # per flat result
    single_result: bool  # the rule returns one value (array or pytree) rather than a tuple
    real_results: tuple  # per flat result: a real cotangent (a complex return keeps .real)
    args: tuple = ()  # Groups: how the rule's arguments are built from operands
    results: tuple = ()  # Groups: how its return value maps to flat results
    structured: bool = False  # some group is a pytree: see jaxdecl._host.structure
    zeros_ok: bool = False  # None stands for a zero result (cotangents)
    keywords: tuple = ()  # Keywords: the rule's keyword-only `saved`/`result` arguments
    n_extra: int = 0  # trailing operands that are extras (result, residuals), not positional


OPERANDS, RESULTS = "operands", "results"


@dataclasses.dataclass(frozen=True)
class Keyword:
    """A keyword-only argument of a rule (``saved=``, ``result=``) and where it comes from.

    `source` is :data:`OPERANDS` (read-only views of the rule's operands),
    :data:`RESULTS` (writable views of its results: the residuals a
    ``forward_saving`` kernel fills), or None (the argument is ``None``: a
    plain forward's ``saved``). `groups` are over those flat values; the
    argument is the one group's value when `single`, else a tuple of them.
    """

    name: str
    groups: tuple = ()
    single: bool = True
    source: str | None = None


def _shifted(groups, offset: int) -> tuple:
    return tuple(Group(g.tree, tuple(s + offset for s in g.positions)) for g in groups)


def _tangent_groups(groups, has_tangent, first_position: int) -> tuple:
    """Groups of the tangents of `groups` (those with any tangent-carrying leaf).

    Tangent-carrying leaves take consecutive positions from `first_position` in leaf
    order; the others are -1 (``None`` in the rule's pytree).
    """
    position = {leaf: first_position + k
                for k, leaf in enumerate(i for i, f in enumerate(has_tangent) if f)}
    return tuple(Group(g.tree, tuple(position.get(s, -1) for s in g.positions))
                 for g in groups if any(has_tangent[s] for s in g.positions))


def rule_io(spec, interface: Interface, rule: str, wrt: int) -> RuleIO:
    """The operands/results of `rule` at `interface` (see the module table), with the user's
    rule checked against them (:func:`check_traced`)."""
    io = _unchecked_rule_io(spec, interface, rule, wrt)
    check_traced(spec, interface, rule, wrt, io)
    return io


def _unchecked_rule_io(spec, interface: Interface, rule: str, wrt: int) -> RuleIO:
    keeps = spec.keeps
    if keeps is None:  # no rule takes saved= or result=: the plain table
        return _rule_io(spec, interface, rule, wrt)
    if rule == FORWARD_SAVING:
        io = _rule_io(spec, interface, FORWARD, wrt)
        m, k = len(interface.outputs), len(interface.saved)
        saved = Keyword("saved", _shifted((interface.saved_group,), m), True, RESULTS)
        return dataclasses.replace(
            io, out_names=io.out_names + interface.saved_names,
            out_avals=io.out_avals + interface.saved, real_results=(False,) * (m + k),
            keywords=(saved,))
    io = _rule_io(spec, interface, rule, wrt)
    takes = keeps.takes.get(rule, frozenset())
    if rule == FORWARD:
        return dataclasses.replace(io, keywords=(Keyword("saved"),)) if takes else io
    if rule not in (JVP, VJP):
        return io
    names, keywords = list(io.in_names), []
    if keeps.result:  # every output leaf, integers too: the op's whole return value
        groups = _shifted(interface.out_groups, len(names))
        if "result" in takes:
            keywords.append(Keyword("result", groups, interface.single_output, OPERANDS))
        names += [f"result {name}" for name in interface.output_names]
    if keeps.saved:
        group = _shifted((interface.saved_group,), len(names))
        if "saved" in takes:
            keywords.append(Keyword("saved", group, True, OPERANDS))
        names += list(interface.saved_names)
    return dataclasses.replace(io, in_names=tuple(names), keywords=tuple(keywords),
                               n_extra=len(names) - len(io.in_names))


def _rule_io(spec, interface: Interface, rule: str, wrt: int) -> RuleIO:
    n = len(interface.inputs)
    diff, float_outs = interface.diff_indices, interface.float_out_indices
    params = interface.in_groups
    structured = interface.structured
    if rule == FORWARD:
        return RuleIO(interface.input_names, interface.output_names, interface.outputs,
                      interface.single_output, (False,) * len(interface.outputs),
                      params, interface.out_groups, structured)
    if rule == JVP:
        tangents = _tangent_groups(params, interface.diff, n)
        results = _tangent_groups(interface.out_groups, interface.float_out, 0)
        in_names = interface.input_names + tuple(f"tangent of {interface.input_names[i]}"
                                                 for i in diff)
        out_names = tuple(f"tangent of {interface.output_names[j]}" for j in float_outs)
        return RuleIO(in_names, out_names, tuple(interface.outputs[j] for j in float_outs),
                      len(results) == 1, (False,) * len(out_names),
                      params + tangents, results, structured)
    if rule in (VJP, TRANSPOSE):
        ct_names = tuple(f"cotangent of {interface.output_names[j]}" for j in float_outs)
        if rule == VJP:
            lead = params
            lead_names = interface.input_names
        else:
            lead, position = [], 0
            for g in params:
                if any(interface.diff[s] for s in g.positions):
                    if not all(interface.diff[s] for s in g.positions):
                        raise RuleError(
                            f"{spec.name} is linear=True, but input "
                            f"{spec.params[interface.leaf_param[g.positions[0]]]!r} mixes "
                            f"differentiable and integer (or nondiff) leaves; pass the "
                            f"integer leaves as a separate nondiff= input")
                    continue
                lead.append(Group(g.tree, tuple(range(position, position + len(g.positions)))))
                position += len(g.positions)
            lead = tuple(lead)
            lead_names = tuple(interface.input_names[i] for i in interface.nondiff_indices)
        cts = _tangent_groups(interface.out_groups, interface.float_out, len(lead_names))
        groups = _tangent_groups(params, interface.diff, 0)
        avals = tuple(interface.inputs[i] for i in diff)
        real = tuple(not np.issubdtype(dtype, np.complexfloating) for _, dtype in avals)
        out_names = tuple(f"cotangent of {interface.input_names[i]}" for i in diff)
        return RuleIO(lead_names + ct_names, out_names, avals, len(groups) == 1, real,
                      tuple(lead) + cts, groups, structured, zeros_ok=True)
    if rule == TRANSPOSE_WRT:  # multilinear ops take arrays only (see interface_of)
        lead = tuple(p for i, p in enumerate(interface.input_names) if i != wrt)
        cts = tuple(f"cotangent of {interface.output_names[j]}" for j in float_outs)
        aval = interface.inputs[wrt]
        args = tuple(bare_group(k) for k in range(len(lead))) + _tangent_groups(
            interface.out_groups, interface.float_out, len(lead))
        return RuleIO(lead + cts, (f"cotangent of {interface.input_names[wrt]}",), (aval,), True,
                      (not np.issubdtype(aval[1], np.complexfloating),), args, (bare_group(0),),
                      structured, zeros_ok=True)
    raise ValueError(f"unknown rule {rule!r}")  # pragma: no cover - internal


def check_traced(spec, interface, rule_kind: str, wrt: int, io) -> None:
    """Checks a rule's arity at the input types of one trace (counts that depend on dtypes).

    `io` is the rule's :class:`RuleIO`: one argument per group. A mismatch is a
    DeclarationError naming the rule and the signature it should have.
    """
    if rule_kind == FORWARD:
        return  # named like @abstract, checked when the class was created
    if rule_kind == TRANSPOSE:
        rule = spec.rules.get("transpose") or spec.rules.get("adjoint")
    elif rule_kind == TRANSPOSE_WRT:
        rule = spec.transposes_wrt.get(spec.params[wrt])
    else:
        rule = spec.rules.get(rule_kind)
    found = None if rule is None else parameters(rule.function)
    if found is None or found.varargs or len(found.positional) - 1 == len(io.args):
        return
    # Which inputs (outputs) carry a tangent (cotangent) at these types.
    with_tangent = [spec.params[k] for k, g in enumerate(interface.in_groups)
                    if any(interface.diff[s] for s in g.positions)]
    if rule_kind == TRANSPOSE:
        _refuse_differentiated_leads(spec, rule, found, with_tangent)
    expected, why = _expected_arguments(spec, interface, rule_kind, wrt, with_tangent)
    raise DeclarationError(
        f"{spec.name}.{rule.name} ({decorator_label(rule)}) takes "
        f"({', '.join(found.positional)}), but at these input types jaxdecl passes {why}: "
        f"{suggested_def(rule, expected)}")


def _expected_arguments(spec, interface, rule_kind: str, wrt: int, with_tangent: list) -> tuple:
    """``(names, why)``: the arguments jaxdecl passes a rule at these types, and in words."""
    without = [p for p in spec.params if p not in with_tangent]
    outputs = [k for k, g in enumerate(interface.out_groups)
               if any(interface.float_out[s] for s in g.positions)]
    cts = ["ct"] if len(outputs) == 1 else [f"ct{k}" for k in outputs]
    per_output = f"one cotangent per floating or complex output ({len(outputs)} here)"
    if rule_kind == JVP:
        ints = [p for p in without if p not in spec.nondiff]
        note = "" if not ints else (
            f"; {', '.join(ints)} is an integer input here, which takes no tangent"
            if len(ints) == 1 else
            f"; {', '.join(ints)} are integer inputs here, which take no tangent")
        return list(spec.params) + ["d" + p for p in with_tangent], (
            f"the op's inputs ({', '.join(spec.params)}), then one tangent per input with a "
            f"floating or complex value not in nondiff= ({', '.join(with_tangent)}){note}")
    if rule_kind == VJP:
        return list(spec.params) + cts, (
            f"the op's inputs ({', '.join(spec.params)}), then {per_output}")
    if rule_kind == TRANSPOSE:
        return without + cts, (
            f"the inputs without a tangent ({', '.join(without) or 'none'}), then {per_output}")
    return [p for p in spec.params if p != spec.params[wrt]] + cts, (
        f"every input but {spec.params[wrt]!r}, then {per_output}")


def _refuse_differentiated_leads(spec, rule, found, with_tangent: list) -> None:
    """A transpose that takes a floating input as a leading parameter: almost always an
    input the op is not linear in (coordinates), which nondiff= declares."""
    named = [p for p in found.positional[1:] if p in with_tangent]
    if not named or len(with_tangent) <= len(named):
        return
    listed = ", ".join(repr(p) for p in named)
    it = "it" if len(named) == 1 else "them"
    raise DeclarationError(
        f"{spec.name}.{rule.name} ({decorator_label(rule)}) takes {listed}, "
        f"{'a floating input' if len(named) == 1 else 'floating inputs'} of {spec.name} that "
        f"jaxdecl differentiates: a linear op's transpose receives only the inputs it is not "
        f"linear in. Declare {it} non-differentiable: `class {spec.name}(jd.Primitive, "
        f"linear=True, nondiff=({listed},))` (or @jd.primitive(..., nondiff=...)); if "
        f"{spec.name} is linear in {it}, drop {it} from the signature")
