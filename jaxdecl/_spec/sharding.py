"""Sharding declarations and the factors of every rule derived from them.

An op declares how the dims of its forward's inputs and results relate, in
the einsum-like factor syntax of ``custom_partitioning``'s ``sharding_rule``:
``sharding="b k, k -> b"``. One name per dim; a name is a *factor*. A factor
is independent (the rules may run on any slice along it) unless listed in
``replicate=`` (the rules need it whole) or ``reduce=`` (the rules sum over it:
partial results are added up across devices).

This module has one job: from a declaration, a rule kind and the shapes of
one equation (``primals`` and ``batch``), name the factor of every dim of
every operand and result of that rule. One declaration covers every rule:

- a tangent of input *i*, or a cotangent of output *j*, has the factors of
  its primal;
- a result without a factor that is split elsewhere is a sum over that
  factor's slices (a ``reduce`` factor of the forward; for a cotangent, the
  factors its input lacks);
- dims added by ``vmap`` (the ``batch`` parameter) are fresh independent
  factors; an operand that broadcasts along one (size 1 there) gets a factor
  of its own;
- residuals (``@jd.residuals``) take the factors the declaration's
  ``residuals=`` part gives them, a pytree of factor strings shaped like the
  residuals: ``residuals={"lu": "b n m", "piv": "b n"}``. Each device's forward
  keeps the residuals of its own block, so a residual must have a dim for
  every factor the rules may split (all but ``replicate`` ones), and a
  residual dim no input has is a ``replicate`` factor. The forward's outputs
  that a ``result=`` rule reads keep their declared factors.

Which mesh axes a factor is split over is decided later, by
:mod:`jaxdecl._sharded.plan` and :mod:`jaxdecl._transforms.lowering`.

Example:
    >>> from jaxdecl._spec.sharding import ShardingRule
    >>> rule = ShardingRule("b k, k -> b", reduce=("k",))
    >>> rule.operands, rule.results
    ((('b', 'k'), ('k',)), (('b',),))
"""

from __future__ import annotations

import dataclasses
import re

from .._errors import DeclarationError, RuleError

_FACTOR = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_ELLIPSIS = "..."


def _names(value, what: str, owner: str) -> tuple:
    if isinstance(value, str):
        value = (value,)
    try:
        names = tuple(value)
    except TypeError:
        raise DeclarationError(f"{owner}: {what}= must be a tuple of factor names, "
                               f"got {value!r}") from None
    for name in names:
        if not isinstance(name, str):
            raise DeclarationError(f"{owner}: {what}= must hold factor names (str), "
                                   f"got {name!r}")
    return names


def _parse_value(text: str, owner: str, rule: str) -> tuple:
    factors = tuple(text.split())
    for position, name in enumerate(factors):
        if name == _ELLIPSIS:
            if position != 0:
                raise DeclarationError(
                    f"{owner}: sharding rule {rule!r}: '...' may only stand first "
                    f"(for leading dims)")
        elif not _FACTOR.match(name):
            raise DeclarationError(
                f"{owner}: sharding rule {rule!r}: {name!r} is not a factor name (a letter, "
                f"then letters, digits or underscores; '...' for leading dims)")
    named = [f for f in factors if f != _ELLIPSIS]
    if len(set(named)) != len(named):
        raise DeclarationError(
            f"{owner}: sharding rule {rule!r}: a factor names two dims of one array ({text!r})")
    return factors


