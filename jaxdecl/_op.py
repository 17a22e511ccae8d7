"""The op's Python face: instances as ops, shared per configuration, and the call path.

Every op instance maps to an :class:`OpHandle`, shared by all live instances of
the same class with equal configuration (see :class:`jaxdecl.Primitive`). The handle owns the
per-shape caches (layouts, kernels). What the primitive carries as its ``op``
parameter is a :class:`BoundOp`: the handle plus the instance that bound it,
so that a traced program holds the op it calls.

Lifetimes (memory is bounded by what is alive):

- a handle lives while an instance with its configuration lives (a
  ``weakref.finalize`` anchor per instance), or a trace refers to it;
- kernels refer to their op instance weakly; a compiled executable that runs
  a kernel holds it and that instance until its last run has finished (see
  :mod:`jaxdecl._runtime` for the whole ownership graph);
- eager calls, sharded or not, run through executables shared by every op of
  a signature: nothing compiles per configuration;
- nothing global holds an instance.

Example:
    >>> import jax, jax.numpy as jnp, jaxdecl as jd
    >>> from jaxdecl._op import handle_of
    >>> class Scale(jd.Primitive):
    ...     def __init__(self, factor):
    ...         self.factor = factor
    ...     @jd.abstract
    ...     def shapes(self, x):
    ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
    ...     @jd.forward
    ...     def apply(self, x):
    ...         return self.factor * x
    >>> handle_of(Scale(2.0)) is handle_of(Scale(2.0))  # equal configuration
    True
"""

from __future__ import annotations

import dataclasses
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from . import (
    _compat,
    _dtypes,
    _eager,
    _fingerprint,
    _layout,
    _partition,
    _residuals,
    _runtime,
    _sharding,
    _signatures,
    _structure,
)
from ._cfunction import CFunction
from ._errors import missing_rule
from ._layout import FORWARD, FORWARD_SAVING, TRANSPOSE, TRANSPOSE_WRT
from ._primitive import bind_rule, refusal

_lock = threading.RLock()
_live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # config key -> handle
_anchors: dict = {}  # id(instance) -> its handle, while the instance lives
_unanchorable: list = []  # instances that cannot be weakly referenced: kept for good
_by_fingerprint: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

# Bumped whenever the operand/result order a kernel sees changes: part of
# every kernel fingerprint, so that old serialized executables are refused.
_KERNEL_ABI = "jaxdecl-kernel-1"


