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
import numpy as np
from jax.core import ShapedArray

from .. import _compat, _errors
from .._host import registry as _runtime
from .._sharded import plan as _plan
from .._sharded import shardmap as _shardmap
from .._sharded import strategy as _strategy
from .._sharded.plan import Plan as _Plan
from .._sharded.strategy import Strategy

eager_p = _compat.Primitive("jaxdecl_eager_call")
eager_p.multiple_results = True


def _abstract_eval(slot, *avals, out_avals):
    return [ShapedArray(shape, dtype) for shape, dtype in out_avals]


_ffi_lowering = jax.ffi.ffi_lowering(_runtime.EAGER_TARGET, has_side_effect=False)


def _lowering(ctx, slot, *operands, out_avals):
    # (`run` names the op: the eager executable is shared by every op)
    _errors.refuse_other_platforms(ctx.platforms or ctx.module_context.platforms,
                                   "a jaxdecl op")
    return _ffi_lowering(ctx, slot, *operands)  # out_avals are ctx.avals_out already


def _impl(slot, *operands, out_avals):
    # Reached only inside jax.disable_jit(), which runs the executable's Python.
    with jax.disable_jit(False):
        return executable(out_avals, depth=-1)(slot, *operands)


eager_p.def_impl(_impl)
eager_p.def_abstract_eval(_abstract_eval)
_compat.register_lowering(eager_p, _lowering)  # CPU and CUDA: the same target names


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
def sharded_executable(mesh, plan: _Plan, once_per_block: bool, have: tuple, want: tuple,
                       out_avals: tuple):
    """The jitted caller that runs a kernel on every device's block of sharded operands.

    Built by :func:`jaxdecl._sharded.shardmap.build` (the one per-shard map builder).
    Like :func:`executable` it names no kernel (the slot is an operand,
    replicated), so every op whose per-shard signature, mesh and plan agree
    shares it. `out_avals` are the per-device results.
    """
    def run(slot, *blocks):
        return eager_p.bind(slot, *blocks, out_avals=out_avals)

    return jax.jit(_shardmap.build(run, mesh, plan, out_avals=out_avals,
                                   once_per_block=once_per_block, have=have,
                                   want=want, explicit=_compat.has_explicit_axes(mesh),
                                   lead=((),)))


class Call:
    """One kernel ready to run eagerly: its slot operand, result signature and caller."""

    __slots__ = ("kernel", "pin", "slot", "out_avals", "single", "rebuild", "caller", "nests")

    def __init__(self, kernel: _runtime.Kernel, out_avals: tuple, single: bool,
                 rebuild=None, caller=None):
        self.kernel = kernel
        # `kernel.pin` without its frame: every eager call takes the pin.
        self.pin = _pinned if kernel.instance_ref is None else kernel.instance_ref
        self.slot = kernel.slot_operand()
        self.out_avals = out_avals
        self.single = single  # return the one result bare, not in a list
        self.rebuild = rebuild  # or: the results' pytree from the flat tuple of them
        # A per-shard caller has no copies for nested calls (see _nested).
        self.nests = caller is None
        self.caller = executable(out_avals) if caller is None else caller


def _pinned():
    """The pin of a kernel that holds its op strongly (or has none)."""
    return True


def run(call: Call, operands):
    """Runs `call` on JAX arrays now; returns its result(s), raising the rule's error.

    A rule's exception reaches the caller as itself (type, message, chained
    exceptions); the call blocks so that it is raised here. The caller holds
    the kernel's pin (see :meth:`~jaxdecl._host.registry.Kernel.pin`).
    """
    try:
        try:
            results = call.caller(call.slot, *operands)
        except _errors.PlatformError as error:
            raise error.naming(call.kernel.name) from None
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


# ---------------------------------------------------------------------------------------
# Operands that span several devices
# ---------------------------------------------------------------------------------------

def spans_devices(values) -> bool:
    """True when some array among `values` (a pytree) lives on several devices."""
    for value in values:  # the common case, JAX arrays, without flattening
        if type(value) is not _compat.ArrayImpl:
            break
        if value.sharding.num_devices > 1:
            return True
    else:
        return False
    return any(getattr(getattr(a, "sharding", None), "num_devices", 1) > 1
               for a in jax.tree_util.tree_leaves(values))


def _devices_spanned(operands) -> int:
    """How many devices the operands live on, together."""
    devices = set()
    for x in jax.tree_util.tree_leaves(operands):
        devices.update(getattr(getattr(x, "sharding", None), "device_set", ()))
    return len(devices)


def run_sharded(eqn, operands, *, single: bool = False, rebuild=None):
    """Runs `eqn` now on operands spanning several devices, as its strategy says.

    Per shard over the operands' mesh (:func:`sharded_call`), declared or not;
    or once on one device where they share no mesh. Results come back on the
    operands' mesh, with the shardings the plan implies, so they mix with the
    operands in any later JAX op. `single`/`rebuild` shape the return value as
    :class:`Call` does.
    """
    mesh, specs = _plan.common_mesh(operands)
    # A call cached for these operands' mesh and specs was planned per shard already.
    found = sharded_call(eqn, mesh, specs, operands, single=single, rebuild=rebuild,
                         cached_only=True) if mesh is not None else None
    if found is None:
        strategy = _strategy.decide(
            devices=_devices_spanned(operands), eager=True, common_mesh=mesh is not None,
            declared=eqn.declared,
            explicit=mesh is not None and _compat.has_explicit_axes(mesh),
            splits=eqn.declared or _splits_batch(eqn, specs),
            addressable=all(getattr(x, "is_fully_addressable", True) for x in operands))
        if strategy is Strategy.ONE_DEVICE:
            return _one_device(eqn, operands, mesh, specs, single, rebuild)
        found = sharded_call(eqn, mesh, specs, operands, single=single, rebuild=rebuild)
    call, pin = found
    # Operands on no mesh (NumPy values, one-device arrays) join it whole.
    placed = [x if isinstance(getattr(x, "sharding", None), _compat.NamedSharding) else
              jax.device_put(x, _compat.NamedSharding(mesh, _compat.P())) for x in operands]
    with _compat.outside_vmap_axes():  # the per-shard map covers the whole mesh
        result = run(call, placed)
    del pin  # held until here: the kernel's op stays alive for the call
    return result


