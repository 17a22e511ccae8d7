"""The one place that knows about JAX's internal, version-dependent API.

jaxdecl emits its own JAX primitive, which needs JAX's autodiff, batching and
lowering registries; they live in modules JAX does not promise to keep stable.
Everything version-specific is imported or shimmed in this package, for every JAX from
0.6 on; no other module imports ``jax._src`` or looks at a version
(``tests/test_layers.py`` checks). What needs a newer JAX is a feature flag:

- :data:`SPLITS_PER_SHARD`: Shardy rules with reduction and replication
  factors (JAX 0.7), needed to run a sharding declaration per shard under
  ``jit``; and :func:`shardy_enabled` (the default from JAX 0.7).
- :data:`EXPLICIT_REDUCTIONS`: a ``psum`` inside a per-shard function over
  Explicit mesh axes (XLA fails on it before JAX 0.9).
- :data:`COTANGENTS_TYPED_LIKE_PRIMALS`: JAX's rule for a cotangent's sharding
  type under Explicit axes (its primal's from JAX 0.7).

Values differ too: :func:`plain_values` gives traceable rules arrays where
JAX >= 0.7 holds constants as its own literal types.

Example:
    >>> from jaxdecl import _compat
    >>> isinstance(_compat.JAX_VERSION, tuple)
    True

It is three modules by the part of JAX they know: :mod:`.core` (versions, the
primitive's registries, tracing, values, runtime hooks), :mod:`.sharding`
(meshes, shardings, ``shard_map``) and :mod:`.lowering` (Shardy rules, HLO,
export). This package re-exports their names, so callers write ``_compat.X``.
"""

from __future__ import annotations

from jax.interpreters import ad, batching, mlir  # noqa: F401 - the registries

from .core import (  # noqa: F401
    JAX_VERSION,
    JAX_VERSION_TEXT,
    X64,
    ArrayImpl,
    JaxRuntimeError,
    Primitive,
    Tracer,
    UndefinedPrimal,
    Zero,
    float0_zero,
    get_aval,
    hide_frames,
    hold_weakly_in_caches,
    instantiate_zeros,
    is_undefined_primal,
    not_mapped,
    not_tracing,
    plain_values,
    register_ffi_state_type,
    worker_transfer_guard,
)

# Pickled executables name this path (jaxdecl._compat._no_callback): see lowering.
from .lowering import (  # noqa: F401
    _no_callback,  # noqa: F401
    constrained_to_type,
    for_export,
    ir,
    register_batch_partitionable,
    register_lowering,
    reshape,
    run_on_one_device,
    sdy_rule_attribute,
    serializable_partition_callbacks,
)
from .sharding import (  # noqa: F401
    COTANGENTS_TYPED_LIKE_PRIMALS,
    EXPLICIT_REDUCTIONS,
    SPLITS_PER_SHARD,
    NamedSharding,
    P,
    ShapedArray,
    ShardingContext,
    ShardingTypeError,
    all_axes_manual,
    context_mesh,
    custom_partitioning,
    distributed_job,
    has_explicit_axes,
    insert_reshards,
    outside_context_mesh,
    outside_vmap_axes,
    psum,
    requires_devices_when_lowering,
    reshard,
    sdy,
    shard_map,
    sharded_aval,
    shardy_enabled,
    some_axes_automatic,
    vma_of,
)