class OpHandle:
    """One op configuration: its layouts and kernels, shared by equal instances."""

    def __init__(self, spec, cls, items):
        self.spec = spec
        self.fingerprint = _claim_fingerprint(self, cls, items)
        self._layouts: dict = {}
        self._rule_ios: dict = {}  # (primals, rule, wrt) -> RuleIO, its arity checked
        self._kernels: dict = {}
        self._shardings: dict = {}  # primals -> _sharding.Resolved or None
        self.declares_sharding = spec.sharding is not None or "sharding" in spec.rules
        self.eager_calls: dict = {}  # primals -> _eager.Call
        self.sharded_calls: dict = {}  # see _partition.eager_call -> _eager.Call
        self.gather_warned: set = set()  # signatures warned about (see _partition.warn_gathers)
        self.split_checked: set = set()  # signatures whose split @abstract agrees (lower_split)

    def __repr__(self) -> str:
        return self.spec.name

    def layout(self, primals: tuple, instance) -> _layout.Layout:
        layout = self._layouts.get(primals)
        if layout is None:
            layout = _layout.compute_layout(self.spec, instance, primals)
            self._layouts[primals] = layout
        return layout

    def rule_io(self, primals: tuple, rule: str, wrt: int, instance) -> _layout.RuleIO:
        """The operands and results of `rule` at `primals`, checked against its signature.

        The first time a rule is traced at some input types, its parameters
        are counted against what jaxdecl will pass (how many tangents or
        cotangents depends on the dtypes): a mismatch is a DeclarationError
        now rather than a bare TypeError from inside XLA later.
        """
        key = (primals, rule, wrt)
        io = self._rule_ios.get(key)
        if io is None:
            layout = self.layout(primals, instance)
            io = _layout.rule_io(self.spec, layout, rule, wrt)
            _signatures.check_traced(self.spec, layout, rule, wrt, io)
            self._rule_ios[key] = io
        return io

    def sharding(self, primals: tuple, instance):
        """The sharding declaration applied to `primals` (None: the op declares none)."""
        if primals in self._shardings:
            return self._shardings[primals]
        spec = self.spec
        resolved = None
        if self.declares_sharding:
            layout = self.layout(primals, instance)
            rule = spec.sharding
            if rule is None:
                rule = _sharding.call_method(spec.rules["sharding"], instance, layout, spec.name)
            resolved = _sharding.resolve(rule, layout, spec.params, spec.name,
                                         spec.keeps is not None and spec.keeps.result)
        self._shardings[primals] = resolved
        return resolved

    def user_rule(self, rule: str, wrt: int = -1):
        """The Rule behind `rule`, or raise MissingRuleError naming what to add."""
        spec = self.spec
        if rule in (FORWARD, FORWARD_SAVING):
            return spec.rules["forward"]
        if rule == TRANSPOSE:
            return spec.rules.get("transpose") or spec.rules["adjoint"]
        if rule == TRANSPOSE_WRT:
            return spec.transposes_wrt[spec.params[wrt]]
        found = spec.rules.get(rule)
        if found is None:
            raise missing_rule(spec, rule)
        return found

    def kernel(self, instance, rule: str, wrt: int, primals: tuple, batch: tuple,
               in_shapes: tuple) -> tuple:
        """``(kernel, pin)``: the registered kernel of one rule at one set of shapes.

        Built on first use. Hold `pin` while the kernel may run: it keeps the op
        instance the kernel calls alive. A cached kernel whose instance is gone
        is rebuilt on `instance` (any live instance of this configuration
        computes the same).
        """
        cache_key = (rule, wrt, primals, batch, in_shapes)
        kernel = self._kernels.get(cache_key)
        pin = kernel.pin() if kernel is not None else None
        if pin is None:
            with _lock:
                # Another thread may have built it meanwhile: one registration each.
                kernel = self._kernels.get(cache_key)
                pin = kernel.pin() if kernel is not None else None
                if pin is None:
                    kernel = self._build_kernel(instance, rule, wrt, primals, batch, in_shapes)
                    self._kernels[cache_key] = kernel
                    pin = kernel.pin()
        return kernel, pin

    def _build_kernel(self, instance, rule, wrt, primals, batch, in_shapes):
        spec = self.spec
        user = self.user_rule(rule, wrt)
        name = f"{spec.name}.{user.name} (@{user.kind})"
        fingerprint = _fingerprint.digest(
            _KERNEL_ABI, self.fingerprint, rule, str(wrt), repr(primals), repr(batch),
            repr(in_shapes))
        looped = bool(batch) and spec.batch_mode == "loop"
        io = self.rule_io(primals, rule, wrt, instance)
        function, ref = _runtime.weak_binding(user, instance)
        zero_copy = user.zero_copy
        keyworded = bool(io.keywords or io.n_extra)
        if keyworded:  # saved=/result= arguments, or extras the rule leaves out
            function, zero_copy, io = _residuals.kernel_rule(
                function, io, zero_copy, name, 0 if ref is None else 1,
                0 if looped else len(batch))
        if isinstance(function, CFunction) and user.kind != "adjoint" and not looped:
            return _runtime.register_c(fingerprint, name, function)
        if io.structured and not keyworded:  # (kernel_rule packs pytrees itself)
            # The rule takes and returns pytrees; the kernel deals in flat arrays.
            function = _structure.structured_rule(
                function, io, zero_copy, name, n_head=0 if ref is None else 1)
            io = dataclasses.replace(io, single_result=False)
        if user.kind == "adjoint":
            n_lead = len(io.in_names) - sum(self.layout(primals, instance).float_out)
            function = _runtime.transpose_from_adjoint(
                function, zero_copy, n_lead, takes_instance=ref is not None)
        kernel, on_escape = _runtime.make_kernel(
            function, zero_copy=zero_copy, io=io, context=name, batch_shape=batch,
            loop=looped, in_shapes=in_shapes, instance_ref=ref,
        )
        return _runtime.register(fingerprint, name, kernel, on_escape, ref)

    def eager_call(self, instance, args) -> tuple:
        """``(call, operands, pin)``: the forward ready to run eagerly on `args`.

        Converts NumPy arrays and scalars to JAX arrays; the call is cached by
        the operands' (shape, dtype), which is what :func:`apply_op` looks up.
        """
        operands, primals = flatten_inputs(self.spec, args)
        call = self.eager_calls.get(primals)
        pin = call.kernel.pin() if call is not None else None
        if pin is None:
            layout = self.layout(primals, instance)
            if self.declares_sharding:  # a declaration that does not fit fails here, named
                self.sharding(primals, instance)
            in_shapes = tuple(shape for shape, _ in layout.inputs)
            kernel, pin = self.kernel(instance, FORWARD, -1, primals, (), in_shapes)
            if layout.structured:
                call = _eager.Call(kernel, layout.outputs, False,
                                   rebuild=lambda outs, groups=layout.out_groups,
                                   single=layout.single_output: rebuild(groups, single, outs))
            else:
                call = _eager.Call(kernel, layout.outputs, layout.single_output)
            self.eager_calls[primals] = call
        return call, operands, pin

    def sharded_eager_call(self, instance, operands: list, primals: tuple):
        """``(call, pin)``: the forward ready to run now, per shard, or None.

        See :func:`jaxdecl._partition.eager_call`; here the results come back
        as ``@abstract`` declared them (one array, a tuple, pytrees).
        """
        layout = self.layout(primals, instance)
        rebuilt = None
        if layout.structured:
            rebuilt = lambda outs, groups=layout.out_groups, single=layout.single_output: \
                rebuild(groups, single, outs)  # noqa: E731
        return _partition.eager_call(
            BoundOp(self, instance), FORWARD, -1, primals, (), operands, describe=refusal,
            single=layout.single_output and not layout.structured, rebuild=rebuilt)


