"""Lowering ``jaxdecl_call`` to XLA: one builder per strategy.

:func:`lower` asks :mod:`jaxdecl._sharded.strategy` how the equation runs in the
program being compiled, then emits it:

- ``INLINE``: the traceable rule's jaxpr;
- ``DIRECT``: one FFI custom call naming the kernel by fingerprint;
- ``SPLIT``: the same call with a trailing unit dim on every operand and
  result, a Shardy rule and ``num_batch_dims``: XLA's batch partitioner splits
  it per device itself (no callback at compile time);
- ``PARTITIONED``: a ``custom_partitioning`` call whose callback plans the
  split for the shardings XLA proposes (:mod:`jaxdecl._sharded.plan`) and binds the
  per-shard equation;
- ``PER_SHARD_MAP``: over Explicit axes the types fix the plan now, so the
  equation lowers as a ``shard_map`` built by :mod:`jaxdecl._sharded.shardmap`.

A call bound to one device (``jd.pure_callback(..., sharding=)``) lowers by
:mod:`jaxdecl._transforms.one_device` instead.

An op without a declaration takes the same paths with its implied plan (every
dim whole but the vmapped ones), running once per distinct block.

Example:
    >>> import jax, jax.numpy as jnp, jaxdecl as jd
    >>> class Neg(jd.Primitive):
    ...     @jd.abstract
    ...     def shapes(self, x):
    ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
    ...     @jd.forward
    ...     def apply(self, x):
    ...         return -x
    >>> "jaxdecl_dispatch" in jax.jit(Neg()).lower(jnp.ones(2)).as_text()
    True
"""

from __future__ import annotations

import functools
import warnings

import jax
import numpy as np

from .. import _compat, _errors
from .._host import processes as _processes
from .._host import registry as _runtime
from .._op import fingerprint as _fingerprint
from .._sharded import plan as _plan
from .._sharded import shardmap as _shardmap
from .._sharded import shardy as _shardy
from .._sharded import strategy as _strategy
from .._sharded.strategy import Strategy
from .._spec import interface as _interface
from . import one_device as _one_device
from . import recipes as _recipes
from .primitive import bind, broadcast_vmapped, jaxdecl_p, mesh_of


def _program_mesh(ctx):
    """``(mesh, devices)`` the program is compiled for; ``(None, 1)`` inside shard_map."""
    context = ctx.module_context.axis_context
    if not isinstance(context, _compat.ShardingContext):
        # shard_map (manual axes): the rule already sees blocks
        mesh = getattr(context, "mesh", None)
        _spanning(mesh.devices if isinstance(mesh, jax.sharding.Mesh) else None,
                  getattr(mesh, "size", 1))
        return None, 1
    devices = len(context.device_assignment or ())
    _spanning(context.device_assignment, devices)
    mesh = context.abstract_mesh
    if mesh is None or mesh.empty:
        mesh = mesh_of(ctx.avals_in)
    if mesh is None or mesh.empty:
        return None, 1
    return mesh, devices


def _spanning(devices, count: int) -> None:
    """A program on `devices` (or, where unknown, on `count` devices, more than this
    process has) spans processes: from now on a rule that fails in this process ends
    the job (:mod:`jaxdecl._host.processes`)."""
    if jax.process_count() == 1:
        return
    if devices is not None:
        me = jax.process_index()
        if any(getattr(d, "process_index", me) != me for d in np.ravel(devices)):
            _processes.join()
    elif count > jax.local_device_count():
        _processes.join()


