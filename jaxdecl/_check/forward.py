"""The forward: ``@abstract`` against its eager result, every element of ``out`` and of
the residuals written, and the same outputs with and without ``saved=``."""

from __future__ import annotations

import numpy as np

from .._errors import RuleError
from .._host import structure as _structure
from .._host.keyword_rules import settle
from .._spec.cfunction import CFunction
from .tolerances import value_error

#: Two fills of every byte of `out` (and the residuals) before two runs of the forward:
#: an element that holds its fill after both was never written. A forward whose last
#: bits vary between runs writes every element in both, so it passes.
_FILLS = (0x5A, 0xA5)


def check_forward(case) -> tuple:
    """Runs the op eagerly and checks what its forward writes; returns the eager outputs."""
    spec, interface = case.spec, case.interface
    forward = spec.rules["forward"]
    try:
        eager = case.call(case.leaves)
    except RuleError as error:
        raise AssertionError(
            f"jd.check: {spec.describe('abstract')} (@abstract) disagrees with "
            f"{spec.describe('forward')} (@forward): {error}"
        ) from None
    if not (forward.zero_copy or interface.saved):
        return eager
    takes_saved = spec.keeps is not None and "saved" in spec.keeps.takes.get("forward", ())
    runs = []
    for fill in _FILLS:
        outs = tuple(_filled(shape, dtype, fill) for shape, dtype in interface.outputs)
        saved = tuple(_filled(shape, dtype, fill) for shape, dtype in interface.saved)
        returned = _run_forward(forward, case.op, [a.copy() for a in case.leaves], case.tree,
                                interface, outs, saved, takes_saved)
        runs.append((outs if forward.zero_copy else returned) + saved)
    names = interface.output_names + interface.saved_names
    describe = f"{spec.describe('forward')} (@forward)"
    when = " when a derivative follows (saved= is given)" if interface.saved else ""
    checked = [index for index in range(len(names))
               if forward.zero_copy or index >= len(interface.outputs)]
    for index in checked:
        first, second = runs[0][index], runs[1][index]
        unwritten = _holds(first, _FILLS[0]) & _holds(second, _FILLS[1])
        if unwritten.any():
            raise AssertionError(
                f"jd.check: {describe} leaves {int(unwritten.sum())} of {unwritten.size} "
                f"elements of {names[index]} unwritten{when}")
    for index in checked:  # all written: what was there before must not matter
        error = value_error(runs[0][index], runs[1][index], case.tolerances.values)
        if error is not None:
            raise AssertionError(
                f"jd.check: {describe} reads {names[index]} before writing it{when}: two "
                f"runs whose buffers started with different contents differ by {error:.3g} "
                f"(relative), more than {case.tolerances.values:.2g}")
    if interface.saved:
        for index, (a, b) in enumerate(zip(runs[0], eager)):
            error = value_error(a, b, case.tolerances.values)
            if error is not None:
                raise AssertionError(
                    f"jd.check: {describe} returns a different {interface.output_names[index]} "
                    f"when given saved= than without it (relative difference {error:.3g}, "
                    f"tolerance {case.tolerances.values:.2g})")
    return eager


def _filled(shape, dtype, byte: int) -> np.ndarray:
    value = np.empty(shape, dtype)
    value.reshape(-1).view(np.uint8)[:] = byte
    return value


def _holds(value, byte: int) -> np.ndarray:
    """Per element of `value`: every one of its bytes is still `byte`."""
    value = np.ascontiguousarray(value)
    raw = value.reshape(-1).view(np.uint8).reshape(value.size, value.dtype.itemsize)
    return (raw == byte).all(axis=1)


def _run_forward(forward, op, args, tree, interface, outs, saved, takes_saved) -> tuple:
    """Calls the user's forward on NumPy arrays; returns its outputs as flat leaves."""
    if isinstance(forward.function, CFunction):  # flat buffers: outputs, then residuals
        forward.function(*args, out=outs + saved)
        return outs
    keywords = {}
    if takes_saved:
        keywords["saved"] = _structure.pack((interface.saved_group,), saved)[0] \
            if saved else None
    inputs = tree.unflatten(args)
    if forward.zero_copy:
        views = _structure.pack(interface.out_groups, outs)
        returned = forward.bind(op)(
            *inputs, out=views[0] if interface.single_output else tuple(views), **keywords)
    else:
        returned = forward.bind(op)(*inputs, **keywords)
    if saved:  # residuals the rule rebound (saved["lu"] = lu) count as written
        settle(keywords["saved"], interface.saved_group, saved, interface.saved_names,
               f"{op.__jaxdecl_spec__.describe('forward')} (@forward)")
    if forward.zero_copy:
        return outs
    values = (returned,) if interface.single_output else tuple(returned)
    flat = []
    for group, value in zip(interface.out_groups, values):
        flat += [value] if group.tree is None else group.tree.flatten_up_to(value)
    return tuple(np.asarray(v) for v in flat)
