"""jax-finufft's broadcasting rules: user shapes to the ops' (T, B, ...) layout and back.

Each coordinate array is ``(..., M)`` and the values are ``(..., M)`` (types 1
and 3) or ``(..., N1, ..., Nd)`` (type 2). The leading dims of the points and
of the values broadcast against each other; the values may also have exactly
one leading dim more than the points (a batch of transforms sharing all the
points). Leading dims along which the points have size 1 while the values do
not are transforms sharing their points: they become finufft's ``n_trans``
(``B``); the other leading dims are separate point sets (``T``). So every
call is one op call on ``points (T, M)`` and ``values (T, B, ...)``.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxdecl.contrib.finufft._shapes import flatten
    >>> layout, (x,), _, c = flatten(1, jnp.ones((4, 7), jnp.complex64), (jnp.ones(7),), ())
    >>> x.shape, c.shape, layout.unflatten(jnp.ones((1, 4, 16))).shape
    ((1, 7), (1, 4, 7), (4, 16))
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the op's (T, B, ...) result goes back to the user's shape."""

    lead: tuple  # the values' leading dims, shared ones moved last
    moved_from: tuple  # where the shared dims were
    moved_to: tuple  # where they are in `lead`

    def unflatten(self, result):
        result = jnp.reshape(result, self.lead + result.shape[2:])
        return jnp.moveaxis(result, self.moved_to, self.moved_from) if self.moved_to else result


def flatten(nufft_type: int, values, points: tuple, targets: tuple, mask=None):
    """``(layout, points, targets, values)`` in the ops' layout, or with a `mask`
    ``(layout, points, targets, values, mask)``.

    `points` are the coordinate arrays (x, y, z), `targets` type 3's (s, t, u)
    (empty otherwise); the values' trailing dims are one axis of points
    (types 1, 3) or the d mode axes (type 2). A mask broadcasts and moves as the
    points do, to ``(T, M)``. Raises ValueError naming the shapes that do not
    broadcast.
    """
    ndim = len(points)
    core = ndim if nufft_type == 2 else 1
    masked = mask is not None
    if masked:
        points = tuple(points) + (mask,)
    try:
        points = jnp.broadcast_arrays(*points)
        targets = jnp.broadcast_arrays(*targets) if targets else ()
        lead = points[0].shape[:-1]
        if targets:
            lead = jnp.broadcast_shapes(lead, targets[0].shape[:-1])
            points = [jnp.broadcast_to(p, lead + p.shape[-1:]) for p in points]
            targets = [jnp.broadcast_to(s, lead + s.shape[-1:]) for s in targets]
        if values.ndim == len(lead) + core + 1:  # one batch dim more than the points
            lead = lead + (1,)
            points = [p[..., None, :] for p in points]
            targets = [s[..., None, :] for s in targets]
        if values.ndim != len(lead) + core:
            raise ValueError(f"values of rank {values.ndim} for points of rank "
                             f"{len(lead) + 1}: expected rank {len(lead) + core} or one more")
        shape = jnp.broadcast_shapes(values.shape[:len(lead)], lead)
    except ValueError as error:
        raise ValueError(
            f"nufft{nufft_type}: the shapes do not broadcast ({error}): values "
            f"{tuple(values.shape)}, points {[tuple(p.shape) for p in points[:ndim]]}"
            + (f", mask {tuple(points[-1].shape)}" if masked else "")
            + (f", targets {[tuple(s.shape) for s in targets]}" if targets else "")
        ) from None
    values = jnp.broadcast_to(values, shape + values.shape[len(lead):])
    shared = tuple(i for i, (a, b) in enumerate(zip(lead, shape)) if a != b)
    own = len(shape) - len(shared)
    moved_to = tuple(range(own, len(shape)))
    if shared:
        values = jnp.moveaxis(values, shared, moved_to)
        points = [jnp.moveaxis(p, shared, moved_to) for p in points]
        targets = [jnp.moveaxis(s, shared, moved_to) for s in targets]
    lead_moved = values.shape[:len(shape)]
    sets, batch = math.prod(lead_moved[:own]), math.prod(lead_moved[own:])
    values = jnp.reshape(values, (sets, batch) + values.shape[len(shape):])
    points = tuple(jnp.reshape(p, (sets, p.shape[-1])) for p in points)
    targets = tuple(jnp.reshape(s, (sets, s.shape[-1])) for s in targets)
    layout = Layout(lead_moved, shared, moved_to if shared else ())
    if masked:
        return layout, points[:ndim], targets, values, points[ndim]
    return layout, points, targets, values