class ShardingRule:
    """How an op may be split across devices: factors, and which are special.

    ``rule`` is an einsum-like string over the forward's inputs and results,
    ``"b n, n -> b n"``; ``replicate`` lists factors a rule needs whole,
    ``reduce`` factors a rule sums over. Returned by a ``@jd.sharding``
    method, or built from the class options ``sharding=``, ``replicate=``,
    ``reduce=``.

    Example:
        >>> import jaxdecl as jd
        >>> jd.ShardingRule("b n -> b n", replicate=("n",))
        ShardingRule('b n -> b n', replicate=('n',), reduce=())
    """

    __slots__ = ("rule", "replicate", "reduce", "operands", "results", "residuals",
                 "residual_tree", "residual_values")

    def __init__(self, rule: str, replicate=(), reduce=(), *, residuals=None,
                 owner: str = "ShardingRule"):
        if not isinstance(rule, str):
            raise DeclarationError(f"{owner}: the sharding rule must be a string such as "
                                   f"'b n -> b n', got {rule!r}")
        if rule.count("->") != 1:
            raise DeclarationError(
                f"{owner}: sharding rule {rule!r} needs exactly one '->' between the inputs "
                f"and the results")
        left, right = rule.split("->")

        def values(side):
            side = side.strip()
            return () if not side else tuple(
                _parse_value(part, owner, rule) for part in side.split(","))

        self.rule = rule
        self.operands = values(left)
        # Nothing after '->' is one 0-d result (a dot product: "n, n -> ").
        self.results = values(right) or ((),)
        self.replicate = _names(replicate, "replicate", owner)
        self.reduce = _names(reduce, "reduce", owner)
        used_in = set(f for v in self.operands for f in v if f != _ELLIPSIS)
        used_out = set(f for v in self.results for f in v if f != _ELLIPSIS)
        for what, names in (("replicate", self.replicate), ("reduce", self.reduce)):
            for name in names:
                if name not in used_in | used_out:
                    raise DeclarationError(
                        f"{owner}: {what}= names {name!r}, which is no factor of the sharding "
                        f"rule {rule!r}")
        both = set(self.replicate) & set(self.reduce)
        if both:
            raise DeclarationError(
                f"{owner}: factor(s) {sorted(both)} are in both replicate= and reduce=; a "
                f"factor is needed whole or summed over, not both")
        # A result dim that no input has (a padded or resized axis) is computed
        # whole by every rule: it must be declared replicate.
        only_out = used_out - used_in - set(self.replicate)
        if only_out:
            raise DeclarationError(
                f"{owner}: sharding rule {rule!r}: factor(s) {sorted(only_out)} appear in the "
                f"results only; list such a factor in replicate= (no input can split it)")
        for name in self.reduce:
            if name in used_out:
                raise DeclarationError(
                    f"{owner}: reduce= names {name!r}, but the results of {rule!r} have a dim "
                    f"{name!r}; a factor the rules sum over cannot be a result dim")
        for index, value in enumerate(self.results):
            missing = used_in - set(value) - set(self.replicate) - set(self.reduce)
            if missing:
                raise DeclarationError(
                    f"{owner}: sharding rule {rule!r}: result {index} has no dim for factor(s) "
                    f"{sorted(missing)}; list such a factor in reduce= (the rules sum over it) "
                    f"or replicate= (the rules need it whole)")
        self.residuals = residuals
        self.residual_tree, self.residual_values = _parse_residuals(
            residuals, used_in, self.replicate, owner, rule)
        has_ellipsis = [bool(v) and v[0] == _ELLIPSIS for v in self.operands + self.results
                        + tuple(v for _, v in self.residual_values)]
        if any(has_ellipsis) and not all(has_ellipsis):
            raise DeclarationError(
                f"{owner}: sharding rule {rule!r}: '...' must lead every input and result "
                f"(and residual) or none")

    def _key(self) -> tuple:
        tree = None if self.residual_tree is None else str(self.residual_tree)
        return (self.rule, self.replicate, self.reduce, tree, self.residual_values)

    def __repr__(self) -> str:
        extra = "" if self.residuals is None else f", residuals={self.residuals!r}"
        return (f"ShardingRule({self.rule!r}, replicate={self.replicate!r}, "
                f"reduce={self.reduce!r}{extra})")

    def __eq__(self, other):
        return isinstance(other, ShardingRule) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())


