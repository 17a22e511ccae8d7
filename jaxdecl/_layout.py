"""Which values flow in and out of each rule, derived from the primal inputs.

jaxdecl emits one JAX primitive, ``jaxdecl_call``, whose ``rule`` parameter
says which user rule an equation stands for. Each rule has a fixed operand
order, the positional order its Python method takes:

=================  ============================================  ==========================
rule               operands                                      results
=================  ============================================  ==========================
``forward``        all inputs                                    all outputs
``jvp``            all inputs, tangents of differentiable ones   tangents of float outputs
``vjp``            all inputs, cotangents of float outputs       cotangents of diff. inputs
``transpose``      non-differentiable inputs, cotangents         cotangents of diff. inputs
``transpose_wrt``  all inputs but ``wrt``, cotangents            cotangent of ``wrt``
=================  ============================================  ==========================

"Differentiable" means floating or complex and not listed in ``nondiff=``;
"float outputs" are the floating or complex ones.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from . import _dtypes
from ._errors import RuleError

FORWARD, JVP, VJP, TRANSPOSE, TRANSPOSE_WRT = "forward", "jvp", "vjp", "transpose", "transpose_wrt"

Aval = tuple  # (shape: tuple[int, ...], dtype: np.dtype), hashable


def aval_of(x) -> Aval:
    """The (shape, dtype) key of an array, tracer or ShapeDtypeStruct."""
    aval = getattr(x, "aval", x)
    return (tuple(aval.shape), np.dtype(aval.dtype))


@dataclasses.dataclass(frozen=True)
class Layout:
    """The op's signature at one set of primal input shapes/dtypes."""

    inputs: tuple  # Avals of the primal inputs
    outputs: tuple  # Avals of the forward outputs
    single_output: bool  # @abstract returned one struct, not a tuple
    diff: tuple  # per input: carries a tangent
    float_out: tuple  # per output: carries a tangent

    @property
    def diff_indices(self) -> tuple:
        return tuple(i for i, d in enumerate(self.diff) if d)

    @property
    def float_out_indices(self) -> tuple:
        return tuple(i for i, f in enumerate(self.float_out) if f)


@dataclasses.dataclass(frozen=True)
class RuleIO:
    """Operands and results of one rule, with names for messages."""

    in_names: tuple
    out_names: tuple
    out_avals: tuple
    single_result: bool  # the rule returns one array rather than a tuple
    real_results: tuple  # per result: a real cotangent (a complex return keeps .real)


def compute_layout(spec, instance, inputs: tuple) -> Layout:
    """Runs @abstract on `inputs` and validates what it returns."""
    rule = spec.rules["abstract"]
    structs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in inputs]
    result = rule.bind(instance)(*structs)
    single = not isinstance(result, (tuple, list))
    results = (result,) if single else tuple(result)
    if not results:
        raise RuleError(f"{spec.name}.{rule.name} (@abstract) returned no outputs")
    outputs = []
    for index, struct in enumerate(results):
        if not (hasattr(struct, "shape") and hasattr(struct, "dtype")):
            raise RuleError(
                f"{spec.name}.{rule.name} (@abstract) must return jax.ShapeDtypeStruct or a "
                f"tuple of them; output {index} is {type(struct).__name__}"
            )
        shape = getattr(struct, "shape", None)
        if not isinstance(shape, (tuple, list)) or \
                not all(isinstance(d, (int, np.integer)) and d >= 0 for d in shape):
            raise RuleError(
                f"{spec.name}.{rule.name} (@abstract) returned shape {shape} for output {index}; "
                f"every dimension must be a non-negative int (jaxdecl has no dynamic shapes)"
            )
        shape, dtype = aval_of(struct)
        shape = tuple(int(d) for d in shape)
        _dtypes.check_supported(dtype, f"{spec.name}.{rule.name} (@abstract) output {index}")
        outputs.append((shape, dtype))
    diff = tuple(
        _dtypes.is_differentiable(dtype) and name not in spec.nondiff
        for name, (_, dtype) in zip(spec.params, inputs)
    )
    float_out = tuple(_dtypes.is_differentiable(dtype) for _, dtype in outputs)
    return Layout(tuple(inputs), tuple(outputs), single, diff, float_out)


def rule_io(spec, layout: Layout, rule: str, wrt: int) -> RuleIO:
    """The operands/results of `rule` at `layout` (see the module table)."""
    params = spec.params
    out_label = ("output",) if layout.single_output else tuple(
        f"output {i}" for i in range(len(layout.outputs)))
    float_outs = layout.float_out_indices
    cts = tuple(f"cotangent of {out_label[j]}" for j in float_outs)
    diff = layout.diff_indices
    if rule == FORWARD:
        return RuleIO(params, out_label, layout.outputs, layout.single_output,
                      (False,) * len(layout.outputs))
    if rule == JVP:
        names = params + tuple(f"tangent of {params[i]}" for i in diff)
        outs = tuple(f"tangent of {out_label[j]}" for j in float_outs)
        return RuleIO(names, outs, tuple(layout.outputs[j] for j in float_outs),
                      layout.single_output, (False,) * len(outs))
    if rule in (VJP, TRANSPOSE):
        lead = params if rule == VJP else tuple(
            p for i, p in enumerate(params) if not layout.diff[i])
        outs = tuple(f"cotangent of {params[i]}" for i in diff)
        avals = tuple(layout.inputs[i] for i in diff)
        real = tuple(not np.issubdtype(dtype, np.complexfloating) for _, dtype in avals)
        return RuleIO(lead + cts, outs, avals, len(outs) == 1, real)
    if rule == TRANSPOSE_WRT:
        lead = tuple(p for i, p in enumerate(params) if i != wrt)
        aval = layout.inputs[wrt]
        return RuleIO(lead + cts, (f"cotangent of {params[wrt]}",), (aval,), True,
                      (not np.issubdtype(aval[1], np.complexfloating),))
    raise ValueError(f"unknown rule {rule!r}")  # pragma: no cover - internal
