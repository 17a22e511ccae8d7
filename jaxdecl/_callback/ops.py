"""The ops behind ``jd.pure_callback``: a class per ``vmap_method`` and arity, an op per callback.

An op's inputs are the leaves of the callback's ``(args, kwargs)``, one array
each (so that an eager call of JAX arrays takes the dispatcher's fastest path);
its configuration is the callback, the arguments' structure, the declared
results and the ``vmap_method``. How ``vmap`` reaches the callback is the class
(:func:`class_for` makes one per method and number of leaves, named after both,
so that a saved program finds it again):

============================================  =========================================
``vmap_method``                               how a batch runs
============================================  =========================================
``"sequential"``, ``"sequential_unrolled"``   ``LoopedCallback<n>``: once per row, inside
                                              one XLA call (``batch="loop"``)
``"expand_dims"``                             ``ExpandedCallback<n>``: once, unbatched
                                              inputs with a leading dim of 1
                                              (``batch="vectorized"``)
``"broadcast_all"``                           ``BroadcastCallback<n>``: once, every input
                                              tiled to the batch (``@batch``)
``"legacy_vectorized"``                       ``LegacyCallback<n>``: once, unbatched inputs
                                              as they are (``@batch``)
``None``                                      ``UnbatchedCallback<n>``: ``vmap`` raises
                                              ``NotImplementedError``, as JAX does
============================================  =========================================

No class has derivatives: ``jax.pure_callback`` has none either, and
``jax.custom_jvp``/``custom_vjp`` wrappers around it work unchanged. A bare
``grad`` raises a ``ValueError`` (JAX's type) saying so.

Equal configurations are equal ops (:mod:`jaxdecl._callback.keys`: a fresh
lambda of the same code and closure is the same callback), so JAX's caches and
jaxdecl's kernels are shared between them.
"""

from __future__ import annotations

import re
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np

from .. import _declare
from .._op.configuration import _path
from .._spec import decorators as rules
from . import keys, results


class CallbackDerivativeError(ValueError):
    """A derivative of ``jd.pure_callback`` was asked for: like ``jax.pure_callback``, it has
    none (a ``ValueError``, as JAX raises)."""


class PureCallback(_declare.Primitive):
    """``callback(*args, **kwargs)`` on read-only NumPy views, its results checked and
    written into XLA's buffers. Made by :func:`jaxdecl.pure_callback`, never directly."""

    __jaxdecl_base__ = True  # the classes of class_for declare the ops
    # Its attributes are set once and never refer back to the op: the dispatcher finds
    # its handle by identity on every call (jaxdecl._op.identity._anchor).
    _jaxdecl_fixed_ = True

    def __init__(self, callback, in_tree, tree, structs, vmap_method, sharding, key=None):
        self.callback = callback
        self.in_tree = in_tree
        self.tree = tree
        self.results = structs
        self.vmap_method = vmap_method
        self.sharding = sharding
        self.name = keys.describe(callback)
        self._key = keys.key_of(callback) if key is None else key
        self._positional = in_tree == positional_tree(in_tree.num_leaves)
        self._hash = hash((type(self), self._key, in_tree, tree, structs, vmap_method,
                           sharding))

    # --- identity: equal configurations share compiled code -------------------------------

    def __eq__(self, other):
        return (type(other) is type(self) and self._hash == other._hash
                and self._key == other._key and self.in_tree == other.in_tree
                and self.tree == other.tree and self.results == other.results
                and self.vmap_method == other.vmap_method and self.sharding == other.sharding
                and keys.same(self.callback, other.callback))

    def __hash__(self):
        return self._hash

    @property
    def _jaxdecl_one_device_(self):
        """The sharding naming the one device a program runs the call on (or None: the
        plan of an op without a declaration), read by the lowering."""
        return self.sharding

    def __repr__(self):
        return f"jd.pure_callback({self.name})"

    # --- saving: a module-level callback by its import path --------------------------------

    def __getstate__(self):
        if _path(self.callback) is None:
            raise TypeError(
                f"jd.pure_callback({self.name}): a saved program names its callback by "
                f"module and name, so that the loading process finds it; this one is "
                f"{_unnamed(self.callback)}. Pass a function defined at the top level of "
                f"a module that the loading process imports")
        if self.sharding is not None:
            raise TypeError(f"jd.pure_callback({self.name}): a program whose callback has "
                            f"sharding= cannot be saved (its device is this process's)")
        return {"callback": self.callback,
                "arguments": jax.tree_util.tree_unflatten(
                    self.in_tree, [0] * self.in_tree.num_leaves),
                "skeleton": jax.tree_util.tree_unflatten(self.tree, [0] * len(self.results)),
                "results": [(tuple(s.shape), s.dtype) for s in self.results],
                "vmap_method": self.vmap_method}

    def __setstate__(self, state):
        structs = tuple(jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))
                        for shape, dtype in state["results"])
        self.__init__(state["callback"], jax.tree_util.tree_structure(state["arguments"]),
                      jax.tree_util.tree_structure(state["skeleton"]), structs,
                      state["vmap_method"], None)

    # --- what every class's rules run -------------------------------------------------------

    def _declared(self):
        return jax.tree_util.tree_unflatten(self.tree, self.results)

    def _run(self, leaves, out) -> None:
        if self._positional:
            returned = self.callback(*leaves)
        else:
            args, kwargs = jax.tree_util.tree_unflatten(self.in_tree, leaves)
            returned = self.callback(*args, **kwargs)
        if type(out) is np.ndarray:
            if type(returned) is np.ndarray and returned.shape == out.shape and \
                    returned.dtype == out.dtype:  # (the common case, on every call)
                out[...] = returned
                return
            outs = (out,)
        else:
            outs = jax.tree_util.tree_leaves(out)
        if len(outs) == 1 and type(returned) is np.ndarray:
            returned = (returned,)
        else:
            returned = jax.tree_util.tree_leaves(returned)
        results.write_results(returned, outs, self.name)

    @rules.jvp(traceable=True)
    def push(self, *primals_and_tangents):
        raise CallbackDerivativeError(
            f"jd.pure_callback({self.name}) has no derivatives, as jax.pure_callback has none "
            f"(Pure callbacks do not support JVP). Wrap the call in jax.custom_jvp or "
            f"jax.custom_vjp with rules of your own, as for jax.pure_callback, or declare a "
            f"jd.Primitive class with @jd.jvp / @jd.vjp rules")