def _parse_residuals(residuals, used_in: set, replicate: tuple, owner: str, rule: str):
    """``(tree, ((label, factors), ...))`` of a ``residuals=`` pytree of factor strings."""
    if residuals is None:
        return None, ()
    import jax

    with_paths, tree = jax.tree_util.tree_flatten_with_path(residuals)
    if not with_paths:
        raise DeclarationError(f"{owner}: residuals= holds no factor strings ({residuals!r})")
    splittable = used_in - set(replicate)
    values = []
    for path, text in with_paths:
        label = "saved" + jax.tree_util.keystr(tuple(path))
        if not isinstance(text, str):
            raise DeclarationError(
                f"{owner}: residuals= must hold one factor string per residual, like "
                f"'b n'; {label} is {text!r}")
        factors = _parse_value(text, owner, f"residuals {label}: {text!r}")
        named = set(factors) - {_ELLIPSIS}
        new = named - used_in - set(replicate)
        if new:
            raise DeclarationError(
                f"{owner}: residual {label} ({text!r}) has factor(s) {sorted(new)} that no "
                f"input has; list such a factor in replicate= (each device keeps it whole)")
        missing = splittable - named
        if missing:
            raise DeclarationError(
                f"{owner}: residual {label} ({text!r}) has no dim for factor(s) "
                f"{sorted(missing)} of sharding rule {rule!r}; each device keeps the "
                f"residuals of its own block, so a residual needs a dim for every factor the "
                f"rules may split (or list the factor in replicate=)")
        values.append((label, factors))
    return tree, tuple(values)


def from_options(owner: str, options: dict, params: tuple) -> ShardingRule | None:
    """The class options ``sharding=``/``replicate=``/``reduce=`` as a rule (None if absent)."""
    rule = options.get("sharding")
    if rule is None:
        for key in ("replicate", "reduce", "residuals"):
            if options.get(key):
                raise DeclarationError(f"{owner}: {key}= needs a sharding= rule to refer to")
        return None
    declared = ShardingRule(rule, options.get("replicate", ()), options.get("reduce", ()),
                            residuals=options.get("residuals"), owner=owner)
    check_inputs(declared, params, owner)
    return declared


def check_inputs(rule: ShardingRule, params: tuple, owner: str) -> None:
    if len(rule.operands) != len(params):
        raise DeclarationError(
            f"{owner}: sharding rule {rule.rule!r} describes {len(rule.operands)} input(s), "
            f"but the op takes {len(params)} ({', '.join(params)})")


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


def resolve(rule: ShardingRule, layout, params: tuple, owner: str,
            carries_result: bool = False) -> Resolved:
    """Names every dim of the forward at `layout`; ValueError when ranks or sizes disagree.

    `carries_result`: the op's jvp/vjp equations carry its outputs (a rule takes
    ``result``), which then take the outputs' factors there.
    """
    check_inputs(rule, params, owner)
    if len(rule.results) != len(layout.out_groups):
        raise ValueError(
            f"{owner}: sharding rule {rule.rule!r} describes {len(rule.results)} result(s), but "
            f"@abstract gives {len(layout.out_groups)}")
    # A pytree input (output) gives its factors to each of its leaves.
    out_rules = [None] * len(layout.outputs)
    for group, value in zip(layout.out_groups, rule.results):
        for slot in group.slots:
            out_rules[slot] = value
    saved_rules = _residual_rules(rule, layout, owner)
    values = tuple(rule.operands[p] for p in layout.leaf_param) + tuple(out_rules) + \
        saved_rules
    labels = [f"input {name!r}" for name in layout.input_names] + list(layout.output_names) + \
        [f"residual {name}" for name in layout.saved_names[:len(saved_rules)]]
    shapes = [s for s, _ in layout.inputs] + [s for s, _ in layout.outputs] + \
        [s for s, _ in layout.saved[:len(saved_rules)]]
    lead = None
    named = []
    for label, value, shape in zip(labels, values, shapes):
        factors = value
        if value and value[0] == _ELLIPSIS:
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
    n_in, n_out = len(layout.inputs), len(layout.outputs)
    return Resolved(tuple(named[:n_in]), tuple(named[n_in:n_in + n_out]),
                    frozenset(rule.replicate), sizes,
                    tuple(named[n_in + n_out:]) if saved_rules else None, carries_result,
                    owner)