class BoundOp:
    """The primitive's ``op`` parameter: a handle and the instance that bound it.

    Equal (and hashing alike) for every instance of one configuration, so JAX's
    caches treat them as one; holding the instance keeps a traced program's op
    alive for as long as the program exists.
    """

    __slots__ = ("handle", "instance", "__weakref__")

    def __init__(self, handle: OpHandle, instance):
        self.handle = handle
        self.instance = instance

    def __eq__(self, other):
        return type(other) is BoundOp and other.handle is self.handle

    def __hash__(self):
        return id(self.handle)

    def __repr__(self) -> str:
        return self.handle.spec.name

    @property
    def spec(self):
        return self.handle.spec

    def layout(self, primals: tuple) -> _layout.Layout:
        return self.handle.layout(primals, self.instance)

    def rule_io(self, primals: tuple, rule: str, wrt: int) -> _layout.RuleIO:
        """See :meth:`OpHandle.rule_io`."""
        return self.handle.rule_io(primals, rule, wrt, self.instance)

    def user_rule(self, rule: str, wrt: int = -1):
        return self.handle.user_rule(rule, wrt)

    def sharding(self, primals: tuple):
        """See :meth:`OpHandle.sharding`."""
        return self.handle.sharding(primals, self.instance)

    def kernel(self, rule: str, wrt: int, primals: tuple, batch: tuple, in_shapes: tuple):
        """``(kernel, pin)``, see :meth:`OpHandle.kernel`."""
        return self.handle.kernel(self.instance, rule, wrt, primals, batch, in_shapes)

    def traceable(self, rule: str, primals: tuple):
        """The traceable (JAX-valued) form of jvp/vjp as ``f(*operands) -> list``, or None."""
        found = self.spec.rules.get(rule)
        if found is None or not found.traceable:
            return None
        io = self.rule_io(primals, rule, -1)
        context = f"{self.spec.name}.{found.name} (@{found.kind})"
        if io.keywords or io.n_extra:
            return _residuals.traceable_rule(found.bind(self.instance), io, context)
        return _structure.traceable_rule(found.bind(self.instance), io, context)


