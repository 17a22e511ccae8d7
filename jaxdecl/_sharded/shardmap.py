"""The one builder of per-shard maps: a kernel run on each device's blocks by a plan.

Three callers need "run this rule on every device's block, add up partial
results, hand back arrays of the right types", and all three build it here:

- ``jit`` over Explicit mesh axes (:mod:`jaxdecl._transforms.lowering`), where the
  operands' types fix the plan while lowering;
- eager calls on sharded arrays (:mod:`jaxdecl._transforms.eager`), declared or not, one
  process or several;
- an op without a declaration, whose implied plan splits only vmapped dims: it
  runs *once* per distinct block. Devices at a non-zero index along the plan's
  idle mesh axes skip the rule and contribute zeros, and a ``psum`` over those
  axes hands every device the result (as ``jax.pure_callback`` runs once).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxdecl._sharded.plan import Plan
    >>> mesh = jax.make_mesh((1,), ("d",))
    >>> plan = Plan({}, operand_specs=((None,),), result_specs=((None,),), summed=((),),
    ...             idle=("d",))
    >>> twice = build(lambda x: [2 * x], mesh, plan, out_avals=[((3,), "float32")],
    ...               once_per_block=True, have=[(None,)], want=[(None,)], explicit=False)
    >>> [float(v) for v in jax.jit(twice)(jnp.ones(3, "float32"))[0]]
    [2.0, 2.0, 2.0]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import _compat
from .plan import to_spec


def local_body(run, plan, *, out_avals, once_per_block: bool, axis_sizes: dict,
               runs_at: int = 0):
    """The per-device function of plan `plan`: `run` on the blocks, then the sums.

    `run(*blocks)` returns the local results; `out_avals` are their
    ``(shape, dtype)`` (the zeros that skipping devices contribute). With
    `once_per_block`, the device at row-major position `runs_at` along the idle
    axes runs it (0 but for a call bound to one device).
    """
    idle = tuple(plan.idle) if once_per_block else ()

    def local(*blocks):
        if not idle:
            outs = run(*blocks)
        else:
            index = 0
            for axis in idle:  # this device's position along the idle axes, row-major
                index = index * axis_sizes[axis] + jax.lax.axis_index(axis)
            outs = jax.lax.cond(index == runs_at, lambda v: tuple(run(*v)),
                                lambda v: tuple(jnp.zeros(s, d) for s, d in out_avals),
                                tuple(blocks))
        return [_sum(o, tuple(axes) + idle) for o, axes in zip(outs, plan.summed)]

    return local


def _sum(value, axes):
    if not axes:
        return value
    if value.dtype == bool:  # psum has no boolean form; at most one device holds True
        return _compat.psum(value.astype("int8"), axes) > 0
    return _compat.psum(value, axes)


def build(run, mesh, plan, *, out_avals, once_per_block: bool, have, want, explicit: bool, lead=(),
          runs_at: int = 0):
    """``whole(*lead_operands, *operands)``: the shard_map of `run` under plan `plan`.

    `have` are the operands' specs as they arrive and `want` the specs their
    results must have (their types, under Explicit axes). Over Explicit axes an
    operand is first resharded to the plan's spec (a replicated operand beside
    a split one is sliced: no communication; a dim the op needs whole is
    gathered), and each result to its wanted spec. `lead` are the specs of
    leading operands passed through unsplit (the eager kernel slot); `runs_at`: see
    :func:`local_body`.
    """
    local = local_body(run, plan, out_avals=out_avals, once_per_block=once_per_block,
                       axis_sizes=dict(mesh.shape), runs_at=runs_at)
    mapped = _compat.shard_map(
        local, mesh, in_specs=tuple(map(to_spec, lead)) + tuple(map(to_spec, plan.operand_specs)),
        out_specs=[to_spec(s) for s in plan.result_specs])
    n_lead = len(lead)

    def whole(*operands):
        head, operands = operands[:n_lead], operands[n_lead:]
        if explicit:  # shard_map takes operands whose types match its in_specs
            operands = [_resharded(x, mesh, h, w)
                        for x, h, w in zip(operands, have, plan.operand_specs)]
        results = mapped(*head, *operands)
        place = _resharded if explicit else _constrained
        return [place(o, mesh, h, w) for o, h, w in zip(results, plan.result_specs, want)]

    return whole


def _resharded(value, mesh, have, want):
    """`value` with spec `want` in its type (Explicit axes)."""
    if tuple(have) == tuple(want):
        return value
    return _compat.reshard(value, _compat.NamedSharding(mesh, to_spec(want)))


def _constrained(value, mesh, have, want):
    """`value` laid out as `want` (Auto axes: a sharding constraint, not a type)."""
    if tuple(have) == tuple(want):
        return value
    return jax.lax.with_sharding_constraint(value, _compat.NamedSharding(mesh, to_spec(want)))
