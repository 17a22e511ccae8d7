"""Second derivatives: a tangent on an operand an equation is not linear in.

A ``jvp`` or ``vjp`` equation is linear in its tangents (cotangents); a tangent
on its primal inputs needs the rule's own derivative, which JAX takes of a
traceable form of it (:func:`form`): the rule itself where it is traceable,
else the other derivative rule, traceable, transposed.

A partly linear op's ``transpose`` (the cotangents of its linear inputs L,
given the others O) is linear in the cotangents; its derivative with respect
to O (:func:`_transpose_in_leads`) follows from a traceable @jvp: for f linear
in L, the tangent ``jvp(O, L, dO, 0)`` is linear in L too, and transposing it
in L gives the derivative of ``transpose(O, ct)`` in direction dO. (With a
traceable @vjp instead: the cotangent of O, ``vjp(O, L, ct)``, is linear in L,
and its transpose in L applied to dO is the same.) Every further order
composes, as those rules may call jaxdecl ops (the op itself included).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import _compat
from .._errors import MissingRuleError
from .._spec.interface import FORWARD, JVP, TRANSPOSE, VJP
from .._spec.rule_io import active_subset
from .primitive import bind, broadcast_vmapped


def _is_zero(t) -> bool:
    return type(t) is _compat.Zero


def _active(spec, interface, rule: str, leaves) -> tuple | None:
    """The active set of an equation of `rule` that carries (returns) `leaves`, where its
    rule can leave the others out (else None: it carries all)."""
    takes = spec.zero_tangents if rule == JVP else rule in spec.wanted_by
    return active_subset(interface, rule, leaves) if takes else None


def _leaves(interface, rule: str, active) -> tuple:
    """The leaves an equation of `rule` with `active` carries (returns)."""
    if active is not None:
        return active
    return interface.linear_indices if rule == TRANSPOSE else interface.diff_indices


def jvp(eqn, operands, tangents):
    """``(outputs, tangents)`` of `eqn` where some non-linear operand has a tangent."""
    if eqn.rule == TRANSPOSE and eqn.spec.partly_linear:
        return _jvp_of_transpose(eqn, operands, tangents)
    built = form(eqn) if eqn.rule in (JVP, VJP) else None
    if built is None:
        raise not_differentiable(eqn.spec, eqn.rule if eqn.rule in (JVP, VJP) else JVP)
    evaluate = broadcast_vmapped(built, eqn.batch)
    dense = [_compat.instantiate_zeros(t) if _is_zero(t) else t for t in tangents]
    return jax.jvp(lambda *a: evaluate(*a), list(operands), dense)


def not_differentiable(spec, rule) -> MissingRuleError:
    method = spec.describe(rule)
    return MissingRuleError(
        f"{method} (@{rule}) is a NumPy rule, so JAX cannot differentiate it again: second "
        f"derivatives of {spec.name} (hessian, jvp of grad, grad of grad) need "
        f"`@jd.{rule}(traceable=True)` written with jax.numpy or other jaxdecl ops (a "
        f"traceable @{'vjp' if rule == JVP else 'jvp'} also works)"
    )


def _structs(interface, leaves, batch=()) -> list:
    return [jax.ShapeDtypeStruct(tuple(batch) + tuple(interface.inputs[i][0]),
                                 interface.inputs[i][1]) for i in leaves]


def form(eqn):
    """A JAX-traceable version of a jvp/vjp equation's rule, to differentiate it again; None
    where neither derivative rule is traceable."""
    rule, interface, spec = eqn.rule, eqn.interface, eqn.spec
    own = eqn.traceable()
    if own is not None:
        return own
    n = len(interface.inputs)
    leaves = eqn.io.carried
    # Extras (the forward's outputs, residuals) follow the linear operands; they pass through.
    n_linear = len(leaves) if rule == JVP else sum(interface.float_out)
    if rule == JVP:  # jvp(x, .) is the transpose of vjp(x, .)
        active = _active(spec, interface, VJP, leaves)
        other = eqn.traceable(VJP, active)
        if other is None:
            return None
        pick = [_leaves(interface, VJP, active).index(i) for i in leaves]
        ct_avals = [interface.outputs[j] for j in interface.float_out_indices]

        def jvp_form(*operands):
            xs, dxs, extras = operands[:n], operands[n:n + n_linear], operands[n + n_linear:]
            structs = [jax.ShapeDtypeStruct(s, d) for s, d in ct_avals]

            def pull(*c):
                results = other(*xs, *c, *extras)
                return [results[k] for k in pick]

            return list(jax.linear_transpose(pull, *structs)(list(dxs)))

        return jvp_form
    active = _active(spec, interface, JVP, leaves)
    other = eqn.traceable(JVP, active)
    if other is None:
        return None
    pushed = _leaves(interface, JVP, active)

    def vjp_form(*operands):
        xs, cts, extras = operands[:n], operands[n:n + n_linear], operands[n + n_linear:]

        def push(*d):  # tangents of the wanted leaves; the rule may take more (zeros)
            given = dict(zip(leaves, d))
            dxs = [given[i] if i in given else jnp.zeros(*interface.inputs[i]) for i in pushed]
            return other(*xs, *dxs, *extras)

        return list(jax.linear_transpose(push, *_structs(interface, leaves))(list(cts)))

    return vjp_form


def _jvp_of_transpose(eqn, operands, tangents):
    """A partly linear op's transpose, differentiated in its cotangents (itself: linear)
    and in the inputs it is not linear in (:func:`_transpose_in_leads`)."""
    interface = eqn.interface
    lead = interface.lead_indices
    n_lead = len(lead)
    outs = bind(eqn, operands)
    terms = []
    dcts = tangents[n_lead:]
    if any(not _is_zero(t) for t in dcts):
        terms.append(bind(eqn, list(operands[:n_lead]) + [_compat.instantiate_zeros(t)
                                                           for t in dcts]))
    moved = {i: tangents[k] for k, i in enumerate(lead)
             if interface.diff[i] and not _is_zero(tangents[k])}
    if moved:
        terms.append(_transpose_in_leads(eqn, operands, moved))
    total = [sum(t[j] for t in terms) for j in range(len(outs))] if terms else None
    return outs, total if total is not None else [
        _compat.float0_zero(o.aval) for o in outs]


def _transpose_in_leads(eqn, operands, moved: dict) -> list:
    """The derivative of ``transpose(O, ct)`` in direction ``moved`` (leaf -> tangent of O)."""
    interface, spec, batch = eqn.interface, eqn.spec, eqn.batch
    lead, n = interface.lead_indices, len(interface.inputs)
    n_lead = len(lead)
    wanted = eqn.io.carried  # the linear leaves it returns
    float_outs = interface.float_out_indices
    cts = [jnp.broadcast_to(c, batch + tuple(interface.outputs[j][0]))
           for c, j in zip(operands[n_lead:], float_outs)]
    keeps = spec.keeps
    if keeps is not None and keeps.saved:
        raise _needs_traceable(spec, "reads `saved`, which an opaque forward kept")

    def inputs_with(linear_values):
        xs = [None] * n
        for k, i in enumerate(lead):
            xs[i] = operands[k]
        given = dict(zip(wanted, linear_values))
        for i in interface.linear_indices:
            xs[i] = given[i] if i in given else jnp.zeros(
                (1,) * len(batch) + tuple(interface.inputs[i][0]), interface.inputs[i][1])
        extras = list(bind(eqn.with_rule(FORWARD), xs)) if keeps is not None and \
            keeps.result else []
        return xs, extras

    pushing = _active(spec, interface, JVP, moved)
    push = eqn.traceable(JVP, pushing)
    if push is not None:  # transpose, in L, of the tangent jvp(O, L, dO, 0)
        pushed = _leaves(interface, JVP, pushing)
        push = broadcast_vmapped(push, batch)

        def tangent(*linear_values):
            xs, extras = inputs_with(linear_values)
            dxs = [moved[i] if i in moved else jnp.zeros(
                (1,) * len(batch) + tuple(interface.inputs[i][0]), interface.inputs[i][1])
                for i in pushed]
            return push(*xs, *[_compat.instantiate_zeros(d) for d in dxs], *extras)

        return list(jax.linear_transpose(tangent, *_structs(interface, wanted, batch))(cts))
    active = _active(spec, interface, VJP, moved)
    pull = eqn.traceable(VJP, active)
    if pull is None:
        raise _needs_traceable(spec, "is a NumPy rule")
    pulled = _leaves(interface, VJP, active)
    pull = broadcast_vmapped(pull, batch)
    order = sorted(moved)

    def cotangent(*linear_values):  # the cotangent of O, linear in L
        xs, extras = inputs_with(linear_values)
        results = pull(*xs, *cts, *extras)
        return [results[pulled.index(i)] for i in order]

    directions = [jnp.broadcast_to(_compat.instantiate_zeros(moved[i]),
                                   batch + tuple(interface.inputs[i][0])) for i in order]
    return list(jax.linear_transpose(cotangent, *_structs(interface, wanted, batch))(directions))


def _needs_traceable(spec, why: str) -> MissingRuleError:
    linear = ", ".join(map(repr, spec.linear))
    others = ", ".join(repr(p) for p in spec.params if p not in spec.linear and
                       p not in spec.nondiff)
    rule = "jvp" if "jvp" in spec.rules else "vjp"
    return MissingRuleError(
        f"{spec.name}: a second derivative that mixes its linear inputs ({linear}) with the "
        f"others ({others}) (a hessian, jvp of grad) differentiates "
        f"{spec.describe('transpose' if 'transpose' in spec.rules else 'adjoint')} in "
        f"{others}, which jaxdecl derives from a traceable @jvp (or @vjp); "
        f"{spec.describe(rule)} {why}: declare it `@jd.{rule}(traceable=True)`, written with "
        f"jax.numpy or jaxdecl ops (the op itself included), reading the inputs or `result`")
