"""``jd.check``: verify an op's rules the way a careful reviewer would."""

from __future__ import annotations

import jax
import numpy as np

from ._call import flatten_inputs
from ._check_partial import check_linear_part, check_parts
from ._errors import RuleError
from ._host import structure as _structure
from ._host.keyword_rules import settle
from ._op.equation import Equation
from ._op.handle import BoundOp
from ._op.identity import handle_of, spec_of
from ._spec import interface as _interface
from ._spec.cfunction import CFunction
from ._spec.interface import FORWARD_SAVING
from ._transforms.primitive import bind

_DOT_RTOL = {"float16": 3e-2, "bfloat16": 3e-2, "float32": 2e-4, "complex64": 2e-4}
_FD_RTOL = {"float16": 1e-1, "bfloat16": 1e-1, "float32": 2e-2, "complex64": 2e-2}


def _dot(a, b) -> float:
    """The real pairing Re Σ a·b (no conjugation), JAX's transpose convention."""
    return float(np.real(np.sum(np.asarray(a, np.complex128) * np.asarray(b, np.complex128))))


def _random_like(rng, aval):
    shape, dtype = aval
    value = rng.standard_normal(shape)
    if np.issubdtype(dtype, np.complexfloating):
        value = value + 1j * rng.standard_normal(shape)
    return np.asarray(value).astype(dtype)


def _close(a, b, rtol, scale) -> bool:
    return abs(a - b) <= rtol * max(scale, 1e-30)


def _lowest(dtypes, table, default):
    return max([table.get(np.dtype(d).name, default) for d in dtypes] + [default])


