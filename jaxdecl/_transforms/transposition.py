"""Reverse-mode rules of the ``jaxdecl_call`` primitive: the transpose of every equation.

Each equation is linear in some operands (its ``io.linear``) and transposes into
another equation of the same op, which carries only what is asked for where its
rule allows (its ``active`` leaves: a ``vjp`` or ``transpose`` that takes
``wanted`` returns only the cotangents transposed; a ``jvp`` of
``@jvp(zeros=True)`` carries only the tangents that are not zero):

==================  ==============================================================
equation            its transpose
==================  ==============================================================
``forward``         linear op: ``transpose`` (the cotangents of the linear inputs
                    asked for); multilinear op: ``transpose_wrt`` (one input)
``jvp``             ``vjp``, asked for the cotangents of the tangents transposed
``vjp``             ``jvp``, carrying the tangents of the cotangents that are not zero
``transpose``       ``forward``, with the cotangents as its linear inputs
``transpose_wrt``   ``forward`` or another ``transpose_wrt``
==================  ==============================================================

Transposing an equation in an operand it is not linear in (``jax.linear_transpose``
of a nonlinear op) is a :class:`~jaxdecl.MissingRuleError` naming the input and
the declaration that would make it linear there.
"""

from __future__ import annotations

import jax.numpy as jnp

from .. import _compat
from .._errors import MissingRuleError, missing_rule
from .._spec.interface import FORWARD, FORWARD_SAVING, JVP, TRANSPOSE, TRANSPOSE_WRT, VJP
from .._spec.rule_io import active_subset
from .primitive import bind, broadcast_vmapped, jaxdecl_p

Zero = _compat.Zero


def is_zero(t) -> bool:
    return type(t) is Zero


def _fit(ct, aval):
    """Sums a cotangent over batch dimensions its operand broadcast (had size 1)."""
    if ct is None or is_zero(ct) or tuple(ct.shape) == tuple(aval.shape):
        return ct
    axes = tuple(i for i, (c, a) in enumerate(zip(ct.shape, aval.shape)) if a == 1 and c != 1)
    return jnp.sum(ct, axis=axes, keepdims=True)


def _operand_aval(x):
    return x.aval if _compat.is_undefined_primal(x) else _compat.get_aval(x)


def transpose_rule(cts, *operands, equation):
    """JAX's transpose of an equation: which rule transposes it is each step's below."""
    eqn = equation
    undefined = [k for k, x in enumerate(operands) if _compat.is_undefined_primal(x)]
    _refuse_nonlinear(eqn, undefined)
    float_cts = [c for c, f in zip(cts, eqn.interface.float_out) if f] if eqn.rule == FORWARD \
        else list(cts)
    if all(is_zero(c) for c in float_cts):
        return [Zero(operands[k].aval) if k in undefined else None
                for k in range(len(operands))]
    step = _TRANSPOSES[eqn.rule]
    if eqn.rule == FORWARD:
        step = _transpose_linear if eqn.spec.linear else _transpose_multilinear
    out_cts = step(eqn, operands, undefined, float_cts)
    return [_typed_like(_fit(c, _operand_aval(operands[k])), _operand_aval(operands[k]))
            if k in undefined else None for k, c in enumerate(out_cts)]


def _refuse_nonlinear(eqn, undefined) -> None:
    """Transposing in an operand the equation is not linear in has no answer: say which."""
    linear = eqn.io.linear
    wrong = [k for k in undefined if k not in linear]
    if not wrong:
        return
    spec, interface = eqn.spec, eqn.interface
    if eqn.rule in (FORWARD, FORWARD_SAVING):
        leaf = wrong[0]
        name = spec.params[interface.leaf_param[leaf]]
        if not interface.diff[leaf]:
            declared = "an integer input" if name not in spec.nondiff else "declared nondiff="
            raise MissingRuleError(
                f"{spec.name} cannot be transposed with respect to {name!r}: it is "
                f"{declared}, which has no cotangent")
        if spec.multilinear:
            return  # (a multilinear op transposes in any one input)
        now = f"is linear in {', '.join(map(repr, spec.linear))} only" if spec.linear \
            else "is not declared linear"
        names = tuple(spec.linear) + (name,)
        raise MissingRuleError(
            f"{spec.name} {now}, so JAX cannot transpose it with respect to {name!r} "
            f"(jax.linear_transpose, or a function JAX believes linear in it): if {spec.name} "
            f"is linear in {name!r}, declare `linear={names!r}` on the class with a "
            f"`@jd.transpose` method that returns the cotangent of {name!r}; else "
            f"differentiate it with jax.vjp or jax.grad, which use @vjp")
    raise MissingRuleError(
        f"{spec.name}: JAX asked to transpose its {eqn.rule} equation with respect to "
        f"{eqn.io.in_names[wrong[0]]}, which it is not linear in")


