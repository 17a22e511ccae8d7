"""Forward-mode rules of the ``jaxdecl_call`` primitive: the jvp of every equation.

The wiring that gives an opaque function both modes: the forward rule's JVP
binds the ``jvp`` rule, linear in the tangents; transposing that binds the
``vjp`` rule, linear in the cotangents; transposing *that* binds ``jvp`` again
(:mod:`jaxdecl._transforms.transposition`). Linear ops map forward <->
``transpose``; multilinear ops map forward <-> ``transpose_wrt`` one input at a
time. Each rule is linear (or multilinear) in some operands (its "linear
operands"); a tangent on any other operand needs a second derivative
(:mod:`jaxdecl._transforms.second_order`).

A partly linear op (``linear=("strengths",)``) takes both paths: the forward's
tangent with respect to its linear inputs is the forward applied to their
tangents (no @jvp runs), with respect to the others its ``jvp`` rule.

Symbolic zeros stay symbolic where a rule can take them: a ``jvp`` equation
of a ``@jvp(zeros=True)`` carries only the tangents that are not zero (its
``active`` leaves, see :func:`jaxdecl._spec.rule_io.active_mask`; the op's
``zero_tangents``); one of a ``@vjp`` that takes ``wanted`` returns only the
cotangents asked for (see :mod:`jaxdecl._transforms.transposition`). Elsewhere
zeros are instantiated, as a rule without ``zeros=True`` expects them.

An op whose rules take ``saved=`` or ``result=`` binds ``forward_saving`` (or
the plain forward, for ``result`` alone) *before* its ``jvp`` and passes the
forward's outputs and residuals to the ``jvp``/``vjp`` equations as extras
(see :mod:`jaxdecl._spec.residuals`): one forward per derivative.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import _compat
from .._errors import MissingRuleError, missing_rule
from .._spec.interface import FORWARD, FORWARD_SAVING, JVP, TRANSPOSE, TRANSPOSE_WRT, VJP
from .._spec.rule_io import active_subset
from . import second_order as _second_order
from .primitive import bind, broadcast_vmapped, jaxdecl_p

Zero = _compat.Zero


def _is_zero(t) -> bool:
    return type(t) is Zero


def _is_float0(t) -> bool:
    return not _is_zero(t) and getattr(t, "dtype", None) == jax.dtypes.float0


# ---------------------------------------------------------------------------------------
# The jvp rule
# ---------------------------------------------------------------------------------------

def _check_nondiff(op, interface, tangents, inputs=None) -> None:
    """A tangent on a nondiff= input is an error, never silently dropped.

    `tangents[k]` belongs to primal input `inputs[k]` (default: input k).
    """
    inputs = range(len(tangents)) if inputs is None else inputs
    for index, tangent in zip(inputs, tangents):
        if not interface.diff[index] and not _is_zero(tangent) and not _is_float0(tangent):
            name = op.spec.params[interface.leaf_param[index]]
            raise ValueError(
                f"{op.spec.name}: input {name!r} is declared nondiff=, so jaxdecl cannot "
                f"differentiate with respect to it (a value that depends on what you "
                f"differentiate flows into it); wrap it in jax.lax.stop_gradient if its "
                f"derivative is meant to be zero"
            )


def jvp_rule(operands, tangents, *, equation):
    eqn = equation
    op, rule = eqn.op, eqn.rule
    spec = op.spec
    interface = eqn.interface
    if rule in (FORWARD, FORWARD_SAVING):
        _check_nondiff(op, interface, tangents[:len(interface.inputs)])
        if spec.linear:
            return _jvp_linear(eqn, operands, tangents)
        if not spec.multilinear:
            return _jvp_nonlinear(eqn, interface, operands, tangents)
    elif rule in (TRANSPOSE, TRANSPOSE_WRT):
        lead = [i for i in range(len(interface.inputs)) if i != eqn.wrt] \
            if rule == TRANSPOSE_WRT else list(interface.lead_indices)
        _check_nondiff(op, interface, tangents[:len(lead)], lead)

    linear = eqn.io.linear
    others = [k for k in range(len(operands)) if k not in linear]
    if any(not _is_zero(tangents[k]) and tangents[k].dtype != jax.dtypes.float0
           for k in others):
        # A tangent on a non-linear operand: a second derivative.
        return _second_order.jvp(eqn, operands, tangents)

    outs = bind(eqn, operands)
    out_avals = [o.aval for o in outs]
    float_mask = interface.float_out if rule == FORWARD else (True,) * len(outs)
    live = [k for k in linear if not _is_zero(tangents[k])]
    if not live:
        return outs, [_compat.float0_zero(a) for a in out_avals]
    if rule == JVP and spec.zero_tangents:
        # Linear in its tangents, and takes None for a zero one: only the live ones.
        n, leaves = len(interface.inputs), eqn.io.carried
        active = active_subset(interface, JVP, [leaves[k - n] for k in live])
        extras = list(operands[n + len(leaves):])
        terms = [bind(eqn.with_rule(JVP, active=active),
                      list(operands[:n]) + [tangents[k] for k in live] + extras)]
    elif rule in (JVP, VJP, TRANSPOSE):  # jointly linear
        args = list(operands)
        for k in linear:
            args[k] = _compat.instantiate_zeros(tangents[k])
        terms = [bind(eqn, args)]
    else:  # multilinear: one term per linear operand with a tangent
        terms = []
        for k in live:
            args = list(operands)
            args[k] = tangents[k]
            terms.append(bind(eqn, args))
    total = [sum(t[j] for t in terms[1:]) + terms[0][j] if len(terms) > 1 else terms[0][j]
             for j in range(len(outs))]
    tangents_out = [total[j] if float_mask[j] else _compat.float0_zero(out_avals[j])
                    for j in range(len(outs))]
    return outs, tangents_out


def _jvp_linear(eqn, operands, tangents):
    """The forward of a linear op: its tangent with respect to the linear inputs is the
    forward of their tangents; a partly linear op's others go through its jvp rule."""
    interface = eqn.interface
    if any(not _is_zero(tangents[i]) for i in interface.other_indices):
        return _jvp_nonlinear(eqn, interface, operands, tangents)
    outs = bind(eqn, operands)
    linear = interface.linear_indices
    if all(_is_zero(tangents[i]) for i in linear) or not any(interface.float_out):
        return outs, [_compat.float0_zero(o.aval) for o in outs]
    if eqn.rule == FORWARD_SAVING:  # second order: what it keeps depends on the inputs
        _refuse_residual_tangents(eqn.op, interface)
    args = list(operands)
    for i in linear:  # (a linear input whose tangent is zero contributes nothing)
        args[i] = _compat.instantiate_zeros(tangents[i])
    tangent_outs = bind(eqn.with_rule(FORWARD), args)
    return outs, [t if f else _compat.float0_zero(o.aval) for t, f, o in
                  zip(tangent_outs, interface.float_out, outs)] + [
        _compat.float0_zero(o.aval) for o in outs[len(interface.outputs):]]


