"""``jd.pure_callback``: ``jax.pure_callback``'s API on jaxdecl's dispatch path.

Code switches by changing ``jax.pure_callback`` to ``jd.pure_callback``: the
same arguments (pytrees in and out, ``vmap_method``, ``sharding``, keyword
arguments for the callback), the same checks and the same errors' types. The
call runs as a jaxdecl op (:mod:`jaxdecl._callback.ops`), made once per
callback and result types and kept while it is used (:func:`op_for`): the
callback gets read-only NumPy views of XLA's buffers, with no copy and no
``device_put``, and the program can be exported when the callback is a
module-level function.

Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxdecl as jd
    >>> x = jnp.linspace(0.0, 1.0, 4)
    >>> y = jax.jit(lambda x: jd.pure_callback(
    ...     np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x))(x)
    >>> bool(jnp.allclose(y, jnp.sin(x)))
    True
"""

from __future__ import annotations

import collections
import inspect
import threading
import weakref

import jax
import numpy as np

from .. import _compat
from . import keys, ops, results

__all__ = ["pure_callback", "CallbackResultError", "CallbackDerivativeError"]

CallbackResultError = results.CallbackResultError
CallbackDerivativeError = ops.CallbackDerivativeError

#: How many recently used callback ops are kept alive when nothing else holds them
#: (so that an eager loop calling a module-level function, or a fresh lambda of the
#: same code and closure, reuses one op and one kernel). Older ones live only as long
#: as a trace or a compiled program holds them: memory is bounded by what is alive.
RECENT = 256

_ALLOWED = ["sequential", "sequential_unrolled", "expand_dims", "broadcast_all",
            "legacy_vectorized", None]
# The installed JAX's signature, followed exactly: up to some releases it still names
# the removed `vectorized` (and refuses it); later ones pass it to the callback.
_JAX_SIGNATURE = inspect.signature(jax.pure_callback)
_REFUSES_VECTORIZED = "vectorized" in _JAX_SIGNATURE.parameters
_ALLOWED_SET = frozenset(_ALLOWED)

_recent: collections.OrderedDict = collections.OrderedDict()
_alive: dict = {}
#: callback -> (shape, dtype, in_tree, vmap_method, sharding, x64, op) of its last call
#: with one declared array (op_for's first, cheapest lookup).
_last: dict = {}
_X64 = _compat.X64
_lock = threading.RLock()  # (an op dropped under it runs _forget)


def pure_callback(callback, result_shape_dtypes, *args, sharding=None, vmap_method=None,
                  **kwargs):
    """Calls a pure host function from JAX code: ``jax.pure_callback``, on jaxdecl's path.

    Takes what ``jax.pure_callback`` takes and means the same: `callback` is
    called with `args` and `kwargs` (pytrees; their leaves read-only NumPy
    arrays) and returns a pytree of arrays matching `result_shape_dtypes`
    (leaves with ``shape`` and ``dtype``); `vmap_method` says how ``vmap``
    reaches it (``"sequential"``, ``"sequential_unrolled"``, ``"expand_dims"``,
    ``"broadcast_all"``, ``"legacy_vectorized"``, or None to refuse ``vmap``);
    `sharding` (one device) is where the call runs, inside a program over many
    devices too (see ``jaxdecl/_transforms/one_device.py``).
    It has no derivatives: wrap it in ``jax.custom_jvp``/``custom_vjp`` as with
    ``jax.pure_callback``.

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np, jaxdecl as jd
        >>> f = jax.vmap(lambda x: jd.pure_callback(
        ...     np.cumsum, jax.ShapeDtypeStruct(x.shape, x.dtype), x,
        ...     vmap_method="sequential"))
        >>> f(jnp.ones((2, 3))).tolist()
        [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]
    """
    if kwargs and _REFUSES_VECTORIZED and "vectorized" in kwargs:
        raise ValueError("The 'vectorized' argument of jax.pure_callback was removed in JAX "
                         "v0.6.0. Use 'vmap_method' instead.")
    if vmap_method not in _ALLOWED_SET:
        raise ValueError(f"vmap_method must be on of the allowed methods {_ALLOWED}, but got: "
                         f"{vmap_method}")
    if sharding is not None:
        _check_sharding(sharding)
    leaves = args  # (the common case: arrays, no keywords; a pytree costs a microsecond)
    if kwargs:
        leaves, in_tree = _flatten((args, kwargs))
    else:
        for a in args:
            if type(a) not in _ARRAY_CLASSES and not isinstance(a, _ARRAY_TYPES):
                leaves, in_tree = _flatten((args, kwargs))
                break
        else:
            in_tree = _POSITIONAL.get(len(args))
            if in_tree is None:
                in_tree = ops.positional_tree(len(args))
    op = op_for(callback, result_shape_dtypes, vmap_method, sharding, in_tree)
    if sharding is not None and _compat.not_tracing():
        leaves = _onto_device(leaves, sharding)  # (traced, the lowering places the call)
    if not op.results:
        # A pure function without results changes nothing: never run (as under jit,
        # where XLA drops such a call), and jaxdecl's ops have at least one result.
        return jax.tree_util.tree_unflatten(op.tree, [])
    return op(*leaves)