def check(op, *args, rtol: float | None = None, seed: int = 0) -> None:
    """Checks every rule of `op` at `args`; raises AssertionError naming the wrong rule.

    Verifies: ``@abstract`` against the eager result; that the zero-copy
    ``@forward`` writes every output element; ``jit`` against eager; ``@jvp``
    against central finite differences; ``@vjp``/``@transpose`` against the
    tangent map by the dot-product test ⟨ct, J t⟩ = ⟨Jᵀ ct, t⟩ (pairing
    Re Σ a·b); and ``vmap`` against a loop.

    A partly linear op (``linear=("c",)``) also has its forward checked for
    linearity in its linear inputs at fixed others, and its ``@transpose`` (or
    ``@adjoint``) against that forward by the dot-product test; an op whose
    rules see part of the inputs (a partly linear op, ``@jvp(zeros=True)``, a
    ``@vjp`` or ``@transpose`` that takes ``wanted``) has its derivatives in
    each input alone checked, in both modes (the others' tangents zero, the
    one cotangent asked for).

    An op with ``@jd.residuals`` also has its forward checked for writing
    every element of every residual, and for returning the same outputs with
    and without ``saved``; the derivative checks run through the rules that
    read ``saved`` (and ``result``), as ``grad`` and ``jvp`` do.

    Args:
      op: a jaxdecl op instance.
      *args: example inputs (arrays, scalars or pytrees of them).
      rtol: relative tolerance for the numeric comparisons; by default keyed
        by the lowest precision among the inputs.
      seed: seed of the random tangents and cotangents.

    An op that declares ``sharding=`` (or ``@jd.sharding``) also has its
    declaration verified: the inputs are cut in two along each factor the
    rules may split (independent and ``reduce`` ones), the op runs on each
    half, and the halves' results, joined (or summed, for ``reduce``), must
    equal the whole op's; so must the halves' residuals, joined, where the
    declaration gives them factors (``residuals=``).

    Example:
        >>> import jax, numpy as np, jaxdecl as jd
        >>> class Mul(jd.Primitive):
        ...     @jd.abstract
        ...     def shapes(self, x1, x2):
        ...         return jax.ShapeDtypeStruct(x1.shape, x1.dtype)
        ...     @jd.forward
        ...     def apply(self, x1, x2):
        ...         return x1 * x2**2
        ...     @jd.jvp
        ...     def push(self, x1, x2, dx1, dx2):
        ...         return x2**2 * dx1 + 2 * x1 * x2 * dx2
        ...     @jd.vjp
        ...     def pull(self, x1, x2, ct):
        ...         return x2**2 * ct, 2 * x1 * x2 * ct
        >>> jd.check(Mul(), np.ones(3), np.arange(3.0))
    """
    spec = spec_of(op)
    rng = np.random.default_rng(seed)
    operands, signature = flatten_inputs(spec, args)
    # The checks work on flat leaves; `call` rebuilds the op's pytree arguments.
    leaves = [np.asarray(x) for x in operands]
    tree = jax.tree_util.tree_structure(tuple(args))
    interface = _interface.interface_of(spec, op, signature)
    dtypes = [d for _, d in interface.inputs] + [d for _, d in interface.outputs]
    dot_rtol = rtol if rtol is not None else _lowest(dtypes, _DOT_RTOL, 1e-8)
    fd_rtol = rtol if rtol is not None else _lowest(dtypes, _FD_RTOL, 1e-5)

    def call(flat, wrapper=lambda f: f):
        return tuple(jax.tree_util.tree_leaves(wrapper(op)(*tree.unflatten(list(flat)))))

    eager = _check_forward(spec, op, leaves, tree, interface, call)
    _check_jit(spec, leaves, eager, dot_rtol, call)
    if any(interface.diff) and any(interface.float_out):
        check_linear_part(spec, leaves, interface, rng, dot_rtol, call)
        _check_derivatives(spec, leaves, interface, rng, dot_rtol, fd_rtol, call)
        check_parts(spec, leaves, interface, rng, dot_rtol, fd_rtol, call)
    _check_vmap(spec, leaves, dot_rtol, call)
    resolved = handle_of(op).sharding(signature, op)
    if resolved is not None:
        _check_sharding(spec, leaves, interface, resolved, eager, dot_rtol, call)
        if resolved.saved is not None:
            def residuals_of(flat):  # what the forward keeps when a derivative follows
                operands, signature = flatten_inputs(spec, tree.unflatten(list(flat)))
                kept = bind(Equation(BoundOp(handle_of(op), op), FORWARD_SAVING, signature),
                            operands)
                return [np.asarray(r) for r in kept[len(interface.outputs):]]

            _check_residual_sharding(spec, leaves, interface, resolved, dot_rtol, residuals_of)


def _check_forward(spec, op, args, tree, interface, call):
    forward = spec.rules["forward"]
    try:
        eager = call(args)
    except RuleError as error:
        raise AssertionError(
            f"jd.check: {spec.describe('abstract')} (@abstract) disagrees with "
            f"{spec.describe('forward')} (@forward): {error}"
        ) from None
    takes_saved = spec.keeps is not None and "saved" in spec.keeps.takes.get("forward", ())
    if forward.zero_copy or interface.saved:
        # Run the rule twice on outputs (and residuals) pre-filled with different
        # values: an element the rule never writes keeps its fill value.
        results = []
        for fill in (0, 1):
            outs = tuple(np.full(shape, fill, dtype) for shape, dtype in interface.outputs)
            saved = tuple(np.full(shape, fill, dtype) for shape, dtype in interface.saved)
            returned = _run_forward(forward, op, [a.copy() for a in args], tree, interface, outs,
                                    saved, takes_saved)
            results.append((outs if forward.zero_copy else returned) + saved)
        names = interface.output_names + interface.saved_names
        for index, (a, b) in enumerate(zip(*results)):
            if index < len(interface.outputs) and not forward.zero_copy:
                continue
            unwritten = np.asarray(a != b)
            if unwritten.any():
                raise AssertionError(
                    f"jd.check: {spec.describe('forward')} (@forward) leaves "
                    f"{int(unwritten.sum())} of {unwritten.size} elements of "
                    f"{names[index]} unwritten"
                    + (" when a derivative follows (saved= is given)" if interface.saved else "")
                )
        if interface.saved:
            for index, (a, b) in enumerate(zip(results[0], eager)):
                if not np.allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0,
                                   equal_nan=True):
                    raise AssertionError(
                        f"jd.check: {spec.describe('forward')} (@forward) returns a different "
                        f"{interface.output_names[index]} when given saved= than without it")
    return eager


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


