"""The derivative rules, against finite differences and against each other.

Along one direction ``t`` of the differentiable inputs (random, leaning on the gradient the
cotangent rule claims; :mod:`.differences`):

1. the tangent map (``@jvp``, or a linear op's forward) against finite differences, per
   output: ``max |J t - fd| <= rtol·max(|J t|, |fd|) + the differences' own error``;
2. the cotangent map (``@vjp``, ``@transpose``, ``@adjoint``) against finite differences:
   ``<Jᵀ ct, t>`` against ``<ct, fd>``, with ``ct`` the conjugate of ``fd`` so the pairing
   cannot cancel. A ``@jvp`` and a ``@vjp`` that are wrong together fail both;
3. when both pass, the cotangent map against the tangent map by the dot-product test with
   a random ``ct``: ``<Jᵀ ct, t> = <ct, J t>`` to rounding, finer than differences resolve.

A failure is then located: along each input alone, per output, the pairs that disagree
are named, with their relative error and its tolerance.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import numpy as np

from .differences import differences, direction
from .tolerances import largest, magnitude, pairing, wide

#: Finite differences that resolve a derivative only this coarsely (times the derivative
#: tolerance) make the check weak: jd.check warns.
_WEAK = 10


def check_derivatives(case) -> None:
    """Checks the op's derivative rules at the example inputs (see the module's text).

    An op whose rules see part of its inputs (a partly linear op, ``@jvp(zeros=True)``, a
    ``@vjp`` or ``@transpose`` taking ``wanted``) is then checked in each input alone as
    well: the other inputs constants, so their tangents are symbolic zeros and only that
    input's cotangent is asked for, as under ``jax.grad(f, argnums=k)``.
    """
    interface = case.interface
    if not (any(interface.diff) and any(interface.float_out)):
        return
    _check_along(case, interface.diff_indices)
    if _sees_parts(case.spec):
        groups = [[i for i in g.positions if interface.diff[i]] for g in interface.in_groups]
        groups = [g for g in groups if g]
        for positions in groups if len(groups) > 1 else ():
            _check_along(case, tuple(positions))


def _sees_parts(spec) -> bool:
    """The op's rules run differently when only some inputs carry a derivative."""
    jvp, vjp = spec.rules.get("jvp"), spec.rules.get("vjp")
    transpose = spec.rules.get("transpose") or spec.rules.get("adjoint")
    return spec.partly_linear or any(
        rule is not None and flag for rule, flag in (
            (jvp, jvp is not None and jvp.zeros), (vjp, vjp is not None and vjp.wanted),
            (transpose, transpose is not None and transpose.wanted)))


def _check_along(case, positions) -> None:
    """The three tests of the module's text, in the differentiable leaves at `positions`
    (the others fixed at the example's values)."""
    interface = case.interface
    linear = bool(case.spec.linear) and all(interface.linear[i] for i in positions)
    forward, reverse = _rules(case.spec, linear)
    if not (forward or reverse):
        return
    maps = _Maps(case, reverse is not None, positions)
    fd = maps.joint = maps.along(maps.direction)
    maps.require_finite(fd)
    failures, jt = [], maps.jvp(fd.tangent) if forward else None
    if forward and _tangent_failures(case, maps, fd, jt):
        failures += maps.located(_tangent_failures, forward)
    if reverse and _cotangent_failures(case, maps, fd):
        failures += maps.located(_cotangent_failures, reverse)
    if not failures and forward and reverse and _dot_failures(case, maps, fd, jt):
        failures = maps.located(_dot_failures, reverse, differences=False)
    if failures:
        if positions != interface.diff_indices:  # in one input alone: the rules saw part
            names = sorted({case.spec.params[interface.leaf_param[i]] for i in positions})
            failures.append(
                f"(differentiating in {', '.join(map(repr, names))} alone: the other inputs' "
                f"tangents are symbolic zeros and only its cotangent is wanted; the rules "
                f"agree with finite differences in all inputs at once)")
        raise AssertionError("\n".join(failures))
    if maps.weakest > _WEAK * case.tolerances.derivative or maps.unresolved:
        skipped = f", and not at all for {', '.join(sorted(maps.unresolved))}" \
            if maps.unresolved else ""
        warnings.warn(
            f"jd.check: finite differences resolve the derivatives of {case.spec.name} only "
            f"to {maps.weakest:.0%} at these inputs (rounding noise, or curvature within a "
            f"relative step of {fd.step:.2g}), so its derivative rules are checked that "
            f"loosely there{skipped}; give jd.check example inputs at which the outputs "
            f"change smoothly and clearly with the inputs", UserWarning, stacklevel=4)


