"""Declaring a primitive: the op's spec, the metaclass and ``@jd.primitive``.

A class becomes a jaxdecl primitive by marking methods with the decorators of
:mod:`jaxdecl._spec.rules`. The marks are collected into an :class:`OpSpec` when
the class is created, and a misdeclared class is rejected there, naming the
class and the method, long before anything is traced.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ._call import apply_op
from ._errors import DeclarationError
from ._host import residuals as _residuals
from ._op.handle import spec_of  # noqa: F401 - spec_of re-exported
from ._spec import signatures as _signatures
from ._spec.cfunction import CFunction
from ._spec.rules import Rule, collect_rules, rule_of
from ._spec.sharding import ShardingRule, from_options

BATCH_MODES = ("loop", "vectorized")


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """Everything jaxdecl knows about a primitive class, collected once."""

    name: str
    params: tuple[str, ...]  # input names, from @forward's signature
    rules: dict  # kind -> Rule (transpose: only the linear one)
    transposes_wrt: dict  # multilinear: input name -> Rule
    linear: bool
    multilinear: bool
    nondiff: frozenset
    batch_mode: str
    sharding: ShardingRule | None = None  # from the class options (else maybe @sharding)
    keeps: _residuals.Keeps | None = None  # residuals and result= (None: no rule uses them)

    def rule(self, kind: str) -> Rule | None:
        return self.rules.get(kind)

    def describe(self, kind: str) -> str:
        """`Class.method` for a rule, for messages."""
        rule = self.rules.get(kind)
        return f"{self.name}.{rule.name}" if rule else f"{self.name} (@{kind})"


# The options that make up a sharding declaration: a subclass that declares
# sharding anew replaces all of them (replicate=, reduce= and residuals= name
# the factors of the parent's rule).
_SHARDING_OPTIONS = ("sharding", "replicate", "reduce", "residuals")
_OPTIONS = ("linear", "multilinear", "nondiff", "batch") + _SHARDING_OPTIONS


def build_spec(cls, options: dict[str, Any]) -> OpSpec:
    """Collects and validates the rules of `cls`; raises DeclarationError."""
    name = cls.__name__
    unknown = set(options) - set(_OPTIONS)
    if unknown:
        raise DeclarationError(
            f"{name}: unknown option(s) {sorted(unknown)}; jaxdecl options are {list(_OPTIONS)}"
        )
    linear = bool(options.get("linear", False))
    multilinear = bool(options.get("multilinear", False))
    batch_mode = options.get("batch", "loop")
    nondiff = options.get("nondiff", ())
    if isinstance(nondiff, str):
        nondiff = (nondiff,)
    nondiff = frozenset(nondiff)
    if linear and multilinear:
        raise DeclarationError(f"{name}: choose one of linear=True and multilinear=True")
    if batch_mode not in BATCH_MODES:
        raise DeclarationError(
            f"{name}: batch={batch_mode!r} is not one of {BATCH_MODES}"
        )

    rules: dict[str, Rule] = {}
    transposes_wrt: dict[str, Rule] = {}
    for rule in collect_rules(cls):
        if rule.kind == "transpose" and rule.wrt is not None:
            if rule.wrt in transposes_wrt:
                raise DeclarationError(
                    f"{name}: two @transpose(wrt={rule.wrt!r}) methods, "
                    f"{transposes_wrt[rule.wrt].name} and {rule.name}"
                )
            transposes_wrt[rule.wrt] = rule
            continue
        if rule.kind in rules:
            raise DeclarationError(
                f"{name}: two @{rule.kind} methods, {rules[rule.kind].name} and {rule.name}; "
                f"keep one"
            )
        rules[rule.kind] = rule

    for rule in rules.values():
        if isinstance(rule.function, CFunction) and rule.kind in ("abstract", "batch",
                                                                  "residuals"):
            raise DeclarationError(f"{name}: @{rule.kind} must be a Python method, not a C kernel")
    if "sharding" in rules and isinstance(rules["sharding"].function, CFunction):
        raise DeclarationError(f"{name}: @sharding must be a Python method, not a C kernel")
    for kind in ("forward", "abstract"):
        if kind not in rules:
            raise DeclarationError(
                f"{name} has no @jd.{kind} method; every primitive needs "
                + ("`@jd.forward def apply(self, ...)`" if kind == "forward"
                   else "`@jd.abstract def shapes(self, ...)` returning jax.ShapeDtypeStruct(s)")
            )
    # The inputs' names come from @abstract (a C kernel's @forward has none);
    # @forward and @sharding must name the same ones.
    params = _signatures.op_inputs(name, rules, transposes_wrt)
    for input_name in nondiff:
        if input_name not in params:
            raise DeclarationError(
                f"{name}: nondiff names {input_name!r}, which is not an input of "
                f"{name}.{rules['forward'].name}{params}"
            )

    has_transpose = "transpose" in rules or "adjoint" in rules
    if linear:
        if "transpose" in rules and "adjoint" in rules:
            raise DeclarationError(
                f"{name}: give @transpose or @adjoint, not both "
                f"({rules['transpose'].name}, {rules['adjoint'].name})"
            )
        if not has_transpose:
            raise DeclarationError(
                f"{name} is declared linear=True but has no @jd.transpose (or @jd.adjoint) method"
            )
        for kind in ("jvp", "vjp"):
            if kind in rules:
                raise DeclarationError(
                    f"{name}.{rules[kind].name}: a linear=True op derives @{kind} from @forward "
                    f"and @transpose; remove it"
                )
    elif has_transpose:
        method = rules.get("transpose") or rules.get("adjoint")
        raise DeclarationError(
            f"{name}.{method.name}: @{method.kind} needs a linear op; declare the class with "
            f"linear=True"
            + (" (or multilinear=True with @transpose(wrt=...))" if not multilinear else
               "; a multilinear op takes one @transpose(wrt=...) per input instead")
        )
    if transposes_wrt and not multilinear:
        rule = next(iter(transposes_wrt.values()))
        raise DeclarationError(
            f"{name}.{rule.name}: @transpose(wrt=...) needs multilinear=True on the class"
        )
    if multilinear:
        for kind in ("jvp", "vjp"):
            if kind in rules:
                raise DeclarationError(
                    f"{name}.{rules[kind].name}: a multilinear=True op derives @{kind} from "
                    f"@forward and its @transpose(wrt=...) rules; remove it"
                )
        for wrt, rule in transposes_wrt.items():
            if wrt not in params:
                raise DeclarationError(
                    f"{name}.{rule.name}: @transpose(wrt={wrt!r}) names no input of {params}"
                )
            if wrt in nondiff:
                raise DeclarationError(
                    f"{name}.{rule.name}: @transpose(wrt={wrt!r}) names a nondiff input"
                )
        missing = [p for p in params if p not in nondiff and p not in transposes_wrt]
        if missing:
            raise DeclarationError(
                f"{name} is multilinear but has no @jd.transpose(wrt=...) for input(s) "
                f"{missing}; add one per differentiable input, or list integer inputs in nondiff="
            )
    for rule in rules.values():
        if rule.traceable and rule.zero_copy:
            raise DeclarationError(
                f"{name}.{rule.name}: a traceable rule returns JAX values; it cannot take `out`"
            )
    if "batch" in rules and rules["batch"].zero_copy:
        raise DeclarationError(f"{name}.{rules['batch'].name}: @batch rules cannot take `out`")
    declared = from_options(name, options, params)
    if declared is not None and "sharding" in rules:
        raise DeclarationError(
            f"{name}: give sharding= or a @jd.sharding method ({rules['sharding'].name}), not "
            f"both (a subclass removes an inherited method with `{rules['sharding'].name} = "
            f"None`)")
    if "sharding" in rules and rules["sharding"].zero_copy:
        raise DeclarationError(f"{name}.{rules['sharding'].name}: @sharding cannot take `out`")
    _signatures.check_rules(name, rules, transposes_wrt, params, nondiff)

    keeps = _residuals.declare(name, rules, transposes_wrt, params, linear or multilinear,
                               _signatures.method_inputs)

    return OpSpec(
        name=name, params=params, rules=rules, transposes_wrt=transposes_wrt, linear=linear,
        multilinear=multilinear, nondiff=nondiff, batch_mode=batch_mode, sharding=declared,
        keeps=keeps,
    )


#: ``op(*args, **kwargs)``: the primitive applied to JAX arrays, NumPy arrays or Python
#: scalars (no wrapper frame: this is on the path of every eager call).
_op_call = apply_op


def _install(cls, options: dict[str, Any]):
    spec = build_spec(cls, options)
    cls.__jaxdecl_spec__ = spec
    return cls


_RULES_AND_OPTIONS = """
    A class declares one op: mark its methods with the rule decorators below;
    the op's inputs are the parameters of ``@abstract`` after ``self``
    (``x1, x2`` here). Instances are the ops, ``Mul()(x1, x2)``; static
    configuration (axes, flags, thread counts) is set in ``__init__``, and
    instances with equal configuration share compiled code. The class is
    checked when it is created: a misdeclared one raises
    :class:`~jaxdecl.DeclarationError` naming the method and the fix.

    Decorators:
        ``@jd.abstract`` ``(self, x1, x2)``
            Required. The outputs' shapes and dtypes from the inputs': each
            input arrives as a ``jax.ShapeDtypeStruct``; return one, a tuple
            of them, or a pytree of them.
        ``@jd.forward`` ``(self, x1, x2)`` or ``(self, x1, x2, *, out)``
            Required. The result(s), computed on read-only NumPy views of XLA's
            buffers; the zero-copy form fills ``out`` and returns None. With
            ``@jd.residuals`` it also takes ``*, saved=None``.
        ``@jd.jvp`` ``(self, x1, x2, dx1, dx2)``
            Forward mode: the output tangent(s), from one tangent per
            differentiable input. ``@jd.jvp(traceable=True)``: a rule written
            with ``jax.numpy`` that JAX differentiates again. It may add the
            keyword-only ``result`` (the forward's output) and ``saved`` (the
            residuals).
        ``@jd.vjp`` ``(self, x1, x2, ct)``
            Reverse mode: the input cotangent(s), from one cotangent per
            floating output. ``traceable=True``, ``result`` and ``saved`` as
            for ``@jvp``.
        ``@jd.transpose`` ``(self, <nondiff inputs>, ct)``
            A linear op's transpose: the cotangent(s) of its linear inputs. A
            multilinear op has one ``@jd.transpose(wrt="x1")`` taking
            ``(self, <inputs but x1>, ct)`` per differentiable input.
        ``@jd.adjoint`` ``(self, <nondiff inputs>, y)``
            A linear op's conjugate transpose A^H y, instead of ``@transpose``.
        ``@jd.batch`` ``(self, args, axes)``
            ``vmap`` at trace time, on JAX values: returns
            ``(outputs, out_axes)``. Without it, ``batch=`` decides.
        ``@jd.sharding`` ``(self, x1, x2)``
            The sharding declaration as a method, from the inputs' shapes:
            returns a :class:`~jaxdecl.ShardingRule`.
        ``@jd.residuals`` ``(self, x1, x2)``
            What the forward keeps for the derivative rules, from the inputs'
            shapes: a pytree of ``jax.ShapeDtypeStruct``. The ``@forward``
            then takes ``*, saved=None`` and fills it when a derivative
            follows, so that the forward runs once per derivative.

    Class options:
        ``linear=True``
            Linear in its differentiable inputs jointly: needs ``@transpose``
            (or ``@adjoint``) and no ``@jvp``/``@vjp``; every derivative order
            follows.
        ``multilinear=True``
            Linear in each differentiable input separately (``x1 * x2``): one
            ``@transpose(wrt=...)`` per differentiable input.
        ``nondiff=("theta", ...)``
            Inputs never differentiated (coordinates, geometry); integer and
            bool inputs never are anyway.
        ``batch="loop"`` (default) or ``batch="vectorized"``
            How ``vmap`` reaches the NumPy rules when there is no ``@batch``:
            once per batch element inside one XLA call, or once with leading
            batch dims on every input and output.
        ``sharding="b n, n -> b n"``
            How the forward's dims relate, one factor name per dim: the rules
            may run per device on slices along each named factor. Verify every
            declaration with :func:`~jaxdecl.check`.
        ``replicate=("n",)``
            Factors the rules need whole (gathered first when split).
        ``reduce=("k",)``
            Factors the rules sum over (partial results are added up).
        ``residuals={"lu": "b n m"}``
            The residuals' factors, a pytree of factor strings shaped like
            ``@jd.residuals``' result, so that each device keeps those of its
            own block.
