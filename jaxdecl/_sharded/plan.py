"""Where each factor of an equation lives on a mesh, and what each device then runs.

Given the factors of one equation (:meth:`~jaxdecl._op.equation.Equation.factors`)
and how its operands are sharded, :func:`plan` decides which mesh axes split
each factor: the first operand sharded along a factor sets its axes;
``replicate`` factors, factors whose size the axes do not divide, and axes
already taken by another factor stay whole (gathered). A result without a
split factor is a sum over that factor's slices: the plan lists the axes to
``psum`` over. Mesh axes that split nothing are *idle*: an op without a
declaration runs only on the devices at index 0 along them (once, not once
per device), see :mod:`jaxdecl._sharded.shardmap`.

Pure functions of shapes, factors and specs: no JAX tracing, no kernels.

Example:
    >>> from jaxdecl._spec.factors import RuleFactors
    >>> factors = RuleFactors(operands=(("b", "k"), ("k",)), results=(("b",),),
    ...                       replicate=frozenset(), sizes={"b": 8, "k": 4}, inputs=(), batch=())
    >>> plan = make_plan(factors, [("d", None), (None,)], {"d": 2, "e": 2})
    >>> plan.operand_specs, plan.result_specs, plan.summed, plan.idle
    ((('d', None), (None,)), (('d',),), ((),), ('e',))
    >>> make_plan(factors, [(None, "e"), ("e",)], {"d": 2, "e": 2}).summed
    (('e',),)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import sys
import warnings

import jax
import jaxlib

from .. import _compat
from .._errors import RuleError
from .._spec import interface as _interface
from .._spec.rule_io import active_mask


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
    idle: tuple = ()  # mesh axes that split no factor

    def __hash__(self):  # (factor_axes follows from the specs)
        return hash((self.operand_specs, self.result_specs, self.summed, self.idle))

    def local_size(self, factor, size: int, axis_sizes: dict) -> int:
        axes = self.factor_axes.get(factor, ())
        return size // math.prod(axis_sizes[a] for a in axes)


def make_plan(factors, specs, axis_sizes: dict, *, strict: bool = False, describe=None) -> Plan:
    """Assigns mesh axes to factors from the operands' `specs` (PartitionSpec-like tuples).

    With `strict` (explicit axes: the types promise the sharding) a sharding
    the op cannot honour raises ShardingTypeError, the message made by
    ``describe(operand, dim, factor, why, axes)``; otherwise that dim is gathered.
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
    idle = tuple(a for a in order if a not in used)
    return Plan(factor_axes, operand_specs, result_specs, tuple(summed), tuple(gathered), idle)


_WHY = {
    "replicate": "the op needs that factor whole (replicate=)",
    "conflict": "another input splits that factor over other mesh axes",
    "axis taken": "those mesh axes already split another factor",
    "uneven": "the mesh axes do not divide its size",
}


def proposal(factors, axis_sizes: dict) -> list:
    """Operand specs that split the equation as its factors allow, with no operands'
    shardings to follow (a program exported over Auto axes).

    Each mesh axis, in order, goes to the first factor it divides: factors the
    results keep (no sum needed), the larger first, then summed ones (a psum).
    Factors needed whole are never split.

    Example:
        >>> from jaxdecl._spec.factors import RuleFactors
        >>> f = RuleFactors(operands=(("b", "k"), ("k",)), results=(("b",),),
        ...                 replicate=frozenset(), sizes={"b": 8, "k": 6}, inputs=(), batch=())
        >>> proposal(f, {"x": 2, "y": 3})
        [('x', 'y'), ('y',)]
    """
    kept = set(itertools.chain.from_iterable(factors.results))
    candidates = sorted(
        {f for names in factors.operands for f in names if f not in factors.replicate},
        key=lambda f: (f not in kept, -factors.sizes[f], f))
    assigned: dict = {}
    for axis, size in axis_sizes.items():
        for factor in candidates:
            split = math.prod(axis_sizes[a] for a in assigned.get(factor, ())) * size
            if factors.sizes[factor] % split == 0:
                assigned.setdefault(factor, ())
                assigned[factor] += (axis,)
                break
    return [tuple(_entry(assigned.get(f, ())) for f in names) for names in factors.operands]


