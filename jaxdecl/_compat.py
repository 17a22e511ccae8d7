"""The one place that knows about JAX's internal, version-dependent API.

jaxdecl emits its own JAX primitive, which needs JAX's autodiff, batching and
lowering registries; they live in modules JAX does not promise to keep stable.
Everything version-specific is imported or shimmed here, for every JAX from
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
"""

from __future__ import annotations

import contextlib
import inspect

import jax
import numpy as np
from jax._src import core as _core
from jax._src.lib.mlir import ir
from jax.interpreters import ad, batching, mlir

try:  # jax >= 0.4.36
    from jax.extend.core import Primitive
except ImportError:  # pragma: no cover - older jax
    from jax.core import Primitive

#: The running JAX's version, as text (for messages) and as a comparable tuple.
JAX_VERSION_TEXT = jax.__version__
JAX_VERSION = tuple(int(part) for part in JAX_VERSION_TEXT.split(".")[:3] if part.isdigit())

Zero = ad.Zero
UndefinedPrimal = ad.UndefinedPrimal
is_undefined_primal = ad.is_undefined_primal
instantiate_zeros = ad.instantiate_zeros
# vmap marks an unbatched operand with None (a NotMapped sentinel in older JAX).
not_mapped = getattr(batching, "not_mapped", None)
Tracer = jax.core.Tracer
JaxRuntimeError = getattr(jax.errors, "JaxRuntimeError", RuntimeError)
get_aval = jax.typeof

__all__ = [
    "Primitive", "Zero", "UndefinedPrimal", "is_undefined_primal", "instantiate_zeros",
    "not_mapped", "Tracer", "JaxRuntimeError", "ad", "batching", "mlir", "ir", "shard_map",
    "has_explicit_axes", "JAX_VERSION", "JAX_VERSION_TEXT", "SPLITS_PER_SHARD",
    "EXPLICIT_REDUCTIONS", "shardy_enabled", "all_axes_manual", "reshard",
    "worker_transfer_guard", "float0_zero", "not_tracing",
    "hold_weakly_in_caches",
    "get_aval", "hide_frames", "register_ffi_state_type", "register_batch_partitionable",
    "sdy_rule_attribute", "reshape", "ShapedArray", "context_mesh", "outside_context_mesh",
    "ShardingTypeError", "ShardingContext", "NamedSharding", "P", "psum", "custom_partitioning",
    "outside_vmap_axes",
    "sdy", "requires_devices_when_lowering", "vma_of", "insert_reshards", "sharded_aval",
    "plain_values", "ArrayImpl",
]

#: The class of every concrete JAX array (jax.Array is its abstract base): a type
#: check against it is the cheapest test for "a JAX array" on the eager path.
from jax._src.array import ArrayImpl  # noqa: E402

# --- sharding -----------------------------------------------------------------------------
from jax._src.sharding_impls import ShardingContext  # noqa: E402
from jax.experimental import custom_partitioning as sdy  # noqa: E402 - ArrayMapping, SdyShardingRule

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
    mapped = getattr(jax, "shard_map", None)
    if mapped is not None:
        return mapped(function, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                      check_vma=False)
    from jax.experimental.shard_map import shard_map as legacy  # pragma: no cover

    return legacy(function, mesh, in_specs, out_specs, check_rep=False)  # pragma: no cover


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


def insert_reshards(args) -> list:
    """Makes the operands' varying manual axes agree before a bind (pvary where needed).

    The inserted ``pvary`` transposes to a ``psum``: the gradient of an input
    replicated across ``shard_map`` sums over the devices.
    """
    insert = getattr(_core, "auto_insert_reshard", None)
    if insert is None:  # JAX < 0.10
        insert = _core.standard_insert_pvary
    return list(insert(*args))


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


