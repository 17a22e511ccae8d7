"""Meshes and shardings as this JAX spells them: feature flags, Explicit and manual axes,
resharding, ``shard_map``, sharded types, and the current mesh.

Example:
    >>> from jaxdecl._compat import sharding
    >>> isinstance(sharding.SPLITS_PER_SHARD, bool)
    True
"""

from __future__ import annotations

import contextlib

import jax
from jax._src import core as _core
from jax._src.sharding_impls import ShardingContext  # noqa: F401 - re-exported
from jax.experimental import custom_partitioning as sdy  # ArrayMapping, SdyShardingRule

from .core import JAX_VERSION

custom_partitioning = sdy.custom_partitioning
NamedSharding = jax.sharding.NamedSharding
P = jax.sharding.PartitionSpec
ShapedArray = jax.core.ShapedArray
psum = jax.lax.psum
ShardingTypeError = _core.ShardingTypeError


#: Shardy rules that name reduction and replication factors (JAX >= 0.7).
SPLITS_PER_SHARD = "need_replication_factors" in getattr(
    getattr(sdy, "SdyShardingRule", None), "__init__", lambda: None).__code__.co_varnames
#: A psum inside a per-shard function over Explicit axes compiles (JAX >= 0.9).
EXPLICIT_REDUCTIONS = JAX_VERSION >= (0, 9)
#: Under Explicit axes a cotangent takes its primal's sharding type (JAX >= 0.7
#: casts and checks it; JAX 0.6 leaves each cotangent as its computation types it).
COTANGENTS_TYPED_LIKE_PRIMALS = JAX_VERSION >= (0, 7)


def shardy_enabled() -> bool:
    """True when JAX lowers shardings to Shardy (the default from JAX 0.7)."""
    return bool(getattr(jax.config, "jax_use_shardy_partitioner", False))


def some_axes_automatic(axis_context) -> bool:
    """True inside a ``shard_map`` over only some mesh axes (``axis_names=``)."""
    manual = getattr(axis_context, "manual_axes", None)
    mesh = getattr(axis_context, "mesh", None)
    return bool(manual) and mesh is not None and set(manual) != set(mesh.axis_names)


def all_axes_manual(mesh) -> bool:
    """True when every axis of `mesh` is manual (inside ``shard_map``)."""
    value = getattr(mesh, "are_all_axes_manual", None)
    if value is None:  # JAX < 0.7
        value = getattr(mesh, "_are_all_axes_manual", False)
    return bool(value)


def reshard(value, spec):
    """``jax.sharding.reshard``: `value` with the sharding `spec` in its type."""
    if hasattr(jax.sharding, "reshard"):
        return jax.sharding.reshard(value, spec)
    from jax.experimental.shard import reshard as experimental  # pragma: no cover - JAX 0.6

    return experimental(value, spec)  # pragma: no cover


def shard_map(function, mesh, in_specs, out_specs):
    """``jax.shard_map`` without replication checks (the body binds opaque primitives)."""
    return jax.shard_map(function, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


def has_explicit_axes(mesh) -> bool:
    """True when some axis of `mesh` is of type Explicit (sharding in the types)."""
    explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
    return explicit is not None and explicit in tuple(getattr(mesh, "axis_types", ()))


def requires_devices_when_lowering(primitive) -> None:
    """Asks JAX to pass the device assignment to `primitive`'s lowering.

    Without it a lowering over several devices cannot build the mesh that a
    ``custom_partitioning`` call needs (JAX registers its own primitive so).
    """
    from jax._src import dispatch

    dispatch.prim_requires_devices_during_lowering.add(primitive)


def vma_of(name: str, avals) -> frozenset:
    """The varying manual axes of a result inside ``shard_map`` (those of the operands)."""
    return _core.standard_vma_rule(name, *avals)


#: ``insert_reshards(*operands)``: the operands with their varying manual axes made
#: to agree before a bind (pvary where needed). The inserted ``pvary`` transposes to
#: a ``psum``: the gradient of an input replicated across ``shard_map`` sums over the
#: devices. JAX's own function (``standard_insert_pvary`` before JAX 0.10), unwrapped:
#: every bind calls it.
insert_reshards = getattr(_core, "auto_insert_reshard", None) or _core.standard_insert_pvary


def sharded_aval(shape, dtype, mesh, spec, varying=frozenset()):
    """A ShapedArray whose type carries a sharding (explicit axes) or varying axes."""
    from jax.core import ShapedArray

    sharding = NamedSharding(mesh, P(*spec))
    if varying:
        if hasattr(_core, "ManualAxisType"):  # JAX >= 0.10
            return ShapedArray(shape, dtype, sharding=sharding,
                               manual_axis_type=_core.ManualAxisType(varying=frozenset(varying)))
        return ShapedArray(shape, dtype, sharding=sharding, vma=frozenset(varying))
    return ShapedArray(shape, dtype, sharding=sharding)


def context_mesh():
    """The concrete mesh ``jax.set_mesh`` made current, or None."""
    from jax._src import mesh as mesh_lib

    getter = getattr(mesh_lib, "get_concrete_mesh", None)
    mesh = getter() if getter is not None else None
    return None if mesh is None or mesh.empty else mesh


@contextlib.contextmanager
def outside_vmap_axes():
    """No axes of an enclosing eager ``vmap`` for a while: a computation run now.

    ``vmap`` of a batch dim split over Explicit mesh axes names those axes in the
    axis environment, and ``shard_map`` takes them off the axes it maps over; a
    ``shard_map`` run eagerly inside it maps over its whole mesh all the same.
    """
    context, top = getattr(_core, "trace_ctx", None), getattr(_core, "top_axis_env", None)
    if context is None or top is None:  # pragma: no cover - other JAX versions
        yield
        return
    previous = context.axis_env
    context.set_axis_env(top)
    try:
        yield
    finally:
        context.set_axis_env(previous)


@contextlib.contextmanager
def outside_context_mesh():
    """No current mesh for a while: a one-device computation inside ``jax.set_mesh``.

    Under a context mesh JAX compiles every ``jit`` for that mesh's devices, so
    an executable fed arrays on one device refuses them.
    """
    from jax._src import mesh as mesh_lib
    from jax._src import sharding_impls

    # JAX 0.6 (``jax.sharding.use_mesh``) marks "no concrete mesh" with None.
    empty = getattr(mesh_lib, "empty_concrete_mesh", None)
    use_concrete = getattr(sharding_impls, "_internal_use_concrete_mesh", None)
    if use_concrete is None:  # pragma: no cover - JAX without a context mesh
        yield
        return
    with use_concrete(empty), mesh_lib.use_abstract_mesh(mesh_lib.empty_abstract_mesh):
        yield


def distributed_job():
    """``(client, process index, process count)`` of the ``jax.distributed`` job this
    process belongs to, or None (not initialized, or one process): the client's
    key-value store is the job's, shared by every process."""
    from jax._src import distributed

    state = distributed.global_state
    if state.client is None or (state.num_processes or 1) <= 1:
        return None
    return state.client, state.process_id, state.num_processes

