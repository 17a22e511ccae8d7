"""The factors of every rule of an op, from its sharding declaration and one equation.

From a declaration (:mod:`jaxdecl._spec.sharding`), a rule kind and the shapes
of one equation (``signature`` and ``batch``), name the factor of every dim of
every operand and result of that rule. One declaration covers every rule:

- a tangent of input *i*, or a cotangent of output *j*, has the factors of
  its primal;
- a result without a factor that is split elsewhere is a sum over that
  factor's slices (a ``reduce`` factor of the forward; for a cotangent, the
  factors its input lacks);
- dims added by ``vmap`` (the ``batch`` parameter) are fresh independent
  factors; an operand that broadcasts along one (size 1 there) gets a factor
  of its own;
- residuals take the factors the declaration's ``residuals=`` part gives
  them. Each device's forward keeps the residuals of its own block, so a
  residual must have a dim for every factor the rules may split (all but
  ``replicate`` ones), and a residual dim no input has is a ``replicate``
  factor. The forward's outputs that a ``result=`` rule reads keep their
  declared factors.

Which mesh axes a factor is split over is decided later, by
:mod:`jaxdecl._sharded.plan` and :mod:`jaxdecl._transforms.lowering`.

Example:
    >>> import jax, numpy as np, jaxdecl as jd
    >>> from jaxdecl._spec.factors import resolve
    >>> from jaxdecl._spec.interface import interface_of
    >>> class MatVec(jd.Primitive, sharding="b k, k -> b", reduce=("k",)):
    ...     @jd.abstract
    ...     def shapes(self, a, x):
    ...         return jax.ShapeDtypeStruct(a.shape[:1], a.dtype)
    ...     @jd.forward
    ...     def apply(self, a, x):
    ...         return a @ x
    >>> spec = MatVec.__jaxdecl_spec__
    >>> f64 = np.dtype("float64")
    >>> interface = interface_of(spec, MatVec(), (((4, 3), f64), ((3,), f64)))
    >>> resolve(spec.sharding, interface, spec.params, "MatVec").sizes
    {'b': 4, 'k': 3}
"""

from __future__ import annotations

import dataclasses

