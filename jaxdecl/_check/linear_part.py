"""A partly linear op's linear part: its forward is linear there, its transpose transposes it.

For an op declared ``linear=("c",)`` and differentiable in its other inputs, at the
example's other inputs:

1. the forward is linear in the linear inputs jointly: ``f(a u + b v) = a f(u) + b f(v)``
   for random ``u``, ``v`` and scalars ``a``, ``b`` (complex where the inputs are), per
   output, relative to ``|a f(u)| + |b f(v)|``;
2. ``@transpose`` (or ``@adjoint``) is its transpose there, by the dot-product test
   ``<ct, f(t)> = <T(ct), t>`` (pairing Re Σ a·b), relative to the magnitude of the terms.

These run before the derivative checks, which rest on them: a derivative in the linear
inputs alone is the forward itself, its cotangent the transpose.
"""

from __future__ import annotations

import jax
import numpy as np

from .tolerances import largest, magnitude, pairing, wide

#: The forward runs on inputs of the size of `u` and `v`: its rounding is relative to
#: the largest term it sums, not to its result, so linearity gets this much slack.
_LINEARITY_SLACK = 10


def check_linear_part(case) -> None:
    """Checks the linear part of a partly linear op (see the module's text)."""
    interface = case.interface
    if not (case.spec.partly_linear and interface.linear_indices and
            interface.float_out_indices):
        return
    _check_linearity(case)
    _check_transpose(case)


def _restricted(case):
    """The float outputs as a function of the linear input leaves, the others fixed."""
    interface = case.interface

    def f(*values):
        flat = list(case.leaves)
        for i, value in zip(interface.linear_indices, values):
            flat[i] = value
        outs = case.call(flat)
        return tuple(outs[j] for j in interface.float_out_indices)

    return f


def _random(case, aval):
    shape, dtype = aval
    value = case.rng.standard_normal(shape)
    if np.issubdtype(dtype, np.complexfloating):
        value = value + 1j * case.rng.standard_normal(shape)
    return np.asarray(value).astype(dtype)


def _names(case) -> str:
    return ", ".join(repr(p) for p in case.spec.linear)


def _check_linearity(case) -> None:
    interface, spec = case.interface, case.spec
    f = _restricted(case)
    u = [_random(case, interface.inputs[i]) for i in interface.linear_indices]
    v = [_random(case, interface.inputs[i]) for i in interface.linear_indices]
    complex_scalars = all(np.iscomplexobj(x) for x in u)
    a, b = (0.7 + 0.4j, -1.3 + 0.2j) if complex_scalars else (0.7, -1.3)
    mixed = f(*[(a * x + b * y).astype(x.dtype) for x, y in zip(u, v)])
    fu, fv = f(*u), f(*v)
    rtol = _LINEARITY_SLACK * case.tolerances.values
    for index, (got, p, q) in enumerate(zip(mixed, fu, fv)):
        want = a * wide(p) + b * wide(q)
        scale = largest(a * wide(p)) + largest(b * wide(q))
        error = largest(wide(got) - want)
        if not error <= rtol * scale:
            name = interface.output_names[interface.float_out_indices[index]]
            raise AssertionError(
                f"jd.check: {spec.describe('forward')} (@forward) is not linear in "
                f"{_names(case)} (linear={spec.linear!r}) at fixed other inputs: "
                f"f(a u + b v) differs from a f(u) + b f(v) for {name}, relative error "
                f"{error / scale if scale else float('inf'):.3g} against a tolerance of "
                f"{rtol:.2g}")


def _check_transpose(case) -> None:
    interface, spec = case.interface, case.spec
    f = _restricted(case)
    t = [_random(case, interface.inputs[i]) for i in interface.linear_indices]
    ct = [_random(case, interface.outputs[j]) for j in interface.float_out_indices]
    structs = [jax.ShapeDtypeStruct(*interface.inputs[i]) for i in interface.linear_indices]
    ft = f(*t)
    pulled = jax.linear_transpose(f, *structs)(tuple(ct))
    forward = sum(pairing(c, y) for c, y in zip(ct, ft))
    transposed = sum(pairing(g, x) for g, x in zip(pulled, t))
    scale = sum(magnitude(c, y) for c, y in zip(ct, ft)) + sum(
        magnitude(g, x) for g, x in zip(pulled, t))
    rtol = case.tolerances.dot
    if not abs(forward - transposed) <= rtol * scale:
        kind = "transpose" if "transpose" in spec.rules else "adjoint"
        size = max(abs(forward), abs(transposed)) or 1.0
        raise AssertionError(
            f"jd.check: {spec.describe(kind)} (@{kind}) fails the dot-product test against "
            f"{spec.describe('forward')} (@forward) in its linear inputs at "
            f"fixed other inputs: <T^T ct, t> = {transposed:.6g} but <ct, f(t)> = "
            f"{forward:.6g}, relative error {abs(forward - transposed) / size:.3g} against a "
            f"tolerance of {rtol * scale / size:.2g}")
