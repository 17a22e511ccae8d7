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
from . import derivatives, forward, sharding, transforms
from .case import Case
from .tolerances import tolerances_for

#: The checks after the forward and jit ones, in order.
CHECKS = (derivatives.check_derivatives, transforms.check_vmap, sharding.check_sharding)


def check(op, *args, rtol: float | None = None, seed: int = 0) -> None:
    """Checks every rule of `op` at `args`; raises AssertionError naming the wrong rule.

    Verifies: ``@abstract`` against the eager result; that the zero-copy
    ``@forward`` writes every output element; ``jit`` against eager; ``@jvp``
    against central finite differences; ``@vjp``/``@transpose`` against the
    tangent map by the dot-product test ⟨ct, J t⟩ = ⟨Jᵀ ct, t⟩ (pairing
    Re Σ a·b); and ``vmap`` against a loop.

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
