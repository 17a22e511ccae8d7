"""Which values flow in and out of each rule, derived from the primal inputs.

jaxdecl emits one JAX primitive, ``jaxdecl_call``, whose ``rule`` parameter
says which user rule an equation stands for. The primitive sees arrays only:
an input that is a pytree contributes its leaves, in JAX's flattening order.
Each rule has a fixed order of those flat operands:

==================  ============================================  ==========================
rule                operands                                      results
==================  ============================================  ==========================
``forward``         all input leaves                              all output leaves
``forward_saving``  all input leaves                              all output leaves, residuals
``jvp``             all input leaves, tangents of diff. leaves    tangents of float leaves
``vjp``             all input leaves, cotangents of float leaves  cotangents of diff. leaves
``transpose``       non-differentiable inputs, cotangents         cotangents of diff. leaves
``transpose_wrt``   all inputs but ``wrt``, cotangents            cotangent of ``wrt``
==================  ============================================  ==========================

"Differentiable" means floating or complex and not in an input listed in
``nondiff=``; "float" outputs are the floating or complex ones. "Residuals"
are the leaves of what ``@jd.residuals`` declares (see :mod:`jaxdecl._spec.residuals`).
An op whose derivative rules take ``result=`` or ``saved=`` has its ``jvp``
and ``vjp`` operands followed by *extras*: all output leaves (when some rule
takes ``result``), then the residuals (when the op declares them). The rules
receive them as keyword arguments, :class:`Keyword` says how.

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

    An entry of the primitive's ``primals`` parameter; an array input's entry
    is its plain :data:`Aval`.
    """

    tree: object  # jax.tree_util.PyTreeDef
    leaves: tuple  # Avals


def primal_leaves(primals: tuple) -> list:
    """The Avals of every leaf of `primals` (entries: Avals or TreeAvals), in order."""
    leaves = []
    for entry in primals:
        leaves.extend(entry.leaves if isinstance(entry, TreeAval) else (entry,))
    return leaves


def with_leaves(primals: tuple, leaves) -> tuple:
    """`primals` with its leaves' Avals replaced by `leaves` (same order and count)."""
    leaves = iter(leaves)
    return tuple(TreeAval(e.tree, tuple(next(leaves) for _ in e.leaves))
                 if isinstance(e, TreeAval) else next(leaves) for e in primals)


@dataclasses.dataclass(frozen=True)
class Group:
    """One argument (or result) of a rule and the flat values it is made of.

    `tree` is None for a bare array (one slot). `slots` holds, per leaf of
    `tree`, the index of its flat operand (or result), or -1 for a leaf that
    has no value there (``None`` in a tangent pytree).
    """

    tree: object
    slots: tuple


def _bare(slot: int) -> Group:
    return Group(None, (slot,))


@dataclasses.dataclass(frozen=True)
class Layout:
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
    saved_group: Group | None = None  # the residuals' pytree over slots 0..len(saved)-1
    saved_names: tuple = ()  # per residual leaf: "saved" or "saved['lu']"

    @property
    def diff_indices(self) -> tuple:
        return tuple(i for i, d in enumerate(self.diff) if d)

    @property
    def float_out_indices(self) -> tuple:
        return tuple(i for i, f in enumerate(self.float_out) if f)

    def input_structs(self) -> list:
        """The inputs as @abstract sees them: ShapeDtypeStructs, in pytrees where given."""
        structs = [jax.ShapeDtypeStruct(s, d) for s, d in self.inputs]
        return [structs[g.slots[0]] if g.tree is None else
                g.tree.unflatten([structs[s] for s in g.slots]) for g in self.in_groups]

    @property
    def structured(self) -> bool:
        """Some argument or output is a pytree rather than an array."""
        return any(g.tree is not None for g in self.in_groups + self.out_groups)


