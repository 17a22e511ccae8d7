"""Ops as shared configurations: handles, their per-shape caches, and what equations carry.

Every op instance maps to an :class:`OpHandle`, shared by all live instances of
the same class with equal configuration (:mod:`jaxdecl._op.identity` says which
are equal). The handle owns the per-shape caches (interfaces, kernels). What an
:class:`~jaxdecl._op.equation.Equation` carries as its ``op`` is a
:class:`BoundOp`: the handle plus the instance that bound it, so that a traced
program holds the op it calls. Calling an op lives in :mod:`jaxdecl._call`.

Lifetimes (memory is bounded by what is alive):

- a handle lives while an instance with its configuration lives (a
  ``weakref.finalize`` anchor per instance), or a trace refers to it;
- kernels refer to their op instance weakly; a compiled executable that runs
  a kernel holds it and that instance until its last run has finished (see
  :mod:`jaxdecl._host.registry` for the whole ownership graph);
- eager calls, sharded or not, run through executables shared by every op of
  a signature: nothing compiles per configuration;
- nothing global holds an instance.

Example:
    >>> import jax, jax.numpy as jnp, jaxdecl as jd
    >>> from jaxdecl._op.identity import handle_of
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

import threading

from .. import _compat
from .._errors import missing_rule
from .._host import device_kernels as _device_kernels
from .._host import kernels as _kernels
from .._host import keyword_rules as _keyword_rules
from .._host import registry as _runtime
from .._host import structure as _structure
from .._spec import factors as _factors
from .._spec import interface as _interface
from .._spec import rule_io as _rule_io
from .._spec import sharding as _sharding
from .._spec.cfunction import CFunction
from .._spec.interface import FORWARD, FORWARD_SAVING, TRANSPOSE, TRANSPOSE_WRT
from . import fingerprint as _fingerprint

_lock = threading.RLock()  # one registration per kernel, when threads build one at once

# Bumped whenever the operand/result order a kernel sees changes: part of
# every kernel fingerprint, so that no program compiled against another order
# finds a live kernel by name. Bump _recipes.FORMAT with it: a program's recipe
# would otherwise rebuild a kernel of this order for it (tests/test_recipes.py
# pins the pair).
_KERNEL_ABI = "jaxdecl-kernel-1"


class OpHandle:
    """One op configuration: its interfaces and kernels, shared by equal instances."""

    def __init__(self, spec):
        self.spec = spec
        #: The configuration part of its kernels' fingerprints (set by identity.handle_of).
        self.fingerprint = None
        self._interfaces: dict = {}
        self._rule_ios: dict = {}  # equation key -> RuleIO, its arity checked
        #: equation key -> (Interface, RuleIO): read by every Equation as it is made
        self.equations: dict = {}
        self._kernels: dict = {}
        self._shardings: dict = {}  # signature -> _factors.Resolved or None
        self.declares_sharding = spec.sharding is not None or "sharding" in spec.rules
        self.eager_calls: dict = {}  # signature -> _eager.Call
        self.sharded_calls: dict = {}  # see _eager.sharded_call -> _eager.Call
        self.gather_warned: set = set()  # equations warned about (see _plan.warn_gathers)
        self.split_checked: set = set()  # equations whose split @abstract agrees (lower_split)
        self.saved = None  # (class path, saved configuration), see _op/configuration.configuration

    def __repr__(self) -> str:
        return self.spec.name

    def interface(self, signature: tuple, instance) -> _interface.Interface:
        interface = self._interfaces.get(signature)
        if interface is None:
            interface = _interface.interface_of(self.spec, instance, signature)
            self._interfaces[signature] = interface
        return interface

    def interface_and_io(self, key: tuple, instance) -> tuple:
        """``(interface, io)`` of equation `key`: what every equation reads when it is made."""
        found = self.equations.get(key)
        if found is None:
            found = (self.interface(key[2], instance), self.rule_io(key, instance))
            self.equations[key] = found
        return found

    def rule_io(self, key: tuple, instance) -> _rule_io.RuleIO:
        """The operands and results of the rule of equation `key`, checked against its
        signature.

        The first time a rule is traced at some input types, its parameters
        are counted against what jaxdecl will pass (how many tangents or
        cotangents depends on the dtypes): a mismatch is a DeclarationError
        now rather than a bare TypeError from inside XLA later.
        """
        io = self._rule_ios.get(key)
        if io is None:
            rule, wrt, signature, _, active = key
            interface = self.interface(signature, instance)
            io = _rule_io.rule_io(self.spec, interface, rule, wrt, active)
            self._rule_ios[key] = io
        return io

    def sharding(self, signature: tuple, instance):
        """The sharding declaration applied to `signature` (None: the op declares none)."""
        if signature in self._shardings:
            return self._shardings[signature]
        spec = self.spec
        resolved = None
        if self.declares_sharding:
            interface = self.interface(signature, instance)
            rule = spec.sharding
            if rule is None:
                rule = _sharding.call_method(spec.rules["sharding"], instance, interface, spec.name)
            resolved = _factors.resolve(rule, interface, spec.params, spec.name,
                                         spec.keeps is not None and spec.keeps.result)
        self._shardings[signature] = resolved
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

    def kernel(self, key: tuple, in_shapes: tuple, instance) -> tuple:
        """``(kernel, pin)``: the registered kernel of equation `key` at `in_shapes`.

        Built on first use. Hold `pin` while the kernel may run: it keeps the op
        instance the kernel calls alive. A cached kernel whose instance is gone
        is rebuilt on `instance` (any live instance of this configuration
        computes the same).
        """
        cache_key = (key, in_shapes)
        kernel = self._kernels.get(cache_key)
        pin = kernel.pin() if kernel is not None else None
        if pin is None:
            with _lock:
                # Another thread may have built it meanwhile: one registration each.
                kernel = self._kernels.get(cache_key)
                pin = kernel.pin() if kernel is not None else None
                if pin is None:
                    kernel = self._build_kernel(key, in_shapes, instance)
                    self._kernels[cache_key] = kernel
                    pin = kernel.pin()
        return kernel, pin

    def kernel_fingerprint(self, key: tuple, in_shapes: tuple) -> tuple:
        """What compiled HLO names the kernel of equation `key` at `in_shapes` by."""
        rule, wrt, signature, batch, active = key
        # (an equation of every derivative leaf names its kernel as before `active` existed)
        extra = () if active is None else (repr(active),)
        return _fingerprint.digest(_KERNEL_ABI, self.fingerprint, rule, str(wrt),
                                   repr(signature), repr(batch), repr(in_shapes), *extra)

    def traceable(self, key: tuple, instance, symbolic: bool = False):
        """The traceable (JAX-valued) form of equation `key`'s jvp/vjp rule as
        ``f(*operands) -> list``, or None (a host rule). With `symbolic`, a result the
        rule returned as None stays None (else it is zeros)."""
        rule = key[0]
        found = self.spec.rules.get(rule)
        if found is None or not found.traceable:
            return None
        io = self.rule_io(key, instance)
        context = f"{self.spec.name}.{found.name} (@{found.kind})"
        if io.keywords or io.n_extra:
            return _keyword_rules.traceable_rule(found.bind(instance), io, context, symbolic)
        return _structure.traceable_rule(found.bind(instance), io, context, symbolic)

    def device_rule(self, rule: str, wrt: int = -1):
        """The device rule (``platform="gpu"``) behind `rule`, or None (the host rule runs
        on GPUs too, staged)."""
        spec = self.spec
        if rule in (FORWARD, FORWARD_SAVING):
            return spec.device_rules.get("forward")
        if rule == TRANSPOSE_WRT:
            return spec.device_transposes_wrt.get(spec.params[wrt])
        return spec.device_rules.get(rule)

    def _build_kernel(self, key: tuple, in_shapes: tuple, instance):
        spec = self.spec
        rule, wrt, signature, batch, _ = key
        user = self.user_rule(rule, wrt)
        name = f"{spec.name}.{user.name} (@{user.kind})"
        fingerprint = self.kernel_fingerprint(key, in_shapes)
        # batch="loop": the dispatcher runs the kernel once per row of the batch.
        rows = batch if spec.batch_mode == "loop" else ()
        io = self.rule_io(key, instance)
        # An adjoint's leading operands (the non-differentiable inputs) pass unconjugated.
        n_lead = len(io.in_names) - sum(self.interface(signature, instance).float_out)
        batch_rank = 0 if rows else len(batch)  # a vectorized batch's results may broadcast
        # The device rule, if any: the CUDA handler runs it instead of staging this one.
        device = _device_kernel(self.device_rule(rule, wrt), instance, io, spec.name, rows,
                                batch_rank)
        if isinstance(user.function, CFunction):
            return _runtime.register_c(
                fingerprint, name, user.function, operands=_keyword_rules.c_operands(io),
                rows=rows, conj_from=n_lead if user.kind == "adjoint" else -1, device=device)
        # (a GPU C device rule takes its operands as a C host rule would)
        gpu_operands = _keyword_rules.c_operands(io) if isinstance(device, CFunction) else ()
        function, ref, zero_copy, io = _flat_rule(user, instance, io, name, batch_rank)
        if user.kind == "adjoint":
            function = _kernels.transpose_from_adjoint(
                function, zero_copy, n_lead, takes_instance=ref is not None)
        host = _kernels.make_kernel(function, zero_copy=zero_copy, io=io, context=name,
                                    batch_rank=batch_rank, rows=rows, instance_ref=ref)
        return _runtime.register(fingerprint, name, host, ref, device=device,
                                 operands=gpu_operands)


def _flat_rule(user, instance, io, name: str, batch_rank: int, function=None) -> tuple:
    """``(function, instance_ref, zero_copy, io)``: the user's rule bound to `instance`
    (weakly), as a function of flat operands and results (`function`: a wrapped form of
    the rule's own function)."""
    bound, ref = _kernels.weak_binding(user, instance)
    function = bound if function is None else function
    zero_copy = user.zero_copy
    if io.keywords or io.n_extra:  # saved=/result= arguments, or extras the rule leaves out
        function, zero_copy, io = _keyword_rules.kernel_rule(
            function, io, zero_copy, name, 0 if ref is None else 1, batch_rank)
    elif io.structured:
        # The rule takes and returns pytrees; the kernel deals in flat arrays.
        function, io = _structure.structured_rule(
            function, io, zero_copy, name, n_head=0 if ref is None else 1)
    return function, ref, zero_copy, io


def _device_kernel(device, instance, io, op_name: str, rows: tuple, batch_rank: int):
    """The device kernel of device rule `device` (a GPU C kernel as it is), or None."""
    if device is None:
        return None
    if isinstance(device.function, CFunction):
        return device.function
    context = f"{op_name}.{device.name} (@{device.kind}, platform='gpu')"
    bound, ref = _kernels.weak_binding(device, instance)
    function, ref, zero_copy, io = _flat_rule(device, instance, io, context, batch_rank,
                                              _device_kernels.taking_stream(bound))
    return _device_kernels.make_device_kernel(function, zero_copy=zero_copy, io=io,
                                              context=context, rows=rows, instance_ref=ref)


class BoundOp:
    """The primitive's ``op`` parameter: a handle and the instance that bound it.

    Equal (and hashing alike) for every instance of one configuration, so JAX's
    caches treat them as one; holding the instance keeps a traced program's op
    alive for as long as the program exists. An
    :class:`~jaxdecl._op.equation.Equation` asks the handle, with the instance.
    """

    __slots__ = ("handle", "instance", "spec", "identity", "__weakref__")

    def __init__(self, handle: OpHandle, instance):
        self.handle = handle
        self.instance = instance
        self.spec = handle.spec
        self.identity = id(handle)  # one per configuration, while the handle lives

    def __eq__(self, other):
        return type(other) is BoundOp and other.handle is self.handle

    def __hash__(self):
        return self.identity

    def __repr__(self) -> str:
        return self.spec.name


_compat.hold_weakly_in_caches(BoundOp)
