"""An op's signature at one set of inputs: its flat leaves and how arguments group them.

jaxdecl emits one JAX primitive, ``jaxdecl_call``, which sees arrays only: an
input that is a pytree contributes its leaves, in JAX's flattening order. A
:class:`Interface` is the op at one signature (its ``signature``: per input, its
``(shape, dtype)`` or a :class:`TreeAval`): the input and output leaves, which
carry tangents, and how each argument (and result) is rebuilt from flat
leaves (:class:`Group`). :func:`interface_of` makes one by asking
``@abstract``. Which of those leaves each rule takes and returns is
:mod:`jaxdecl._spec.rule_io`.

"Differentiable" means floating or complex and not in an input listed in
``nondiff=``; "float" outputs are the floating or complex ones. "Residuals"
are the leaves of what ``@jd.residuals`` declares (see :mod:`jaxdecl._spec.residuals`).
"Linear" leaves are the differentiable leaves of the inputs ``linear=`` names
(every differentiable leaf for ``linear=True``); the others are a linear op's
"lead" leaves, which its transpose takes before the cotangents.

The user's rule sees *arguments*, not leaves: a :class:`Group` says how one
argument is rebuilt from flat operands (and one result flattened back). The
arity of a rule follows its differentiable values: ``@jvp`` gets
one tangent per input with a differentiable leaf and returns one per output
with a float leaf, bare when there is exactly one; inside a tangent pytree a
leaf that has no tangent (an integer leaf) is ``None``.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from .. import _dtypes
from .._errors import RuleError

FORWARD, JVP, VJP, TRANSPOSE, TRANSPOSE_WRT = "forward", "jvp", "vjp", "transpose", "transpose_wrt"
FORWARD_SAVING = "forward_saving"

Aval = tuple  # (shape: tuple[int, ...], dtype: np.dtype), hashable


def aval_of(x) -> Aval:
    """The (shape, dtype) key of an array, tracer or ShapeDtypeStruct."""
    aval = getattr(x, "aval", x)
    return (tuple(aval.shape), np.dtype(aval.dtype))


@dataclasses.dataclass(frozen=True)
class TreeAval:
    """The signature of a pytree input: its structure and its leaves' avals.

    An entry of the primitive's ``signature`` parameter; an array input's entry
    is its plain :data:`Aval`.
    """

    tree: object  # jax.tree_util.PyTreeDef
    leaves: tuple  # Avals


def signature_leaves(signature: tuple) -> list:
    """The Avals of every leaf of `signature` (entries: Avals or TreeAvals), in order."""
    leaves = []
    for entry in signature:
        leaves.extend(entry.leaves if isinstance(entry, TreeAval) else (entry,))
    return leaves


def with_leaves(signature: tuple, leaves) -> tuple:
    """`signature` with its leaves' Avals replaced by `leaves` (same order and count)."""
    leaves = iter(leaves)
    return tuple(TreeAval(e.tree, tuple(next(leaves) for _ in e.leaves))
                 if isinstance(e, TreeAval) else next(leaves) for e in signature)


@dataclasses.dataclass(frozen=True)
class Group:
    """One argument (or result) of a rule and the flat values it is made of.

    `tree` is None for a bare array (one position). `positions` holds, per leaf of
    `tree`, the index of its flat operand (or result), or -1 for a leaf that
    has no value there (``None`` in a tangent pytree).
    """

    tree: object
    positions: tuple


def bare_group(position: int) -> Group:
    """The group of a bare array argument at flat `position`."""
    return Group(None, (position,))


@dataclasses.dataclass(frozen=True)
class Interface:
    """The op's signature at one set of primal inputs: flat leaves and their grouping."""

    inputs: tuple  # Avals of the primal input leaves
    outputs: tuple  # Avals of the forward output leaves
    single_output: bool  # @abstract returned one value (array or pytree), not a tuple
    diff: tuple  # per input leaf: carries a tangent
    float_out: tuple  # per output leaf: carries a tangent
    in_groups: tuple  # per input argument: its Group over input leaves
    out_groups: tuple  # per output: its Group over output leaves
    input_names: tuple  # per input leaf, for messages: "x" or "params['a']"
    output_names: tuple  # per output leaf: "output", "output 1" or "output['a']"
    leaf_param: tuple  # per input leaf: index of its argument
    saved: tuple = ()  # Avals of the residual leaves (@jd.residuals); () without
    saved_group: Group | None = None  # the residuals' pytree over positions 0..len(saved)-1
    saved_names: tuple = ()  # per residual leaf: "saved" or "saved['lu']"
    linear: tuple = ()  # per input leaf: differentiable and in an input named by linear=

    # Derived once, read at every step of a trace (attributes, not properties).
    diff_indices: tuple = dataclasses.field(init=False, repr=False, compare=False)
    #: The input leaves without a tangent (integers, nondiff=).
    nondiff_indices: tuple = dataclasses.field(init=False, repr=False, compare=False)
    #: The input leaves a linear op is linear in: its transpose's results.
    linear_indices: tuple = dataclasses.field(init=False, repr=False, compare=False)
    #: The other input leaves: a linear op's transpose's lead operands (for linear=True,
    #: the nondiff ones).
    lead_indices: tuple = dataclasses.field(init=False, repr=False, compare=False)
    #: Differentiable leaves a partly linear op is not linear in (@jvp/@vjp differentiate).
    other_indices: tuple = dataclasses.field(init=False, repr=False, compare=False)
    float_out_indices: tuple = dataclasses.field(init=False, repr=False, compare=False)
    #: Some argument or output is a pytree rather than an array.
    structured: bool = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        linear = self.linear or (False,) * len(self.diff)
        derived = {"diff_indices": tuple(i for i, d in enumerate(self.diff) if d),
                   "nondiff_indices": tuple(i for i, d in enumerate(self.diff) if not d),
                   "linear_indices": tuple(i for i, f in enumerate(linear) if f),
                   "lead_indices": tuple(i for i, f in enumerate(linear) if not f),
                   "other_indices": tuple(i for i, (d, f) in enumerate(zip(self.diff, linear))
                                          if d and not f),
                   "float_out_indices": tuple(i for i, f in enumerate(self.float_out) if f),
                   "structured": any(g.tree is not None
                                     for g in self.in_groups + self.out_groups)}
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    def input_structs(self) -> list:
        """The inputs as @abstract sees them: ShapeDtypeStructs, in pytrees where given."""
        structs = [jax.ShapeDtypeStruct(s, d) for s, d in self.inputs]
        return [structs[g.positions[0]] if g.tree is None else
                g.tree.unflatten([structs[s] for s in g.positions]) for g in self.in_groups]