def refusal(eqn, operand, dim, factor, why, axes) -> str:
    """The ShardingTypeError message for an input the op cannot take as sharded."""
    name = eqn.io.in_names[operand]
    factor = "a vmap dim" if factor.startswith("#") else f"factor {factor!r}"
    where = "" if eqn.rule == "forward" else f" (in its {eqn.rule} rule)"
    return (f"{eqn.name}{where}: input {name!r} is sharded along dim {dim} ({factor}) over "
            f"mesh axes {axes}, but {_WHY[why]}. Reshard it with that dim unsharded first, "
            f"e.g. jax.sharding.reshard(x, P(..., None, ...)) (or declare the factor "
            f"independent if the rule may run on slices of it)")


def plan_for(eqn, factors, specs, axis_sizes: dict, *, explicit: bool) -> Plan:
    """The plan of `eqn` for operands of `specs`, with the checks its mode needs.

    Over Explicit axes a declared op refuses (ShardingTypeError) what it cannot
    take and what this JAX cannot sum; over Auto axes it warns where it
    gathers. An op without a declaration gathers what it needs, silently: that
    is what it declared.
    """
    strict = explicit and eqn.declared
    plan = make_plan(factors, specs, axis_sizes, strict=strict,
             describe=lambda *where: refusal(eqn, *where))
    if explicit:
        check_explicit_sums(eqn.name, plan)
    elif eqn.declared:
        warn_gathers(eqn, plan)
    return plan


def result_specs(eqn, plan: Plan, operand_specs, operand_shapes, meshless=frozenset()) -> list:
    """The specs the results of `eqn` have under plan `plan`.

    A result of an op without a declaration is laid out like the operand it
    mirrors (:func:`mirrored`), as JAX's elementwise ops keep their operand's
    type: the plan computes it whole (but its vmapped dims), and each device
    then keeps its slice of it (no communication).

    A cotangent has its primal's sharding, as for JAX's own ops: the cotangent
    of an input split along fewer factors than the plan splits (a replicated
    matrix against a split vector) is gathered to it (not on JAX 0.6, whose
    cotangents keep the sharding their computation gives them). The cotangent of
    an operand whose type has no mesh (positions in `meshless`) keeps the plan's
    sharding, as JAX's elementwise ops leave it.
    """
    specs = list(plan.result_specs)
    if not eqn.declared:
        for j, (shape, _) in enumerate(eqn.out_avals):
            i = mirrored(shape, operand_specs, operand_shapes, meshless)
            if i is not None:
                specs[j] = tuple(operand_specs[i])
    if eqn.rule == "vjp" and _compat.COTANGENTS_TYPED_LIKE_PRIMALS:
        mask = active_mask(eqn.interface, eqn.rule, eqn.active)
        for j, i in enumerate(k for k, f in enumerate(mask) if f):
            if i not in meshless:
                specs[j] = tuple(operand_specs[i])
    return specs


def mirrored(shape, operand_specs, operand_shapes, meshless=frozenset()):
    """The operand a result of `shape` mirrors, or None: the first one of that shape
    (batch dims included) split over the mesh, not in `meshless`.

    Example:
        >>> mirrored((8, 4), [(None, None), ("d", None), (None, "d")],
        ...          [(8, 4), (8, 4), (8, 4)])
        1
        >>> mirrored((4,), [("d", None)], [(8, 4)]) is None
        True
    """
    for i, (spec, own) in enumerate(zip(operand_specs, operand_shapes)):
        if i not in meshless and tuple(own) == tuple(shape) and any(map(_axes, spec)):
            return i
    return None


def whole_plan(eqn) -> Plan:
    """The plan of a call that runs on whole operands (one device, or every device on
    gathered inputs): every result whole, nothing summed."""
    return Plan({}, (), tuple((None,) * len(shape) for shape, _ in eqn.out_avals), ())


