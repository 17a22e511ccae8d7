"""Finite differences along one direction, with a bound on their own error.

The method, in the op's own precision: the op runs as the user ships it (no float64 copy,
so an op whose ``@abstract`` fixes float32 is checked as it runs, and no rule has to
accept a precision it was not written for).

- **A step per input element.** Each differentiable input leaf moves along a direction
  whose size at each element is that element's magnitude (at least 1e-3 of the leaf's root
  mean square) times a step ``h``, first eps^(1/4) as a power of two (1/64 in float32,
  2^-13 in float64): the same relative change at any amplitude. Each element moves by a
  random fraction in [1/2, 1] of that, with the sign (complex: the phase) of the gradient
  the cotangent rule claims for a random projection of the outputs, where there is one: a
  sum of many inputs then changes as much as the step allows instead of cancelling. A
  wrong claim only makes it another direction to test along.
- **The step actually taken.** ``x ± h·d`` is rounded to the input's dtype; the direction
  the differences measure is recomputed exactly (in float64) from the rounded points, so
  rounding the inputs costs nothing. The rules under test get that direction.
- **Richardson extrapolation.** Central differences at ``h`` and ``2h`` (four calls of the
  op) combine to a fourth-order estimate ``(8 D(h) - D(2h)) / 6``.
- **Its error, bounded per output.** Rounding: each call's error is taken as the largest of
  ``8·eps·max|f|``, twice what two runs at the same inputs differed by (a forward whose
  last bits vary), and half the fourth difference of the five values ``f(x + k·h·d)``,
  ``k = -2..2`` (which shows noise, and curvature); the extrapolation multiplies it by 1.5.
  Truncation: the third-order term ``(D(2h) - 2 D(h)) / 6``, the error of the plain
  central difference, bounds the extrapolated one's.
- **A step that fits.** When that error exceeds a quarter of the derivative tolerance
  relative to the derivative, the step grows 4-fold (to at most 1/8) where rounding
  limits it, else shrinks 16-fold, and the most accurate of at most three steps is kept:
  four calls of the op usually, twelve at most.
- **Resolved or not.** An output whose bound exceeds half its differences is not resolved
  (the step sees more than the derivative, and the bound is no bound there): it is not
  compared, and ``jd.check`` warns.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .tolerances import largest, wide

_TRIES, _SHRINK, _GROW, _LARGEST = 3, 16.0, 4.0, 1.0 / 8
_RESOLVED = 0.5
_NOISE_ULPS = 8.0


@dataclasses.dataclass(frozen=True)
class Differences:
    """Finite differences of an op's float outputs along one direction of its inputs."""

    tangent: list  # per differentiable input leaf: the direction measured (wide)
    values: list  # per float output leaf: J·tangent by finite differences (wide)
    error: list  # per float output leaf: a bound on max |values - J·tangent|
    resolved: list  # per float output leaf: the error is at most half of max |values|
    # (beyond, the step sees more than the derivative and the bound is not one)
    step: float  # h, relative to each input element
    quality: float  # max over outputs of error / max |values|: what they can resolve
    rounding_bound: bool  # rounding, not truncation, limits the worst output: a larger
    # step would do better


def direction(rng, leaves: list, toward=None) -> list:
    """Per leaf, a random direction scaled to each element's magnitude (wide).

    With `toward` (per leaf, e.g. a gradient as the cotangent rule claims it), each
    element moves the way that increases the pairing with it, so that the outputs change
    as much as the step allows (a random sign would cancel in a sum); a wrong claim only
    makes it another direction to test along.
    """
    directions = []
    for index, leaf in enumerate(leaves):
        value = wide(leaf)
        size = np.abs(value)
        rms = float(np.sqrt(np.mean(size**2))) if size.size else 0.0
        size = np.maximum(size, 1e-3 * rms) if rms > 0 else np.ones_like(size)
        length = rng.uniform(0.5, 1.0, value.shape)
        if np.iscomplexobj(value):
            unit = np.exp(2j * np.pi * rng.uniform(0.0, 1.0, value.shape))
        else:
            unit = rng.choice([-1.0, 1.0], value.shape)
        if toward is not None:
            claim = np.nan_to_num(wide(toward[index]), nan=0.0, posinf=0.0, neginf=0.0)
            if not np.iscomplexobj(value):
                claim = np.real(claim)
            moved = np.abs(claim) > 0
            unit = np.where(moved, np.conj(claim) / np.where(moved, np.abs(claim), 1.0), unit)
        directions.append(size * length * unit)
    return directions


def differences(evaluate, centre, x: list, d: list, eps: float, step: float, target: float,
                noise=None) -> Differences:
    """Finite differences of `evaluate` at `x` along `d` (per leaf), accurate to `target`
    relative to the derivative where the op allows.

    Args:
      evaluate: the op's float outputs (as a list) at a list of input leaves.
      centre: `evaluate(x)`, already computed.
      x: the differentiable input leaves (their own dtypes).
      d: the direction per leaf (wide), e.g. from :func:`direction`.
      eps: machine epsilon of the lowest precision involved.
      step: the first relative step.
      target: the relative error at which a step is good enough.
      noise: per output leaf, a difference already seen between two runs at `x`.
    """
    noise = noise or [0.0] * len(centre)
    best, h, tried = None, step, set()
    while len(tried) < _TRIES and h not in tried:
        tried.add(h)
        found = _at(evaluate, centre, x, d, eps, h, noise)
        if best is None or found.quality < best.quality:
            best = found
        if best.quality <= target:
            break
        h = h * _GROW if found.rounding_bound and h * _GROW <= _LARGEST else h / _SHRINK
    return best


def _at(evaluate, centre, x, d, eps, h, noise) -> Differences:
    points = {k: [(wide(xi) + k * h * di).astype(xi.dtype) for xi, di in zip(x, d)]
              for k in (1, -1, 2, -2)}
    f = {k: [wide(v) for v in evaluate(p)] for k, p in points.items()}
    tangent = [(8 * (wide(p1) - wide(m1)) / 2 - (wide(p2) - wide(m2)) / 2) / 6
               for p1, m1, p2, m2 in zip(points[1], points[-1], points[2], points[-2])]
    values, errors, resolved, quality, rounding_bound = [], [], [], 0.0, False
    for j, f0 in enumerate(centre):
        f0 = wide(f0)
        first = (f[1][j] - f[-1][j]) / 2
        second = (f[2][j] - f[-2][j]) / 2
        estimate = (8 * first - second) / 6
        third = (second - 2 * first) / 6
        fourth = f[-2][j] - 4 * f[-1][j] + 6 * f0 - 4 * f[1][j] + f[2][j]
        size = max(largest(f0), *(largest(f[k][j]) for k in f))
        known = max(_NOISE_ULPS * eps * size, 2 * noise[j])  # rounding, as modelled and seen
        rounding = max(known, largest(fourth) / 2)  # what the five values show
        error = 1.5 * rounding + largest(third)
        values.append(estimate)
        errors.append(error)
        # An output the direction does not move has nothing to resolve.
        unchanged = all(np.array_equal(f[k][j], f0, equal_nan=True) for k in f)
        scale = largest(estimate)
        worst = 0.0 if unchanged else error / scale if scale > 0 else float("inf")
        worst = worst if np.isfinite(error) and np.isfinite(scale) else float("inf")
        resolved.append(worst <= _RESOLVED)
        if worst >= quality:  # a fourth difference beyond rounding is curvature (or worse)
            quality = worst
            rounding_bound = 1.5 * known > largest(third) and largest(fourth) <= 8 * known
    return Differences(tangent, values, errors, resolved, h, quality, rounding_bound)
