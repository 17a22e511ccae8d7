"""Which flat values flow in and out of each rule at one signature, checked.

Each rule of an op has a fixed order of flat operands and results (the
leaves of its :class:`~jaxdecl._spec.interface.Interface`):

==================  ============================================  ==========================
rule                operands                                      results
==================  ============================================  ==========================
``forward``         all input leaves                              all output leaves
``forward_saving``  all input leaves                              all output leaves, residuals
``jvp``             all input leaves, tangents of active leaves   tangents of float leaves
``vjp``             all input leaves, cotangents of float leaves  cotangents of active leaves
``transpose``       the inputs it is not linear in, cotangents    cotangents of active leaves
``transpose_wrt``   all inputs but ``wrt``, cotangents            cotangent of ``wrt``
==================  ============================================  ==========================

"Differentiable" means floating or complex and not in an input listed in
``nondiff=``; "float" outputs are the floating or complex ones. "Residuals"
are the leaves of what ``@jd.residuals`` declares (see :mod:`jaxdecl._spec.residuals`).
A linear op's ``transpose`` returns the cotangents of the leaves it is linear in
(for ``linear=True`` the differentiable ones) and takes every other input leaf.

*Active* leaves are an equation's ``active`` set (see :func:`active_mask`): by
default every differentiable leaf (every linear one for ``transpose``); an
equation of a ``@jvp`` declared ``zeros=True`` carries only the tangents that
are not symbolically zero (the rule gets ``None`` for the others), one of a
``@vjp`` or ``@transpose`` that takes ``wanted`` returns only the cotangents
asked for (the rule gets ``wanted``, one bool per argument it returns a
cotangent for, and may return ``None`` where it is False).
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
    keywords: tuple = ()  # Keywords: the rule's keyword-only `saved`/`result`/`wanted`
    n_extra: int = 0  # trailing operands that are extras (result, residuals), not positional
    #: The input leaves whose tangents a jvp carries, whose cotangents a vjp or transpose
    #: returns (its active leaves), in order.
    carried: tuple = ()
    linear: tuple = ()  # the operands the rule is linear (or multilinear) in


OPERANDS, RESULTS, VALUE = "operands", "results", "value"


@dataclasses.dataclass(frozen=True)
class Keyword:
    """A keyword-only argument of a rule (``saved=``, ``result=``) and where it comes from.

    `source` is :data:`OPERANDS` (read-only views of the rule's operands),
    :data:`RESULTS` (writable views of its results: the residuals a
    ``forward_saving`` kernel fills), :data:`VALUE` (the argument is `value`,
    fixed by the equation: ``wanted``), or None (the argument is ``None``: a
    plain forward's ``saved``). `groups` are over those flat values; the
    argument is the one group's value when `single`, else a tuple of them.
    """

    name: str
    groups: tuple = ()
    single: bool = True
    source: str | None = None
    value: object = None


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


def _derivative_groups(groups, has_value, active, first_position: int) -> tuple:
    """Like :func:`_tangent_groups`, for the arguments with any `has_value` leaf, but only
    the `active` leaves take positions (the others are -1: ``None`` to the rule)."""
    groups = [g for g in groups if any(has_value[s] for s in g.positions)]
    position = {leaf: first_position + k
                for k, leaf in enumerate(i for i, f in enumerate(active) if f)}
    return tuple(Group(g.tree, tuple(position.get(s, -1) for s in g.positions))
                 for g in groups)


def active_mask(interface: Interface, rule: str, active) -> tuple:
    """Per input leaf, whether equation `rule` carries its tangent (``jvp``) or returns its
    cotangent (``vjp``, ``transpose``): the leaves in `active` (input leaf indices), or
    every differentiable leaf (linear leaf, for ``transpose``) when `active` is None."""
    eligible = interface.linear if rule == TRANSPOSE else interface.diff
    if active is None:
        return tuple(eligible)
    return tuple(bool(e) and i in active for i, e in enumerate(eligible))


def active_subset(interface: Interface, rule: str, leaves) -> tuple | None:
    """The ``active`` set of an equation of `rule` that carries (returns) `leaves`: their
    sorted indices, or None when that is every one (the default)."""
    leaves = tuple(sorted(set(leaves)))
    every = interface.linear_indices if rule == TRANSPOSE else interface.diff_indices
    return None if leaves == every else leaves


def rule_io(spec, interface: Interface, rule: str, wrt: int, active=None) -> RuleIO:
    """The operands/results of `rule` at `interface` (see the module table), with the user's
    rule checked against them (:func:`check_traced`)."""
    io = _unchecked_rule_io(spec, interface, rule, wrt, active)
    io = _with_wanted(spec, interface, rule, active, io)
    check_traced(spec, interface, rule, wrt, io)
    return dataclasses.replace(io, linear=_linear_operands(spec, interface, rule, wrt, io))


def _linear_operands(spec, interface: Interface, rule: str, wrt: int, io: RuleIO) -> tuple:
    """The operands a rule is linear in (jointly; a multilinear op's forward and
    ``transpose_wrt``: in each separately)."""
    n, n_ct = len(interface.inputs), sum(interface.float_out)
    if rule == FORWARD:
        return interface.linear_indices if spec.linear else \
            interface.diff_indices if spec.multilinear else ()
    if rule == JVP:
        return tuple(range(n, n + len(io.carried)))
    if rule == VJP:
        return tuple(range(n, n + n_ct))
    if rule == TRANSPOSE:
        n_lead = len(interface.lead_indices)
        return tuple(range(n_lead, n_lead + n_ct))
    if rule == TRANSPOSE_WRT:  # the other differentiable inputs, then the cotangents
        others = [i for i in range(n) if i != wrt]
        return tuple(k for k, i in enumerate(others) if interface.diff[i]) + tuple(
            range(n - 1, n - 1 + n_ct))
    return ()  # forward_saving


def _with_wanted(spec, interface: Interface, rule: str, active, io: RuleIO) -> RuleIO:
    """A @vjp or @transpose that takes ``wanted`` gets one bool per argument it returns."""
    if rule not in (VJP, TRANSPOSE):
        return io
    user = spec.rules.get("vjp") if rule == VJP else \
        spec.rules.get("transpose") or spec.rules.get("adjoint")
    if user is None or not user.wanted:
        return io
    mask = active_mask(interface, rule, active)
    has = interface.linear if rule == TRANSPOSE else interface.diff
    wanted = tuple(any(mask[s] for s in g.positions) for g in interface.in_groups
                   if any(has[s] for s in g.positions))
    keyword = Keyword("wanted", source=VALUE, value=wanted)
    return dataclasses.replace(io, keywords=io.keywords + (keyword,))


def _unchecked_rule_io(spec, interface: Interface, rule: str, wrt: int, active) -> RuleIO:
    keeps = spec.keeps
    if keeps is None:  # no rule takes saved= or result=: the plain table
        return _rule_io(spec, interface, rule, wrt, active)
    if rule == FORWARD_SAVING:
        io = _rule_io(spec, interface, FORWARD, wrt, None)
        m, k = len(interface.outputs), len(interface.saved)
        saved = Keyword("saved", _shifted((interface.saved_group,), m), True, RESULTS)
        return dataclasses.replace(
            io, out_names=io.out_names + interface.saved_names,
            out_avals=io.out_avals + interface.saved, real_results=(False,) * (m + k),
            keywords=(saved,))
    io = _rule_io(spec, interface, rule, wrt, active)
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


def _rule_io(spec, interface: Interface, rule: str, wrt: int, active) -> RuleIO:
    n = len(interface.inputs)
    float_outs = interface.float_out_indices
    params = interface.in_groups
    structured = interface.structured
    if rule == FORWARD:
        return RuleIO(interface.input_names, interface.output_names, interface.outputs,
                      interface.single_output, (False,) * len(interface.outputs),
                      params, interface.out_groups, structured)
    mask = active_mask(interface, rule, active) if rule in (JVP, VJP, TRANSPOSE) else ()
    carried = tuple(i for i, f in enumerate(mask) if f)
    if rule == JVP:
        tangents = _derivative_groups(params, interface.diff, mask, n)
        results = _tangent_groups(interface.out_groups, interface.float_out, 0)
        in_names = interface.input_names + tuple(f"tangent of {interface.input_names[i]}"
                                                 for i in carried)
        out_names = tuple(f"tangent of {interface.output_names[j]}" for j in float_outs)
        jvp = spec.rules.get("jvp")
        # A tangent left out (None to the rule): the kernel packs the rule's arguments.
        absent = len(carried) < sum(interface.diff)
        return RuleIO(in_names, out_names, tuple(interface.outputs[j] for j in float_outs),
                      len(results) == 1, (False,) * len(out_names),
                      params + tangents, results, structured or absent,
                      zeros_ok=jvp is not None and jvp.zeros, carried=carried)
    if rule in (VJP, TRANSPOSE):
        ct_names = tuple(f"cotangent of {interface.output_names[j]}" for j in float_outs)
        has = interface.diff
        if rule == VJP:
            lead = params
            lead_names = interface.input_names
        else:
            has = interface.linear
            lead = _transpose_leads(spec, interface)
            lead_names = tuple(interface.input_names[i] for i in interface.lead_indices)
        cts = _tangent_groups(interface.out_groups, interface.float_out, len(lead_names))
        groups = _derivative_groups(params, has, mask, 0)
        avals = tuple(interface.inputs[i] for i in carried)
        real = tuple(not np.issubdtype(dtype, np.complexfloating) for _, dtype in avals)
        out_names = tuple(f"cotangent of {interface.input_names[i]}" for i in carried)
        # Where some argument's cotangent is not asked for, the kernel picks the results
        # out of what the rule returns (see jaxdecl._host.structure.unpack).
        dropped = len(carried) < sum(has)
        return RuleIO(lead_names + ct_names, out_names, avals, len(groups) == 1, real,
                      tuple(lead) + cts, groups, structured or dropped, zeros_ok=True,
                      carried=carried)
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


def _transpose_leads(spec, interface: Interface) -> tuple:
    """The groups of a linear op's transpose's lead operands: every argument without a
    linear leaf, over consecutive positions."""
    lead, position = [], 0
    for g in interface.in_groups:
        if any(interface.linear[s] for s in g.positions):
            if not all(interface.linear[s] for s in g.positions):
                name = spec.params[interface.leaf_param[g.positions[0]]]
                declared = f"linear in {name!r}, but that input" if spec.partly_linear else \
                    f"linear=True, but input {name!r}"
                raise RuleError(
                    f"{spec.name} is {declared} mixes differentiable and integer (or nondiff) "
                    f"leaves; pass the integer leaves as a separate nondiff= input")
            continue
        lead.append(Group(g.tree, tuple(range(position, position + len(g.positions)))))
        position += len(g.positions)
    return tuple(lead)


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
    has = interface.linear if rule_kind == TRANSPOSE else interface.diff
    with_tangent = [spec.params[k] for k, g in enumerate(interface.in_groups)
                    if any(has[s] for s in g.positions)]
    if rule_kind == TRANSPOSE and not spec.partly_linear:
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
        what = "the inputs it is not linear in" if spec.partly_linear else \
            "the inputs without a tangent"
        return without + cts, (f"{what} ({', '.join(without) or 'none'}), then {per_output}")
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
        f"linear=True, nondiff=({listed},))` (or @jd.primitive(..., nondiff=...)), or, to "
        f"differentiate {spec.name} in {it} through @jvp/@vjp, name only the inputs it is "
        f"linear in: linear=(...); if {spec.name} is linear in {it}, drop {it} from the "
        f"signature")