def _transpose_linear(eqn, operands, undefined, float_cts) -> list:
    """forward of a linear op -> its transpose, given the other inputs, for the linear
    inputs asked for."""
    interface, out_cts = eqn.interface, [None] * len(operands)
    active = active_subset(interface, TRANSPOSE, undefined) \
        if "transpose" in eqn.spec.wanted_by else None
    cts = [_compat.instantiate_zeros(c) for c in float_cts]
    transpose = eqn.with_rule(TRANSPOSE, active=active)
    results = bind(transpose, [operands[k] for k in interface.lead_indices] + cts)
    for i, r in zip(transpose.io.carried, results):
        if i in undefined:
            out_cts[i] = r
    return out_cts


def _transpose_multilinear(eqn, operands, undefined, float_cts) -> list:
    """forward of a multilinear op -> its transpose w.r.t. the one undefined input."""
    if len(undefined) != 1:
        raise ValueError(f"{eqn.name} is multilinear: it is linear in one input at a time, "
                         f"but {len(undefined)} inputs were transposed together")
    i, out_cts = undefined[0], [None] * len(operands)
    others = [operands[k] for k in range(len(eqn.interface.inputs)) if k != i]
    cts = [_compat.instantiate_zeros(c) for c in float_cts]
    out_cts[i] = bind(eqn.with_rule(TRANSPOSE_WRT, i), others + cts)[0]
    return out_cts


def _zeros_operand(eqn, leaf):
    """A zero operand for input leaf `leaf` (size 1 along the batch dims: it broadcasts)."""
    shape, dtype = eqn.interface.inputs[leaf]
    return jnp.zeros((1,) * len(eqn.batch) + tuple(shape), dtype)


def _transpose_jvp(eqn, operands, undefined, float_cts) -> list:
    """jvp -> vjp, asked for the cotangents of the transposed tangents; the extras (outputs,
    residuals) pass along."""
    interface, spec = eqn.interface, eqn.spec
    n = len(interface.inputs)
    tangent_of = eqn.io.carried  # operand n + k: the tangent of leaf tangent_of[k]
    active = active_subset(interface, VJP, [tangent_of[k - n] for k in undefined]) \
        if "vjp" in spec.wanted_by else None
    extras = list(operands[len(operands) - eqn.io.n_extra:])
    args = list(operands[:n]) + [_compat.instantiate_zeros(c) for c in float_cts] + extras
    inline = eqn.traceable(VJP, active)
    vjp = eqn.with_rule(VJP, active=active)
    if inline is not None:
        results = broadcast_vmapped(inline, eqn.batch)(*args)
    elif VJP in spec.rules:
        results = bind(vjp, args)
    else:
        raise missing_rule(spec, VJP)
    returned = vjp.io.carried
    out_cts = [None] * len(operands)
    for k in undefined:
        out_cts[k] = results[returned.index(tangent_of[k - n])]
    return out_cts


def _transpose_vjp(eqn, operands, undefined, float_cts) -> list:
    """vjp -> jvp, carrying the tangents (the incoming cotangents) that are not zero."""
    interface, spec = eqn.interface, eqn.spec
    n = len(interface.inputs)
    live = {i: c for i, c in zip(eqn.io.carried, float_cts) if not is_zero(c)}
    active = active_subset(interface, JVP, live) if spec.zero_tangents else None
    jvp = eqn.with_rule(JVP, active=active)
    dxs = [_compat.instantiate_zeros(live[i]) if i in live else _zeros_operand(eqn, i)
           for i in jvp.io.carried]
    extras = list(operands[len(operands) - eqn.io.n_extra:])
    args = list(operands[:n]) + dxs + extras
    inline = eqn.traceable(JVP, active)
    if inline is not None:
        results = broadcast_vmapped(inline, eqn.batch)(*args)
    elif JVP in spec.rules:
        results = bind(jvp, args)
    else:
        raise missing_rule(spec, JVP)
    out_cts = [None] * len(operands)
    for k in undefined:
        out_cts[k] = results[k - n]
    return out_cts


