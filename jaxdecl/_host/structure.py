"""Rules that take and return pytrees: rebuilding arguments, flattening results.

The primitive and the host kernels deal in flat arrays; a user's rule sees
the pytrees its op was called with. :func:`structured_rule` wraps a rule with
a :class:`~jaxdecl._spec.interface.RuleIO` whose groups are pytrees into a function
of flat operands, for NumPy kernels and traceable rules alike. Ops whose
inputs and outputs are all arrays never pass through here.
:func:`stands_for_array` tells which arguments are arrays though they look
like pytrees (flax's ``nnx.Variable``).

Example:
    >>> import jax, jax.numpy as jnp, jaxdecl as jd
    >>> class Affine(jd.Primitive):
    ...     @jd.abstract
    ...     def shapes(self, x, p):
    ...         return {"y": jax.ShapeDtypeStruct(x.shape, x.dtype)}
    ...     @jd.forward
    ...     def apply(self, x, p):
    ...         return {"y": p["scale"] * x + p["shift"]}
    >>> out = Affine()(jnp.ones(2), {"scale": 3.0, "shift": jnp.ones(2)})
    >>> out["y"].tolist()
    [4.0, 4.0]
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .. import _compat
from .._errors import RuleError
from .._spec.rule_io import RuleIO

_tree = jax.tree_util


def stands_for_array(value) -> bool:
    """Whether `value` is one array to ``jax.numpy`` though not a JAX array.

    Such an object has ``__jax_array__`` (flax's ``nnx.Variable``, array
    wrappers); ``jnp.asarray`` gives the array it stands for. An op takes it
    as that array, as ``jax.numpy`` functions do, even where it is also a
    registered pytree: flattened as a pytree, its rules would receive the
    object and owe cotangents shaped like it, where JAX differentiates
    through ``__jax_array__`` and expects an array's. Given as ``is_leaf``
    when an op's arguments are flattened, it makes each such object one leaf,
    at the top of an argument or inside a pytree.
    """
    return getattr(value, "__jax_array__", None) is not None


def pack(groups, values) -> list:
    """The rule's arguments: each group's pytree with `values` at its leaves."""
    args = []
    for group in groups:
        if group.tree is None:  # (-1: no value there, a zero tangent or an unwanted result)
            args.append(None if group.positions[0] < 0 else values[group.positions[0]])
        else:
            args.append(group.tree.unflatten([None if s < 0 else values[s]
                                              for s in group.positions]))
    return args


def _is_none(x) -> bool:
    return x is None


class _Mismatch(Exception):
    pass


def _first_difference(expected, value) -> str:
    """Where `value`'s structure first departs from `expected`'s, as a key path."""
    if value is not None and type(value) is not type(expected):
        return f"the top level ({type(value).__name__} where a {type(expected).__name__} " \
               f"is expected)"
    want = [tuple(p) for p, _ in _tree.tree_flatten_with_path(expected)[0]]
    got = [tuple(p) for p, _ in _tree.tree_flatten_with_path(value, is_leaf=_is_none)[0]]
    for path in want:  # a leaf that nothing returned covers
        if not any(path[:len(g)] == g for g in got):
            return f"{_tree.keystr(path)} (missing)"
    for path in got:  # something returned where no leaf or subtree is expected
        if path not in want and not any(w[:len(path)] == path for w in want):
            return f"{_tree.keystr(path)} (not expected)"
    return "the top level"


def _leaves_of(group, value):
    """`value`'s leaves in `group`'s leaf order (None: a zero); raises _Mismatch."""
    if group.tree is None:
        return [value]
    expected = group.tree.unflatten(list(range(len(group.positions))))
    found = [None] * len(group.positions)

    def put(leaf, position):
        if isinstance(position, int):
            found[position] = leaf
        elif leaf is not None:  # an array where a subtree is expected
            raise _Mismatch
        return None

    try:
        _tree.tree_map(put, value, expected, is_leaf=_is_none)
    except (ValueError, TypeError, _Mismatch):
        raise _Mismatch from None
    return found


def leaves_or_none(group, value) -> list:
    """`value`'s leaves in `group`'s order, where `value` may hold None for a subtree."""
    try:
        return _leaves_of(group, value)
    except _Mismatch:
        raise ValueError(f"{value!r:.200} does not match the structure {group.tree}") from None


def unpack(io: RuleIO, value, context: str) -> list:
    """The flat results of a rule that returned `value` (None: a zero result)."""
    groups = io.results
    if io.single_result:
        values = (value,)
    elif type(value) in (tuple, list) and len(value) == len(groups):
        values = value
    else:
        got = len(value) if type(value) in (tuple, list) else 1
        labels = [_group_label(io, g) for g in groups]
        raise RuleError(
            f"{context} returned {got} result(s), but {len(groups)} were expected "
            f"({', '.join(labels)})")
    flat = [None] * len(io.out_names)
    for group, item in zip(groups, values):
        try:
            leaves = _leaves_of(group, item)
        except _Mismatch:
            expected = group.tree.unflatten(["*"] * len(group.positions))
            source = "its input's" if io.zeros_ok else "@abstract's"
            raise RuleError(
                f"{context} returned {_group_label(io, group)} with a structure that differs "
                f"from {source} at {_first_difference(expected, item)}: expected a pytree "
                f"like {expected}, got {_describe(item)}") from None
        for position, leaf in zip(group.positions, leaves):
            if position < 0:
                continue  # no tangent here (an integer leaf): whatever was returned
            if leaf is None and not io.zeros_ok:
                raise RuleError(f"{context} returned None for {io.out_names[position]}")
            flat[position] = leaf
    return flat


def _group_label(io: RuleIO, group) -> str:
    name = next((io.out_names[s] for s in group.positions if s >= 0), "a result")
    return name.split("[")[0]


def _describe(value) -> str:
    return str(_tree.tree_map(lambda x: type(x).__name__, value, is_leaf=_is_none))[:200]


def structured_rule(function, io: RuleIO, zero_copy: bool, context: str,
                    n_head: int = 0) -> tuple:
    """``(rule, io)``: `function` as a rule of flat operands and flat results.

    Called as ``rule(*head, *operands)`` (return form) or ``rule(*head,
    *operands, out=...)`` (zero-copy: fills the views through their pytree).
    `n_head` leading arguments (the op instance) pass unchanged. Where only
    the arguments are pytrees, the results pass as the rule gives them and
    `io` is unchanged, so the kernel stores them as an array op's (a pytree
    argument then costs its packing alone); else the rule returns (or takes)
    the flat results, and the returned `io` says so.
    """
    args_groups, result_groups, single = io.args, io.results, io.single_result
    pack_args = packer(args_groups)
    if all(g.tree is None and g.positions[0] >= 0 for g in result_groups):
        rule = _argument_packing_rule(function, args_groups, len(io.in_names), zero_copy, n_head)
        return rule, io
    if zero_copy:
        def rule(*operands, out):
            head, flat = operands[:n_head], operands[n_head:]
            outs = pack(result_groups, out)
            return function(*head, *pack_args(flat), out=outs[0] if single else tuple(outs))
    else:
        def rule(*operands):
            head, flat = operands[:n_head], operands[n_head:]
            return unpack(io, function(*head, *pack_args(flat)), context)
    return rule, dataclasses.replace(io, single_result=False)


def _argument_packing_rule(function, groups, n_operands: int, zero_copy: bool, n_head: int):
    """``rule(*head, *operands[, out])``: `function` called with its pytree arguments.

    Its source is written for these groups, e.g. ``function(h0, {'x': v0, 'y': v1}, v2,
    out=out)``: the kernel calls it on every call, and a loop over the groups
    (or a tree's ``unflatten``) would cost more than the rule's own call.
    """
    names = {"function": function}
    args = [f"h{k}" for k in range(n_head)]
    for index, group in enumerate(groups):
        leaves = ["None" if s < 0 else f"v{s}" for s in group.positions]
        if group.tree is None:
            args.append(leaves[0])
            continue
        try:
            args.append(_literal(group.tree, iter(leaves)))
        except _NotLiteral:  # another node type: JAX rebuilds it
            names[f"t{index}"] = group.tree.unflatten
            args.append(f"t{index}([{', '.join(leaves)}])")
    params = [f"h{k}" for k in range(n_head)] + [f"v{k}" for k in range(n_operands)]
    if zero_copy:
        params.append("*, out")
        args.append("out=out")
    source = f"def rule({', '.join(params)}):\n    return function({', '.join(args)})\n"
    exec(compile(source, "<jaxdecl pytree arguments>", "exec"), names)  # noqa: S102
    return names["rule"]


class _NotLiteral(Exception):
    pass


def _literal(tree, leaves) -> str:
    """Python source that builds `tree` from `leaves` (sources), for dicts, tuples, lists."""
    if tree.num_nodes == 1 and tree.num_leaves == 1:
        return next(leaves)
    kind, keys = tree.node_data()
    parts = [_literal(child, leaves) for child in tree.children()]
    if kind is dict and all(type(k) in (str, int) for k in keys):
        return "{" + ", ".join(f"{k!r}: {p}" for k, p in zip(keys, parts)) + "}"
    if kind is tuple:
        return "(" + "".join(f"{p}, " for p in parts) + ")"
    if kind is list:
        return "[" + ", ".join(parts) + "]"
    if kind is type(None):
        return "None"
    raise _NotLiteral


def packer(groups):
    """``pack(values)``: :func:`pack` for these `groups`, with their shapes decided once."""
    steps = [(g.positions[0], None, None) if g.tree is None else
             (-1, g.tree.unflatten, g.positions) for g in groups]

    def pack_values(values):
        return [(None if index < 0 else values[index]) if unflatten is None else
                unflatten([None if s < 0 else values[s] for s in slots])
                for index, unflatten, slots in steps]

    return pack_values


def traceable_rule(function, io: RuleIO, context: str, symbolic: bool = False):
    """A traceable rule as ``f(*flat operands) -> list of flat results``, zeros filled
    (left None where `symbolic`: the caller makes them symbolic zeros)."""
    direct = not io.structured and all(g.tree is None and g.positions == (k,)
                                       for k, g in enumerate(io.args))

    def evaluate(*operands):
        operands = _compat.plain_values(operands)
        if direct:
            result = function(*operands)
            flat = list(result) if isinstance(result, (tuple, list)) else [result]
        else:
            flat = unpack(io, function(*pack(io.args, operands)), context)
        return filled(flat, io, symbolic)

    return evaluate


def filled(flat, io: RuleIO, symbolic: bool = False) -> list:
    """A traceable rule's flat results: zeros for None (kept None where `symbolic`), and
    the real part of a complex cotangent of a real input (as JAX keeps it)."""
    return [(None if symbolic else jnp.zeros(*aval)) if x is None else
            jnp.real(x) if real and jnp.iscomplexobj(x) else x
            for x, aval, real in zip(flat, io.out_avals, io.real_results)]