def lower(ctx, *args, equation):
    """The lowering rule of ``jaxdecl_call``, on CPU and CUDA alike.

    The platform is a detail of the runtime: the same custom call (by target
    name) runs jaxdecl's CPU handler or its CUDA one, so one lowering serves a
    program exported for both. Other platforms are refused here, naming the op.
    """
    eqn = equation
    # (a platform_dependent branch, or a multi-platform export's, narrows ctx.platforms)
    platforms = ctx.platforms or ctx.module_context.platforms
    if not _RUNS_ON.issuperset(platforms):
        _errors.refuse_other_platforms(platforms, _described(eqn))
    traceable = eqn.traceable()
    if traceable is not None:
        evaluate = broadcast_vmapped(traceable, eqn.batch)
        return _compat.mlir.lower_fun(evaluate, multiple_results=True)(ctx, *args)
    eqn.user_rule()  # raises MissingRuleError before anything runs
    _refuse_partly_manual(ctx, eqn)
    in_shapes = tuple(tuple(aval.shape) for aval in ctx.avals_in)
    sharding = getattr(eqn.op.instance, "_jaxdecl_one_device_", None)
    if sharding is not None:  # (jd.pure_callback(..., sharding=))
        return _one_device.lower(ctx, args, eqn, sharding, program_mesh=_program_mesh,
                                 direct=functools.partial(lower_direct, ctx, args, eqn, in_shapes))
    mesh, devices = _program_mesh(ctx)
    explicit = mesh is not None and _compat.has_explicit_axes(mesh)
    facts = dict(devices=devices, declared=eqn.declared, explicit=explicit)
    factors, rank = None, 0
    if devices > 1 and not explicit:
        factors = eqn.factors(in_shapes)
        rank = _shardy.split_rank(factors, devices, eqn.looped)
        facts["elementwise"] = bool(rank)
    strategy = _strategy.decide(**facts)
    if strategy is Strategy.DIRECT:
        if devices > 1 and eqn.declared:
            _warn_cannot_split(eqn.name)
        return lower_direct(ctx, args, eqn, in_shapes, typed=explicit)
    if strategy is Strategy.SPLIT:
        return lower_split(ctx, args, eqn, factors, devices, rank)
    if strategy is Strategy.PARTITIONED:
        if _compat.for_export(ctx):
            # An exported program carries no partitioning callback: the split is
            # planned now, from the declaration alone, as a per-shard map.
            return lower_per_shard_map(ctx, args, eqn, mesh, proposed=True)
        return lower_partitioned(ctx, args, eqn, factors)
    return lower_per_shard_map(ctx, args, eqn, mesh)


_RUNS_ON = frozenset(_errors.PLATFORMS)


def _described(eqn) -> str:
    """``Class.method (@kind)`` of the rule `eqn` runs, for messages (the class alone when
    it has no such rule: lowering says so next)."""
    try:
        rule = eqn.user_rule()
    except _errors.MissingRuleError:
        return eqn.name
    return f"{eqn.name}.{rule.name} (@{rule.kind})"


def _refuse_partly_manual(ctx, eqn) -> None:
    """A named error where XLA would abort the process: without Shardy, its SPMD
    partitioner fails a check on a custom call inside a ``shard_map`` over only some
    mesh axes (as JAX refuses its own callbacks there)."""
    context = ctx.module_context.axis_context
    if _compat.shardy_enabled() or not _compat.some_axes_automatic(context):
        return
    raise _compat.ShardingTypeError(
        f"{eqn.name}: called inside a shard_map over only some mesh axes "
        f"(axis_names={set(context.manual_axes)}); compiling that needs JAX >= 0.7 with "
        f"Shardy (this is JAX {_compat.JAX_VERSION_TEXT}, "
        f"jax_use_shardy_partitioner={_compat.shardy_enabled()}). Map over every mesh axis "
        f"instead, or call the op outside the shard_map")


def _call_site(ctx, eqn, in_shapes) -> dict:
    """The attributes naming the kernel of `eqn` at `in_shapes`: fingerprint, name and
    recipe (:mod:`jaxdecl._transforms.recipes`), so that any process can find or rebuild it.

    Outside ``jax.export`` the Python executable also keeps the kernel
    registered until XLA has instantiated the program, whose call site then
    holds the kernel and its op (see _runtime): the common in-process case
    needs no rebuild. An exported module may carry no such keep-alive (JAX
    refuses to serialize one), and needs a recipe.
    """
    kernel, pin = eqn.kernel(in_shapes)
    exporting = _compat.for_export(ctx)
    recipe = _recipes.recipe(eqn, in_shapes, required=exporting)
    if not exporting:
        ctx.module_context.add_keepalive(_runtime.KeepAlive(kernel, pin))
    hi, lo = kernel.fingerprint
    return dict(fingerprint_hi=np.int64(hi), fingerprint_lo=np.int64(lo), name=kernel.name,
                recipe=recipe)


def lower_direct(ctx, args, eqn, in_shapes, typed: bool = False):
    """One custom call of the kernel (see :func:`_call_site`).

    `typed`: over Explicit axes (an op without a declaration on a JAX that
    cannot run it once), every device runs the call on gathered operands, then
    keeps the slice of each result its type names (no communication).
    """
    outs = _ffi_lowering(ctx, *args, **_call_site(ctx, eqn, in_shapes))
    if typed:
        outs = [_compat.constrained_to_type(ctx, o, a) for o, a in zip(outs, ctx.avals_out)]
    return outs


_ffi_lowering = jax.ffi.ffi_lowering(_runtime.TARGET, has_side_effect=False)
# Executables holding a custom_partitioning call can be serialized (see there).
_compat.serializable_partition_callbacks()

_warned: set = set()


