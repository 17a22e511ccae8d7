"""Derivatives of the three NUFFTs, written with the NUFFT ops themselves.

With sign σ (``iflag``) and modes k, points x_j, strengths c_j:

- type 1, f_k = Σ_j c_j e^{iσ k·x_j}: df = A(dc) + Σ_d (iσ k_d) ⊙ A(dx_d ⊙ c);
- type 2, c_j = Σ_k f_k e^{iσ k·x_j}: dc = A(df) + Σ_d dx_d ⊙ A((iσ k_d) ⊙ f);
- type 3, f_k = Σ_j c_j e^{iσ s_k·x_j}: df = A(dc) + Σ_d (iσ s_d) ⊙ A(dx_d ⊙ c)
  + Σ_d ds_d ⊙ A((iσ x_d) ⊙ c);

where A is the op itself at the same points: every term is one more transform
of the same kind, so all of a tangent's transforms run as **one** call, the
terms stacked as extra transforms (finufft's n_trans). The cotangents are the
transposes: Aᵀ (type 2 for type 1, and back; type 3 from the targets to the
points) of the cotangent and of (iσ k_d) ⊙ ct, again stacked into one call,
with a point's cotangent the real part of Σ_b over the transforms sharing it.

A tangent that is symbolically zero (``None``) costs nothing, and a cotangent
nobody wants (``wanted``) is not computed. Since every term calls the ops,
these rules are themselves differentiable: derivatives of every order.
Shapes are the ops' layout: points (T, M), values (T, B, ...).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def frequencies(n: int, modeord: bool) -> np.ndarray:
    """The integer modes along an axis of n: -n/2 .. (n-1)/2, or in FFT order (zero first)."""
    k = np.arange(-(n // 2), (n + 1) // 2)
    return np.fft.ifftshift(k) if modeord else k


def _phase(op, modes: tuple, axis: int, dtype) -> np.ndarray:
    """iσ k along mode axis `axis`, shaped to broadcast over (T, B, *modes)."""
    k = frequencies(modes[axis], op.modeord)
    shape = [1] * (2 + len(modes))
    shape[2 + axis] = modes[axis]
    return (1j * op.iflag * k).astype(dtype).reshape(shape)


def _present(tangents) -> list:
    """(index, tangent) of the coordinate tangents that are not symbolically zero."""
    if tangents is None:
        return []
    return [(d, t) for d, t in enumerate(tangents) if t is not None]


def stacked(call, pieces: list) -> list:
    """`call` on the pieces (T, B, ...) as one call of their n_trans stacked; the results."""
    if len(pieces) == 1:
        return [call(pieces[0])]
    out = call(jnp.concatenate(pieces, axis=1))
    return jnp.split(out, len(pieces), axis=1)


def _point_cotangent(values, out) -> jnp.ndarray:
    """Re Σ_b values ⊙ out over the transforms sharing the points: (T, M)."""
    return jnp.sum(values * out, axis=1).real


# --- type 1 --------------------------------------------------------------------------------


def push1(op, config, points, source, dpoints, dsource):
    dtype = source.dtype
    pieces, scales = [], []
    if dsource is not None:
        pieces.append(dsource)
        scales.append(None)
    for d, dx in _present(dpoints):
        pieces.append(dx[:, None, :].astype(dtype) * source)
        scales.append(_phase(op, op.n_modes, d, dtype))
    if not pieces:
        return None
    outs = stacked(lambda v: op(config, points, v), pieces)
    return sum(o if s is None else s * o for o, s in zip(outs, scales))


def pull1(op, config, points, source, ct, *, wanted=(True, True)):
    want_points, want_source = wanted
    dtype = ct.dtype
    pieces = [ct] if want_source else []
    if want_points:
        pieces += [_phase(op, op.n_modes, d, dtype) * ct for d in range(len(points))]
    if not pieces:
        return None, None
    back = op.transposed()
    outs = stacked(lambda v: back(back.config, points, v), pieces)
    ct_source = outs.pop(0) if want_source else None
    ct_points = tuple(_point_cotangent(source, o) for o in outs) if want_points else None
    return ct_points, ct_source


# --- type 2 --------------------------------------------------------------------------------


def push2(op, config, points, source, dpoints, dsource):
    dtype = source.dtype
    modes = tuple(source.shape[2:])
    present = _present(dpoints)
    pieces = ([dsource] if dsource is not None else []) + \
        [_phase(op, modes, d, dtype) * source for d, _ in present]
    if not pieces:
        return None
    outs = stacked(lambda v: op(config, points, v), pieces)
    tangent = outs.pop(0) if dsource is not None else 0
    for (_, dx), o in zip(present, outs):
        tangent = tangent + dx[:, None, :].astype(dtype) * o
    return tangent


def pull2(op, config, points, source, ct, *, wanted=(True, True)):
    want_points, want_source = wanted
    modes = tuple(source.shape[2:])
    ct_source = None
    if want_source:
        back = op.transposed(modes)
        ct_source = back(back.config, points, ct)
    ct_points = None
    if want_points:  # dc/dx_d is a forward transform of (iσ k_d) ⊙ f, weighted by ct
        pieces = [_phase(op, modes, d, source.dtype) * source for d in range(len(points))]
        outs = stacked(lambda v: op(config, points, v), pieces)
        ct_points = tuple(_point_cotangent(ct, o) for o in outs)
    return ct_points, ct_source


# --- type 3 --------------------------------------------------------------------------------


def _scaled(op, coordinate, dtype):
    """iσ x, shaped (T, 1, M) to broadcast over the transforms."""
    return (1j * op.iflag) * coordinate[:, None, :].astype(dtype)


def push3(op, config, points, targets, source, dpoints, dtargets, dsource):
    dtype = source.dtype
    pieces, scales = [], []
    if dsource is not None:
        pieces.append(dsource)
        scales.append(None)
    for d, dx in _present(dpoints):  # moving a point: its phase turns with the targets
        pieces.append(dx[:, None, :].astype(dtype) * source)
        scales.append(_scaled(op, targets[d], dtype))
    for d, ds in _present(dtargets):  # moving a target: its phase turns with the points
        pieces.append(_scaled(op, points[d], dtype) * source)
        scales.append(ds[:, None, :].astype(dtype))
    if not pieces:
        return None
    outs = stacked(lambda v: op(config, points, targets, v), pieces)
    return sum(o if s is None else s * o for o, s in zip(outs, scales))


def pull3(op, config, points, targets, source, ct, *, wanted=(True, True, True)):
    want_points, want_targets, want_source = wanted
    dtype = ct.dtype
    ct_points = ct_targets = ct_source = None
    pieces = ([ct] if want_source else []) + \
        ([_scaled(op, s, dtype) * ct for s in targets] if want_points else [])
    if pieces:  # the transpose: from the targets back to the points
        back = op.transposed()
        outs = stacked(lambda v: back(back.config, targets, points, v), pieces)
        ct_source = outs.pop(0) if want_source else None
        if want_points:
            ct_points = tuple(_point_cotangent(source, o) for o in outs)
    if want_targets:
        pieces = [_scaled(op, x, dtype) * source for x in points]
        outs = stacked(lambda v: op(config, points, targets, v), pieces)
        ct_targets = tuple(_point_cotangent(ct, o) for o in outs)
    return ct_points, ct_targets, ct_source