def warn_gathers(eqn, plan: Plan) -> None:
    """Warns, once per equation, that inputs split along a replicate factor are gathered.

    Such an input is all-gathered onto every device before the rule runs: correct,
    but the communication and memory of an unsharded op, which nothing else
    would tell the user about.
    """
    if not plan.gathered:
        return
    warned = eqn.op.handle.gather_warned
    if eqn.key in warned:
        return
    warned.add(eqn.key)
    io = eqn.io
    where = "" if eqn.rule == "forward" else f" (in its {eqn.rule} rule)"
    inputs = "; ".join(
        f"input {io.in_names[operand]!r} is split along dim {dim} (factor {factor!r}) over "
        f"mesh axes {axes}" for operand, dim, factor, axes in plan.gathered)
    factors = sorted({factor for _, _, factor, _ in plan.gathered})
    warnings.warn(
        f"{eqn.name}{where}: {inputs}, but the op declares "
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


def check_explicit_sums(name: str, plan: Plan) -> None:
    """Raises when a plan over Explicit mesh axes sums partial results on a JAX that cannot."""
    summed = sorted({axis for axes in plan.summed for axis in axes})
    if summed and not _compat.EXPLICIT_REDUCTIONS:
        raise _compat.ShardingTypeError(
            f"{name}: its inputs are split along a factor it sums over (reduce=, or a "
            f"cotangent of an input without that factor) on Explicit mesh axes {summed}; "
            f"adding the partial results there needs JAX >= 0.9 (this is JAX "
            f"{_compat.JAX_VERSION_TEXT}). Reshard the inputs whole along that factor "
            f"first, or use mesh axes of type Auto")


def local_equation(eqn, factors, plan: Plan, axis_sizes: dict, operand_shapes) -> tuple:
    """``(equation, operand shapes)`` each device runs under plan `plan`.

    Its ``signature`` and ``batch`` are the blocks' (each dim divided by its
    split). Raises RuleError when ``@abstract`` on the local shapes disagrees
    with the shapes the declaration implies (the declaration does not fit the op).
    """
    def local(names, shape):
        return tuple(plan.local_size(f, n, axis_sizes) for f, n in zip(names, shape))

    local_signature = _interface.with_leaves(eqn.signature, (
        (local(names, shape), dtype)
        for names, (shape, dtype) in zip(factors.inputs,
                                         _interface.signature_leaves(eqn.signature))))
    local_batch = local(factors.batch, eqn.batch)
    shard = eqn.with_shapes(local_signature, local_batch)
    local_in = tuple(local(names, shape) for names, shape in zip(factors.operands,
                                                                   operand_shapes))
    expected = [local(names, shape) for names, (shape, _) in zip(factors.results,
                                                                 eqn.out_avals)]
    got = [shape for shape, _ in shard.out_avals]
    for j, (g, e) in enumerate(zip(got, expected)):
        if g != e:
            raise RuleError(
                f"{eqn.name} ({eqn.rule}): on a shard, @abstract gives {shard.io.out_names[j]} "
                f"the shape {g}, but the sharding declaration implies {e} (local inputs "
                f"{[s for s, _ in _interface.signature_leaves(local_signature)]}); the declaration "
                f"does not match the op's shapes")
    return shard, local_in


def split_rank(factors, devices: int, looped: bool) -> int:
    """The rank of an equation XLA may split by itself, or 0 (then a callback splits it).

    That is when every operand and result has the same factors in the same
    order: the equation is elementwise (``"b n -> b n"``, a vmap dim included),
    so any split of any dims runs the same rule on each block, and nothing is
    summed or gathered. Each factor must divide evenly over all `devices` (so
    over any of their mesh axes), and none may be ``replicate`` (the callback
    path warns when it gathers one). Rules looped over a vmap dim are excluded:
    their kernel loops over the whole batch shape.
    """
    tensors = [*factors.operands, *factors.results]
    if looped or not tensors:
        return 0
    rank = len(tensors[0])
    if rank == 0 or any(tuple(t) != tuple(tensors[0]) for t in tensors[1:]):
        return 0
    names = tensors[0]
    if len(set(names)) != rank or any(
            f in factors.replicate or factors.sizes.get(f, 0) < devices
            or factors.sizes[f] % devices for f in names):
        return 0
    return rank


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


def to_spec(entries):
    """A PartitionSpec of `entries`, trailing whole dims left out (as users write them)."""
    entries = list(entries)
    while entries and entries[-1] is None:
        entries.pop()
    return _compat.P(*entries)


def partition_spec_of(struct) -> tuple:
    """The PartitionSpec entries of an array or aval, one per dim (None: whole)."""
    sharding = getattr(struct, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None:  # not a NamedSharding: treat as whole (XLA gathers)
        return (None,) * len(struct.shape)
    return tuple(spec) + (None,) * (len(struct.shape) - len(spec))


def common_mesh(operands) -> tuple:
    """``(mesh, specs)``: the one mesh the operands are sharded over, and their specs.

    Operands without a NamedSharding (NumPy values, scalars) count as whole.
    ``(None, None)`` when no operand has a mesh or two have different meshes.
    """
    mesh, specs = None, []
    for x in operands:
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, _compat.NamedSharding):
            if mesh is not None and sharding.mesh != mesh:
                return None, None
            mesh = sharding.mesh
        specs.append(partition_spec_of(x))
    return mesh, tuple(specs)