_compat.hold_weakly_in_caches(BoundOp)


def spec_of(op):
    """The OpSpec of a jaxdecl op (instance) or class; TypeError otherwise."""
    spec = getattr(op, "__jaxdecl_spec__", None)
    if spec is None:
        raise TypeError(f"{op!r} is not a jaxdecl primitive (subclass jd.Primitive or use "
                        f"@jd.primitive)")
    return spec


# ---------------------------------------------------------------------------------------
# Configurations and their handles
# ---------------------------------------------------------------------------------------

class _WeakKey:
    """A dict key that stands for an instance without keeping it alive.

    By identity, or by the class's own ``__eq__``/``__hash__``. A key whose
    instance is gone equals nothing, so a reused ``id`` never finds the handle
    of a dead op.
    """

    __slots__ = ("ref", "hash", "by_identity")

    def __init__(self, instance, by_identity: bool):
        self.ref = weakref.ref(instance)
        self.by_identity = by_identity
        self.hash = id(instance) if by_identity else hash((type(instance), instance))

    def __hash__(self):
        return self.hash

    def __eq__(self, other):
        if type(other) is not _WeakKey or other.by_identity != self.by_identity:
            return False
        a, b = self.ref(), other.ref()
        if a is None or b is None:
            return False
        if self.by_identity:
            return a is b
        return type(a) is type(b) and bool(a == b)


def _weak_or_strong_key(instance, by_identity: bool):
    try:
        return _WeakKey(instance, by_identity)
    except TypeError:  # no __weakref__: such instances are kept for good (see _anchor)
        return ("id", id(instance)) if by_identity else ("eq", type(instance), instance)


_slot_names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # class -> names


