"""The eager path: one compiled executable per signature, shared by every op.

An op called outside any trace must not compile anew for each op instance (a
loop that builds a fresh identity-keyed op per iteration would compile each
time, and every executable would keep its op alive). So the eager executable
does not name its kernel: the kernel's registry slot arrives as an extra
scalar operand (``jaxdecl_dispatch_eager``), and one executable per
(operand, result) signature serves every op and rule. The kernel is held by
the caller for the duration of the call, which blocks.

Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxdecl as jd
    >>> class Twice(jd.Primitive):
    ...     def __init__(self, table):
    ...         self.table = table  # an array: the op is keyed by identity
    ...     @jd.abstract
    ...     def shapes(self, x):
    ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
    ...     @jd.forward
    ...     def apply(self, x):
    ...         return 2 * x
    >>> [float(Twice(np.zeros(2))(jnp.float32(i))) for i in range(3)]  # compiled once
    [0.0, 2.0, 4.0]
"""

from __future__ import annotations

import functools

import jax
from jax.core import ShapedArray

from . import _compat, _errors, _runtime

eager_p = _compat.Primitive("jaxdecl_eager_call")
eager_p.multiple_results = True


def _abstract_eval(slot, *avals, out_avals):
    return [ShapedArray(shape, dtype) for shape, dtype in out_avals]


_ffi_lowering = jax.ffi.ffi_lowering(_runtime.EAGER_TARGET, has_side_effect=False)


def _lowering(ctx, slot, *operands, out_avals):
    return _ffi_lowering(ctx, slot, *operands)  # out_avals are ctx.avals_out already


def _impl(slot, *operands, out_avals):
    # Reached only inside jax.disable_jit(), which runs the executable's Python.
    with jax.disable_jit(False):
        return executable(out_avals, depth=-1)(slot, *operands)


eager_p.def_impl(_impl)
eager_p.def_abstract_eval(_abstract_eval)
_compat.mlir.register_lowering(eager_p, _lowering, platform="cpu")


@functools.lru_cache(maxsize=1024)
def executable(out_avals: tuple, depth: int = 0):
    """The jitted caller for one result signature (operands: jit's own cache).

    `depth` numbers copies of it: a rule that calls another op of the same
    signature cannot re-enter the executable that is running it (JAX refuses
    recursive calls), so a nested call takes the next copy.
    """
    return jax.jit(lambda slot, *operands: eager_p.bind(slot, *operands, out_avals=out_avals))


def _nested(call, operands):
    """Runs `call` from inside a rule that a copy of its executable is running."""
    depth = 1
    while True:
        try:
            return executable(call.out_avals, depth)(call.slot, *operands)
        except RecursionError as error:
            if "Recursively calling" not in str(error):
                raise
            depth += 1


@functools.lru_cache(maxsize=256)
def sharded_executable(mesh, in_specs: tuple, out_specs: tuple, summed: tuple,
                       out_avals: tuple):
    """The jitted caller that runs a kernel on every device's block of sharded operands.

    Like :func:`executable` it names no kernel (the slot is an operand,
    replicated), so every op whose per-shard signature, mesh and plan agree
    shares it. `out_avals` are the per-device results; ``summed[i]`` lists the
    mesh axes over which result `i`'s partial results are added.
    """
    P = _compat.P

    def local(slot, *blocks):
        outs = eager_p.bind(slot, *blocks, out_avals=out_avals)
        return [_compat.psum(o, axes) if axes else o for o, axes in zip(outs, summed)]

    return jax.jit(_compat.shard_map(
        local, mesh, in_specs=(P(),) + tuple(P(*s) for s in in_specs),
        out_specs=[P(*s) for s in out_specs]))


class Call:
    """One kernel ready to run eagerly: its slot operand, result signature and caller."""

    __slots__ = ("kernel", "slot", "out_avals", "single", "rebuild", "caller", "nests")

    def __init__(self, kernel: _runtime.Kernel, out_avals: tuple, single: bool,
                 rebuild=None, caller=None):
        self.kernel = kernel
        self.slot = kernel.slot_operand()
        self.out_avals = out_avals
        self.single = single  # return the one result bare, not in a list
        self.rebuild = rebuild  # or: the results' pytree from the flat tuple of them
        # A per-shard caller has no copies for nested calls (see _nested).
        self.nests = caller is None
        self.caller = executable(out_avals) if caller is None else caller


def run(call: Call, operands):
    """Runs `call` on JAX arrays now; returns its result(s), raising the rule's error.

    A rule's exception reaches the caller as itself (type, message, chained
    exceptions); the call blocks so that it is raised here. The caller holds
    the kernel's pin (see :meth:`~jaxdecl._runtime.Kernel.pin`).
    """
    try:
        try:
            results = call.caller(call.slot, *operands)
        except RecursionError as error:  # a rule calling an op of its own signature
            if "Recursively calling" not in str(error) or not call.nests:
                raise
            results = _nested(call, operands)
        if call.single:
            results[0].block_until_ready()
        else:
            for result in results:
                result.block_until_ready()
    except (_compat.JaxRuntimeError, ValueError) as error:
        # JAX's jit fast path reports a failed execution as ValueError, its
        # first call as JaxRuntimeError: the eager path always gives the rule's
        # own exception, or else JaxRuntimeError (a C kernel's failure).
        original = _errors.take_original(error)
        if original is None:
            if isinstance(error, _compat.JaxRuntimeError) or \
                    not _errors.describe(error).startswith("INTERNAL: "):
                raise
            original = _compat.JaxRuntimeError(_errors.describe(error))
    else:
        if call.single:
            return results[0]
        return tuple(results) if call.rebuild is None else call.rebuild(results)
    # Raised outside the except block: the rule's own __cause__/__context__ stay.
    raise original