#: True while no JAX trace is active (jit, vmap, grad, scan, eval_shape, ...).
#: Arguments alone cannot tell: a constant passed to an op inside ``jit`` is a
#: NumPy array, yet the op must be staged into the trace, not run. Every eager
#: call asks: see :func:`_not_tracing_function` for the fastest form this JAX allows.
def _not_tracing_function():
    """``trace_state_clean``, or the same test with fewer Python frames.

    JAX >= 0.10 keeps the trace and the axis environment in two thread-local
    states that ``TracingContext.is_top_level`` reads through two properties;
    reading them directly halves the cost. Used only where the code of those
    properties still reads what this function reads.
    """
    context = getattr(_core, "TracingContext", None)
    try:
        reads = (set(context.is_top_level.__code__.co_names),
                 set(context.trace.fget.__code__.co_names),
                 set(context.axis_env.fget.__code__.co_names))
        trace_state, axis_state = _core.trace_state_strong_ref, _core.axis_env_state
        top_trace, top_axis_env = _core.eval_trace, _core.top_axis_env
    except AttributeError:
        return _core.trace_state_clean
    if reads != ({"trace", "eval_trace", "axis_env", "top_axis_env"},
                 {"trace_state_strong_ref", "value"}, {"axis_env_state", "value"}):
        return _core.trace_state_clean

    def not_tracing() -> bool:
        return trace_state.value is top_trace and axis_state.value is top_axis_env

    return not_tracing


not_tracing = _not_tracing_function()


def hold_weakly_in_caches(cls) -> None:
    """Lets JAX's parameter-keyed caches (abstract evaluation) hold `cls` values weakly.

    Primitive parameters are cache keys; held strongly, an op's parameter would
    keep the op alive for as long as the cache remembers it.
    """
    try:
        from jax._src import util

        util.weakref_cache_key_types.add(cls)
    except (ImportError, AttributeError):  # pragma: no cover - other jax versions
        pass


# --- values a traceable rule receives ------------------------------------------------------
def _literal_types() -> tuple:
    try:  # JAX >= 0.7
        from jax._src import literals
    except ImportError:  # JAX 0.6: constants are NumPy or JAX arrays
        return ()
    names = ("LiteralArray", "LiteralInt", "LiteralFloat", "LiteralComplex",  # JAX 0.7
             "TypedNdArray", "TypedInt", "TypedFloat", "TypedComplex")  # JAX >= 0.8
    return tuple(t for t in (getattr(literals, n, None) for n in names) if isinstance(t, type))


_LITERAL_TYPES = _literal_types()


def _ordinary_array(value):
    from jax._src.lax import lax as lax_internal

    aval = jax.typeof(value)
    return lax_internal._convert_element_type(
        np.asarray(value), jax.dtypes.canonicalize_dtype(aval.dtype), aval.weak_type)


def plain_values(values) -> list:
    """`values` with JAX's constant literals turned into ordinary arrays of the same type.

    From JAX 0.7 a constant that a traced program holds reaches a primitive's
    rules as JAX's own host-side literal (``LiteralArray`` in 0.7,
    ``TypedNdArray`` from 0.8, or a scalar subclass of ``int``/``float``/
    ``complex``). It has only some of an array's operators (0.7's lacks ``**``,
    0.8's unary minus), and from 0.8 its arithmetic yields NumPy arrays
    (float64 cotangents for float32 inputs without x64). A traceable rule gets
    a JAX array of the literal's dtype and weak type instead, as on JAX 0.6.
    """
    if not _LITERAL_TYPES:
        return list(values)
    return [_ordinary_array(v) if isinstance(v, _LITERAL_TYPES) else v for v in values]


def float0_zero(aval) -> Zero:
    """The symbolic zero tangent of a primal value (float0 for integers)."""
    return Zero(aval.to_tangent_aval())


def worker_transfer_guard():
    """``(state, attribute, value)`` that forbids host-to-device transfers on a thread.

    While a rule runs on one of XLA's own worker threads, a rule that calls JAX
    there waits on a computation that waits on the rule (a deadlock); so the
    first transfer of a NumPy value into JAX fails instead. The dispatcher sets
    ``state().attribute = value`` around each such call itself (what
    ``jax.transfer_guard_host_to_device("disallow")`` does, less a context
    manager: inside an XLA loop this runs once per iteration).
    """
    from jax._src.lib import guard_lib

    return (guard_lib.thread_local_state, "host_to_device",
            guard_lib.TransferGuardLevel.DISALLOW)


