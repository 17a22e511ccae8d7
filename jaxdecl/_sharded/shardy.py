"""What XLA's partitioners are told of an equation: the Shardy rule of its factors, and
whether XLA may split its call by itself.

Pure functions of an equation's factors (:mod:`jaxdecl._sharded.plan` decides
where they live when jaxdecl plans the split itself).

Example:
    >>> from jaxdecl._spec.factors import RuleFactors
    >>> f = RuleFactors(operands=(("b", "n"),), results=(("b", "n"),),
    ...                 replicate=frozenset(), sizes={"b": 8, "n": 4}, inputs=(), batch=())
    >>> split_rank(f, 4, looped=False)
    2
"""

from __future__ import annotations

import itertools

from .. import _compat


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


def sdy_rule(factors, *, declared: bool = True):
    """The Shardy sharding rule of one equation (factors renamed f0, f1, ...).

    An op without a declaration (`declared` False) computes each result whole,
    then keeps the block of it that Shardy gives the result: the factors a result
    shares with an operand (:func:`jaxdecl._op.equation.undeclared_factors`) carry
    that operand's sharding over to it instead of requiring both whole. Its
    operands are gathered all the same: the plan takes every such factor whole.
    """
    names: dict = {}
    for f in itertools.chain(*factors.operands, *factors.results):
        names.setdefault(f, f"f{len(names)}")
    in_results = set(itertools.chain(*factors.results))
    reduction = tuple(names[f] for f in names if f not in in_results
                      and f not in factors.replicate)
    replicate = tuple(names[f] for f in names if f in factors.replicate
                      and (declared or f not in in_results))
    mapping = _compat.sdy.ArrayMapping
    return _compat.sdy.SdyShardingRule(
        tuple(mapping(*(names[f] for f in v)) for v in factors.operands),
        tuple(mapping(*(names[f] for f in v)) for v in factors.results),
        reduction_factors=reduction, need_replication_factors=replicate)