@dataclasses.dataclass(frozen=True)
class RuleIO:
    """Operands and results of one rule: flat names and avals, and their grouping."""

    in_names: tuple  # per flat operand
    out_names: tuple  # per flat result
    out_avals: tuple  # per flat result
    single_result: bool  # the rule returns one value (array or pytree) rather than a tuple
    real_results: tuple  # per flat result: a real cotangent (a complex return keeps .real)
    args: tuple = ()  # Groups: how the rule's arguments are built from operands
    results: tuple = ()  # Groups: how its return value maps to flat results
    structured: bool = False  # some group is a pytree: see jaxdecl._host.structure
    zeros_ok: bool = False  # None stands for a zero result (cotangents)
    keywords: tuple = ()  # Keywords: the rule's keyword-only `saved`/`result` arguments
    n_extra: int = 0  # trailing operands that are extras (result, residuals), not positional


OPERANDS, RESULTS = "operands", "results"


@dataclasses.dataclass(frozen=True)
class Keyword:
    """A keyword-only argument of a rule (``saved=``, ``result=``) and where it comes from.

    `source` is :data:`OPERANDS` (read-only views of the rule's operands),
    :data:`RESULTS` (writable views of its results: the residuals a
    ``forward_saving`` kernel fills), or None (the argument is ``None``: a
    plain forward's ``saved``). `groups` are over those flat values; the
    argument is the one group's value when `single`, else a tuple of them.
    """

    name: str
    groups: tuple = ()
    single: bool = True
    source: str | None = None


def _shifted(groups, offset: int) -> tuple:
    return tuple(Group(g.tree, tuple(s + offset for s in g.slots)) for g in groups)


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


def compute_layout(spec, instance, inputs: tuple) -> Layout:
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
            in_groups.append(_bare(len(leaves)))
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
        _dtypes.is_differentiable(dtype) and spec.params[p] not in spec.nondiff
        for p, (_, dtype) in zip(leaf_param, leaves)
    )
    float_out = tuple(_dtypes.is_differentiable(dtype) for _, dtype in outputs)
    saved, saved_group, saved_names = _residual_avals(spec, instance, structs)
    layout = Layout(tuple(leaves), tuple(outputs), single, diff, float_out, tuple(in_groups),
                    tuple(out_groups), tuple(names), tuple(out_names), tuple(leaf_param),
                    saved, saved_group, saved_names)
    if layout.structured and spec.multilinear and any(g.tree is not None for g in in_groups):
        raise RuleError(
            f"{spec.name} is multilinear=True: its inputs must be arrays, not pytrees "
            f"(it is linear in each input separately, so each is one array)")
    return layout


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
    _dtypes.check_supported(dtype, f"{context} {label}")
    return tuple(int(d) for d in shape), dtype


def _tangent_groups(groups, has_tangent, first_slot: int) -> tuple:
    """Groups of the tangents of `groups` (those with any tangent-carrying leaf).

    Tangent-carrying leaves take consecutive slots from `first_slot` in leaf
    order; the others are -1 (``None`` in the rule's pytree).
    """
    position = {leaf: first_slot + k
                for k, leaf in enumerate(i for i, f in enumerate(has_tangent) if f)}
    return tuple(Group(g.tree, tuple(position.get(s, -1) for s in g.slots))
                 for g in groups if any(has_tangent[s] for s in g.slots))


def rule_io(spec, layout: Layout, rule: str, wrt: int) -> RuleIO:
    """The operands/results of `rule` at `layout` (see the module table)."""
    keeps = spec.keeps
    if keeps is None:  # no rule takes saved= or result=: the plain table
        return _rule_io(spec, layout, rule, wrt)
    if rule == FORWARD_SAVING:
        io = _rule_io(spec, layout, FORWARD, wrt)
        m, k = len(layout.outputs), len(layout.saved)
        saved = Keyword("saved", _shifted((layout.saved_group,), m), True, RESULTS)
        return dataclasses.replace(
            io, out_names=io.out_names + layout.saved_names,
            out_avals=io.out_avals + layout.saved, real_results=(False,) * (m + k),
            keywords=(saved,))
    io = _rule_io(spec, layout, rule, wrt)
    takes = keeps.takes.get(rule, frozenset())
    if rule == FORWARD:
        return dataclasses.replace(io, keywords=(Keyword("saved"),)) if takes else io
    if rule not in (JVP, VJP):
        return io
    names, keywords = list(io.in_names), []
    if keeps.result:  # every output leaf, integers too: the op's whole return value
        groups = _shifted(layout.out_groups, len(names))
        if "result" in takes:
            keywords.append(Keyword("result", groups, layout.single_output, OPERANDS))
        names += [f"result {name}" for name in layout.output_names]
    if keeps.saved:
        group = _shifted((layout.saved_group,), len(names))
        if "saved" in takes:
            keywords.append(Keyword("saved", group, True, OPERANDS))
        names += list(layout.saved_names)
    return dataclasses.replace(io, in_names=tuple(names), keywords=tuple(keywords),
                               n_extra=len(names) - len(io.in_names))


