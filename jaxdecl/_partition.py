"""Running a rule per shard: which mesh axes split which factor, and the lowering that does it.

Given the factors of one equation (:mod:`jaxdecl._sharding`) and how its
operands are sharded, :func:`plan` decides which mesh axes split each factor:
the first operand sharded along a factor sets its axes; ``replicate`` factors,
factors whose size the axes do not divide, and axes already taken by another
factor stay whole (XLA gathers them). A result without a split factor is a
sum over that factor's slices: :func:`plan` lists the axes to ``psum`` over.

:func:`lower` is the lowering under ``jax.jit`` over several devices (mesh
axes of type Auto or Explicit): the equation becomes a
``custom_partitioning`` call whose partition callback applies :func:`plan` to
the shardings XLA proposes and binds the same rule on the local blocks (its
``primals`` recomputed for the local shapes), adding ``psum`` where the plan
sums. On one device, inside ``shard_map`` (every axis manual) and for ops
without a declaration, the direct lowering applies and the HLO is unchanged.

Example:
    >>> import numpy as np
    >>> from jaxdecl._sharding import RuleFactors
    >>> factors = RuleFactors(operands=(("b", "k"), ("k",)), results=(("b",),),
    ...                       replicate=frozenset(), sizes={"b": 8, "k": 4}, inputs=(), batch=())
    >>> p = plan(factors, [("d", None), (None,)], {"d": 2, "e": 2})
    >>> p.operand_specs, p.result_specs, p.summed
    ((('d', None), (None,)), (('d',),), ((),))
    >>> plan(factors, [(None, "e"), ("e",)], {"d": 2, "e": 2}).summed
    (('e',),)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import secrets
import sys
import warnings

import jax
import jaxlib

from . import _compat, _layout, _runtime
from ._errors import RuleError


def _axes(entry) -> tuple:
    """The mesh axes of one PartitionSpec entry, as a tuple."""
    if entry is None or not isinstance(entry, (str, tuple, list)):
        return ()  # None, or P.UNCONSTRAINED
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: tuple):
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Where every factor of one equation lives on the mesh."""

    factor_axes: dict  # factor -> mesh axes splitting it (absent: whole)
    operand_specs: tuple  # per operand: a PartitionSpec-like tuple of entries
    result_specs: tuple
    summed: tuple  # per result: mesh axes whose partial results must be summed
    gathered: tuple = ()  # (operand, dim, factor, mesh axes): split inputs of replicate factors

    def local_size(self, factor, size: int, axis_sizes: dict) -> int:
        axes = self.factor_axes.get(factor, ())
        return size // math.prod(axis_sizes[a] for a in axes)


class _Refusal(Exception):
    """An input sharded in a way the op cannot run per shard (explicit axes raise it)."""


def plan(factors, specs, axis_sizes: dict, *, strict: bool = False, describe=None) -> Plan:
    """Assigns mesh axes to factors from the operands' `specs` (PartitionSpec-like tuples).

    With `strict` (explicit axes: the types promise the sharding) a sharding
    the op cannot honour raises ShardingTypeError, the message made by
    ``describe(operand, dim, factor, why)``; otherwise that dim is gathered.
    """
    factor_axes: dict = {}
    used: set = set()
    gathered = []
    for operand, (names, spec) in enumerate(zip(factors.operands, specs)):
        spec = tuple(spec)
        for dim, factor in enumerate(names):
            axes = _axes(spec[dim]) if dim < len(spec) else ()
            if not axes or factor_axes.get(factor) == axes:
                continue
            why = None
            if factor in factors.replicate:
                why = "replicate"
            elif factor in factor_axes:
                why = "conflict"
            elif used & set(axes):
                why = "axis taken"
            elif factors.sizes[factor] % math.prod(axis_sizes[a] for a in axes):
                why = "uneven"
            if why is None:
                factor_axes[factor] = axes
                used.update(axes)
            elif strict:
                raise _compat.ShardingTypeError(describe(operand, dim, factor, why, axes))
            elif why == "replicate":
                gathered.append((operand, dim, factor, axes))
    operand_specs = tuple(tuple(_entry(factor_axes.get(f, ())) for f in names)
                          for names in factors.operands)
    result_specs = tuple(tuple(_entry(factor_axes.get(f, ())) for f in names)
                         for names in factors.results)
    order = list(axis_sizes)
    summed = []
    for names in factors.results:
        axes = set(itertools.chain.from_iterable(
            a for f, a in factor_axes.items() if f not in names))
        summed.append(tuple(a for a in order if a in axes))
    return Plan(factor_axes, operand_specs, result_specs, tuple(summed), tuple(gathered))


