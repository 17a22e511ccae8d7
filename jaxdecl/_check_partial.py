"""``jd.check``'s checks of derivatives taken in part of an op's inputs.

- A partly linear op (``linear=("c",)``): the forward is linear in the linear
  inputs at fixed others (f(a u + b v) = a f(u) + b f(v)), and ``@transpose``
  (or ``@adjoint``) is its transpose there, by the dot-product test
  ⟨ct, f(t)⟩ = ⟨Tᵀ(ct), t⟩ (pairing Re Σ a·b).
- Each differentiable input alone, where an op's rules see that: the tangent of
  one input (a ``@jvp(zeros=True)`` gets None for the others; a partly linear
  op's linear inputs run the forward) against central finite differences, and
  the cotangent of that input alone (a ``@vjp`` or ``@transpose`` taking
  ``wanted`` is asked for it alone) by the dot-product test against them.

Each raises an ``AssertionError`` naming the rule, the input and by how much.
"""

from __future__ import annotations

import jax
import numpy as np


def _pair(a, b) -> float:
    """Re Σ a·b over leaves (no conjugation), JAX's transpose convention."""
    return float(sum(np.real(np.sum(np.asarray(x, np.complex128) * np.asarray(y, np.complex128)))
                     for x, y in zip(a, b)))


def _magnitude(a, b) -> float:
    """Σ |a|·|b| over leaves: the scale of a pairing, for its tolerance."""
    return float(sum(np.sum(np.abs(np.asarray(x)) * np.abs(np.asarray(y))) for x, y in zip(a, b)))


def _random(rng, aval):
    shape, dtype = aval
    value = rng.standard_normal(shape)
    if np.issubdtype(dtype, np.complexfloating):
        value = value + 1j * rng.standard_normal(shape)
    return np.asarray(value).astype(dtype)


def _restricted(leaves, positions, floats, call):
    """f(values at `positions`) -> the float outputs, the other inputs fixed at `leaves`."""
    def f(*values):
        full = list(leaves)
        for i, value in zip(positions, values):
            full[i] = value
        outs = call(full)
        return tuple(outs[j] for j in floats)

    return f


def check_linear_part(spec, leaves, interface, rng, dot_rtol, call) -> None:
    """A partly linear op: its forward is linear in the linear inputs, its transpose their
    transpose (both at the example's other inputs). Runs before the derivative checks,
    which rest on it."""
    if spec.partly_linear and interface.linear_indices and interface.float_out_indices:
        _check_linearity(spec, leaves, interface, rng, dot_rtol, call)
        _check_transpose(spec, leaves, interface, rng, dot_rtol, call)


def check_parts(spec, leaves, interface, rng, dot_rtol, fd_rtol, call) -> None:
    """Each differentiable input alone, where the op's rules see part of the inputs."""
    if not interface.float_out_indices or not interface.diff_indices:
        return
    jvp, vjp = spec.rules.get("jvp"), spec.rules.get("vjp")
    transpose = spec.rules.get("transpose") or spec.rules.get("adjoint")
    if spec.partly_linear or (jvp is not None and jvp.zeros) or \
            (vjp is not None and vjp.wanted) or (transpose is not None and transpose.wanted):
        for k, group in enumerate(interface.in_groups):
            own = [i for i in group.positions if interface.diff[i]]
            if own:
                _check_one_input(spec, leaves, interface, rng, dot_rtol, fd_rtol, call,
                                 spec.params[k], own)


def _check_linearity(spec, leaves, interface, rng, rtol, call) -> None:
    linear = interface.linear_indices
    f = _restricted(leaves, linear, interface.float_out_indices, call)
    u = [_random(rng, interface.inputs[i]) for i in linear]
    v = [_random(rng, interface.inputs[i]) for i in linear]
    complex_scalars = all(np.iscomplexobj(x) for x in u)
    a, b = (0.7 + 0.4j, -1.3 + 0.2j) if complex_scalars else (0.7, -1.3)
    mixed = f(*[(a * x + b * y).astype(x.dtype) for x, y in zip(u, v)])
    apart = [a * np.asarray(p) + b * np.asarray(q) for p, q in zip(f(*u), f(*v))]
    for index, (got, want) in enumerate(zip(mixed, apart)):
        got, want = np.asarray(got, np.complex128), np.asarray(want, np.complex128)
        scale = max(float(np.max(np.abs(want), initial=0)), 1.0)
        error = float(np.max(np.abs(got - want), initial=0))
        if error > 10 * rtol * scale:
            names = ", ".join(repr(p) for p in spec.linear)
            raise AssertionError(
                f"jd.check: {spec.describe('forward')} (@forward) is not linear in {names} "
                f"(linear={spec.linear!r}) at fixed other inputs: f(a u + b v) differs from "
                f"a f(u) + b f(v) by {error:.3g} (scale {scale:.3g}) for "
                f"{interface.output_names[interface.float_out_indices[index]]}")


