"""A sharding declaration, verified on one device: the op on two slices along each factor
its rules may split, joined (or summed, for ``reduce=``), against the whole."""

from __future__ import annotations

import numpy as np

from .._op.equation import Equation
from .._op.handle import BoundOp
from .._op.identity import handle_of
from .._spec.interface import FORWARD_SAVING
from .._transforms.primitive import bind
from .tolerances import largest, value_error, wide


def check_sharding(case) -> None:
    """Checks the declaration of an op that has one (outputs, then residuals)."""
    signature = case.signature
    resolved = handle_of(case.op).sharding(signature, case.op)
    if resolved is None:
        return
    _check_outputs(case, resolved)
    if resolved.saved is not None:
        _check_residuals(case, resolved)


def _splits(resolved):
    """``(factor, its label, the two halves)`` for each factor the rules may split."""
    for factor, size in resolved.sizes.items():
        if factor in resolved.replicate or size < 2:
            continue
        label = factor if not factor.startswith("...") else f"leading dim {factor[3:]} ('...')"
        yield factor, label, (slice(0, size // 2), slice(size // 2, size))


def _check_outputs(case, resolved) -> None:
    spec, rtol = case.spec, case.tolerances.values
    summed = set(resolved.sizes) - {f for names in resolved.outputs for f in names}
    for factor, label, halves in _splits(resolved):
        pieces = [case.call([_cut(a, names, factor, part)
                             for a, names in zip(case.leaves, resolved.inputs)])
                  for part in halves]
        for index, names in enumerate(resolved.outputs):
            first, second = np.asarray(pieces[0][index]), np.asarray(pieces[1][index])
            expected = np.asarray(case.eager[index])
            if factor in summed:  # a sum's rounding is relative to its terms
                joined, how = first + second, "summing"
                scale = largest(np.abs(wide(first)) + np.abs(wide(second))) \
                    if first.shape == second.shape else None
            else:
                joined = np.concatenate([first, second], axis=names.index(factor))
                how, scale = "joining", None
            error = value_error(joined, expected, rtol, scale)
            if error is None:
                continue
            kind = "reduce=" if factor in summed else "independent"
            raise AssertionError(
                f"jd.check: {spec.name}'s sharding declaration is wrong: factor {label!r} is "
                f"declared {kind}, but running {spec.describe('forward')} on two slices "
                f"along it and {how} the results differs from the whole op for "
                f"{case.interface.output_names[index]} (relative difference {error:.3g}, "
                f"tolerance {rtol:.2g}). If the rule needs the whole of that factor, list it "
                f"in replicate=")


def _check_residuals(case, resolved) -> None:
    """The residuals of two slices along each splittable factor, joined, against the whole."""
    spec, interface, rtol = case.spec, case.interface, case.tolerances.values

    def residuals_of(flat):  # what the forward keeps when a derivative follows
        operands, signature = case.flatten(flat)
        kept = bind(Equation(BoundOp(handle_of(case.op), case.op), FORWARD_SAVING, signature),
                    operands)
        return [np.asarray(r) for r in kept[len(interface.outputs):]]

    whole = residuals_of(case.leaves)
    for factor, label, halves in _splits(resolved):
        pieces = [residuals_of([_cut(a, names, factor, part)
                                for a, names in zip(case.leaves, resolved.inputs)])
                  for part in halves]
        for index, names in enumerate(resolved.saved):
            joined = np.concatenate([pieces[0][index], pieces[1][index]],
                                    axis=names.index(factor))
            if value_error(joined, whole[index], rtol) is None:
                continue
            raise AssertionError(
                f"jd.check: {spec.name}'s sharding declaration is wrong for residual "
                f"{interface.saved_names[index]}: keeping it per slice along factor {label!r} and "
                f"joining differs from what {spec.describe('forward')} keeps for the whole. If "
                f"the residual needs the whole of that factor, list it in replicate=")


def _cut(value, names, factor, part):
    """`value` sliced to `part` along the dim named `factor` (whole if it has none)."""
    if factor not in names:
        return value
    index = [slice(None)] * value.ndim
    index[names.index(factor)] = part
    return np.ascontiguousarray(value[tuple(index)])