def _warn_cannot_split(name: str) -> None:
    """Once per op: this JAX gathers the inputs of a declared op (correct, not split)."""
    if name in _warned:
        return
    _warned.add(name)
    need = ("JAX >= 0.7" if not _compat.SPLITS_PER_SHARD else
            "the Shardy partitioner (jax.config.update('jax_use_shardy_partitioner', True))")
    warnings.warn(
        f"{name} declares how it splits across devices, but running it per shard needs "
        f"{need} (this is JAX {_compat.JAX_VERSION_TEXT}); XLA gathers its inputs instead, and "
        f"every device runs the rule on the whole arrays", RuntimeWarning, stacklevel=2)


def lower_split(ctx, args, eqn, factors, devices: int, rank: int):
    """One custom call that XLA's batch partitioner splits over its leading `rank` dims
    (:func:`jaxdecl._sharded.shardy.split_rank`; see the module docstring).

    The call is the single-device one (same kernel) with a trailing unit dim on
    every operand and result: XLA's batch partitioner splits only dims in front
    of a last one, and the Shardy rule lets the leading ones follow the
    operands' shardings. No partitioning callback runs when XLA compiles, so
    the program compiles about as fast as one of JAX's own ops, and its
    persistent-cache entry is reusable.
    """
    in_shapes = tuple(tuple(a.shape) for a in ctx.avals_in)
    checked = (eqn.key, devices)  # every rule's shapes follow @abstract's
    if checked not in eqn.op.handle.split_checked:
        # Where XLA will split is decided later; check @abstract against the finest
        # split now (each factor over every device), as the callback path would.
        names = factors.operands[0] if factors.operands else factors.results[0]
        finest = _plan.Plan(factor_axes={f: ("all",) for f in names}, operand_specs=(),
                            result_specs=(), summed=())
        _plan.local_equation(eqn, factors, finest, {"all": devices}, in_shapes)
        eqn.op.handle.split_checked.add(checked)
    site = _call_site(ctx, eqn, in_shapes)

    def with_unit(aval):
        return _compat.ShapedArray(tuple(aval.shape) + (1,), aval.dtype)

    operands = [with_unit(a) for a in ctx.avals_in]
    results = [with_unit(a) for a in ctx.avals_out]
    attributes = {
        "mhlo.frontend_attributes": _compat.mlir.ir_attribute({"num_batch_dims": str(rank)}),
        "sdy.sharding_rule": _compat.sdy_rule_attribute(
            _split_rule(rank, len(operands), len(results)), operands, results,
            ctx.module_context),
    }
    call = jax.ffi.ffi_lowering(_runtime.SPLIT_TARGET, has_side_effect=False,
                                extra_attributes=attributes)
    outs = call(ctx.replace(avals_in=operands, avals_out=results),
                *(_compat.reshape(ctx, x, a) for x, a in zip(args, operands)), **site)
    return [_compat.reshape(ctx, o, a) for o, a in zip(outs, ctx.avals_out)]


@functools.lru_cache(maxsize=256)
def _split_rule(rank: int, n_operands: int, n_results: int):
    """The Shardy rule of a split call: `rank` shared leading factors, then each
    tensor's own unit dim (which stays whole)."""
    names = [f"f{i}" for i in range(rank)]  # (the op's own names may not suit Shardy)
    units = [f"u{i}" for i in range(n_operands + n_results)]
    mapping = _compat.sdy.ArrayMapping
    return _compat.sdy.SdyShardingRule(
        tuple(mapping(*names, u) for u in units[:n_operands]),
        tuple(mapping(*names, u) for u in units[n_operands:]),
        need_replication_factors=tuple(units))


class _Held:
    """Kernels built for per-shard equations, held as long as the executable lives."""

    __slots__ = ("keep",)

    def __init__(self):
        self.keep = []