def warn_gathers(op, rule: str, wrt: int, primals: tuple, batch: tuple, p: Plan) -> None:
    """Warns, once per op and signature, that inputs split along a replicate factor are gathered.

    Such an input is all-gathered onto every device before the rule runs: correct,
    but the communication and memory of an unsharded op, which nothing else
    would tell the user about.
    """
    if not p.gathered:
        return
    key = (rule, wrt, primals, batch)
    if key in op.handle.gather_warned:
        return
    op.handle.gather_warned.add(key)
    io = op.rule_io(primals, rule, wrt)
    where = "" if rule == "forward" else f" (in its {rule} rule)"
    inputs = "; ".join(
        f"input {io.in_names[operand]!r} is split along dim {dim} (factor {factor!r}) over "
        f"mesh axes {axes}" for operand, dim, factor, axes in p.gathered)
    factors = sorted({factor for _, _, factor, _ in p.gathered})
    warnings.warn(
        f"{op.spec.name}{where}: {inputs}, but the op declares "
        f"{', '.join(repr(f) for f in factors)} in replicate= (the rules need it whole), so "
        f"XLA gathers that input onto every device first. Reshard it with that dim unsharded "
        f"to avoid the gather, or, if the rules may run on slices along it, declare the "
        f"factor independent (and verify the declaration with jd.check)",
        UserWarning, stacklevel=_caller_level())


_LIBRARIES = tuple(os.path.dirname(os.path.abspath(path)) + os.sep
                   for path in (__file__, jax.__file__, jaxlib.__file__))


def _caller_level() -> int:
    """The ``stacklevel`` that points a warning at the user's code, past jaxdecl and JAX.

    XLA runs the partition callback during compilation, where no user frame may
    be on the stack: the warning then points at jaxdecl's caller of it.
    """
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def local_params(factors, p: Plan, axis_sizes: dict, primals: tuple, batch: tuple) -> tuple:
    """``(primals, batch)`` of the per-shard equation: each dim divided by its split."""
    local_primals = _layout.with_leaves(primals, (
        (tuple(p.local_size(f, n, axis_sizes) for f, n in zip(names, shape)), dtype)
        for names, (shape, dtype) in zip(factors.inputs, _layout.primal_leaves(primals))))
    local_batch = tuple(p.local_size(f, n, axis_sizes) for f, n in zip(factors.batch, batch))
    return local_primals, local_batch


def sdy_rule(factors):
    """The Shardy sharding rule of one equation (factors renamed f0, f1, ...)."""
    names: dict = {}
    for f in itertools.chain(*factors.operands, *factors.results):
        names.setdefault(f, f"f{len(names)}")
    in_results = set(itertools.chain(*factors.results))
    reduction = tuple(names[f] for f in names if f not in in_results
                      and f not in factors.replicate)
    replicate = tuple(names[f] for f in names if f in factors.replicate)
    mapping = _compat.sdy.ArrayMapping
    return _compat.sdy.SdyShardingRule(
        tuple(mapping(*(names[f] for f in v)) for v in factors.operands),
        tuple(mapping(*(names[f] for f in v)) for v in factors.results),
        reduction_factors=reduction, need_replication_factors=replicate)


def wants_partitioning(ctx) -> bool:
    """True when the lowering targets several devices of a mesh that jaxdecl can split over."""
    context = ctx.module_context.axis_context
    if not isinstance(context, _compat.ShardingContext):
        return False  # shard_map (manual axes): the rule already sees blocks
    devices = context.device_assignment
    return bool(devices) and len(devices) > 1 and context.abstract_mesh is not None \
        and not context.abstract_mesh.empty


class _Held:
    """Kernels built for per-shard equations, held as long as the executable lives."""

    __slots__ = ("keep",)

    def __init__(self):
        self.keep = []