pure_callback.__signature__ = _JAX_SIGNATURE
_flatten = jax.tree_util.tree_flatten
_ShapeDtypeStruct = jax.ShapeDtypeStruct
_ARRAY_TYPES = (jax.Array, np.ndarray)
_ARRAY_CLASSES = frozenset((_compat.ArrayImpl, np.ndarray))  # (no isinstance on jax.Array)
_POSITIONAL = ops.POSITIONAL


def op_for(callback, result_shape_dtypes, vmap_method=None, sharding=None,
           in_tree=None) -> ops.PureCallback:
    """The op that calls `callback` with arguments of structure `in_tree` (by default
    one array) for these results: one made earlier for the same callback
    (:mod:`jaxdecl._callback.keys`) where one is alive, else a new one."""
    if in_tree is None:
        in_tree = ops.positional_tree(1)
    x64 = _X64.value
    one = type(result_shape_dtypes) is _ShapeDtypeStruct  # (the common case: no flattening)
    if one:
        # An eager loop calls the same callback with equal arguments: found by the
        # callback alone (a dict's get, no key to hash), then checked field by field.
        shape, dtype = result_shape_dtypes.shape, result_shape_dtypes.dtype
        try:
            last = _last.get(callback)
        except TypeError:  # (an unhashable callable)
            last = None
        if last is not None and last[0] == shape and last[1] == dtype and \
                (last[2] is in_tree or last[2] == in_tree) and last[3] == vmap_method and \
                last[4] == sharding and last[5] == x64:
            op = last[6]
            if op.callback is callback or keys.same(op.callback, callback):
                return op
    callable_key = keys.key_of(callback)
    if one:
        declared = None
        wanted = (None, ((shape, dtype),))
    else:
        declared = results.declared(result_shape_dtypes, _Named(callback))
        tree, structs = declared
        wanted = (None if jax.tree_util.treedef_is_leaf(tree) else tree,
                  tuple((s.shape, s.dtype) for s in structs))
    key = (callable_key, wanted, in_tree, vmap_method, sharding, x64)
    # (Reads take no lock: a dict's get is atomic, and a hit is checked against its op.)
    op = _recent.get(key)
    if op is not None and keys.same(op.callback, callback):
        try:
            _recent.move_to_end(key)
        except KeyError:  # another thread dropped it meanwhile: it is still this op
            pass
        if one:
            _remember(callback, (shape, dtype, in_tree, vmap_method, sharding, x64, op))
        return op
    with _lock:
        ref = _alive.get(key)
        op = None if ref is None else ref()
        if op is not None and keys.same(op.callback, callback):
            _recent[key] = op
            _recent.move_to_end(key)
            return op
    if not callable(callback):
        raise TypeError(f"jd.pure_callback: callback {callback!r:.60} is not callable")
    if declared is None:
        declared = results.declared(result_shape_dtypes, _Named(callback))
    cls = ops.class_for(vmap_method, in_tree.num_leaves)
    op = cls(callback, in_tree, *declared, vmap_method, sharding, callable_key)
    with _lock:
        _recent[key] = op
        _recent.move_to_end(key)
        _alive[key] = weakref.ref(op, lambda _, key=key: _forget(key))
        while len(_recent) > RECENT:
            _recent.popitem(last=False)
    if one:
        _remember(callback, (shape, dtype, in_tree, vmap_method, sharding, x64, op))
    return op


def _remember(callback, entry) -> None:
    """`entry` as the last op of `callback` (at most RECENT callbacks are remembered: like
    the recent ops, they live on only that long)."""
    if len(_last) >= RECENT:
        _last.clear()
    try:
        _last[callback] = entry
    except TypeError:  # (an unhashable callable)
        pass


def _forget(key) -> None:
    with _lock:
        ref = _alive.get(key)
        if ref is not None and ref() is None:
            del _alive[key]


def _onto_device(leaves, sharding):
    """The arguments, on the one device of `sharding`, where the call then runs (as a
    compiled program runs it there)."""
    device = next(iter(sharding.device_set))
    return [x if isinstance(x, jax.Array) and x.sharding.device_set == {device}
            else jax.device_put(x, device) for x in leaves]


def _check_sharding(sharding) -> None:
    """JAX's rule: a callback runs on one device, so its `sharding` names one."""
    if isinstance(sharding, jax.sharding.SingleDeviceSharding) or (
            isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh.size == 1):
        return
    raise NotImplementedError(
        f"pure_callback only supports SingleDeviceSharding, but got {type(sharding)}")


class _Named:
    """The callback's name for a message, made only when a message is."""

    def __init__(self, callback):
        self.callback = callback

    def __format__(self, spec):
        return keys.describe(self.callback)


def clear() -> None:
    """Forgets the recently used ops (tests of lifetimes; the cache refills itself)."""
    with _lock:
        _recent.clear()
        _last.clear()
