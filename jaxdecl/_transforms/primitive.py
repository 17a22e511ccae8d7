"""The JAX primitive every jaxdecl op binds: abstract evaluation and eager evaluation.

A single primitive, ``jaxdecl_call`` (:data:`jaxdecl_p`, bound by :func:`bind`),
stands for every rule of every op; its one parameter, ``equation``, is an
:class:`~jaxdecl._op.equation.Equation` saying which. This module gives it its
types (abstract evaluation, shardings included), its eager evaluation, and
the evaluation of traceable (JAX-valued) rules under the equation's batch
dims (:func:`broadcast_vmapped`). The lowering
(:mod:`jaxdecl._transforms.lowering`), differentiation
(:mod:`jaxdecl._transforms.autodiff`) and batching
(:mod:`jaxdecl._transforms.batching`) register themselves on the same
primitive.

Example:
    >>> import jax, jax.numpy as jnp, jaxdecl as jd
    >>> class Neg(jd.Primitive):
    ...     @jd.abstract
    ...     def shapes(self, x):
    ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
    ...     @jd.forward
    ...     def apply(self, x):
    ...         return -x
    >>> str(jax.make_jaxpr(Neg())(jnp.ones(2))).count("jaxdecl_call")
    1
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.core import ShapedArray

from .. import _compat
from .._op.equation import Equation
from .._sharded import plan as _plan
from .._sharded import strategy as _strategy
from .._sharded.strategy import Strategy
from . import eager as _eager

#: The one primitive every rule of every op binds; its parameter is an Equation.
jaxdecl_p = _compat.Primitive("jaxdecl_call")
jaxdecl_p.multiple_results = True


_insert_reshards = _compat.insert_reshards  # JAX's own function: every bind calls it


def bind(eqn: Equation, operands) -> list:
    """Binds `eqn` on JAX values (or tracers); returns its results."""
    # Inside shard_map, operands that vary over fewer manual axes than others are
    # cast (pvary) first; transposed, that sums a replicated input's gradient.
    return jaxdecl_p.bind(*_insert_reshards(*operands), equation=eqn)


def broadcast_vmapped(function, batch: tuple):
    """Applies a traceable rule to operands with leading (maybe size-1) batch dims.

    An operand of size 1 along a batch dim is unbatched there: it is mapped
    with ``in_axes=None``, never broadcast to the batch's size. A rule's result
    that is None (a symbolic zero) stays None.
    """
    if not batch:
        return function

    def batched(*operands):
        mapped_dims, squeezed = [], []
        for x in operands:
            mapped = tuple(s == b for s, b in zip(x.shape[:len(batch)], batch))
            drop = tuple(k for k, m in enumerate(mapped) if not m)
            squeezed.append(jax.lax.squeeze(x, drop) if drop else x)
            mapped_dims.append(mapped)
        mapped = function
        for k in reversed(range(len(batch))):  # the outermost vmap maps batch dim 0
            mapped = jax.vmap(mapped, in_axes=tuple(0 if m[k] else None for m in mapped_dims),
                              axis_size=batch[k])
        return mapped(*squeezed)

    return batched


def mesh_of(avals):
    """The (abstract) mesh the operands' types refer to, or None."""
    for aval in avals:
        mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty:
            return mesh
    return None


def _impl(*args, equation):
    """Eager evaluation (e.g. inside an un-jitted jax.jvp), through the shared executable."""
    eqn = equation
    traceable = eqn.traceable()
    if traceable is not None:
        return broadcast_vmapped(traceable, eqn.batch)(*args)
    eqn.user_rule()  # raises MissingRuleError before anything runs
    if _eager.spans_devices(args):
        return list(_eager.run_sharded(eqn, args))
    kernel, pin = eqn.kernel(tuple(tuple(np.shape(x)) for x in args))
    results = _eager.run(_eager.Call(kernel, eqn.out_avals, single=False), args)
    del pin  # held until here: the kernel's op stays alive for the call
    return list(results)


def _abstract_eval(*avals, equation):
    eqn = equation
    io = eqn.io
    if len(avals) != len(io.in_names):  # pragma: no cover - internal invariant
        raise ValueError(f"{eqn}: got {len(avals)} operands, expected {len(io.in_names)}")
    shapes = eqn.out_avals
    mesh = mesh_of(avals)
    if mesh is None:
        return [ShapedArray(shape, dtype) for shape, dtype in shapes]
    # Inside shard_map (over all mesh axes or some) results vary over the manual
    # axes as the operands do.
    varying = _compat.vma_of(jaxdecl_p.name, avals)

    def typed(result_specs):
        return [_compat.sharded_aval(shape, dtype, mesh, spec, varying)
                for (shape, dtype), spec in zip(shapes, result_specs)]

    def whole():
        # Unsplit, on the operands' mesh, as JAX types its own ops' results: a
        # type without the mesh would lose it for what follows (under vmap of a
        # split batch dim, a later transpose re-adds the batch's mesh axis to it).
        return typed([(None,) * len(shape) for shape, _ in shapes])

    specs = [_plan.partition_spec_of(a) for a in avals]
    if _compat.all_axes_manual(mesh) or not any(any(s) for s in specs):
        return whole()
    # The types carry shardings (Explicit axes): the results' follow from the
    # strategy the lowering will take, and its plan.
    strategy = _strategy.decide(
        devices=math.prod(dict(mesh.shape).values()), declared=eqn.declared,
        explicit=_compat.has_explicit_axes(mesh))
    shapes_in = tuple(tuple(a.shape) for a in avals)
    if strategy is Strategy.DIRECT:
        # (an op without a declaration, on a JAX that cannot run it once: every
        # device runs it on gathered inputs, and keeps its slice of each result)
        plan = _plan.whole_plan(eqn)
    else:
        factors = eqn.factors(shapes_in)
        plan = _plan.plan_for(eqn, factors, specs, dict(mesh.shape), explicit=True)
    meshless = {i for i, a in enumerate(avals) if mesh_of([a]) is None}
    return typed(_plan.result_specs(eqn, plan, specs, shapes_in, meshless))


jaxdecl_p.def_impl(_impl)
_compat.requires_devices_when_lowering(jaxdecl_p)
jaxdecl_p.def_abstract_eval(_abstract_eval)