def _check_jit(spec, args, eager, rtol, call):
    jitted = call(args, jax.jit)
    for index, (a, b) in enumerate(zip(eager, jitted)):
        if not np.allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=0, equal_nan=True):
            raise AssertionError(
                f"jd.check: {spec.describe('forward')} gives different output {index} under "
                f"jax.jit than eagerly"
            )


def _check_derivatives(spec, args, interface, rng, dot_rtol, fd_rtol, call):
    diff = interface.diff_indices
    floats = interface.float_out_indices

    def f(*diff_args):
        full = list(args)
        for i, value in zip(diff, diff_args):
            full[i] = value
        outs = call(full)
        return tuple(outs[j] for j in floats)

    x = tuple(args[i] for i in diff)
    t = tuple(_random_like(rng, interface.inputs[i]) for i in diff)
    ct = tuple(_random_like(rng, interface.outputs[j]) for j in floats)
    # (a partly linear op's derivative in all its inputs is its @jvp's and @vjp's)
    linear = bool(spec.linear) and not spec.partly_linear
    has_forward_mode = linear or spec.multilinear or "jvp" in spec.rules
    has_reverse_mode = linear or spec.multilinear or "vjp" in spec.rules or (
        "jvp" in spec.rules and spec.rules["jvp"].traceable)

    # Finite differences in float64/complex128 where the inputs allow.
    eps = 1e-6 if all(np.finfo(d).eps < 1e-10 for _, d in (interface.inputs[i] for i in diff)) \
        else 1e-3
    plus = f(*[xi + eps * ti for xi, ti in zip(x, t)])
    minus = f(*[xi - eps * ti for xi, ti in zip(x, t)])
    fd = tuple((np.asarray(p, np.complex128) - np.asarray(m, np.complex128)) / (2 * eps)
               for p, m in zip(plus, minus))
    if has_forward_mode:
        _, jt = jax.jvp(f, x, t)
        tangent_rule = spec.describe("jvp") if "jvp" in spec.rules else \
            spec.describe("forward")
        for index, (a, b) in enumerate(zip(jt, fd)):
            scale = float(np.max(np.abs(b))) if np.size(b) else 0.0
            error = float(np.max(np.abs(np.asarray(a, np.complex128) - b))) if np.size(b) \
                else 0.0
            if error > fd_rtol * max(scale, 1.0):
                raise AssertionError(
                    f"jd.check: {tangent_rule} (@jvp) disagrees with finite differences for "
                    f"{interface.output_names[floats[index]]}: max error {error:.3g} "
                    f"(scale {scale:.3g})"
                )
        reference = _dot(0, 0) + sum(_dot(c, j) for c, j in zip(ct, jt))
    else:
        reference = sum(_dot(c, d) for c, d in zip(ct, fd))
    if has_reverse_mode:
        _, pullback = jax.vjp(f, *x)
        cts_in = pullback(ct)
        transposed = sum(_dot(c, ti) for c, ti in zip(cts_in, t))
        scale = sum(abs(_dot(np.abs(c), np.abs(ti))) for c, ti in zip(cts_in, t)) + abs(reference)
        tolerance = dot_rtol if has_forward_mode else fd_rtol
        if not _close(transposed, reference, tolerance, scale):
            if linear:
                rule = spec.describe("transpose" if "transpose" in spec.rules else "adjoint")
                kind = "@transpose" if "transpose" in spec.rules else "@adjoint"
            elif spec.multilinear:
                rule, kind = f"{spec.name} transpose(wrt=...)", "@transpose"
            else:
                rule, kind = spec.describe("vjp"), "@vjp"
            against = "<ct, J t> from the tangent map" if has_forward_mode else \
                "finite differences"
            raise AssertionError(
                f"jd.check: {rule} ({kind}) fails the dot-product test against {against}: "
                f"<J^T ct, t> = {transposed:.6g} but <ct, J t> = {reference:.6g}"
            )