def hide_frames(path: str) -> None:
    """Leaves jaxdecl's own frames out of JAX's filtered tracebacks."""
    try:
        from jax._src import traceback_util

        traceback_util.register_exclusion(path)
    except (ImportError, AttributeError):  # pragma: no cover - older/newer jax
        pass


def register_ffi_state_type(name: str, registration: dict) -> None:
    """Registers an FFI state type (``{"type_id": capsule, "type_info": capsule}``) on CPU, now.

    XLA takes a type only before the handlers that use it, and a CPU client
    that starts later registers JAX's queued handlers before its queued types:
    so the type goes straight to XLA's process-wide registry, which needs no
    client. Newer jaxlibs take the type's deleter with it
    (``register_custom_type``); older ones only its id.
    """
    from jaxlib import xla_client

    xla_module = xla_client._xla
    direct = getattr(xla_module, "register_custom_type", None)
    if direct is not None:
        direct(name, registration)
        return
    direct = getattr(xla_module, "register_custom_type_id", None)  # pragma: no cover - older
    direct(name, registration["type_id"])  # pragma: no cover - older


def _no_callback():
    return None


def serializable_partition_callbacks() -> None:
    """Lets ``serialize_executable`` pickle programs that hold a ``custom_partitioning`` call.

    JAX keeps each call's callback record (closures, the module context) alive
    with the executable, and ``serialize_executable`` pickles what an
    executable keeps alive. The record serves only the compiler's partitioner:
    a compiled executable never calls it. So it pickles to nothing, the way
    jaxdecl's own keep-alives do.
    """
    import copyreg

    from jax._src import custom_partitioning

    record = getattr(custom_partitioning, "_ShardingCallbackInfo", None)
    if record is not None and record not in copyreg.dispatch_table:
        copyreg.pickle(record, lambda _: (_no_callback, ()))


def for_export(ctx) -> bool:
    """The module is being lowered by ``jax.export`` (it must be serializable)."""
    return bool(getattr(ctx.module_context.lowering_parameters, "for_export", False))


def register_batch_partitionable(name: str) -> None:
    """Lets XLA split FFI target `name` along its leading dims with no callback.

    XLA reads the count from the call's ``num_batch_dims`` frontend attribute
    and runs the same call on each device's block of those dims.
    """
    jax.ffi.register_ffi_target_as_batch_partitionable(name)


# Newer JAX passes the module context first (it knows the mesh's memory kinds).
_IR_TYPE_TAKES_CONTEXT = len(inspect.signature(mlir.aval_to_ir_type).parameters) > 1


def sdy_rule_attribute(rule, operand_avals, result_avals, module_context):
    """The ``sdy.sharding_rule`` attribute of SdyShardingRule `rule` for these avals.

    Built once per module and signature: a program calling one op many times
    reuses it (kept in the module's own attribute cache, so it goes with the
    module and its MLIR context).
    """
    from jax._src.custom_partitioning_sharding_rule import sdy_sharding_rule_to_mlir

    cache = getattr(module_context, "sharding_attr_cache", None)
    key = ("jaxdecl.sdy_rule", rule,
           tuple((tuple(a.shape), a.dtype) for a in operand_avals),
           tuple((tuple(a.shape), a.dtype) for a in result_avals))
    attribute = cache.get(key) if cache is not None else None
    if attribute is None:
        def types(avals):
            if _IR_TYPE_TAKES_CONTEXT:
                return [mlir.aval_to_ir_type(module_context, aval) for aval in avals]
            return [mlir.aval_to_ir_type(aval) for aval in avals]

        attribute = sdy_sharding_rule_to_mlir(rule, types(operand_avals), types(result_avals))
        if cache is not None:
            cache[key] = attribute
    return attribute


def constrained_to_type(ctx, value, aval):
    """`value` laid out as the sharding in `aval`'s type, as JAX lowers its own ops."""
    from jax._src.interpreters import mlir as internal

    return internal.lower_with_sharding_in_types(ctx, value, aval)


def reshape(ctx, value, aval):
    """An HLO reshape of `value` to `aval` inside lowering rule context `ctx`."""
    from jax._src.interpreters import mlir as internal

    return internal.reshape(ctx, value, aval)


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