def _rules(spec, linear: bool) -> tuple:
    """``(rule, kind)`` of the tangent map and of the cotangent map (None without one).

    `linear`: every input differentiated is one the op is linear in (all of a linear
    op's; a partly linear op's named ones), so the forward and its transpose serve."""
    forward = reverse = None
    if linear or spec.multilinear:
        forward = (spec.describe("forward"), "@forward of a linear op" if linear
                   else "@forward of a multilinear op")
    elif "jvp" in spec.rules:
        forward = (spec.describe("jvp"), "@jvp")
    if linear:
        kind = "transpose" if "transpose" in spec.rules else "adjoint"
        reverse = (spec.describe(kind), f"@{kind}")
    elif spec.multilinear:
        reverse = (f"{spec.name} transpose(wrt=...)", "@transpose")
    elif "vjp" in spec.rules:
        reverse = (spec.describe("vjp"), "@vjp")
    elif "jvp" in spec.rules and spec.rules["jvp"].traceable:
        reverse = (spec.describe("jvp"), "@jvp, transposed by JAX")
    return forward, reverse


class _Maps:
    """The op as a function of some of its differentiable leaves (`positions`; the others
    fixed), its tangent and cotangent maps, and finite differences along a direction (all
    those leaves at once, or one alone)."""

    def __init__(self, case, reverse: bool, positions: tuple):
        self.case = case
        interface = case.interface
        self.diff, self.floats = positions, interface.float_out_indices
        self.x = [case.leaves[i] for i in self.diff]
        self.in_names = [interface.input_names[i] for i in self.diff]
        self.out_names = [interface.output_names[j] for j in self.floats]
        self.out_dtypes = [interface.outputs[j][1] for j in self.floats]
        self._pullback, self._alone = None, {}
        self.dot_cotangent = self.random_cotangent()
        # Along the gradient of a random projection, as the cotangent rule claims it.
        toward = self.vjp(self.random_cotangent()) if reverse else None
        self.direction = direction(case.rng, self.x, toward)
        self.joint = None  # finite differences along all inputs at once
        self.weakest = 0.0  # the largest error of the differences, relative to what they test
        self.unresolved = set()  # outputs whose derivative the differences could not see

    def f(self, *diff_leaves) -> tuple:
        flat = list(self.case.leaves)
        for i, value in zip(self.diff, diff_leaves):
            flat[i] = value
        outs = self.case.call(flat)
        return tuple(outs[j] for j in self.floats)

    def along(self, d):
        case = self.case
        tol = case.tolerances
        return differences(lambda points: [np.asarray(v) for v in self.f(*points)],
                           [case.eager[j] for j in self.floats], self.x, d, tol.eps,
                           tol.step, tol.derivative / 4, [case.noise[j] for j in self.floats])

    def alone(self, i):
        """Finite differences along input `i` alone (cached)."""
        if i not in self._alone:
            self._alone[i] = self.along([d if k == i else np.zeros_like(d)
                                         for k, d in enumerate(self.direction)])
        return self._alone[i]

    def jvp(self, tangent) -> list:
        tangents = tuple(t.astype(x.dtype) for t, x in zip(tangent, self.x))
        return [wide(v) for v in jax.jvp(self.f, tuple(self.x), tangents)[1]]

    def vjp(self, cotangent) -> list:
        if self._pullback is None:
            self._pullback = jax.vjp(self.f, *self.x)[1]
        return [wide(v) for v in self._pullback(tuple(self.cast(cotangent)))]

    def cast(self, cotangent) -> list:
        return [(c if np.issubdtype(d, np.complexfloating) else np.real(c)).astype(d)
                for c, d in zip(cotangent, self.out_dtypes)]

    def random_cotangent(self) -> list:
        rng = self.case.rng
        return [rng.standard_normal(np.shape(v)) + (1j * rng.standard_normal(np.shape(v))
                if np.issubdtype(d, np.complexfloating) else 0)
                for v, d in zip([self.case.eager[j] for j in self.floats], self.out_dtypes)]

    def resolve(self, fd_error, size) -> None:
        """Notes how coarsely the differences resolved a value of this `size`."""
        if size > 0:  # (both zero: a rule that says zero where the op does not move)
            self.weakest = max(self.weakest, fd_error / size)

    def require_finite(self, fd) -> None:
        for name, value, error in zip(self.out_names, fd.values, fd.error):
            if not (np.all(np.isfinite(value)) and np.isfinite(error)):
                raise AssertionError(
                    f"jd.check: finite differences of {self.case.spec.name} are not finite "
                    f"at the example inputs ({name} is NaN or infinite within a relative step "
                    f"of {fd.step:.2g} of them): give jd.check example inputs inside the "
                    f"op's domain, where it is differentiable")

    def located(self, failures_of, rule, differences=True) -> list:
        """The failures of one test along each input alone (with finite differences along
        it, or only the tangent); the joint failure if none."""
        found = []
        for i in range(len(self.diff)) if len(self.diff) > 1 else ():
            along = self.alone(i) if differences else dataclasses.replace(self.joint, tangent=[
                t if k == i else np.zeros_like(t) for k, t in enumerate(self.joint.tangent)])
            found += failures_of(self.case, self, along, only=i, rule=rule)
        return found or failures_of(self.case, self, self.joint, rule=rule)


def _where(maps, j, i) -> str:
    inputs = maps.in_names if i is None else [maps.in_names[i]]
    return f"d {maps.out_names[j]} / d {', '.join(inputs)}"


