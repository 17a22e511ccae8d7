"""``vmap`` of the ``jaxdecl_call`` primitive.

Without a user ``@batch`` rule, a vmapped equation becomes the same rule with
one more leading batch dimension (the ``batch`` parameter): batched operands
have their batch axis moved to the front, unbatched ones get a size-1 axis
there (a reshape, no copy), which broadcasts. The host kernel then either
calls the NumPy rule once per element inside one XLA call (``batch="loop"``)
or hands it the whole batch (``batch="vectorized"``). Derived rules (jvp, vjp,
transpose) batch the same way, so users write no batching code for them.

A user ``@batch`` rule handles the forward; a linear op's ``transpose`` (a
partly linear op's too, its other inputs batched or not as ``vmap`` gives them)
is then batched as the transpose of that batched forward, so one rule serves
both. A derivative equation keeps its active leaves under ``vmap``: a zero
tangent or an unwanted cotangent is no more an operand or a result batched
than unbatched. The
rule sees every mix of batched and unbatched inputs ``vmap`` can make; by
returning ``NotImplemented`` it declines one, which then batches as without it
(the class's ``batch=`` mode).
The forward that keeps residuals for a derivative (``forward_saving``) is
batched like the derivative rules: a ``@batch`` rule returns outputs only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import _compat
from .._host import structure as _structure
from .._spec.interface import FORWARD, TRANSPOSE
from .primitive import bind, jaxdecl_p

not_mapped = _compat.not_mapped


def _batch_size(args, dims) -> int:
    for x, d in zip(args, dims):
        if d is not not_mapped:
            return x.shape[d]
    raise ValueError("jaxdecl: vmap of an equation with no batched operand")  # pragma: no cover


def batch_rule(args, dims, *, equation):
    eqn = equation
    op, rule, signature = eqn.op, eqn.rule, eqn.signature
    spec = op.spec
    user = spec.rules.get("batch")
    if user is not None and rule == FORWARD:
        batched = _user_batch(op, args, dims, eqn.interface)
        if batched is not NotImplemented:
            return batched
    elif user is not None and rule == TRANSPOSE:
        try:
            return _transpose_of_user_batch(op, args, dims, eqn.interface, eqn.io.carried)
        except _Declined:
            pass
    size = _batch_size(args, dims)
    moved = [jnp.expand_dims(x, 0) if d is not_mapped else jnp.moveaxis(x, d, 0)
             for x, d in zip(args, dims)]
    outs = bind(eqn.with_shapes(signature, (size,) + eqn.batch), moved)
    return outs, [0] * len(outs)


def _call_user_batch(op, args, axes, interface):
    spec = op.spec
    rule = spec.rules["batch"]
    if interface.structured:
        args = _structure.pack(interface.in_groups, args)
        axes = _structure.pack(interface.in_groups, axes)
    result = rule.bind(op.instance)(tuple(args), tuple(axes))
    if result is NotImplemented:  # declined: batched as without the rule
        return result
    try:
        outs, out_axes = result
    except (TypeError, ValueError):
        raise TypeError(
            f"{spec.name}.{rule.name} (@batch) must return (outputs, out_axes); got {result!r}"
        ) from None
    if interface.structured:
        return _flatten_batched(interface, outs, out_axes, f"{spec.name}.{rule.name} (@batch)")
    if not isinstance(outs, (tuple, list)):
        outs, out_axes = [outs], [out_axes]
    elif not isinstance(out_axes, (tuple, list)):
        out_axes = [out_axes] * len(outs)
    if len(out_axes) != len(outs):
        raise TypeError(
            f"{spec.name}.{rule.name} (@batch) returned {len(outs)} outputs but "
            f"{len(out_axes)} out_axes"
        )
    return list(outs), [not_mapped if a is None else a for a in out_axes]


def _flatten_batched(interface, outs, out_axes, context):
    """Flat outputs and axes of a @batch rule that returned pytrees like the op's."""
    groups = interface.out_groups
    single = interface.single_output
    outs = [outs] if single else list(outs)
    if single or not isinstance(out_axes, (tuple, list)):
        out_axes = [out_axes] * len(groups)
    if len(outs) != len(groups) or len(out_axes) != len(groups):
        raise TypeError(f"{context} returned {len(outs)} outputs and {len(out_axes)} out_axes "
                        f"for an op with {len(groups)} outputs")
    flat_outs, flat_axes = [None] * len(interface.outputs), [None] * len(interface.outputs)
    for group, value, axes in zip(groups, outs, out_axes):
        leaves = [value] if group.tree is None else group.tree.flatten_up_to(value)
        if axes is None or isinstance(axes, int) or group.tree is None:
            axes = [axes] * len(leaves)
        else:  # a pytree of axes: None marks an unbatched subtree
            axes = _structure.leaves_or_none(group, axes)
        for position, leaf, axis in zip(group.positions, leaves, axes):
            flat_outs[position] = leaf
            flat_axes[position] = not_mapped if axis is None else axis
    return flat_outs, flat_axes


def _user_batch(op, args, dims, interface):
    axes = [None if d is not_mapped else d for d in dims]
    return _call_user_batch(op, args, axes, interface)


def _transpose_of_user_batch(op, args, dims, interface, returned):
    """Batches ``transpose`` as the linear transpose of the user's batched forward; its
    results are the cotangents of the `returned` linear leaves."""
    n = len(interface.inputs)
    diff = interface.linear_indices
    lead = interface.lead_indices
    size = _batch_size(args, dims)
    n_lead = len(lead)
    lead_args, lead_dims = args[:n_lead], dims[:n_lead]
    cts = [jnp.broadcast_to(c, (size,) + c.shape) if d is not_mapped else jnp.moveaxis(c, d, 0)
           for c, d in zip(args[n_lead:], dims[n_lead:])]

    def batched_forward(*linear):
        full, axes = [None] * n, [None] * n
        for position, i in enumerate(lead):
            full[i] = lead_args[position]
            axes[i] = None if lead_dims[position] is not_mapped else lead_dims[position]
        for x, i in zip(linear, diff):
            full[i], axes[i] = x, 0
        batched = _call_user_batch(op, full, axes, interface)
        if batched is NotImplemented:
            raise _Declined
        outs, out_axes = batched
        moved = [jnp.broadcast_to(o, (size,) + o.shape) if a is not_mapped
                 else jnp.moveaxis(o, a, 0) for o, a in zip(outs, out_axes)]
        return [o for o, f in zip(moved, interface.float_out) if f]

    structs = [jax.ShapeDtypeStruct((size,) + interface.inputs[i][0], interface.inputs[i][1])
               for i in diff]
    results = jax.linear_transpose(batched_forward, *structs)(cts)
    results = [results[diff.index(i)] for i in returned]
    return results, [0] * len(results)


class _Declined(Exception):
    """The @batch rule returned NotImplemented while its transpose was being traced."""


_compat.batching.primitive_batchers[jaxdecl_p] = batch_rule
