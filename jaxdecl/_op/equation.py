"""One equation of the ``jaxdecl_call`` primitive: which rule of which op, at which shapes.

What always travels together, from binding through abstract evaluation,
differentiation, batching, planning and lowering to the kernel:

- ``op``: the :class:`~jaxdecl._op.handle.BoundOp` (class + configuration + the
  instance that bound it);
- ``rule``: ``forward``, ``forward_saving``, ``jvp``, ``vjp``, ``transpose`` or
  ``transpose_wrt`` (operand orders in :mod:`jaxdecl._spec.interface`);
- ``wrt``: the input index of a multilinear ``transpose_wrt`` (else -1);
- ``signature``: per primal input, its (shape, dtype) per batch element, or a
  :class:`~jaxdecl._spec.interface.TreeAval` for a pytree input;
- ``batch``: leading batch dims every operand and result carries (operands may
  have size 1 there, broadcasting; results never do);
- ``active``: the input leaves whose tangents a ``jvp`` equation carries, or
  whose cotangents a ``vjp`` or ``transpose`` equation returns (sorted leaf
  indices); None for all of them (see :func:`jaxdecl._spec.rule_io.active_mask`).

It is the primitive's one parameter, so a new field reaches every stage at
once. Equations are equal (and hash alike) when their fields are, and JAX's
caches hold them weakly (:func:`jaxdecl._compat.hold_weakly_in_caches`): a
cache entry never keeps an op alive.

Example:
    >>> import jax, jax.numpy as jnp, jaxdecl as jd
    >>> class Neg(jd.Primitive):
    ...     @jd.abstract
    ...     def shapes(self, x):
    ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
    ...     @jd.forward
    ...     def apply(self, x):
    ...         return -x
    >>> jaxpr = jax.make_jaxpr(Neg())(jnp.ones(2))  # one jaxdecl_call equation
    >>> eqn = jaxpr.eqns[0].params["equation"]
    >>> eqn.rule, eqn.signature[0][0], eqn.with_rule("jvp").rule
    ('forward', (2,), 'jvp')
"""

from __future__ import annotations

import itertools
from typing import Protocol

from .. import _compat
from .._spec import factors as _factors
from .._spec.interface import Interface, signature_leaves
from .._spec.rule_io import RuleIO


class EquationOp(Protocol):
    """What an equation needs of its op (``BoundOp``, :mod:`jaxdecl._op.handle`): the
    handle of its configuration, the instance that bound it, and its spec."""

    handle: OpHandleLike
    instance: object
    spec: object  # the class's OpSpec
    identity: int  # equal for every instance of one configuration


class OpHandleLike(Protocol):
    """What an equation asks the op's handle, by the equation's key (rule, wrt,
    signature, batch, active) or its signature: each answer is cached on the handle."""

    declares_sharding: bool
    equations: dict  # equation key -> (Interface, RuleIO), filled by interface_and_io

    def interface_and_io(self, key: tuple, instance) -> tuple[Interface, RuleIO]: ...
    def user_rule(self, rule: str, wrt: int = -1): ...
    def sharding(self, signature: tuple, instance): ...
    def kernel(self, key: tuple, in_shapes: tuple, instance) -> tuple: ...
    def traceable(self, key: tuple, instance, symbolic: bool = False): ...