def _relative(error, size, bound, own, rtol) -> str:
    """By how much, against what: relative to the finite differences' magnitude `size`."""
    if size == 0:
        return f"off by {error:.3g} where finite differences give 0 (within {bound:.2g})"
    return (f"relative error {error / size:.3g} against a tolerance of {bound / size:.2g} "
            f"(rtol {rtol:.2g} of the larger of the two + {own / size:.2g} for the finite "
            f"differences' own error and rounding)")


def _tangent_failures(case, maps, fd, jt=None, only=None, rule=None) -> list:
    jt = maps.jvp(fd.tangent) if jt is None else jt
    rtol, found = case.tolerances.derivative, []
    for j, (a, b, fd_error) in enumerate(zip(jt, fd.values, fd.error)):
        if not fd.resolved[j]:
            maps.unresolved.add(maps.out_names[j])
            continue
        error = largest(np.nan_to_num(a - b, nan=np.inf))
        bound = rtol * max(largest(a), largest(b)) + fd_error
        maps.resolve(fd_error, max(largest(a), largest(b)))
        if error > bound:
            if rule is None:
                return [True]
            found.append(
                f"jd.check: {rule[0]} ({rule[1]}) disagrees with finite differences for "
                f"{_where(maps, j, only)}: " + _relative(error, largest(b), bound, fd_error, rtol)
                + f"; step {fd.step:.2g} of each input element")
    return found


def _cotangent_failures(case, maps, fd, only=None, rule=None) -> list:
    tol, found = case.tolerances, []
    aligned = [np.zeros_like(c) if not resolved else
               np.conj(v) / largest(v) if largest(v) > 0 else c
               for v, c, resolved in zip(fd.values, maps.random_cotangent(), fd.resolved)]
    maps.unresolved.update(n for n, r in zip(maps.out_names, fd.resolved) if not r)
    if not any(fd.resolved):
        return []
    for j in range(len(aligned)) if rule is not None else (None,):
        ct = [c if j in (None, k) else np.zeros_like(c) for k, c in enumerate(aligned)]
        ct = [wide(c) for c in maps.cast(ct)]
        cts = maps.vjp(ct)
        p = sum(pairing(c, v) for c, v in zip(ct, fd.values))
        q = sum(pairing(g, t) for g, t in zip(cts, fd.tangent))
        fd_error = sum(e * float(np.sum(np.abs(c))) for e, c in zip(fd.error, ct))
        own = fd_error + tol.dot * sum(magnitude(g, t) for g, t in zip(cts, fd.tangent))
        bound = tol.derivative * max(abs(p), abs(q)) + own
        maps.resolve(fd_error, max(abs(p), abs(q)))
        if not abs(p - q) <= bound:
            if rule is None:
                return [True]
            found.append(
                f"jd.check: {_reverse(case, rule, only)} disagrees with finite differences "
                f"for {_where(maps, j, only)}: <J^T ct, t> = {q:.6g} but <ct, J t> = {p:.6g} "
                f"by finite differences, " + _relative(abs(p - q), abs(p), bound, own,
                                                      tol.derivative))
    return found


def _dot_failures(case, maps, fd, jt=None, only=None, rule=None) -> list:
    """The dot-product test: the cotangent map against the tangent map, to rounding."""
    rtol, found = case.tolerances.dot, []
    jt = maps.jvp(fd.tangent) if jt is None else jt
    random = maps.dot_cotangent
    for j in range(len(random)) if rule is not None else (None,):
        ct = [wide(c) for c in maps.cast(
            [c if j in (None, k) else np.zeros_like(c) for k, c in enumerate(random)])]
        cts = maps.vjp(ct)
        p = sum(pairing(c, v) for c, v in zip(ct, jt))
        q = sum(pairing(g, t) for g, t in zip(cts, fd.tangent))
        scale = sum(magnitude(c, v) for c, v in zip(ct, jt)) + sum(
            magnitude(g, t) for g, t in zip(cts, fd.tangent))
        if not abs(p - q) <= rtol * scale:
            if rule is None:
                return [True]
            size = max(abs(p), abs(q)) or 1.0
            found.append(
                f"jd.check: {_reverse(case, rule, only)} fails the dot-product test against "
                f"<ct, J t> from the tangent map for {_where(maps, j, only)}: <J^T ct, t> = "
                f"{q:.6g} but <ct, J t> = {p:.6g}, relative error {abs(p - q) / size:.3g} "
                f"against a tolerance of {rtol * scale / size:.2g}")
    return found


def _reverse(case, rule, only) -> str:
    """The cotangent rule, named: a multilinear op's transpose for input `only`."""
    spec = case.spec
    if spec.multilinear and only is not None:
        param = spec.params[case.interface.leaf_param[case.interface.diff_indices[only]]]
        method = spec.transposes_wrt.get(param)
        if method is not None:
            return f"{spec.name}.{method.name} (@transpose(wrt={param!r}))"
    return f"{rule[0]} ({rule[1]})"
