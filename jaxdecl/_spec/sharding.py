"""Sharding declarations: what an op says about how its dims relate across devices.

An op declares how the dims of its forward's inputs and results relate, in
the einsum-like factor syntax of ``custom_partitioning``'s ``sharding_rule``:
``sharding="b k, k -> b"``. One name per dim; a name is a *factor*. A factor
is independent (the rules may run on any slice along it) unless listed in
``replicate=`` (the rules need it whole) or ``reduce=`` (the rules sum over it:
partial results are added up across devices). Residuals (``@jd.residuals``)
take the factors of a ``residuals=`` part, a pytree of factor strings shaped
like them: ``residuals={"lu": "b n m", "piv": "b n"}``.

This module parses and checks a declaration (:class:`ShardingRule`, the class
options, a ``@jd.sharding`` method's result);
:mod:`jaxdecl._spec.factors` applies it to the shapes of one equation.

Example:
    >>> from jaxdecl._spec.sharding import ShardingRule
    >>> rule = ShardingRule("b k, k -> b", reduce=("k",))
    >>> rule.operands, rule.results
    ((('b', 'k'), ('k',)), (('b',),))
"""

from __future__ import annotations

import re

from .._errors import DeclarationError, RuleError

_FACTOR = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
ELLIPSIS = "..."


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
        if name == ELLIPSIS:
            if position != 0:
                raise DeclarationError(
                    f"{owner}: sharding rule {rule!r}: '...' may only stand first "
                    f"(for leading dims)")
        elif not _FACTOR.match(name):
            raise DeclarationError(
                f"{owner}: sharding rule {rule!r}: {name!r} is not a factor name (a letter, "
                f"then letters, digits or underscores; '...' for leading dims)")
    named = [f for f in factors if f != ELLIPSIS]
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
        used_in = set(f for v in self.operands for f in v if f != ELLIPSIS)
        used_out = set(f for v in self.results for f in v if f != ELLIPSIS)
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
        has_ellipsis = [bool(v) and v[0] == ELLIPSIS for v in self.operands + self.results
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
        named = set(factors) - {ELLIPSIS}
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


def call_method(method, instance, interface, owner: str) -> ShardingRule:
    """Runs a ``@jd.sharding`` method on the inputs as ShapeDtypeStructs."""
    result = method.bind(instance)(*interface.input_structs())
    if not isinstance(result, ShardingRule):
        raise RuleError(f"{owner}.{method.name} (@sharding) must return jd.ShardingRule(...), "
                        f"got {type(result).__name__}")
    return result