def _splits_batch(eqn, specs) -> bool:
    """Some operand is split along a vmapped dim (the dims an undeclared op may split)."""
    n = len(eqn.batch)
    return bool(n and specs and any(any(spec[:n]) for spec in specs))


def sharded_call(eqn, mesh, specs, operands, *, single=False, rebuild=None,
                 cached_only=False):
    """``(call, pin)``: `eqn` ready to run now on each device's blocks (hold `pin`).

    Runs through an executable shared by every op with the same per-shard
    signature (nothing compiles per configuration); a rule's exception reaches
    the caller as itself. Calls are cached on the op's handle; `cached_only`:
    None where none is.
    """
    cache = eqn.op.handle.sharded_calls
    # The op's own eager call returns what @abstract declares (`single`, `rebuild`),
    # the primitive's a flat list: the same equation and operands, two different calls.
    key = (eqn.key, mesh, specs, single, rebuild is not None)
    call = cache.get(key)
    pin = call.kernel.pin() if call is not None else None
    if pin is not None:
        return call, pin
    if cached_only:
        return None
    in_shapes = tuple(tuple(x.shape) for x in operands)
    factors = eqn.factors(in_shapes)
    axis_sizes = dict(mesh.shape)
    plan = _plan.plan_for(eqn, factors, specs, axis_sizes,
                       explicit=_compat.has_explicit_axes(mesh))
    shard, local_in = _plan.local_equation(eqn, factors, plan, axis_sizes, in_shapes)
    kernel, pin = shard.kernel(local_in)
    want = tuple(tuple(s) for s in _plan.result_specs(eqn, plan, specs, in_shapes))
    caller = sharded_executable(mesh, plan, not eqn.declared, tuple(specs), want,
                                shard.out_avals)
    call = Call(kernel, shard.out_avals, single, rebuild=rebuild, caller=caller)
    if all(getattr(x, "is_fully_addressable", True) for x in operands):
        # The slot goes to every device of the mesh once, not at each call (a
        # one-device scalar would be copied to each device on every run). Across
        # processes the slot differs per process, which a global array may not.
        call.slot = jax.device_put(call.slot, _compat.NamedSharding(mesh, _compat.P()))
    cache[key] = call
    return call, pin


def _one_device(eqn, operands, mesh, specs, single, rebuild):
    """`eqn` run once on one device, its results placed back where they belong."""
    placements = None
    mesh = mesh if mesh is not None else _compat.context_mesh()
    if mesh is not None:
        specs = specs or [_plan.partition_spec_of(x) for x in operands]
        # Operands on another mesh place no result (their specs name its axes).
        elsewhere = frozenset(i for i, x in enumerate(operands)
                              if getattr(getattr(x, "sharding", None), "mesh", None) != mesh)
        per_result = _plan.result_specs(eqn, _plan.whole_plan(eqn), specs,
                                        [np.shape(x) for x in operands], elsewhere)
        placements = [_compat.NamedSharding(mesh, _compat.P(*s)) for s in per_result]

    def run_whole(values):
        in_shapes = tuple(tuple(x.shape) for x in values)
        kernel, pin = eqn.kernel(in_shapes)
        result = run(Call(kernel, eqn.out_avals, single, rebuild=rebuild), values)
        del pin
        return result

    return run_once(run_whole, operands, placements)


def onto_one_device(values):
    """`values` (a pytree) moved whole onto one device, where they span several.

    Arrays another process holds parts of stay as they are.
    """
    leaves = jax.tree_util.tree_leaves(values)
    sharded = [x for x in leaves if getattr(getattr(x, "sharding", None), "num_devices", 1) > 1]
    if not sharded or not all(getattr(x, "is_fully_addressable", True) for x in sharded):
        return values
    device = min(sharded[0].sharding.device_set, key=lambda d: d.id)
    return jax.device_put(values, device)


def run_once(run_whole, values, placements=None):
    """``run_whole(values)`` on one device, `values` (a pytree) moved there whole first.

    Inside ``jax.set_mesh`` the run happens outside the context mesh (whose
    ``jit`` would refuse one-device arrays). `placements` (a sharding per
    result leaf, or None) say where the results go back; by default they stay.
    """
    if _compat.context_mesh() is None:
        results = run_whole(onto_one_device(values))
    else:
        with _compat.outside_context_mesh():
            results = run_whole(onto_one_device(values))
    if placements is None:
        return results
    leaves, tree = jax.tree_util.tree_flatten(results)
    return jax.tree_util.tree_unflatten(tree, [
        jax.device_put(x, where) for x, where in zip(leaves, placements)])
