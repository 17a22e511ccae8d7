"""``jd.check``: verify an op's rules the way a careful reviewer would.

Each check is a function of one :class:`~.case.Case` (the op at the example inputs) that
raises ``AssertionError`` naming the wrong rule: adding a check is adding one function to
:data:`CHECKS`. The order matters only in that later checks trust earlier ones (the
derivative checks trust the forward, ``jit`` and ``vmap`` the eager result).
"""

from __future__ import annotations

import jax
import numpy as np

from .._call import flatten_inputs
from .._op.identity import spec_of
from .._spec import interface as _interface
from . import derivatives, forward, linear_part, sharding, transforms
from .case import Case
from .tolerances import tolerances_for

#: The checks after the forward and jit ones, in order.
CHECKS = (linear_part.check_linear_part, derivatives.check_derivatives,
          transforms.check_vmap, sharding.check_sharding)


def check(op, *args, rtol: float | None = None, seed: int = 0) -> None:
    """Checks every rule of `op` at `args`; raises AssertionError naming the wrong rule.

    Verifies, at the example inputs, in the op's own precision:

    - ``@abstract`` against the eager result; a zero-copy ``@forward`` writes
      every element of ``out`` (an element is unwritten when it keeps its fill
      in both of two runs with different fills) and does not read it first;
      the same for the residuals of ``@jd.residuals``, and the same outputs
      with and without ``saved``;
    - ``jit`` against eager, and ``vmap`` against a loop of calls;
    - the tangent map (``@jvp``, or a linear op's forward) against finite
      differences, per output and input;
    - the cotangent map (``@vjp``, ``@transpose``, ``@adjoint``) against finite
      differences too, by ⟨Jᵀ ct, t⟩ against ⟨ct, fd⟩ (pairing Re Σ a·b, no
      conjugation), so rules that are wrong together are caught; then against
      the tangent map by the dot-product test ⟨ct, J t⟩ = ⟨Jᵀ ct, t⟩;
    - a partly linear op (``linear=("c",)``): its forward is linear in the
      linear inputs at the example's other inputs, and ``@transpose`` (or
      ``@adjoint``) is its transpose there by the dot-product test; an op
      whose rules see part of the inputs (a partly linear op,
      ``@jvp(zeros=True)``, a ``@vjp`` or ``@transpose`` taking ``wanted``)
      has its derivative rules checked in each input alone too, the others'
      tangents symbolic zeros and only that cotangent asked for;
    - a sharding declaration (``sharding=`` or ``@jd.sharding``): the op on two
      slices along each factor its rules may split, joined (or summed, for
      ``reduce=``), against the whole op; the residuals likewise.

    Finite differences move each input element by a step relative to its own
    magnitude, extrapolate central differences at two steps (Richardson), and
    estimate their own error from rounding and truncation; a derivative must
    agree with them within ``rtol`` of its own magnitude plus that error. Every
    other comparison is relative to the magnitude of what it compares. Default
    tolerances, by the lowest precision among the op's inputs and outputs:

    ============================  =========  ==========  ==========
    comparison                    float16    float32     float64
    ============================  =========  ==========  ==========
    derivatives vs differences    1e-1       1e-3        1e-5
    values, dot-product test      3e-2       2e-4        1e-8
    ============================  =========  ==========  ==========

    A failure says which rule is wrong, for which output and input, by how
    much (relative error) and against what tolerance. Finite differences too
    coarse to check a derivative at these inputs (rounding noise, curvature
    within the step) warn (``UserWarning``) instead of passing silently.

    Args:
      op: a jaxdecl op instance.
      *args: example inputs (arrays, scalars or pytrees of them), inside the
        op's domain, where it is differentiable.
      rtol: one relative tolerance for every comparison instead of the
        defaults (finite differences still add their own error).
      seed: seed of the random directions and cotangents.

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
    operands, signature = flatten_inputs(spec, args)
    interface = _interface.interface_of(spec, op, signature)
    dtypes = [d for _, d in interface.inputs] + [d for _, d in interface.outputs]
    case = Case(spec=spec, op=op, leaves=[np.asarray(x) for x in operands],
                tree=jax.tree_util.tree_structure(tuple(args)), signature=signature,
                interface=interface, tolerances=tolerances_for(dtypes, rtol),
                rng=np.random.default_rng(seed))
    case.eager = forward.check_forward(case)
    case.noise = transforms.check_jit(case)
    for step in CHECKS:
        step(case)
