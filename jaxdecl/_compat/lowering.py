"""Lowering as this JAX spells it: Shardy rules, HLO helpers, export, and what compiled
programs keep of a ``custom_partitioning`` call.

Example:
    >>> from jaxdecl._compat import lowering
    >>> callable(lowering.sdy_rule_attribute)
    True
"""

from __future__ import annotations

import inspect

import jax
from jax._src.lib.mlir import ir  # noqa: F401 - re-exported
from jax.interpreters import mlir


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


def register_lowering(primitive, rule) -> None:
    """Registers `rule` as `primitive`'s lowering on every platform: one rule, so that a
    program lowered for several platforms at once (``jax.export(...,
    platforms=["cpu", "cuda"])``) holds the rule's code once, with no switch on the
    platform (JAX emits a switch as soon as two platforms have rules of their own, even
    the same one). The rule itself refuses platforms it cannot serve."""
    mlir.register_lowering(primitive, rule)


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


def run_on_one_device(ctx, op, sharding) -> None:
    """Annotates custom call `op` to run on the one device of `sharding`, as
    ``jax.pure_callback``'s own lowering does (a maximal sharding: XLA moves the
    operands there and the results from there). Nothing where no SPMD partitioning
    runs; the caller has checked that the program holds the device."""
    from jax._src import callback
    from jax._src.interpreters import mlir as internal

    annotation = callback._callback_op_sharding(ctx.module_context.axis_context, sharding,
                                                ctx.avals_out)
    if annotation is None:
        return
    if "ctx" in inspect.signature(internal.set_sharding).parameters:  # (JAX >= 0.10)
        internal.set_sharding(ctx.module_context, op, annotation)
    else:
        internal.set_sharding(op, annotation)