def _label(name: str, path) -> str:
    return name + jax.tree_util.keystr(tuple(path)) if path else name


def _flatten_structs(value, what: str, context: str):
    """Leaves and treedef of a pytree of ShapeDtypeStructs returned by @abstract."""
    with_paths, tree = jax.tree_util.tree_flatten_with_path(value)
    if jax.tree_util.treedef_is_leaf(tree):
        return [((), value)], None
    if not with_paths:
        raise RuleError(f"{context} returned {what} with no arrays in it ({value!r:.80})")
    return with_paths, tree


def interface_of(spec, instance, inputs: tuple) -> Interface:
    """Runs @abstract on `inputs` (Avals or TreeAvals) and validates what it returns."""
    rule = spec.rules["abstract"]
    context = f"{spec.name}.{rule.name} (@abstract)"
    leaves, in_groups, names, leaf_param = [], [], [], []
    structs = []
    for index, (name, entry) in enumerate(zip(spec.params, inputs)):
        if isinstance(entry, TreeAval):
            start = len(leaves)
            leaves.extend(entry.leaves)
            in_groups.append(Group(entry.tree, tuple(range(start, len(leaves)))))
            paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(
                entry.tree.unflatten([0] * len(entry.leaves)))[0]]
            names.extend(_label(name, p) for p in paths)
            leaf_param.extend([index] * len(entry.leaves))
            structs.append(entry.tree.unflatten(
                [jax.ShapeDtypeStruct(s, d) for s, d in entry.leaves]))
        else:
            in_groups.append(bare_group(len(leaves)))
            leaves.append(entry)
            names.append(name)
            leaf_param.append(index)
            structs.append(jax.ShapeDtypeStruct(*entry))
    result = rule.bind(instance)(*structs)
    single = type(result) not in (tuple, list)
    results = (result,) if single else tuple(result)
    if not results:
        raise RuleError(f"{context} returned no outputs")
    outputs, out_groups, out_names = [], [], []
    for index, value in enumerate(results):
        base = "output" if single else f"output {index}"
        with_paths, tree = _flatten_structs(value, base, context)
        start = len(outputs)
        for path, struct in with_paths:
            label = _label(base, path)
            outputs.append(_output_aval(struct, label, context))
            out_names.append(label)
        out_groups.append(Group(tree, tuple(range(start, len(outputs)))))
    diff = tuple(
        dtype in _dtypes.DIFFERENTIABLE and spec.params[p] not in spec.nondiff
        for p, (_, dtype) in zip(leaf_param, leaves)
    )
    float_out = tuple(dtype in _dtypes.DIFFERENTIABLE for _, dtype in outputs)
    linear = tuple(d and spec.params[p] in spec.linear for p, d in zip(leaf_param, diff))
    saved, saved_group, saved_names = _residual_avals(spec, instance, structs)
    interface = Interface(tuple(leaves), tuple(outputs), single, diff, float_out, tuple(in_groups),
                    tuple(out_groups), tuple(names), tuple(out_names), tuple(leaf_param),
                    saved, saved_group, saved_names, linear)
    if interface.structured and spec.multilinear and any(g.tree is not None for g in in_groups):
        raise RuleError(
            f"{spec.name} is multilinear=True: its inputs must be arrays, not pytrees "
            f"(it is linear in each input separately, so each is one array)")
    return interface


def _residual_avals(spec, instance, structs) -> tuple:
    """``(avals, group, names)`` of what ``@jd.residuals`` declares (empty without one)."""
    rule = spec.rules.get("residuals")
    if rule is None:
        return (), None, ()
    context = f"{spec.name}.{rule.name} (@residuals)"
    value = rule.bind(instance)(*structs)
    with_paths, tree = _flatten_structs(value, "saved", context)
    avals, names = [], []
    for path, struct in with_paths:
        label = _label("saved", path)
        avals.append(_output_aval(struct, label, context))
        names.append(label)
    return tuple(avals), Group(tree, tuple(range(len(avals)))), tuple(names)


def _output_aval(struct, label: str, context: str) -> Aval:
    if not (hasattr(struct, "shape") and hasattr(struct, "dtype")):
        raise RuleError(
            f"{context} must return jax.ShapeDtypeStruct, a pytree of them or a tuple of "
            f"those; {label} is {type(struct).__name__}"
        )
    shape = getattr(struct, "shape", None)
    if not isinstance(shape, (tuple, list)) or \
            not all(isinstance(d, (int, np.integer)) and d >= 0 for d in shape):
        raise RuleError(
            f"{context} returned shape {shape} for {label}; every dimension must be a "
            f"non-negative int (jaxdecl has no dynamic shapes)"
        )
    shape, dtype = aval_of(struct)
    if dtype not in _dtypes.SUPPORTED_DTYPES:
        _dtypes.check_supported(dtype, f"{context} {label}")
    return tuple(int(d) for d in shape), dtype
