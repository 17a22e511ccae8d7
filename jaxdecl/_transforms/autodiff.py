"""Forward- and reverse-mode rules of the ``jaxdecl_call`` primitive.

The wiring that gives an opaque function both modes: the forward rule's JVP
binds the ``jvp`` rule, linear in the tangents; transposing that binds the
``vjp`` rule, linear in the cotangents; transposing *that* binds ``jvp`` again.
Linear ops map forward <-> ``transpose``; multilinear ops map forward <->
``transpose_wrt`` one input at a time. Each rule is linear (or multilinear) in
some operands (its "linear operands"); a tangent on any other operand needs a second
derivative, which exists only for traceable rules.

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
from .primitive import bind, broadcast_vmapped, jaxdecl_p

Zero = _compat.Zero


def _is_zero(t) -> bool:
    return type(t) is Zero


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


def _linear_operands(op, interface, rule, wrt):
    """Operand indices a rule is linear (or multilinear) in."""
    n = len(interface.inputs)
    n_ct = sum(interface.float_out)
    diff = interface.diff_indices
    if rule == FORWARD:
        return diff
    if rule == JVP:
        return tuple(range(n, n + len(diff)))
    if rule == VJP:
        return tuple(range(n, n + n_ct))
    if rule == TRANSPOSE:
        n_lead = n - len(diff)
        return tuple(range(n_lead, n_lead + n_ct))
    # transpose_wrt: the other differentiable inputs, then the cotangents
    others = [i for i in range(n) if i != wrt]
    return tuple(k for k, i in enumerate(others) if interface.diff[i]) + tuple(
        range(n - 1, n - 1 + n_ct))


def _second_order_form(eqn):
    """A JAX-traceable version of the jvp/vjp rule, so it can be differentiated again."""
    rule, interface = eqn.rule, eqn.interface
    own = eqn.traceable()
    if own is not None:
        return own
    other = eqn.traceable(VJP if rule == JVP else JVP)
    if other is None:
        return None
    n = len(interface.inputs)
    # Extras (the forward's outputs, residuals) follow the linear operands; they pass through.
    n_linear = len(interface.diff_indices) if rule == JVP else sum(interface.float_out)
    if rule == JVP:  # jvp(x, .) is the transpose of vjp(x, .)
        ct_avals = [interface.outputs[j] for j in interface.float_out_indices]

        def jvp_form(*operands):
            xs, dxs, extras = operands[:n], operands[n:n + n_linear], operands[n + n_linear:]
            structs = [jax.ShapeDtypeStruct(s, d) for s, d in ct_avals]
            return list(jax.linear_transpose(lambda *c: other(*xs, *c, *extras),
                                             *structs)(list(dxs)))

        return jvp_form
    dx_avals = [interface.inputs[i] for i in interface.diff_indices]

    def vjp_form(*operands):
        xs, cts, extras = operands[:n], operands[n:n + n_linear], operands[n + n_linear:]
        structs = [jax.ShapeDtypeStruct(s, d) for s, d in dx_avals]
        return list(jax.linear_transpose(lambda *d: other(*xs, *d, *extras),
                                         *structs)(list(cts)))

    return vjp_form


def _not_differentiable(op, rule) -> MissingRuleError:
    spec = op.spec
    method = spec.describe(rule)
    return MissingRuleError(
        f"{method} (@{rule}) is a NumPy rule, so JAX cannot differentiate it again: second "
        f"derivatives of {spec.name} (hessian, jvp of grad, grad of grad) need "
        f"`@jd.{rule}(traceable=True)` written with jax.numpy or other jaxdecl ops (a "
        f"traceable @{'vjp' if rule == JVP else 'jvp'} also works)"
    )


def jvp_rule(operands, tangents, *, equation):
    eqn = equation
    op, rule, wrt, batch = eqn.op, eqn.rule, eqn.wrt, eqn.batch
    spec = op.spec
    interface = eqn.interface
    if rule in (FORWARD, FORWARD_SAVING):
        _check_nondiff(op, interface, tangents[:len(interface.inputs)])
        if not spec.linear and not spec.multilinear:
            return _jvp_nonlinear(eqn, interface, operands, tangents)
    elif rule in (TRANSPOSE, TRANSPOSE_WRT):
        lead = [i for i in range(len(interface.inputs)) if i != wrt] if rule == TRANSPOSE_WRT \
            else list(interface.nondiff_indices)
        _check_nondiff(op, interface, tangents[:len(lead)], lead)

    linear = _linear_operands(op, interface, rule, wrt)
    others = [k for k in range(len(operands)) if k not in linear]
    if any(not _is_zero(tangents[k]) and tangents[k].dtype != jax.dtypes.float0
           for k in others):
        # A tangent on a non-linear operand: differentiate a traceable form.
        form = _second_order_form(eqn) if rule in (JVP, VJP) else None
        if form is None:
            raise _not_differentiable(op, rule if rule in (JVP, VJP) else JVP)
        evaluate = broadcast_vmapped(form, batch)
        dense = [_compat.instantiate_zeros(t) if _is_zero(t) else t for t in tangents]
        return jax.jvp(lambda *a: evaluate(*a), list(operands), dense)

    outs = bind(eqn, operands)
    out_avals = [o.aval for o in outs]
    float_mask = interface.float_out if rule == FORWARD else (True,) * len(outs)
    live = [k for k in linear if not _is_zero(tangents[k])]
    if not live:
        return outs, [_compat.float0_zero(a) for a in out_avals]
    jointly_linear = rule in (JVP, VJP, TRANSPOSE) or (rule == FORWARD and spec.linear)
    if jointly_linear:
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


def _is_float0(t) -> bool:
    return not _is_zero(t) and getattr(t, "dtype", None) == jax.dtypes.float0


def _jvp_nonlinear(eqn, interface, operands, tangents):
    """The forward and its tangents; the rule is ``forward_saving`` only at second order."""
    op, rule = eqn.op, eqn.rule
    diff = interface.diff_indices
    keeps = op.spec.keeps
    live = any(not _is_zero(tangents[i]) for i in diff)
    if not live or not any(interface.float_out):
        outs = bind(eqn, operands)
        return outs, [_compat.float0_zero(o.aval) for o in outs]
    if rule == FORWARD_SAVING:
        _refuse_residual_tangents(op, interface)
    dxs = [_compat.instantiate_zeros(tangents[i]) for i in diff]
    inline = eqn.traceable(JVP)
    inline = inline if "vjp" not in op.spec.rules else None  # else @vjp serves reverse mode
    if keeps is None:
        # Bound before the forward so that a missing @jvp fails before any rule runs.
        tangent_outs = _tangents(eqn, inline, operands, dxs, ())
        outs = bind(eqn.with_rule(FORWARD), operands)
        extra_outs = []
    else:
        if inline is None and "jvp" not in op.spec.rules and \
                not any(isinstance(d, _compat.Tracer) for d in dxs):
            raise missing_rule(op.spec, JVP)  # eager forward mode: before the forward runs
        # One forward: its outputs and residuals are the jvp's (and so the vjp's) extras.
        saving = keeps.saved
        all_outs = bind(eqn.with_rule(FORWARD_SAVING if saving else FORWARD), operands)
        outs, extra_outs = all_outs[:len(interface.outputs)], all_outs[len(interface.outputs):]
        extras = (list(outs) if keeps.result else []) + list(extra_outs)
        tangent_outs = _tangents(eqn, inline, operands, dxs, extras)
    tangent_iter = iter(tangent_outs)
    out_tangents = [next(tangent_iter) if f else _compat.float0_zero(o.aval)
                    for f, o in zip(interface.float_out, outs)]
    if rule == FORWARD:  # the residuals stay inside the derivative
        return list(outs), out_tangents
    # forward_saving (second order): its residuals are integers, with no tangent
    return list(outs) + list(extra_outs), out_tangents + [
        _compat.float0_zero(o.aval) for o in extra_outs]


def _tangents(eqn, inline, operands, dxs, extras):
    """The output tangents: the traceable @jvp inlined, or the jvp equation bound."""
    operands = list(operands) + list(dxs) + list(extras)
    if inline is not None:  # JAX differentiates and transposes the traceable rule itself
        return broadcast_vmapped(inline, eqn.batch)(*operands)
    return bind(eqn.with_rule(JVP), operands)


def _refuse_residual_tangents(op, interface) -> None:
    """Second order through residuals: their derivative is unknown, so never silently zero."""
    if any(_is_inexact(dtype) for _, dtype in interface.saved):
        spec = op.spec
        raise MissingRuleError(
            f"{spec.name} keeps floating-point residuals ({spec.describe('residuals')}, "
            f"@residuals), and JAX cannot differentiate what an opaque forward kept: second "
            f"derivatives of {spec.name} (hessian, jvp of grad, grad of grad) need derivative "
            f"rules that compute what they need from the inputs or from `result` instead of "
            f"`saved`, declared traceable=True")


def _is_inexact(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


# ---------------------------------------------------------------------------------------
# Transposition
# ---------------------------------------------------------------------------------------

def _fit(ct, aval):
    """Sums a cotangent over batch dimensions its operand broadcast (had size 1)."""
    if ct is None or _is_zero(ct) or tuple(ct.shape) == tuple(aval.shape):
        return ct
    axes = tuple(i for i, (c, a) in enumerate(zip(ct.shape, aval.shape)) if a == 1 and c != 1)
    return jnp.sum(ct, axis=axes, keepdims=True)


def _operand_aval(x):
    return x.aval if _compat.is_undefined_primal(x) else _compat.get_aval(x)


def transpose_rule(cts, *operands, equation):
    """JAX's transpose of an equation: which rule transposes it is each step's below."""
    eqn = equation
    undefined = [k for k, x in enumerate(operands) if _compat.is_undefined_primal(x)]
    float_cts = [c for c, f in zip(cts, eqn.interface.float_out) if f] if eqn.rule == FORWARD \
        else list(cts)
    if all(_is_zero(c) for c in float_cts):
        return [Zero(operands[k].aval) if k in undefined else None
                for k in range(len(operands))]
    float_cts = [_compat.instantiate_zeros(c) for c in float_cts]
    step = _TRANSPOSES[eqn.rule]
    if eqn.rule == FORWARD:
        step = _transpose_linear if eqn.spec.linear else _transpose_multilinear
    out_cts = step(eqn, operands, undefined, float_cts)
    return [_typed_like(_fit(c, _operand_aval(operands[k])), _operand_aval(operands[k]))
            if k in undefined else None for k, c in enumerate(out_cts)]


def _inputs(n: int, **placed) -> list:
    """The op's `n` inputs (for a forward or a transpose_wrt equation): values placed at
    their input positions, given as ``positions=values`` pairs of sequences."""
    args = [None] * n
    for positions, values in placed.values():
        for i, value in zip(positions, values):
            args[i] = value
    return args


def _from(start: int, results, count: int) -> list:
    """`count` cotangents: `results` from operand `start` on, None elsewhere."""
    out_cts = [None] * count
    for k, result in zip(range(start, count), results):
        out_cts[k] = result
    return out_cts


def _transpose_linear(eqn, operands, undefined, float_cts) -> list:
    """forward of a linear op -> its transpose, given the non-differentiable inputs."""
    interface, out_cts = eqn.interface, [None] * len(operands)
    lead = interface.nondiff_indices
    if any(k in undefined for k in lead):
        raise ValueError(f"{eqn.name}: a nondiff input cannot be transposed")
    results = bind(eqn.with_rule(TRANSPOSE), [operands[k] for k in lead] + float_cts)
    for i, r in zip(interface.diff_indices, results):
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
    out_cts[i] = bind(eqn.with_rule(TRANSPOSE_WRT, i), others + float_cts)[0]
    return out_cts


def _transpose_derivative(eqn, operands, undefined, float_cts) -> list:
    """jvp and vjp transpose into each other; the extras (outputs, residuals) pass along."""
    n, other = len(eqn.interface.inputs), VJP if eqn.rule == JVP else JVP
    extras = list(operands[len(operands) - eqn.io.n_extra:])
    args = list(operands[:n]) + float_cts + extras
    inline = eqn.traceable(other)
    if inline is not None:
        results = broadcast_vmapped(inline, eqn.batch)(*args)
    elif other in eqn.spec.rules:
        results = bind(eqn.with_rule(other), args)
    else:
        raise missing_rule(eqn.spec, other)
    return _from(n, results, len(operands))


def _transpose_of_transpose(eqn, operands, undefined, float_cts) -> list:
    """transpose -> the forward, with the cotangents as its differentiable inputs."""
    interface = eqn.interface
    lead = interface.nondiff_indices
    args = _inputs(len(interface.inputs), lead=(lead, operands), diff=(interface.diff_indices,
                                                                      float_cts))
    results = bind(eqn.with_rule(FORWARD), args)
    return _from(len(lead), [r for r, f in zip(results, interface.float_out) if f], len(operands))


def _transpose_of_transpose_wrt(eqn, operands, undefined, float_cts) -> list:
    """transpose_wrt is multilinear in (the other differentiable inputs, the cotangents):
    w.r.t. the cotangents, the forward with input `wrt` set to ct; w.r.t. another input
    j, the transpose w.r.t. j with `wrt` set to ct."""
    n, wrt, interface = len(eqn.interface.inputs), eqn.wrt, eqn.interface
    others = [i for i in range(n) if i != wrt]
    args = _inputs(n, others=(others, operands), wrt=((wrt,), float_cts[:1]))
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


_TRANSPOSES = {FORWARD: None, JVP: _transpose_derivative, VJP: _transpose_derivative,
               TRANSPOSE: _transpose_of_transpose,
               TRANSPOSE_WRT: _transpose_of_transpose_wrt}


def _typed_like(ct, aval):
    """`ct` with its primal's sharding type (Explicit axes), as JAX requires of cotangents.

    A rule's result is typed by its plan (a transpose knows its operands, not the
    primal it stands for): where the primal's type says otherwise, reshard to it.
    """
    if ct is None or _is_zero(ct) or not _compat.COTANGENTS_TYPED_LIKE_PRIMALS:
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


_compat.ad.primitive_jvps[jaxdecl_p] = jvp_rule
_compat.ad.primitive_transposes[jaxdecl_p] = transpose_rule
