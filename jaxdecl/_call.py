"""Calling an op: ``op(*args)`` staged into a trace, or run now.

An op's arguments become flat JAX operands and a signature (``signature``:
pytree arguments contribute their leaves); under any trace the forward
equation is bound, outside one it runs through the shared eager executable of
its signature, or by the strategy :mod:`jaxdecl._transforms.eager` chooses for arrays
that span several devices.

Example:
    >>> import jax, jax.numpy as jnp, jaxdecl as jd
    >>> class Scale(jd.Primitive):
    ...     def __init__(self, factor):
    ...         self.factor = factor
    ...     @jd.abstract
    ...     def shapes(self, x):
    ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
    ...     @jd.forward
    ...     def apply(self, x):
    ...         return self.factor * x
    >>> float(Scale(2.0)(jnp.float32(3.0)))  # eager
    6.0
    >>> float(jax.jit(Scale(2.0))(jnp.float32(3.0)))  # staged
    6.0
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat, _dtypes
from ._host import structure as _structure
from ._op.equation import Equation
from ._op.handle import BoundOp, OpHandle
from ._op.identity import check_static, handle_of
from ._spec import interface as _interface
from ._spec.interface import FORWARD
from ._transforms import eager as _eager
from ._transforms.primitive import bind


def _as_operand(value, spec, name):
    if isinstance(value, _ARRAYS):
        operand = value
    else:
        try:
            operand = jnp.asarray(value)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"{spec.name}: input {name!r} is a {type(value).__name__} ({value!r:.80}), "
                f"not an array: inputs are JAX or NumPy arrays or Python scalars. "
                f"Configuration (flags, callables, strings) belongs on the instance, set in "
                f"__init__ ({error})"
            ) from None
    if operand.dtype not in _SUPPORTED:  # (the message is built only when it is needed)
        _dtypes.check_supported(operand.dtype, f"{spec.name}: input {name}")
    return operand


_ARRAYS = (_compat.Tracer, jax.Array)
_SUPPORTED = _dtypes.SUPPORTED_DTYPES
_ArrayImpl, _SingleDeviceSharding = _compat.ArrayImpl, jax.sharding.SingleDeviceSharding
_LEAVES = (_compat.Tracer, jax.Array, np.ndarray, np.generic, int, float, complex, bool)


def flatten_inputs(spec, args) -> tuple:
    """``(operands, signature)``: the op's arguments as flat JAX arrays, and its signature.

    An array (or scalar) argument is one operand with a ``(shape, dtype)``
    entry; a pytree argument contributes its leaves, with a
    :class:`~jaxdecl._spec.interface.TreeAval` entry that remembers its structure.
    """
    operands, signature = [], []
    for value, name in zip(args, spec.params):
        # None (an empty pytree) and lone leaves (a string, a callable) get
        # _as_operand's error; arrays and scalars are converted directly.
        leaves, tree = ((), None) if isinstance(value, _LEAVES) or value is None else \
            jax.tree_util.tree_flatten(value, is_leaf=_structure.stands_for_array)
        if tree is None or jax.tree_util.treedef_is_leaf(tree):
            operand = _as_operand(value, spec, name)
            operands.append(operand)
            signature.append((tuple(operand.shape), operand.dtype))
            continue
        paths = None
        avals = []
        for index, leaf in enumerate(leaves):
            if not isinstance(leaf, _LEAVES):
                if paths is None:
                    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(
                        value, is_leaf=_structure.stands_for_array)[0]]
                leaf = _as_operand(leaf, spec, name + jax.tree_util.keystr(paths[index]))
            else:
                leaf = _as_operand(leaf, spec, name)
            operands.append(leaf)
            avals.append((tuple(leaf.shape), leaf.dtype))
        signature.append(_interface.TreeAval(tree, tuple(avals)))
    return operands, tuple(signature)


def rebuild(groups, single: bool, outs):
    """The op's return value from its flat outputs: arrays and pytrees as @abstract said."""
    values = _structure.pack(groups, outs)
    return values[0] if single else tuple(values)


def bind_forward(op: BoundOp, args) -> object:
    """Binds the forward rule on JAX values; returns its result(s) as @abstract declared."""
    operands, signature = flatten_inputs(op.spec, args)
    eqn = Equation(op, FORWARD, signature)
    interface = eqn.interface
    if eqn.declared:
        eqn.sharding()  # a declaration that does not fit the inputs fails here, named
    outs = bind(eqn, operands)
    if interface.structured:
        return rebuild(interface.out_groups, interface.single_output, outs)
    return outs[0] if interface.single_output else tuple(outs)