class Equation:
    """One rule of one op at one signature (see the module docstring).

    What every stage reads of it is an attribute, computed (from the handle's
    caches) when the equation is made: the rule's operands and results
    (``io``), the op's interface at this signature, the results' avals.
    """

    __slots__ = ("op", "rule", "wrt", "signature", "batch", "active", "key", "spec", "name",
                 "declared", "interface", "io", "out_avals", "_hash", "__weakref__")

    def __init__(self, op: EquationOp, rule: str, signature: tuple, batch: tuple = (),
                 wrt: int = -1, active: tuple | None = None):
        self.op = op
        self.rule = rule
        self.wrt = wrt
        self.signature = signature
        self.batch = batch = tuple(batch)
        self.active = active = None if active is None else tuple(active)
        #: The equation without its op: the key of the caches the op's own handle
        #: holds (a handle keying by the whole equation would hold its own op alive).
        self.key = key = (rule, wrt, signature, batch, active)
        self._hash = hash((op.identity,) + key)
        self.spec = op.spec
        self.name = op.spec.name  # the op's class name, for messages
        handle = op.handle
        #: The op declares how it splits across devices (``sharding=``, ``@jd.sharding``).
        self.declared = handle.declares_sharding
        #: The op's interface at this signature, and the rule's operands and results
        #: (:class:`~jaxdecl._spec.interface.RuleIO`), checked against its signature.
        # (the handle's cache read here: an equation is made at every step of a trace)
        found = handle.equations.get(key) or handle.interface_and_io(key, op.instance)
        self.interface, self.io = found
        io = found[1]
        #: ``(shape, dtype)`` of every result, batch dims included.
        self.out_avals = tuple((batch + tuple(shape), dtype) for shape, dtype in io.out_avals)

    def __eq__(self, other):
        return type(other) is Equation and self._hash == other._hash and \
            self.op.handle is other.op.handle and self.key == other.key

    def __hash__(self):
        return self._hash

    def __repr__(self) -> str:
        wrt = f"[{self.wrt}]" if self.wrt >= 0 else ""
        active = f" active={self.active}" if self.active is not None else ""
        batch = f" batch={self.batch}" if self.batch else ""
        return f"{self.name}.{self.rule}{wrt}{active}{batch}"

    def with_rule(self, rule: str, wrt: int = -1, active: tuple | None = None) -> Equation:
        """The equation of another rule of the same op, at the same shapes."""
        return Equation(self.op, rule, self.signature, self.batch, wrt, active)

    def with_shapes(self, signature: tuple, batch: tuple) -> Equation:
        """The same rule at other shapes (one more batch dim, a shard's block)."""
        return Equation(self.op, self.rule, signature, batch, self.wrt, self.active)

    # --- what the op's handle knows about this equation --------------------------------

    @property
    def looped(self) -> bool:
        """The kernel loops over the batch dims itself (``batch="loop"``)."""
        return bool(self.batch) and self.spec.batch_mode == "loop"

    def user_rule(self):
        """The user's Rule behind this equation; MissingRuleError naming what to add."""
        return self.op.handle.user_rule(self.rule, self.wrt)

    def traceable(self, rule: str | None = None, active: tuple | None = None,
                  symbolic: bool = False):
        """This equation's rule (or the op's `rule` at its shapes and `active` leaves) as a
        JAX-traceable ``f(*operands) -> list``, or None (a host rule). With `symbolic`,
        results the rule returned as None stay None."""
        found = self.spec.rules.get(self.rule if rule is None else rule)
        if found is None or not found.traceable:  # most rules: asked without the handle
            return None
        key = self.key if rule is None else (rule, -1, self.signature, self.batch, active)
        return self.op.handle.traceable(key, self.op.instance, symbolic)

    def kernel(self, in_shapes: tuple) -> tuple:
        """``(kernel, pin)`` of this equation for operands of `in_shapes` (hold `pin`)."""
        return self.op.handle.kernel(self.key, in_shapes, self.op.instance)

    def sharding(self):
        """The op's sharding declaration applied to this signature (None: it declares none)."""
        return self.op.handle.sharding(self.signature, self.op.instance)

    def factors(self, operand_shapes: tuple) -> _factors.RuleFactors:
        """Every dim of every operand and result named by a factor.

        A declared op's factors come from its declaration. An op without one
        needs every dim whole, except the batch dims a ``vmap`` added: batch
        elements are independent, so each device may run its own rows.
        """
        if self.declared:
            return _factors.rule_factors(self.sharding(), self.interface, self.rule, self.wrt,
                                         self.batch, operand_shapes, self.active)
        return undeclared_factors(self.batch, operand_shapes,
                                  [s for s, _ in self.out_avals],
                                  [s for s, _ in signature_leaves(self.signature)])


def undeclared_factors(batch: tuple, operand_shapes, result_shapes, input_shapes):
    """The factors of an op without a declaration: batch dims free, all else whole.

    Example:
        >>> f = undeclared_factors((8,), [(8, 3), (1, 3)], [(8, 3)], [(3,), (3,)])
        >>> f.operands[0][0], f.operands[1][0], f.results[0][0], sorted(f.replicate)[:2]
        ('#vmap0', '#bcast1.0', '#vmap0', ['#bcast1.0', 'x0'])
    """
    names = (f"x{k}" for k in itertools.count())
    batch_factors = tuple(f"#vmap{k}" for k in range(len(batch)))
    sizes = dict(zip(batch_factors, batch))
    replicate = set()

    def whole(shape):
        own = tuple(next(names) for _ in shape)
        replicate.update(own)
        return own

    operands = []
    for index, shape in enumerate(operand_shapes):
        lead = []
        for k, size in enumerate(batch):
            if shape[k] == size:
                lead.append(batch_factors[k])
            else:  # broadcast along this batch dim: its own, whole
                own = f"#bcast{index}.{k}"
                sizes[own] = shape[k]
                replicate.add(own)
                lead.append(own)
        operands.append(tuple(lead) + whole(shape[len(batch):]))
    results = tuple(batch_factors + whole(shape[len(batch):]) for shape in result_shapes)
    inputs = tuple(whole(shape) for shape in input_shapes)
    return _factors.RuleFactors(tuple(operands), results, frozenset(replicate), sizes,
                                 inputs, batch_factors)


_compat.hold_weakly_in_caches(Equation)
