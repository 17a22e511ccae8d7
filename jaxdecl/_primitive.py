"""The JAX primitive every jaxdecl op binds, and the one place that wires it into JAX.

A single primitive, ``jaxdecl_call``, stands for every rule of every op; its
parameters say which:

- ``op``: the :class:`~jaxdecl._op.OpHandle` (class + configuration);
- ``rule``: ``forward``, ``jvp``, ``vjp``, ``transpose`` or ``transpose_wrt``
  (operand orders in :mod:`jaxdecl._layout`);
- ``wrt``: the input index of a multilinear ``transpose_wrt`` (else -1);
- ``primals``: (shape, dtype) of the op's primal inputs, per batch element;
- ``batch``: leading batch dimensions every operand and result carries
  (operands may have size 1 there, broadcasting; results never do).

Abstract evaluation, lowering, autodiff and batching are registered once,
here, for all of them.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.core import ShapedArray

from . import _autodiff, _batching, _compat, _errors, _runtime

jaxdecl_p = _compat.Primitive("jaxdecl_call")
jaxdecl_p.multiple_results = True


def _impl(*args, **params):
    """Eager evaluation (e.g. inside an un-jitted jax.jvp): compile and run, blocking.

    Blocks so that a rule's exception reaches the caller here, as itself.
    """
    try:
        return jax.block_until_ready(_compat.apply_primitive(jaxdecl_p, *args, **params))
    except _compat.JaxRuntimeError as error:
        _errors.reraise_original(error)
        raise


def _abstract_eval(*avals, op, rule, wrt, primals, batch):
    io = op.rule_io(primals, rule, wrt)
    if len(avals) != len(io.in_names):  # pragma: no cover - internal invariant
        raise ValueError(f"{op}: rule {rule} got {len(avals)} operands, "
                         f"expected {len(io.in_names)}")
    return [ShapedArray(batch + shape, dtype) for shape, dtype in io.out_avals]


def _lowering(ctx, *args, op, rule, wrt, primals, batch):
    traceable = op.traceable(rule)
    if traceable is not None:
        evaluate = _batching.broadcast_vmapped(traceable, batch, len(args))
        return _compat.mlir.lower_fun(evaluate, multiple_results=True)(ctx, *args)
    op.user_rule(rule, wrt)  # raises MissingRuleError before anything runs
    in_shapes = tuple(tuple(aval.shape) for aval in ctx.avals_in)
    key = op.kernel_key(rule, wrt, primals, batch, in_shapes)
    return _ffi_lowering(ctx, *args, key=np.int64(key))


_ffi_lowering = jax.ffi.ffi_lowering(_runtime.TARGET, has_side_effect=False)

jaxdecl_p.def_impl(_impl)
jaxdecl_p.def_abstract_eval(_abstract_eval)
_compat.mlir.register_lowering(jaxdecl_p, _lowering, platform="cpu")
_compat.ad.primitive_jvps[jaxdecl_p] = _autodiff.jvp_rule
_compat.ad.primitive_transposes[jaxdecl_p] = _autodiff.transpose_rule
_compat.batching.primitive_batchers[jaxdecl_p] = _batching.batch_rule