def _run_sharded(handle: OpHandle, instance, args):
    """Runs the op now on arguments that span several devices (see _eager.run_sharded)."""
    operands, signature = flatten_inputs(handle.spec, args)
    eqn = Equation(BoundOp(handle, instance), FORWARD, signature)
    interface = eqn.interface
    if eqn.declared:  # a declaration that does not fit fails here, named
        eqn.sharding()
    rebuilt = None
    if interface.structured:
        rebuilt = lambda outs, groups=interface.out_groups, single=interface.single_output: \
            rebuild(groups, single, outs)  # noqa: E731
    return _eager.run_sharded(eqn, operands,
                              single=interface.single_output and not interface.structured,
                              rebuild=rebuilt)


def _eager_call(handle: OpHandle, instance, args) -> tuple:
    """``(call, operands, pin)``: the forward ready to run eagerly on `args` (one device).

    Converts NumPy arrays and scalars to JAX arrays; the call is cached on the
    handle by the operands' (shape, dtype), which is what :func:`apply_op` looks up.
    """
    operands, signature = flatten_inputs(handle.spec, args)
    call = handle.eager_calls.get(signature)
    pin = call.kernel.pin() if call is not None else None
    if pin is None:
        interface = handle.interface(signature, instance)
        if handle.declares_sharding:  # a declaration that does not fit fails here, named
            handle.sharding(signature, instance)
        in_shapes = tuple(shape for shape, _ in interface.inputs)
        kernel, pin = handle.kernel((FORWARD, -1, signature, (), None), in_shapes, instance)
        if interface.structured:
            call = _eager.Call(kernel, interface.outputs, False,
                               rebuild=lambda outs, groups=interface.out_groups,
                               single=interface.single_output: rebuild(groups, single, outs))
        else:
            call = _eager.Call(kernel, interface.outputs, interface.single_output)
        handle.eager_calls[signature] = call
    return call, operands, pin


def _arguments(spec, args: tuple, kwargs: dict) -> tuple:
    if not kwargs:
        if len(args) != len(spec.params):
            raise TypeError(
                f"{spec.name} takes {len(spec.params)} input(s) ({', '.join(spec.params)}), "
                f"got {len(args)}"
            )
        return args
    values = dict(zip(spec.params, args))
    for name, value in kwargs.items():
        if name not in spec.params:
            raise TypeError(f"{spec.name} has no input named {name!r} (inputs: {spec.params})")
        if name in values:
            raise TypeError(f"{spec.name} got input {name!r} twice")
        values[name] = value
    missing = [p for p in spec.params if p not in values]
    if missing or len(args) > len(spec.params):
        raise TypeError(f"{spec.name} takes inputs {spec.params}; missing {missing}")
    return tuple(values[p] for p in spec.params)


def apply_op(instance, *args, **kwargs):
    """``op(*args, **kwargs)``: the primitive applied to JAX arrays, NumPy arrays or
    Python scalars; staged into an active trace, else run now.

    Under any trace (jit, vmap, grad, scan, eval_shape, ...) the op binds its
    primitive, constants included. Outside, it runs through the shared eager
    executable of its signature. The common case (JAX arrays whose signature
    ran before) is a few dictionary lookups: the Python work here sits on the
    critical path of every eager call.
    """
    handle = handle_of(instance)
    spec = handle.spec
    if kwargs or len(args) != len(spec.params):
        args = _arguments(spec, args, kwargs)
    if not _compat.not_tracing():
        check_static(spec, instance)
        return bind_forward(BoundOp(handle, instance), args)
    # The common case first: JAX arrays on one device each, of a signature run before.
    key = []
    for a in args:
        if type(a) is not _ArrayImpl or type(a.sharding) is not _SingleDeviceSharding:
            break
        key.append((a.shape, a.dtype))
    else:
        call = handle.eager_calls.get(tuple(key))
        if call is not None:
            pin = call.pin()  # held until the call returns: the op stays alive
            if pin is not None:
                return _eager.run(call, args)
    if _eager.spans_devices(args):
        # The shared single-device executable would gather: the strategy decides.
        return _run_sharded(handle, instance, args)
    try:
        # An object that stands for an array (nnx.Variable: shape and dtype, __jax_array__)
        # shortens the key, so that it misses and flatten_inputs converts the object.
        call = handle.eager_calls[tuple([(a.shape, a.dtype) for a in args
                                         if getattr(a, "__jax_array__", None) is None])]
        pin = call.kernel.pin()  # held until the call returns: the kernel's op stays alive
        if pin is None:
            raise KeyError
    except (AttributeError, KeyError, TypeError):  # scalars, new signatures, dead kernels
        call, args, pin = _eager_call(handle, instance, args)
    return _eager.run(call, args)