def _check_vmap(spec, args, rtol, call):
    batch = 3
    stacked = [np.stack([a + (k if np.issubdtype(a.dtype, np.inexact) else 0)
                         for k in range(batch)]).astype(a.dtype) for a in args]
    batched = call(stacked, jax.vmap)
    for k in range(batch):
        looped = call([s[k] for s in stacked])
        for index, (a, b) in enumerate(zip(batched, looped)):
            if not np.allclose(np.asarray(a)[k], np.asarray(b), rtol=max(rtol, 1e-6),
                               atol=max(rtol, 1e-6), equal_nan=True):
                raise AssertionError(
                    f"jd.check: vmap of {spec.name} disagrees with a loop of calls for "
                    f"output {index}, batch element {k}"
                )


def _check_sharding(spec, args, interface, resolved, whole, rtol, call):
    """Runs the op on two slices along each splittable factor and compares with the whole."""
    summed = set(resolved.sizes) - {f for names in resolved.outputs for f in names}
    for factor, size in resolved.sizes.items():
        if factor in resolved.replicate or size < 2:
            continue
        halves = (slice(0, size // 2), slice(size // 2, size))
        pieces = [call([_cut(a, names, factor, part) for a, names in zip(args, resolved.inputs)])
                  for part in halves]
        label = factor if not factor.startswith("...") else f"leading dim {factor[3:]} ('...')"
        for index, names in enumerate(resolved.outputs):
            first, second = np.asarray(pieces[0][index]), np.asarray(pieces[1][index])
            if factor in summed:
                joined, how = first + second, "summing"
            else:
                joined = np.concatenate([first, second], axis=names.index(factor))
                how = "joining"
            expected = np.asarray(whole[index])
            if joined.shape == expected.shape and np.allclose(
                    joined, expected, rtol=max(rtol, 1e-6), atol=max(rtol, 1e-6) * max(
                        float(np.max(np.abs(expected), initial=0)), 1.0), equal_nan=True):
                continue
            error = float(np.max(np.abs(joined - expected), initial=0)) \
                if joined.shape == expected.shape else float("inf")
            kind = "reduce=" if factor in summed else "independent"
            raise AssertionError(
                f"jd.check: {spec.name}'s sharding declaration is wrong: factor {label!r} is "
                f"declared {kind}, but running {spec.describe('forward')} on two slices "
                f"along it and {how} the results differs from the whole op for "
                f"{interface.output_names[index]} (max error {error:.3g}). If the rule needs "
                f"the whole of that factor, list it in replicate="
            )


def _check_residual_sharding(spec, args, interface, resolved, rtol, residuals_of):
    """The residuals of two slices along each splittable factor, joined, against the whole."""
    whole = residuals_of(args)
    for factor, size in resolved.sizes.items():
        if factor in resolved.replicate or size < 2:
            continue
        halves = (slice(0, size // 2), slice(size // 2, size))
        pieces = [residuals_of([_cut(a, names, factor, part)
                                for a, names in zip(args, resolved.inputs)]) for part in halves]
        for index, names in enumerate(resolved.saved):
            joined = np.concatenate([pieces[0][index], pieces[1][index]],
                                    axis=names.index(factor))
            expected = whole[index]
            scale = max(float(np.max(np.abs(expected), initial=0)), 1.0)
            if joined.shape == expected.shape and np.allclose(
                    joined, expected, rtol=max(rtol, 1e-6), atol=max(rtol, 1e-6) * scale,
                    equal_nan=True):
                continue
            label = factor if not factor.startswith("...") else \
                f"leading dim {factor[3:]} ('...')"
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