def _check_transpose(spec, leaves, interface, rng, rtol, call) -> None:
    linear, floats = interface.linear_indices, interface.float_out_indices
    f = _restricted(leaves, linear, floats, call)
    t = [_random(rng, interface.inputs[i]) for i in linear]
    ct = [_random(rng, interface.outputs[j]) for j in floats]
    structs = [jax.ShapeDtypeStruct(*interface.inputs[i]) for i in linear]
    forward = _pair(ct, f(*t))
    transposed = _pair(jax.linear_transpose(f, *structs)(tuple(ct)), t)
    scale = abs(forward) + _magnitude(ct, f(*t))
    if abs(forward - transposed) > rtol * max(scale, 1e-30):
        kind = "transpose" if "transpose" in spec.rules else "adjoint"
        raise AssertionError(
            f"jd.check: {spec.describe(kind)} (@{kind}) fails the dot-product test against "
            f"{spec.describe('forward')} (@forward) in its linear inputs at fixed other inputs: "
            f"<T^T ct, t> = {transposed:.6g} but <ct, f(t)> = {forward:.6g}")


def _check_one_input(spec, leaves, interface, rng, dot_rtol, fd_rtol, call, name, own) -> None:
    """The derivative in input `name` (its leaves `own`) alone, both modes."""
    floats = interface.float_out_indices
    f = _restricted(leaves, own, floats, call)
    x = tuple(leaves[i] for i in own)
    t = tuple(_random(rng, interface.inputs[i]) for i in own)
    ct = tuple(_random(rng, interface.outputs[j]) for j in floats)
    eps = 1e-6 if all(np.finfo(interface.inputs[i][1]).eps < 1e-10 for i in own) else 1e-3
    plus = f(*[xi + eps * ti for xi, ti in zip(x, t)])
    minus = f(*[xi - eps * ti for xi, ti in zip(x, t)])
    fd = [(np.asarray(p, np.complex128) - np.asarray(m, np.complex128)) / (2 * eps)
          for p, m in zip(plus, minus)]
    linear = bool(spec.linear) and all(interface.linear[i] for i in own)
    if linear or "jvp" in spec.rules:
        jt = jax.jvp(f, x, t)[1]
        for index, (a, b) in enumerate(zip(jt, fd)):
            scale = float(np.max(np.abs(b), initial=0))
            error = float(np.max(np.abs(np.asarray(a, np.complex128) - b), initial=0))
            if error > fd_rtol * max(scale, 1.0):
                rule = "forward" if linear else "jvp"
                raise AssertionError(
                    f"jd.check: {spec.describe(rule)} (@{rule}) disagrees with finite "
                    f"differences for {interface.output_names[floats[index]]} when only "
                    f"{name!r} has a tangent (the others are zero): max error {error:.3g} "
                    f"(scale {scale:.3g})")
        reference, tolerance = _pair(ct, jt), dot_rtol
    else:
        reference, tolerance = _pair(ct, fd), fd_rtol
    if linear or "vjp" in spec.rules or ("jvp" in spec.rules and spec.rules["jvp"].traceable):
        pulled = jax.vjp(f, *x)[1](ct)
        transposed = _pair(pulled, t)
        scale = abs(reference) + _magnitude(pulled, t)
        if abs(transposed - reference) > tolerance * max(scale, 1e-30):
            rule = ("transpose" if "transpose" in spec.rules else "adjoint") if linear else \
                "vjp" if "vjp" in spec.rules else "jvp"
            raise AssertionError(
                f"jd.check: {spec.describe(rule)} (@{rule}) fails the dot-product test when "
                f"asked for the cotangent of {name!r} alone: <J^T ct, t> = {transposed:.6g} "
                f"but <ct, J t> = {reference:.6g}")