def _attributes(instance) -> dict | None:
    """The instance's configuration: its ``__dict__`` and the ``__slots__`` it has set."""
    cls = type(instance)
    names = _slot_names.get(cls)
    if names is None:
        names = []
        for klass in cls.__mro__:
            slots = vars(klass).get("__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if name in ("__dict__", "__weakref__"):
                    continue
                if name.startswith("__") and not name.endswith("__"):
                    name = f"_{klass.__name__.lstrip('_')}{name}"  # name mangling
                names.append(name)
        names = _slot_names[cls] = tuple(names)
    attributes = getattr(instance, "__dict__", None)
    if not names:
        return attributes
    merged = dict(attributes or {})
    for name in names:
        try:
            merged[name] = getattr(instance, name)
        except AttributeError:  # a slot not set
            pass
    return merged


def _config_key(instance):
    """``(key, items)``: equal keys <=> instances share compiled code.

    A class's own ``__eq__``/``__hash__`` decide where it defines them;
    otherwise the instance attributes are compared when they are all hashable,
    and identity is used when they are not.

    `items` are the (name, type, value) triples of the configuration, for the
    fingerprint; None when the op is keyed by identity.
    """
    cls = type(instance)
    attributes = _attributes(instance)
    items = None
    if attributes is not None:
        # Typed, so that 1, 1.0 and True are different configurations.
        items = tuple(sorted((name, type(value), value) for name, value in attributes.items()))
        if any(getattr(value, "__self__", None) is instance for _, _, value in items):
            # A bound method of the op itself: a value key would hold the op for good.
            return _weak_or_strong_key(instance, True), None
    if cls.__eq__ is not object.__eq__ or cls.__hash__ is not object.__hash__:
        try:
            hash(instance)
        except TypeError:
            return _weak_or_strong_key(instance, True), None
        return _weak_or_strong_key(instance, False), items
    if items is None:
        return _weak_or_strong_key(instance, True), None
    try:
        hash(items)
    except TypeError:
        return _weak_or_strong_key(instance, True), None
    return ("attrs", cls, items), items


def _claim_fingerprint(handle, cls, items) -> str:
    """The configuration part of kernel fingerprints, unique among live handles."""
    text = _fingerprint.configuration_token(cls, items)
    owner = _by_fingerprint.get(text)
    if owner is not None and owner is not handle:
        # Another live handle has the same text (two classes with one qualified
        # name, or a class whose __eq__ tells apart what its attributes do not).
        text = f"{text}|{_fingerprint.process_unique()}"
    _by_fingerprint[text] = handle
    return text


def _is_traced(value) -> bool:
    """`value` is a JAX tracer, or a pytree (list, dict, Module, ...) holding one."""
    if isinstance(value, _compat.Tracer):
        return True
    if isinstance(value, (int, float, complex, str, bytes, np.ndarray, jax.Array, type)) \
            or value is None:
        return False
    try:
        return any(isinstance(leaf, _compat.Tracer) for leaf in jax.tree_util.tree_leaves(value))
    except Exception:  # noqa: BLE001 - an exotic object is no pytree of tracers
        return False


def check_static(spec, instance) -> None:
    """Raises TypeError when the op's configuration, or a rule's closure, holds a tracer.

    The rules run on the host, outside the trace, and read the configuration
    there: a traced value (an array field of an equinox.Module op passed
    through ``eqx.filter_jit``, an op built from a traced value, a rule closing
    over one) cannot be read, and would fail later inside XLA.
    """
    for name, value in (_attributes(instance) or {}).items():
        if _is_traced(value):
            raise TypeError(
                f"{spec.name}: the op's configuration attribute {name!r} is a JAX tracer: "
                f"it is traced by the function that calls the op (jax.jit or "
                f"eqx.filter_jit over an op with an array field, or an op built from a "
                f"traced value). Configuration is static (the rules read it on the host), so "
                f"either pass {name!r} as an input of the op (a parameter of @abstract and "
                f"the rules; list it in nondiff= if it is not differentiated: the way for "
                f"large arrays), or mark it static (`{name}: ... = eqx.field(static=True)` "
                f"on an equinox field; or close over the op instead of passing it to the "
                f"traced function)")
    for rule in list(spec.rules.values()) + list(spec.transposes_wrt.values()):
        code = getattr(rule.function, "__code__", None)
        cells = getattr(rule.function, "__closure__", None) or ()
        for variable, cell in zip(getattr(code, "co_freevars", ()), cells):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if _is_traced(value):
                raise TypeError(
                    f"{spec.name}.{rule.name} (@{rule.kind}) closes over {variable!r}, a "
                    f"JAX tracer of the function being traced; the rule runs on the host "
                    f"and cannot read it. Either pass {variable!r} as an input of the op "
                    f"(list it in nondiff= if it is not differentiated), or make it static: "
                    f"a NumPy array or Python value computed outside the traced function")


def _anchor(instance, handle: OpHandle) -> None:
    """Keeps `handle` alive while `instance` lives, and no longer."""
    first = id(instance) not in _anchors
    _anchors[id(instance)] = handle
    if first:
        try:
            finalizer = weakref.finalize(instance, _anchors.pop, id(instance), None)
            finalizer.atexit = False
        except TypeError:  # cannot be weakly referenced
            _unanchorable.append(instance)


def handle_of(instance) -> OpHandle:
    """The shared handle of an op instance's configuration (created on first use).

    Looked up from the configuration on every call rather than cached on the
    instance: a cache attribute would change the pytree and equality of
    dataclass-like ops (equinox, nifty.re), and configuration set after a first
    use (nifty.re models evaluate themselves inside __init__) must count.
    """
    key, items = _config_key(instance)
    handle = _live.get(key)
    if handle is None:
        spec = spec_of(instance)
        with _lock:
            handle = _live.get(key)
            if handle is None:
                check_static(spec, instance)
                handle = OpHandle(spec, type(instance), items)
                _live[key] = handle
    if _anchors.get(id(instance)) is not handle:
        _anchor(instance, handle)
    return handle


# ---------------------------------------------------------------------------------------
# Calling an op
# ---------------------------------------------------------------------------------------

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
    _dtypes.check_supported(operand.dtype, f"{spec.name}: input {name}")
    return operand


_ARRAYS = (_compat.Tracer, jax.Array)
_LEAVES = (_compat.Tracer, jax.Array, np.ndarray, np.generic, int, float, complex, bool)


def flatten_inputs(spec, args) -> tuple:
    """``(operands, primals)``: the op's arguments as flat JAX arrays, and its signature.

    An array (or scalar) argument is one operand with a ``(shape, dtype)``
    entry; a pytree argument contributes its leaves, with a
    :class:`~jaxdecl._layout.TreeAval` entry that remembers its structure.
    """
    operands, primals = [], []
    for value, name in zip(args, spec.params):
        # None (an empty pytree) and lone leaves (a string, a callable) get
        # _as_operand's error; arrays and scalars are converted directly.
        leaves, tree = ((), None) if isinstance(value, _LEAVES) or value is None else \
            jax.tree_util.tree_flatten(value, is_leaf=_structure.stands_for_array)
        if tree is None or jax.tree_util.treedef_is_leaf(tree):
            operand = _as_operand(value, spec, name)
            operands.append(operand)
            primals.append((tuple(operand.shape), operand.dtype))
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
        primals.append(_layout.TreeAval(tree, tuple(avals)))
    return operands, tuple(primals)


def rebuild(groups, single: bool, outs):
    """The op's return value from its flat outputs: arrays and pytrees as @abstract said."""
    values = _structure.pack(groups, outs)
    return values[0] if single else tuple(values)


def bind_forward(op: BoundOp, args) -> object:
    """Binds the forward rule on JAX values; returns its result(s) as @abstract declared."""
    operands, primals = flatten_inputs(op.spec, args)
    layout = op.layout(primals)
    if op.handle.declares_sharding:
        op.sharding(primals)  # a declaration that does not fit the inputs fails here, named
    outs = bind_rule(op, FORWARD, operands, primals, ())
    if layout.structured:
        return rebuild(layout.out_groups, layout.single_output, outs)
    return outs[0] if layout.single_output else tuple(outs)


def _sharded_eager(handle: OpHandle, instance, args):
    """Runs a declared op now, per shard, on arguments that span several devices."""
    operands, primals = flatten_inputs(handle.spec, args)
    found = handle.sharded_eager_call(instance, operands, primals)
    if found is None:
        # Operands on different meshes: jit places them (or raises JAX's own error).
        return jax.jit(lambda *a: bind_forward(BoundOp(handle, instance), a))(*args)
    call, pin = found
    result = _eager.run(call, operands)
    del pin  # held until here: the kernel's op stays alive for the call
    return result


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


def apply_op(instance, args: tuple, kwargs: dict):
    """``op(*args, **kwargs)``: staged into an active trace, else run now.

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
    if _partition.spans_devices(args):
        if handle.declares_sharding:
            # The shared single-device executable would gather; this runs per shard.
            return _sharded_eager(handle, instance, args)
        # Once, on one device, not once per device on gathered copies.
        return _partition.run_once(lambda whole: apply_op(instance, tuple(whole), {}), args)
    try:
        # An object that stands for an array (nnx.Variable: shape and dtype, __jax_array__)
        # shortens the key, so that it misses and flatten_inputs converts the object.
        call = handle.eager_calls[tuple([(a.shape, a.dtype) for a in args
                                         if getattr(a, "__jax_array__", None) is None])]
        pin = call.kernel.pin()  # held until the call returns: the kernel's op stays alive
        if pin is None:
            raise KeyError
    except (AttributeError, KeyError, TypeError):  # scalars, new signatures, dead kernels
        call, args, pin = handle.eager_call(instance, args)
    return _eager.run(call, args)