def n_extra(spec, layout: Layout, rule: str) -> int:
    """How many extras (result and residual leaves) follow the operands of `rule`."""
    keeps = spec.keeps
    if keeps is None or rule not in (JVP, VJP):
        return 0
    return (len(layout.outputs) if keeps.result else 0) + (
        len(layout.saved) if keeps.saved else 0)


def _rule_io(spec, layout: Layout, rule: str, wrt: int) -> RuleIO:
    n = len(layout.inputs)
    diff, float_outs = layout.diff_indices, layout.float_out_indices
    params = layout.in_groups
    structured = layout.structured
    if rule == FORWARD:
        return RuleIO(layout.input_names, layout.output_names, layout.outputs,
                      layout.single_output, (False,) * len(layout.outputs),
                      params, layout.out_groups, structured)
    if rule == JVP:
        tangents = _tangent_groups(params, layout.diff, n)
        results = _tangent_groups(layout.out_groups, layout.float_out, 0)
        in_names = layout.input_names + tuple(f"tangent of {layout.input_names[i]}" for i in diff)
        out_names = tuple(f"tangent of {layout.output_names[j]}" for j in float_outs)
        return RuleIO(in_names, out_names, tuple(layout.outputs[j] for j in float_outs),
                      len(results) == 1, (False,) * len(out_names),
                      params + tangents, results, structured)
    if rule in (VJP, TRANSPOSE):
        ct_names = tuple(f"cotangent of {layout.output_names[j]}" for j in float_outs)
        if rule == VJP:
            lead = params
            lead_names = layout.input_names
        else:
            lead, position = [], 0
            for g in params:
                if any(layout.diff[s] for s in g.slots):
                    if not all(layout.diff[s] for s in g.slots):
                        raise RuleError(
                            f"{spec.name} is linear=True, but input "
                            f"{spec.params[layout.leaf_param[g.slots[0]]]!r} mixes "
                            f"differentiable and integer (or nondiff) leaves; pass the "
                            f"integer leaves as a separate nondiff= input")
                    continue
                lead.append(Group(g.tree, tuple(range(position, position + len(g.slots)))))
                position += len(g.slots)
            lead = tuple(lead)
            lead_names = tuple(layout.input_names[i] for i in range(n) if not layout.diff[i])
        cts = _tangent_groups(layout.out_groups, layout.float_out, len(lead_names))
        groups = _tangent_groups(params, layout.diff, 0)
        avals = tuple(layout.inputs[i] for i in diff)
        real = tuple(not np.issubdtype(dtype, np.complexfloating) for _, dtype in avals)
        out_names = tuple(f"cotangent of {layout.input_names[i]}" for i in diff)
        return RuleIO(lead_names + ct_names, out_names, avals, len(groups) == 1, real,
                      tuple(lead) + cts, groups, structured, zeros_ok=True)
    if rule == TRANSPOSE_WRT:  # multilinear ops take arrays only (see compute_layout)
        lead = tuple(p for i, p in enumerate(layout.input_names) if i != wrt)
        cts = tuple(f"cotangent of {layout.output_names[j]}" for j in float_outs)
        aval = layout.inputs[wrt]
        args = tuple(_bare(k) for k in range(len(lead))) + _tangent_groups(
            layout.out_groups, layout.float_out, len(lead))
        return RuleIO(lead + cts, (f"cotangent of {layout.input_names[wrt]}",), (aval,), True,
                      (not np.issubdtype(aval[1], np.complexfloating),), args, (_bare(0),),
                      structured, zeros_ok=True)
    raise ValueError(f"unknown rule {rule!r}")  # pragma: no cover - internal