def _residual_rules(rule: ShardingRule, layout, owner: str) -> tuple:
    """Per residual leaf, its factors from ``residuals=`` (empty when not declared)."""
    if rule.residual_tree is None or not layout.saved:
        return ()
    tree = layout.saved_group.tree
    if rule.residual_tree != tree and not (tree is None and len(rule.residual_values) == 1):
        raise ValueError(
            f"{owner}: residuals= of sharding rule {rule.rule!r} has the structure "
            f"{rule.residual_tree}, but @residuals declares {tree}; give one factor string per "
            f"residual, in the same pytree")
    return tuple(factors for _, factors in rule.residual_values)


def call_method(method, instance, layout, owner: str) -> ShardingRule:
    """Runs a ``@jd.sharding`` method on the inputs as ShapeDtypeStructs."""
    result = method.bind(instance)(*layout.input_structs())
    if not isinstance(result, ShardingRule):
        raise RuleError(f"{owner}.{method.name} (@sharding) must return jd.ShardingRule(...), "
                        f"got {type(result).__name__}")
    return result


@dataclasses.dataclass(frozen=True)
class RuleFactors:
    """The factors of one equation of ``jaxdecl_call``."""

    operands: tuple  # per operand: a factor per dim (batch dims first)
    results: tuple  # per result: a factor per dim
    replicate: frozenset
    sizes: dict  # factor -> whole size
    inputs: tuple  # per primal input: its factors per batch element (for local primals)
    batch: tuple  # the factors of the batch dims, outermost first


def rule_factors(resolved: Resolved, layout, rule: str, wrt: int, batch: tuple,
                 operand_shapes: tuple) -> RuleFactors:
    """Names every dim of every operand and result of `rule` (see the module docstring).

    Example:
        >>> import jax, numpy as np, jaxdecl as jd
        >>> from jaxdecl._spec.layout import compute_layout
        >>> class M(jd.Primitive, sharding="b k, k -> b", reduce=("k",)):
        ...     @jd.abstract
        ...     def shapes(self, a, x):
        ...         return jax.ShapeDtypeStruct(a.shape[:1], a.dtype)
        ...     @jd.forward
        ...     def apply(self, a, x):
        ...         return a @ x
        >>> f64 = np.dtype("float64")
        >>> spec = M.__jaxdecl_spec__
        >>> layout = compute_layout(spec, M(), (((4, 3), f64), ((3,), f64)))
        >>> resolved = resolve(spec.sharding, layout, ("a", "x"), "M")
        >>> rule_factors(resolved, layout, "vjp", -1, (), ((4, 3), (3,), (4,))).results
        (('b', 'k'), ('k',))
    """
    n = len(layout.inputs)
    ins, outs = resolved.inputs, resolved.outputs
    diff = layout.diff_indices
    float_outs = tuple(outs[j] for j in layout.float_out_indices)
    extras = _extra_factors(resolved, layout, rule)
    if rule == "forward":
        operands, results = ins, outs
    elif rule == "forward_saving":
        operands, results = ins, outs + extras
    elif rule == "jvp":
        operands, results = ins + tuple(ins[i] for i in diff) + extras, float_outs
    elif rule == "vjp":
        operands, results = ins + float_outs + extras, tuple(ins[i] for i in diff)
    elif rule == "transpose":
        operands = tuple(ins[i] for i in range(n) if not layout.diff[i]) + float_outs
        results = tuple(ins[i] for i in diff)
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


def _extra_factors(resolved: Resolved, layout, rule: str) -> tuple:
    """Factors of what a rule carries besides its usual operands (see _layout.rule_io).

    ``forward_saving`` results end with the residuals; ``jvp``/``vjp`` operands
    with the forward's outputs (when a rule takes ``result``), then the residuals.
    """
    if rule == "forward_saving":
        result, saved = False, True
    elif rule in ("jvp", "vjp"):
        result, saved = resolved.carries_result, bool(layout.saved)
    else:
        return ()
    if saved and resolved.saved is None:
        raise ValueError(
            f"{resolved.owner} keeps residuals {list(layout.saved_names)} (@residuals), but its "
            f"sharding declaration does not say how they split: add residuals=, a pytree of factor "
            f"strings shaped like the residuals, beside sharding= (or to jd.ShardingRule), "
            f"e.g. residuals={{'lu': 'b n m', 'piv': 'b n'}}")
    return (resolved.outputs if result else ()) + (resolved.saved if saved else ())