def _jvp_nonlinear(eqn, interface, operands, tangents):
    """The forward and its tangents; the rule is ``forward_saving`` only at second order."""
    op, rule = eqn.op, eqn.rule
    spec = op.spec
    keeps = spec.keeps
    live = [i for i in interface.diff_indices if not _is_zero(tangents[i])]
    if not live or not any(interface.float_out):
        outs = bind(eqn, operands)
        return outs, [_compat.float0_zero(o.aval) for o in outs]
    if rule == FORWARD_SAVING:
        _refuse_residual_tangents(op, interface)
    active = active_subset(interface, JVP, live) if spec.zero_tangents else None
    dxs = [_compat.instantiate_zeros(tangents[i])
           for i in (interface.diff_indices if active is None else active)]
    # A traceable @jvp is inlined (JAX transposes it), unless a @vjp serves reverse mode.
    inline = eqn.traceable(JVP, active, symbolic=True) if "vjp" not in spec.rules else None
    if keeps is None:
        # Bound before the forward so that a missing @jvp fails before any rule runs.
        tangent_outs = _tangents(eqn, inline, active, operands, dxs, ())
        outs = bind(eqn.with_rule(FORWARD), operands)
        extra_outs = []
    else:
        if inline is None and "jvp" not in spec.rules and \
                not any(isinstance(d, _compat.Tracer) for d in dxs):
            raise missing_rule(spec, JVP)  # eager forward mode: before the forward runs
        # One forward: its outputs and residuals are the jvp's (and so the vjp's) extras.
        all_outs = bind(eqn.with_rule(FORWARD_SAVING if keeps.saved else FORWARD), operands)
        outs, extra_outs = all_outs[:len(interface.outputs)], all_outs[len(interface.outputs):]
        extras = (list(outs) if keeps.result else []) + list(extra_outs)
        tangent_outs = _tangents(eqn, inline, active, operands, dxs, extras)
    tangent_iter = iter(tangent_outs)
    out_tangents = []
    for f, o in zip(interface.float_out, outs):
        t = next(tangent_iter) if f else None
        out_tangents.append(_compat.float0_zero(o.aval) if t is None else t)
    if rule == FORWARD:  # the residuals stay inside the derivative
        return list(outs), out_tangents
    # forward_saving (second order): its residuals are integers, with no tangent
    return list(outs) + list(extra_outs), out_tangents + [
        _compat.float0_zero(o.aval) for o in extra_outs]


def _tangents(eqn, inline, active, operands, dxs, extras):
    """The output tangents: the traceable @jvp inlined (None: a symbolic zero), or the jvp
    equation bound."""
    operands = list(operands) + list(dxs) + list(extras)
    if inline is not None:  # JAX differentiates and transposes the traceable rule itself
        return broadcast_vmapped(inline, eqn.batch)(*operands)
    results = bind(eqn.with_rule(JVP, active=active), operands)
    rule = eqn.spec.rules.get(JVP)
    if rule is not None and rule.traceable and rule.zeros:
        # Bound for its @vjp's sake: the tangents the rule returns as None stay symbolic.
        symbolic = broadcast_vmapped(eqn.traceable(JVP, active, symbolic=True), eqn.batch)
        shapes = jax.eval_shape(symbolic, *operands)
        results = [None if shape is None else r for r, shape in zip(results, shapes)]
    return results


def _refuse_residual_tangents(op, interface) -> None:
    """Second order through residuals: their derivative is unknown, so never silently zero."""
    if any(jnp.issubdtype(dtype, jnp.inexact) for _, dtype in interface.saved):
        spec = op.spec
        raise MissingRuleError(
            f"{spec.name} keeps floating-point residuals ({spec.describe('residuals')}, "
            f"@residuals), and JAX cannot differentiate what an opaque forward kept: second "
            f"derivatives of {spec.name} (hessian, jvp of grad, grad of grad) need derivative "
            f"rules that compute what they need from the inputs or from `result` instead of "
            f"`saved`, declared traceable=True")


_compat.ad.primitive_jvps[jaxdecl_p] = jvp_rule