def _transpose_of_transpose(eqn, operands, undefined, float_cts) -> list:
    """transpose -> the forward, with the cotangents as its linear inputs (zero where the
    transpose returned none)."""
    interface = eqn.interface
    lead = interface.lead_indices
    given = dict(zip(eqn.io.carried, float_cts))
    args = [None] * len(interface.inputs)
    for k, i in enumerate(lead):
        args[i] = operands[k]
    for i in interface.linear_indices:
        c = given.get(i)
        args[i] = _zeros_operand(eqn, i) if c is None or is_zero(c) else c
    results = bind(eqn.with_rule(FORWARD), args)
    floats = [r for r, f in zip(results, interface.float_out) if f]
    out_cts = [None] * len(operands)
    for k in undefined:
        out_cts[k] = floats[k - len(lead)]
    return out_cts


def _transpose_of_transpose_wrt(eqn, operands, undefined, float_cts) -> list:
    """transpose_wrt is multilinear in (the other differentiable inputs, the cotangents):
    w.r.t. the cotangents, the forward with input `wrt` set to ct; w.r.t. another input
    j, the transpose w.r.t. j with `wrt` set to ct."""
    n, wrt, interface = len(eqn.interface.inputs), eqn.wrt, eqn.interface
    others = [i for i in range(n) if i != wrt]
    args = [None] * n
    for i, value in zip(others, operands):
        args[i] = value
    args[wrt] = _compat.instantiate_zeros(float_cts[0])
    out_cts = [None] * len(operands)
    if undefined and all(k >= n - 1 for k in undefined):
        results = bind(eqn.with_rule(FORWARD), args)
        float_results = [r for r, f in zip(results, interface.float_out) if f]
        for k, r in zip(range(n - 1, len(operands)), float_results):
            if k in undefined:
                out_cts[k] = r
    elif len(undefined) == 1:
        position = undefined[0]
        j = others[position]
        rest = [args[i] for i in range(n) if i != j]
        cts_in = list(operands[n - 1:])
        out_cts[position] = bind(eqn.with_rule(TRANSPOSE_WRT, j), rest + cts_in)[0]
    else:
        raise ValueError(f"{eqn.name}: a multilinear transpose was transposed in "
                         f"{len(undefined)} operands at once")
    return out_cts


_TRANSPOSES = {FORWARD: None, JVP: _transpose_jvp, VJP: _transpose_vjp,
               TRANSPOSE: _transpose_of_transpose,
               TRANSPOSE_WRT: _transpose_of_transpose_wrt}


def _typed_like(ct, aval):
    """`ct` with its primal's sharding type (Explicit axes), as JAX requires of cotangents.

    A rule's result is typed by its plan (a transpose knows its operands, not the
    primal it stands for): where the primal's type says otherwise, reshard to it.
    """
    if ct is None or is_zero(ct) or not _compat.COTANGENTS_TYPED_LIKE_PRIMALS:
        return ct
    have = getattr(getattr(ct, "aval", None), "sharding", None)
    if have is None or getattr(have.mesh, "empty", True) or \
            not _compat.has_explicit_axes(have.mesh):
        return ct
    want = getattr(aval, "sharding", None)
    if want is None or getattr(want.mesh, "empty", True):
        # A primal with no mesh in its type: JAX leaves its cotangent as computed.
        return ct
    spec = tuple(want.spec) + (None,) * (len(ct.shape) - len(want.spec))
    if tuple(have.spec) + (None,) * (len(ct.shape) - len(have.spec)) == spec:
        return ct
    # A sharding with its mesh: JAX < 0.9 refuses a bare spec outside jax.set_mesh.
    return _compat.reshard(ct, _compat.NamedSharding(have.mesh, _compat.P(*spec)))


_compat.ad.primitive_transposes[jaxdecl_p] = transpose_rule