from .rule_io import active_mask
from .sharding import ELLIPSIS, ShardingRule, check_inputs


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A declaration applied to one set of primal shapes: every dim named."""

    inputs: tuple  # per primal input leaf: a factor per dim
    outputs: tuple  # per forward output leaf: a factor per dim
    replicate: frozenset
    sizes: dict  # factor -> size (the whole, per batch element)
    saved: tuple | None = None  # per residual leaf: a factor per dim (None: not declared)
    carries_result: bool = False  # jvp/vjp equations carry the outputs (a rule takes result)
    owner: str = ""  # the class, for messages


def resolve(rule: ShardingRule, interface, params: tuple, owner: str,
            carries_result: bool = False) -> Resolved:
    """Names every dim of the forward at `interface`; ValueError when ranks or sizes disagree.

    `carries_result`: the op's jvp/vjp equations carry its outputs (a rule takes
    ``result``), which then take the outputs' factors there.
    """
    check_inputs(rule, params, owner)
    if len(rule.results) != len(interface.out_groups):
        raise ValueError(
            f"{owner}: sharding rule {rule.rule!r} describes {len(rule.results)} result(s), but "
            f"@abstract gives {len(interface.out_groups)}")
    # A pytree input (output) gives its factors to each of its leaves.
    out_rules = [None] * len(interface.outputs)
    for group, value in zip(interface.out_groups, rule.results):
        for position in group.positions:
            out_rules[position] = value
    saved_rules = _residual_rules(rule, interface, owner)
    values = tuple(rule.operands[p] for p in interface.leaf_param) + tuple(out_rules) + \
        saved_rules
    labels = [f"input {name!r}" for name in interface.input_names] + \
        list(interface.output_names) + \
        [f"residual {name}" for name in interface.saved_names[:len(saved_rules)]]
    shapes = [s for s, _ in interface.inputs] + [s for s, _ in interface.outputs] + \
        [s for s, _ in interface.saved[:len(saved_rules)]]
    lead = None
    named = []
    for label, value, shape in zip(labels, values, shapes):
        factors = value
        if value and value[0] == ELLIPSIS:
            n = len(shape) - (len(value) - 1)
            if n < 0:
                raise ValueError(
                    f"{owner}: sharding rule {rule.rule!r} gives {label} at least "
                    f"{len(value) - 1} dims, but it has shape {shape}")
            if lead is not None and lead != n:
                raise ValueError(
                    f"{owner}: sharding rule {rule.rule!r}: '...' stands for {lead} dims in "
                    f"one value and {n} in {label} (shape {shape})")
            lead = n
            factors = tuple(f"...{k}" for k in range(n)) + value[1:]
        elif len(value) != len(shape):
            raise ValueError(
                f"{owner}: sharding rule {rule.rule!r} gives {label} {len(value)} dim(s) "
                f"({' '.join(value) or 'a scalar'}), but it has shape {shape}")
        named.append(tuple(factors))
    sizes: dict = {}
    for label, factors, shape in zip(labels, named, shapes):
        for factor, size in zip(factors, shape):
            if sizes.setdefault(factor, size) != size:
                raise ValueError(
                    f"{owner}: sharding rule {rule.rule!r}: factor {factor!r} has size "
                    f"{sizes[factor]} in one value but {size} in {label} (shape {shape})")
    n_in, n_out = len(interface.inputs), len(interface.outputs)
    return Resolved(tuple(named[:n_in]), tuple(named[n_in:n_in + n_out]),
                    frozenset(rule.replicate), sizes,
                    tuple(named[n_in + n_out:]) if saved_rules else None, carries_result,
                    owner)


def _residual_rules(rule: ShardingRule, interface, owner: str) -> tuple:
    """Per residual leaf, its factors from ``residuals=`` (empty when not declared)."""
    if rule.residual_tree is None or not interface.saved:
        return ()
    tree = interface.saved_group.tree
    if rule.residual_tree != tree and not (tree is None and len(rule.residual_values) == 1):
        raise ValueError(
            f"{owner}: residuals= of sharding rule {rule.rule!r} has the structure "
            f"{rule.residual_tree}, but @residuals declares {tree}; give one factor string per "
            f"residual, in the same pytree")
    return tuple(factors for _, factors in rule.residual_values)


@dataclasses.dataclass(frozen=True)
class RuleFactors:
    """The factors of one equation of ``jaxdecl_call``."""

    operands: tuple  # per operand: a factor per dim (batch dims first)
    results: tuple  # per result: a factor per dim
    replicate: frozenset
    sizes: dict  # factor -> whole size
    inputs: tuple  # per primal input: its factors per batch element (for local signature)
    batch: tuple  # the factors of the batch dims, outermost first


def rule_factors(resolved: Resolved, interface, rule: str, wrt: int, batch: tuple,
                 operand_shapes: tuple, active: tuple | None = None) -> RuleFactors:
    """Names every dim of every operand and result of `rule` (see the module docstring).

    Example:
        >>> import jax, numpy as np, jaxdecl as jd
        >>> from jaxdecl._spec.interface import interface_of
        >>> class M(jd.Primitive, sharding="b k, k -> b", reduce=("k",)):
        ...     @jd.abstract
        ...     def shapes(self, a, x):
        ...         return jax.ShapeDtypeStruct(a.shape[:1], a.dtype)
        ...     @jd.forward
        ...     def apply(self, a, x):
        ...         return a @ x
        >>> f64 = np.dtype("float64")
        >>> spec = M.__jaxdecl_spec__
        >>> interface = interface_of(spec, M(), (((4, 3), f64), ((3,), f64)))
        >>> resolved = resolve(spec.sharding, interface, ("a", "x"), "M")
        >>> rule_factors(resolved, interface, "vjp", -1, (), ((4, 3), (3,), (4,))).results
        (('b', 'k'), ('k',))
    """
    n = len(interface.inputs)
    ins, outs = resolved.inputs, resolved.outputs
    # The leaves whose tangents (cotangents) the rule carries (returns).
    carried = tuple(i for i, f in enumerate(active_mask(interface, rule, active)) if f) \
        if rule in ("jvp", "vjp", "transpose") else ()
    float_outs = tuple(outs[j] for j in interface.float_out_indices)
    extras = _extra_factors(resolved, interface, rule)
    if rule == "forward":
        operands, results = ins, outs
    elif rule == "forward_saving":
        operands, results = ins, outs + extras
    elif rule == "jvp":
        operands, results = ins + tuple(ins[i] for i in carried) + extras, float_outs
    elif rule == "vjp":
        operands, results = ins + float_outs + extras, tuple(ins[i] for i in carried)
    elif rule == "transpose":
        operands = tuple(ins[i] for i in interface.lead_indices) + float_outs
        results = tuple(ins[i] for i in carried)
    elif rule == "transpose_wrt":
        operands = tuple(ins[i] for i in range(n) if i != wrt) + float_outs
        results = (ins[wrt],)
    else:  # pragma: no cover - internal
        raise ValueError(f"unknown rule {rule!r}")
    sizes = dict(resolved.sizes)
    batch_factors = tuple(f"#vmap{k}" for k in range(len(batch)))
    sizes.update(zip(batch_factors, batch))
    with_batch = []
    for index, (factors, shape) in enumerate(zip(operands, operand_shapes)):
        lead = []
        for k, size in enumerate(batch):
            if shape[k] == size:
                lead.append(batch_factors[k])
            else:  # broadcast along this batch dim: a factor of its own
                own = f"#bcast{index}.{k}"
                sizes[own] = shape[k]
                lead.append(own)
        with_batch.append(tuple(lead) + tuple(factors))
    results = tuple(batch_factors + tuple(r) for r in results)
    return RuleFactors(tuple(with_batch), results, resolved.replicate, sizes, ins,
                       batch_factors)


def _extra_factors(resolved: Resolved, interface, rule: str) -> tuple:
    """Factors of what a rule carries besides its usual operands (see rule_io.rule_io).

    ``forward_saving`` results end with the residuals; ``jvp``/``vjp`` operands
    with the forward's outputs (when a rule takes ``result``), then the residuals.
    """
    if rule == "forward_saving":
        result, saved = False, True
    elif rule in ("jvp", "vjp"):
        result, saved = resolved.carries_result, bool(interface.saved)
    else:
        return ()
    if saved and resolved.saved is None:
        raise ValueError(
            f"{resolved.owner} keeps residuals {list(interface.saved_names)} (@residuals), but its "
            f"sharding declaration does not say how they split: add residuals=, a pytree of factor "
            f"strings shaped like the residuals, beside sharding= (or to jd.ShardingRule), "
            f"e.g. residuals={{'lu': 'b n m', 'piv': 'b n'}}")
    return (resolved.outputs if result else ()) + (resolved.saved if saved else ())