"""


class PrimitiveMeta(type):
    """Metaclass of :class:`Primitive`: collects and validates the rules at class creation.

    Options arrive as class keywords, ``class Op(jd.Primitive, linear=True)``,
    and a subclass inherits its parent's rules and options (a new
    ``sharding=`` replaces the parent's ``replicate=``/``reduce=`` too).
    Classes that have a metaclass of their own use :func:`primitive` instead.

    Example:
        >>> import jax, jaxdecl as jd
        >>> class Double(jd.Primitive):
        ...     @jd.abstract
        ...     def shapes(self, x):
        ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
        ...     @jd.forward
        ...     def apply(self, x):
        ...         return 2 * x
        >>> type(Double) is jd.PrimitiveMeta
        True
        >>> class Quadruple(Double):  # rules are inherited; a method override keeps its role
        ...     def apply(self, x):
        ...         return 4 * x
        >>> float(Quadruple()(1.0))
        4.0
    """

    def __new__(mcls, name, bases, namespace, **options):
        cls = super().__new__(mcls, name, bases, namespace)
        if namespace.get("__jaxdecl_base__", False):
            return cls
        # A subclass inherits its parent's options unless it gives its own. A new
        # sharding declaration (sharding= or a @jd.sharding method) replaces the
        # whole declaration: the parent's replicate=/reduce= describe its factors.
        inherited = dict(getattr(cls, "__jaxdecl_options__", {}))
        if "sharding" in options or any(
                getattr(rule_of(value), "kind", None) == "sharding"
                for value in namespace.values()):
            for key in _SHARDING_OPTIONS:
                inherited.pop(key, None)
        inherited.update(options)
        cls.__jaxdecl_options__ = inherited
        return _install(cls, inherited)

    def __init__(cls, name, bases, namespace, **options):
        super().__init__(name, bases, namespace)


class Primitive(metaclass=PrimitiveMeta):
    __jaxdecl_base__ = True
    __call__ = _op_call


Primitive.__doc__ = """Base class of jaxdecl primitives: subclass it and decorate methods.

    Options are class keywords: ``class Scale(jd.Primitive, linear=True)``.
