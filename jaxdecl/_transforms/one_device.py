"""A call bound to one device (``jd.pure_callback(..., sharding=)``), in any program.

``jax.pure_callback(..., sharding=)`` runs on the one device its sharding names,
whatever the program's mesh. jaxdecl lowers such a call as the once-per-block map
of an op without a declaration (:mod:`jaxdecl._sharded.shardmap`) over every mesh
axis, run by that device: the operands gathered, the results summed from it
alone. (JAX gives its callback a maximal sharding instead; on jaxdecl's custom
call, with Shardy, JAX 0.10 ran every device's copy in spite of it.) An op asks
for it with the ``_jaxdecl_one_device_`` attribute (a one-device sharding, or
None).

Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxdecl as jd
    >>> one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    >>> y = jax.jit(lambda x: jd.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype),
    ...                                        x, sharding=one))(jnp.zeros(2))
    >>> y.tolist()
    [0.0, 0.0]
"""

from __future__ import annotations

import threading

from .. import _compat
from .._sharded import plan as _plan
from .._sharded import shardmap as _shardmap
from .primitive import bind


def lower(ctx, args, eqn, sharding, *, program_mesh, direct):
    """The lowering of `eqn` on the one device of `sharding`.

    With JAX's errors where a program cannot run it so: inside ``shard_map``,
    NotImplementedError; a device the program does not run on, ValueError.
    `program_mesh(ctx)` is the program's ``(mesh, devices)``, `direct(typed=)` the
    plain custom call (:mod:`jaxdecl._transforms.lowering`).
    """
    if _placing.active:  # inside the map below: the device's own call
        return direct()
    what = repr(eqn.op.instance)
    context = ctx.module_context.axis_context
    if not isinstance(context, _compat.ShardingContext):
        raise NotImplementedError(
            f"{what}: callbacks do not support specifying sharding inside spmd computations "
            f"(inside shard_map each device runs the callback on its own block: leave out "
            f"sharding=)")
    device = next(iter(sharding.device_set))
    devices = tuple(context.device_assignment or ())
    if device not in devices:
        raise ValueError(
            f"{what}: sharding= specifies device {device}, which is not in the device "
            f"assignment of the program ({', '.join(map(str, devices))})")
    mesh, _ = program_mesh(ctx)
    explicit = mesh is not None and _compat.has_explicit_axes(mesh)
    if len(devices) == 1 or mesh is None or (explicit and not _compat.EXPLICIT_REDUCTIONS):
        # One device; or no mesh (GSPMD's shardings: its partitioner honours a maximal
        # one); or Explicit axes before JAX 0.9, which cannot compile the map's psum:
        # there every device runs the call on the gathered operands, as an op without
        # a declaration runs.
        outs = direct(typed=explicit)
        if mesh is None and len(devices) > 1:
            _compat.run_on_one_device(ctx, outs[0].owner, sharding)
        return outs
    whole_specs = tuple((None,) * len(a.shape) for a in ctx.avals_in)
    plan = _plan.Plan({}, operand_specs=whole_specs,
                      result_specs=tuple((None,) * len(a.shape) for a in ctx.avals_out),
                      summed=tuple(() for _ in ctx.avals_out), idle=tuple(mesh.axis_names))
    # (a program's logical devices are its mesh's, in row-major order)
    whole = _shardmap.build(
        lambda *blocks: bind(eqn, blocks), mesh, plan, out_avals=eqn.out_avals,
        once_per_block=True, runs_at=devices.index(device),
        have=[_plan.partition_spec_of(a) for a in ctx.avals_in] if explicit else whole_specs,
        want=([_plan.partition_spec_of(a) for a in ctx.avals_out] if explicit
              else plan.result_specs), explicit=explicit)
    _placing.active = True
    try:
        with _compat.outside_vmap_axes():
            return _compat.mlir.lower_fun(whole, multiple_results=True)(ctx, *args)
    finally:
        _placing.active = False


class _Placing(threading.local):
    active = False  # lowering the map of `lower`, whose inner call is the device's own


_placing = _Placing()