def lower_partitioned(ctx, args, eqn, factors):
    """A ``custom_partitioning`` call: XLA's callback plans the split at compile time."""
    held = _Held()
    ctx.module_context.add_keepalive(held)
    operand_shapes = [tuple(a.shape) for a in ctx.avals_in]
    _mark_partitioned(ctx.module_context.module, eqn, tuple(operand_shapes))
    what = f"{eqn.name} ({eqn.rule})"

    def partition(mesh, arg_shapes, result_shape):
        try:
            axis_sizes = dict(mesh.shape)
            specs = [_plan.partition_spec_of(s) for s in arg_shapes]
            plan = _plan.plan_for(eqn, factors, specs, axis_sizes, explicit=False)
            shard, local_in = _plan.local_equation(eqn, factors, plan, axis_sizes, operand_shapes)
            # Kernels are built now so that the executable holds them (the per-shard
            # lowering's own keep-alives are dropped with its temporary module).
            kernel, pin = shard.kernel(local_in)
            held.keep.append(_runtime.KeepAlive(kernel, pin))
            local = _shardmap.local_body(lambda *blocks: bind(shard, blocks), plan,
                                         out_avals=shard.out_avals, once_per_block=not eqn.declared,
                                         axis_sizes=axis_sizes)
            named = _compat.NamedSharding
            return (mesh, lambda *blocks: tuple(local(*blocks)),
                    tuple(named(mesh, _plan.to_spec(s)) for s in plan.result_specs),
                    tuple(named(mesh, _plan.to_spec(s)) for s in plan.operand_specs))
        except Exception as error:
            # XLA reports the failure as a JaxRuntimeError carrying this text.
            raise RuntimeError(
                f"jaxdecl could not split {what} across devices: "
                f"{type(error).__name__}: {error}") from error

    def whole(*operands):
        return tuple(bind(eqn, operands))

    wrapped = _compat.custom_partitioning(whole)
    wrapped.def_partition(partition=partition, sharding_rule=_shardy.sdy_rule(
        factors, declared=eqn.declared))
    return _compat.mlir.lower_fun(lambda *a: list(wrapped(*a)), multiple_results=True)(
        ctx, *args)


def _mark_partitioned(module, eqn, in_shapes) -> None:
    """Names in the program which equations its ``custom_partitioning`` calls split.

    ``custom_partitioning`` names its callback by an ``id()`` that Python
    reuses, and its call carries nothing else of the op; its per-shard kernels
    are built by the callback, which only a compilation runs. So the program's
    persistent-cache key must say which ops it splits: the kernel fingerprints
    of the whole equations (configuration, rule, shapes), which repeat exactly
    in another process, when their kernels have recipes (a program loaded from
    the cache rebuilds its per-shard kernels from them); else a token unique to
    this lowering, so that such a program never comes from the cache.
    """
    if _recipes.recipe(eqn, in_shapes, required=False):
        hi, lo = eqn.op.handle.kernel_fingerprint(eqn.key, in_shapes)
        token = f"{hi & (2**64 - 1):016x}{lo & (2**64 - 1):016x}"
    else:
        token = _fingerprint.process_unique()
    with module.context:
        attributes = module.operation.attributes
        name = "jaxdecl.partitioned"
        before = attributes[name].value + "," if name in attributes else ""
        attributes[name] = _compat.ir.StringAttr.get(before + token)


def lower_per_shard_map(ctx, args, eqn, mesh, proposed: bool = False):
    """A ``shard_map`` of the rule: over Explicit axes the plan is read from the types;
    `proposed` (an exported program over Auto axes) plans it from the declaration
    (:func:`jaxdecl._sharded.plan.proposal`), and XLA moves the operands there.

    No ``custom_partitioning`` callback is needed, which keeps compile time near
    that of JAX's own ops and the program cacheable and exportable.
    """
    in_shapes = tuple(tuple(a.shape) for a in ctx.avals_in)
    axis_sizes = dict(mesh.shape)
    factors = eqn.factors(in_shapes)
    specs = (_plan.proposal(factors, axis_sizes, primal=_forward_factors(eqn)) if proposed
             else [_plan.partition_spec_of(a) for a in ctx.avals_in])
    plan = _plan.plan_for(eqn, factors, specs, axis_sizes, explicit=not proposed)
    shard, _ = _plan.local_equation(eqn, factors, plan, axis_sizes, in_shapes)
    want = plan.result_specs if proposed else [_plan.partition_spec_of(a) for a in ctx.avals_out]
    whole = _shardmap.build(lambda *blocks: bind(shard, blocks), mesh, plan,
                            out_avals=shard.out_avals, once_per_block=not eqn.declared, have=specs,
                            want=want, explicit=not proposed)
    # Lowered inside an eager vmap (of a jit), the map still covers the whole mesh.
    with _compat.outside_vmap_axes():
        return _compat.mlir.lower_fun(whole, multiple_results=True)(ctx, *args)


def _forward_factors(eqn):
    """The factors of the forward of `eqn`'s op at the same shapes (what its rules follow)."""
    shapes = tuple(eqn.batch + tuple(shape) for shape, _ in
                   _interface.signature_leaves(eqn.signature))
    return (eqn if eqn.rule == "forward" else eqn.with_rule("forward")).factors(shapes)


# The primitive's lowering, one rule for every platform (CPU and CUDA; others are
# refused): registered here, where it is defined (importing jaxdecl imports this module).
_compat.register_lowering(jaxdecl_p, lower)
