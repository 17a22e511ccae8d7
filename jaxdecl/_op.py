"""The op's Python face: instances as ops, shared per configuration, and the call path.

Every op instance maps to an :class:`OpHandle`, shared by all instances of the
same class with equal configuration (API.md §1). The handle is the primitive's
static parameter, owns the per-shape caches (layouts, host kernels) and the
eager entry point. Handles are kept for the life of the process: a compiled
executable may refer to their kernels after the user drops every instance.
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp

from . import _compat, _dtypes, _errors, _layout, _runtime
from ._cfunction import CFunction
from ._errors import MissingRuleError
from ._layout import FORWARD, JVP, TRANSPOSE, TRANSPOSE_WRT

_handles: dict = {}
_lock = threading.RLock()


class OpHandle:
    """One op configuration: the primitive's ``op`` parameter (hashable by identity)."""

    def __init__(self, instance, spec):
        self.instance = instance
        self.spec = spec
        self._layouts: dict = {}
        self._kernels: dict = {}
        self.eager = jax.jit(functools.partial(bind_forward, self))

    def __repr__(self) -> str:
        return self.spec.name

    # -- shapes -------------------------------------------------------------------------
    def layout(self, primals: tuple) -> _layout.Layout:
        layout = self._layouts.get(primals)
        if layout is None:
            layout = _layout.compute_layout(self.spec, self.instance, primals)
            self._layouts[primals] = layout
        return layout

    def rule_io(self, primals: tuple, rule: str, wrt: int) -> _layout.RuleIO:
        return _layout.rule_io(self.spec, self.layout(primals), rule, wrt)

    # -- rules --------------------------------------------------------------------------
    def user_rule(self, rule: str, wrt: int = -1):
        """The Rule behind `rule`, or raise MissingRuleError naming what to add."""
        spec = self.spec
        if rule == FORWARD:
            return spec.rules["forward"]
        if rule == TRANSPOSE:
            return spec.rules.get("transpose") or spec.rules["adjoint"]
        if rule == TRANSPOSE_WRT:
            return spec.transposes_wrt[spec.params[wrt]]
        found = spec.rules.get(rule)
        if found is None:
            raise missing_rule(spec, rule)
        return found

    def traceable(self, rule: str):
        """The traceable (JAX-valued) form of jvp/vjp as ``f(*operands) -> list``, or None."""
        found = self.spec.rules.get(rule)
        if found is None or not found.traceable:
            return None
        function = found.bind(self.instance)

        def evaluate(*operands):
            result = function(*operands)
            return list(result) if isinstance(result, (tuple, list)) else [result]

        return evaluate

    def kernel_key(self, rule: str, wrt: int, primals: tuple, batch: tuple,
                   in_shapes: tuple) -> int:
        """The dispatcher key of the host kernel for one rule at one set of shapes."""
        cache_key = (rule, wrt, primals, batch, in_shapes)
        key = self._kernels.get(cache_key)
        if key is not None:
            return key
        with _lock:
            key = self._kernels.get(cache_key)
            if key is None:
                key = self._build_kernel(rule, wrt, primals, batch, in_shapes)
                self._kernels[cache_key] = key
        return key

    def _build_kernel(self, rule, wrt, primals, batch, in_shapes) -> int:
        user = self.user_rule(rule, wrt)
        looped = bool(batch) and self.spec.batch_mode == "loop"
        if isinstance(user.function, CFunction) and user.kind != "adjoint" and not looped:
            return _runtime.register_c(user.function)
        io = self.rule_io(primals, rule, wrt)
        function = user.bind(self.instance)
        if user.kind == "adjoint":
            n_lead = len(io.in_names) - sum(self.layout(primals).float_out)
            function = _runtime.transpose_from_adjoint(function, user.zero_copy, n_lead)
        kernel, on_escape = _runtime.make_kernel(
            function, zero_copy=user.zero_copy, io=io,
            context=f"{self.spec.name}.{user.name} (@{user.kind})",
            batch_shape=batch, loop=looped, in_shapes=in_shapes,
        )
        return _runtime.register(kernel, on_escape)