""" + _RULES_AND_OPTIONS + """
    Example:
        >>> import jax, jax.numpy as jnp, numpy as np, jaxdecl as jd
        >>> class Mul(jd.Primitive):
        ...     @jd.abstract
        ...     def shapes(self, x1, x2):
        ...         return jax.ShapeDtypeStruct(x1.shape, x1.dtype)
        ...     @jd.forward
        ...     def apply(self, x1, x2, *, out):
        ...         np.multiply(x1, x2**2, out=out)
        ...     @jd.vjp
        ...     def pull(self, x1, x2, ct):
        ...         return x2**2 * ct, 2 * x1 * x2 * ct
        >>> mul = Mul()
        >>> mul(jnp.ones(2), jnp.full(2, 3.0)).tolist()
        [9.0, 9.0]
        >>> jax.grad(lambda a: mul(a, jnp.full(2, 3.0)).sum())(jnp.ones(2)).tolist()
        [9.0, 9.0]
    """


def primitive(cls=None, **options):
    def decorate(klass):
        if not isinstance(klass, type):
            raise TypeError(f"@jd.primitive decorates a class, got {klass!r}")
        if "__call__" in vars(klass):
            raise DeclarationError(
                f"{klass.__name__} defines __call__; @jd.primitive makes instances callable "
                f"as the op, so remove it (or call the op from another method)"
            )
        klass.__call__ = _op_call
        klass.__jaxdecl_options__ = dict(options)
        return _install(klass, options)

    return decorate if cls is None else decorate(cls)


primitive.__doc__ = """The class decorator form of :class:`Primitive`: for any class, any metaclass.

    Adds ``__call__`` and leaves the class's metaclass alone, so it works on
    plain classes, ``equinox.Module`` and ``nifty.re.Model`` subclasses (which
    cannot also take :class:`Primitive`'s metaclass). Options are the
    decorator's arguments: ``@jd.primitive(linear=True)``; without options,
    ``@jd.primitive`` alone.
""" + _RULES_AND_OPTIONS + """
    Example:
        >>> import equinox as eqx, jax, numpy as np, jaxdecl as jd
        >>> @jd.primitive(nondiff=("coords",))
        ... class Sample(eqx.Module):
        ...     order: int = 1  # a field of the module: the op's configuration
        ...     @jd.abstract
        ...     def shapes(self, values, coords):
        ...         return jax.ShapeDtypeStruct(coords.shape, values.dtype)
        ...     @jd.forward
        ...     def apply(self, values, coords):
        ...         return values[coords.astype(int)]
        ...     @jd.vjp
        ...     def pull(self, values, coords, ct):
        ...         grad = np.zeros_like(values)
        ...         np.add.at(grad, coords.astype(int), ct)
        ...         return grad
        >>> op = Sample()
        >>> op(jax.numpy.arange(4.0), jax.numpy.array([3.0, 1.0])).tolist()
        [3.0, 1.0]
        >>> jax.grad(lambda v: op(v, jax.numpy.array([3.0, 3.0])).sum())(
        ...     jax.numpy.zeros(4)).tolist()
        [0.0, 0.0, 0.0, 2.0]
    """