def lower(ctx, args, *, op, rule, wrt, primals, batch, factors, bind):
    """Lowers one equation as a ``custom_partitioning`` call (see the module docstring)."""
    spec = op.spec
    held = _Held()
    ctx.module_context.add_keepalive(held)
    _mark_unique(ctx.module_context.module)
    operand_shapes = [tuple(a.shape) for a in ctx.avals_in]
    result_avals = list(ctx.avals_out)
    what = f"{spec.name} ({rule})"

    def per_shard(mesh, arg_shapes, result_shape):
        try:
            axis_sizes = dict(mesh.shape)
            specs = [_spec_of(s) for s in arg_shapes]
            p = plan(factors, specs, axis_sizes)
            warn_gathers(op, rule, wrt, primals, batch, p)
            local_primals, local_batch, local_in = shard_equation(
                op, rule, wrt, primals, batch, factors, p, axis_sizes, operand_shapes,
                [tuple(a.shape) for a in result_avals])
            # Built now so that the executable holds it (the per-shard lowering's own
            # keep-alives are dropped with its temporary module).
            held.keep.append(_prebuilt(op, rule, wrt, local_primals, local_batch,
                                               local_in))
            summed = p.summed

            def local(*blocks):
                outs = bind(op, rule, blocks, local_primals, local_batch, wrt)
                return tuple(_compat.psum(o, axes) if axes else o
                             for o, axes in zip(outs, summed))

            named = _compat.NamedSharding
            return (mesh, local,
                    tuple(named(mesh, _compat.P(*s)) for s in p.result_specs),
                    tuple(named(mesh, _compat.P(*s)) for s in p.operand_specs))
        except Exception as error:
            # XLA reports the failure as a JaxRuntimeError carrying this text.
            raise RuntimeError(
                f"jaxdecl could not split {what} across devices: "
                f"{type(error).__name__}: {error}") from error

    def whole(*operands):
        return tuple(bind(op, rule, operands, primals, batch, wrt))

    wrapped = _compat.custom_partitioning(whole)
    wrapped.def_partition(partition=per_shard, sharding_rule=sdy_rule(factors))
    return _compat.mlir.lower_fun(lambda *a: list(wrapped(*a)), multiple_results=True)(
        ctx, *args)


_lowerings = itertools.count()
_PROCESS = secrets.token_hex(8)


def _mark_unique(module) -> None:
    """Makes the program's persistent-cache key unique to this lowering.

    Per-shard kernels are built by the partition callback, which XLA runs only
    when it compiles. A program loaded from the persistent cache instead (its
    HLO can repeat exactly: ``custom_partitioning`` names its callback by an
    ``id()`` that Python reuses, or JAX drops it from the key) would call
    kernels this process never built. So these programs never share a cache
    entry: each compiles and registers its kernels.
    """
    with module.context:
        module.operation.attributes["jaxdecl.lowering"] = _compat.ir.StringAttr.get(
            f"{_PROCESS}-{next(_lowerings)}")


def shard_equation(op, rule, wrt, primals, batch, factors, p: Plan, axis_sizes: dict,
                   operand_shapes, result_shapes) -> tuple:
    """``(primals, batch, operand shapes)`` of the equation each device runs under plan `p`.

    Raises RuleError when ``@abstract`` on the local shapes disagrees with the
    shapes the declaration implies (the declaration does not fit the op).
    """
    local_primals, local_batch = local_params(factors, p, axis_sizes, primals, batch)
    local_in = tuple(
        tuple(p.local_size(f, n, axis_sizes) for f, n in zip(names, shape))
        for names, shape in zip(factors.operands, operand_shapes))
    expected = [tuple(p.local_size(f, n, axis_sizes) for f, n in zip(names, shape))
                for names, shape in zip(factors.results, result_shapes)]
    io = op.rule_io(local_primals, rule, wrt)
    got = [tuple(local_batch) + tuple(s) for s, _ in io.out_avals]
    for j, (g, e) in enumerate(zip(got, expected)):
        if g != e:
            raise RuleError(
                f"{op.spec.name} ({rule}): on a shard, @abstract gives {io.out_names[j]} the "
                f"shape {g}, but the sharding declaration implies {e} (local inputs "
                f"{[s for s, _ in _layout.primal_leaves(local_primals)]}); the declaration "
                f"does not match the op's shapes")
    return local_primals, local_batch, local_in


def _spec_of(struct) -> tuple:
    sharding = getattr(struct, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None:  # not a NamedSharding: treat as whole (XLA gathers)
        return (None,) * len(struct.shape)
    return tuple(spec) + (None,) * (len(struct.shape) - len(spec))


def _prebuilt(op, rule, wrt, primals, batch, in_shapes):
    kernel, pin = op.kernel(rule, wrt, primals, batch, in_shapes)
    return _runtime.KeepAlive(kernel, pin)