def spec_of(op):
    """The OpSpec of a jaxdecl op (instance) or class; TypeError otherwise."""
    spec = getattr(op, "__jaxdecl_spec__", None)
    if spec is None:
        raise TypeError(f"{op!r} is not a jaxdecl primitive (subclass jd.Primitive or use "
                        f"@jd.primitive)")
    return spec


def missing_rule(spec, rule: str) -> MissingRuleError:
    """The error for a transformation whose rule the class lacks."""
    params = ", ".join(spec.params)
    if rule == JVP:
        tangents = ", ".join("d" + p for p in spec.params)
        return MissingRuleError(
            f"{spec.name} has no @jvp: forward-mode differentiation (jax.jvp, jacfwd, "
            f"evaluating a linearized function) needs one; add "
            f"`@jd.jvp def push(self, {params}, {tangents})`"
        )
    return MissingRuleError(
        f"{spec.name} has no @vjp: reverse-mode differentiation (grad, vjp, jacrev, "
        f"linear_transpose) needs one; add `@jd.vjp def pull(self, {params}, ct)`, or make "
        f"the @jvp traceable (`@jd.jvp(traceable=True)`) so JAX can transpose it"
    )


def _config_key(instance):
    """Equal keys <=> instances share compiled code (API.md §1)."""
    cls = type(instance)
    if cls.__eq__ is not object.__eq__ or cls.__hash__ is not object.__hash__:
        try:
            hash(instance)
            return ("eq", cls, instance)
        except TypeError:
            return ("id", id(instance))
    attributes = getattr(instance, "__dict__", None)
    if attributes is None:
        return ("id", id(instance))
    items = tuple(sorted(attributes.items()))
    try:
        hash(items)
    except TypeError:
        return ("id", id(instance))
    return ("attrs", cls, items)


def handle_of(instance) -> OpHandle:
    """The shared handle of an op instance's configuration (created on first use).

    Looked up from the configuration on every call rather than cached on the
    instance: a cache attribute would change the pytree and equality of
    dataclass-like ops (equinox, nifty.re), and configuration set after a first
    use (nifty.re models evaluate themselves inside __init__) must count.
    """
    key = _config_key(instance)
    handle = _handles.get(key)
    if handle is None:
        spec = spec_of(instance)
        with _lock:
            handle = _handles.get(key)
            if handle is None:
                handle = _handles[key] = OpHandle(instance, spec)
    return handle


def _as_operand(value, spec, name):
    if isinstance(value, (_compat.Tracer, jax.Array)):
        operand = value
    else:
        operand = jnp.asarray(value)
    _dtypes.check_supported(operand.dtype, f"{spec.name}: input {name}")
    return operand


def bind_forward(handle: OpHandle, *args):
    """Binds the forward rule on JAX values; returns an array or a tuple of them."""
    from ._primitive import jaxdecl_p

    spec = handle.spec
    operands = [_as_operand(a, spec, n) for a, n in zip(args, spec.params)]
    primals = tuple(_layout.aval_of(x) for x in operands)
    layout = handle.layout(primals)
    outs = jaxdecl_p.bind(*operands, op=handle, rule=FORWARD, wrt=-1, primals=primals,
                          batch=())
    return outs[0] if layout.single_output else tuple(outs)


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
    """``op(*args, **kwargs)``: binds under a trace, else runs the cached jitted call."""
    handle = handle_of(instance)
    args = _arguments(handle.spec, args, kwargs)
    for value in args:
        if isinstance(value, _compat.Tracer):
            return bind_forward(handle, *args)
    try:
        result = handle.eager(*args)
        # Wait here, so that a rule's exception is raised by this call, as itself.
        if isinstance(result, tuple):
            for value in result:
                value.block_until_ready()
        else:
            result.block_until_ready()
        return result
    except _compat.JaxRuntimeError as error:
        _errors.reraise_original(error)
        raise