#: count -> the structure of `count` positional arrays and no keywords (read by every
#: eager call: a dict's get, not a cached function's call).
POSITIONAL: dict = {}


def positional_tree(count: int):
    """The structure of `count` positional arrays and no keywords."""
    tree = POSITIONAL.get(count)
    if tree is None:
        tree = POSITIONAL.setdefault(count, jax.tree_util.tree_structure((tuple(range(count)), {})))
    return tree


def _unnamed(callback) -> str:
    qualname = getattr(callback, "__qualname__", "") or ""
    if "<lambda>" in qualname:
        return "a lambda"
    if "<locals>" in qualname:
        return "defined inside a function (a closure)"
    if getattr(callback, "__module__", None) == "__main__":
        return "defined in the __main__ script"
    return f"a {type(callback).__name__}, which has no import path"


# --- vmap methods ---------------------------------------------------------------------------


def _batched_call(op, args, axes, tile: bool):
    """The batch as one call of the same callback: batched leaves with their batch axis
    first, unbatched ones tiled to the batch (`tile`) or left as they are."""
    size = next(leaf.shape[d] for leaf, d in zip(args, axes) if d is not None)
    moved = [jnp.moveaxis(leaf, d, 0) if d is not None
             else (jnp.broadcast_to(leaf, (size, *np.shape(leaf))) if tile else leaf)
             for leaf, d in zip(args, axes)]
    structs = tuple(jax.ShapeDtypeStruct((size, *s.shape), s.dtype) for s in op.results)
    batched = type(op)(op.callback, op.in_tree, op.tree, structs, op.vmap_method,
                       op.sharding, op._key)
    return batched(*moved), 0


def _broadcast_all(self, args, axes):
    return _batched_call(self, args, axes, tile=True)


def _legacy_vectorized(self, args, axes):
    return _batched_call(self, args, axes, tile=False)


def _refused(self, args, axes):
    raise NotImplementedError(
        f"vmap is only supported for the pure_callback primitive when vmap_method is one of "
        f"'sequential', 'sequential_unrolled', 'expand_dims', 'broadcast_all', or "
        f"'legacy_vectorized'. Got vmap_method=None: pass one to "
        f"jd.pure_callback({self.name}) ('sequential' runs each row inside one call; "
        f"'expand_dims' hands the callback the whole batch)")


#: vmap_method -> (class name's stem, class options, @batch rule or None)
_METHODS = {"sequential": ("Looped", {"batch": "loop"}, None),
            "sequential_unrolled": ("Looped", {"batch": "loop"}, None),
            "expand_dims": ("Expanded", {"batch": "vectorized"}, None),
            "broadcast_all": ("Broadcast", {}, _broadcast_all),
            "legacy_vectorized": ("Legacy", {}, _legacy_vectorized),
            None: ("Unbatched", {}, _refused)}
_STEMS = {stem: (options, batch) for stem, options, batch in _METHODS.values()}
_NAME = re.compile(r"^(Looped|Expanded|Broadcast|Legacy|Unbatched)Callback(\d+)$")
_made: dict = {}
_making = threading.Lock()


def class_for(vmap_method, arity: int) -> type:
    """The op class for `vmap_method` and `arity` array leaves (made once, and kept as an
    attribute of this module, where a saved program's recipe finds it)."""
    return _class(_METHODS[vmap_method][0], arity)


def _class(stem: str, arity: int) -> type:
    name = f"{stem}Callback{arity}"
    cls = _made.get(name)
    if cls is not None:
        return cls
    with _making:
        cls = _made.get(name)
        if cls is None:
            options, batch = _STEMS[stem]
            cls = _made[name] = _declare.PrimitiveMeta(
                name, (PureCallback,), _namespace(name, arity, batch), **options)
            setattr(sys.modules[__name__], name, cls)
    return cls


def _namespace(name: str, arity: int, batch) -> dict:
    # The rules name one parameter per leaf: jaxdecl reads an op's inputs from them.
    params = "".join(f", x{i}" for i in range(arity))
    leaves = "(" + "".join(f"x{i}, " for i in range(arity)) + ")"
    source = (f"def shapes(self{params}):\n    return self._declared()\n"
              f"def apply(self{params}, *, out):\n    self._run({leaves}, out)\n")
    made: dict = {}
    exec(compile(source, f"<jd.pure_callback: {name}>", "exec"), made)  # noqa: S102
    namespace = {"__module__": __name__, "__qualname__": name,
                 "__doc__": f"jd.pure_callback's op of {arity} array(s).",
                 "shapes": rules.abstract(made["shapes"]),
                 "apply": rules.forward(made["apply"])}
    if batch is not None:
        namespace["batched"] = rules.batch(batch)
    if arity == 0:
        namespace["push"] = None  # no inputs, nothing to differentiate: no @jvp allowed
    return namespace


def __getattr__(name: str):
    # A process that loads a saved program finds its class here before making any.
    found = _NAME.match(name)
    if found is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _class(found.group(1), int(found.group(2)))
