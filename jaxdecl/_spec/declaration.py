"""A class's declaration, collected once: its rules and options as an :class:`OpSpec`.

:func:`build_spec` runs when a primitive class is created (``jd.Primitive``'s
metaclass, ``@jd.primitive``): it collects the methods the rule decorators
marked, reads the class options, and refuses a misdeclared class there, with a
``DeclarationError`` naming the class and the method, long before anything is
traced. Each check is a named step below.

Example:
    >>> import jax, jaxdecl as jd
    >>> from jaxdecl._spec.declaration import build_spec
    >>> class Neg:
    ...     @jd.abstract
    ...     def shapes(self, x):
    ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
    ...     @jd.forward
    ...     def apply(self, x):
    ...         return -x
    >>> spec = build_spec(Neg, {"batch": "vectorized"})
    >>> spec.params, spec.batch_mode, spec.linear
    (('x',), 'vectorized', ())
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._errors import DeclarationError
from . import device_rules as _device_rules
from . import linearity as _linearity
from . import residuals as _residuals
from . import signatures as _signatures
from .cfunction import CFunction
from .rules import Rule, collect_rules
from .sharding import ShardingRule, from_options

BATCH_MODES = ("loop", "vectorized")


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """Everything jaxdecl knows about a primitive class, collected once."""

    name: str
    params: tuple[str, ...]  # input names, from @abstract's signature
    rules: dict  # kind -> Rule (transpose: only the linear one)
    transposes_wrt: dict  # multilinear: input name -> Rule
    linear: tuple  # the inputs it is linear in (linear=True: all but nondiff=); () none
    multilinear: bool
    nondiff: frozenset
    batch_mode: str
    sharding: ShardingRule | None = None  # from the class options (else maybe @sharding)
    keeps: _residuals.Keeps | None = None  # residuals and result= (None: no rule uses them)
    # platform="gpu": kind -> Rule, and multilinear input name -> Rule (see _device_rules)
    device_rules: dict = dataclasses.field(default_factory=dict)
    device_transposes_wrt: dict = dataclasses.field(default_factory=dict)
    #: Linear in some inputs, differentiable in others through @jvp/@vjp (linear=(...)).
    partly_linear: bool = False
    #: A jvp equation may leave out a zero tangent: the @jvp takes None for it
    #: (zeros=True), or there is none on the host (the equation is transposed, not run).
    zero_tangents: bool = True
    #: The derivative rules that take ``wanted`` ("vjp", "transpose": a linear op's
    #: @transpose or @adjoint), whose equations return only the cotangents asked for.
    wanted_by: frozenset = frozenset()

    def rule(self, kind: str) -> Rule | None:
        return self.rules.get(kind)

    def describe(self, kind: str) -> str:
        """`Class.method` for a rule, for messages."""
        rule = self.rules.get(kind)
        return f"{self.name}.{rule.name}" if rule else f"{self.name} (@{kind})"


# The options that make up a sharding declaration: a subclass that declares
# sharding anew replaces all of them (replicate=, reduce= and residuals= name
# the factors of the parent's rule).
SHARDING_OPTIONS = ("sharding", "replicate", "reduce", "residuals")
OPTIONS = ("linear", "multilinear", "nondiff", "batch") + SHARDING_OPTIONS


@dataclasses.dataclass(frozen=True)
class _Options:
    linear: object  # False, True or a tuple of names (see linearity.read)
    multilinear: bool
    nondiff: frozenset
    batch_mode: str


def build_spec(cls, options: dict[str, Any]) -> OpSpec:
    """Collects and validates the rules of `cls`; raises DeclarationError."""
    name = cls.__name__
    opts = _read_options(name, options)
    rules, transposes_wrt, device = _collect(name, cls)
    _check_rule_kinds(name, rules)
    # The inputs' names come from @abstract (a C kernel's @forward has none);
    # @forward and @sharding must name the same ones.
    params = _signatures.op_inputs(name, rules, transposes_wrt)
    _check_nondiff(name, opts.nondiff, params, rules)
    linear = _linearity.linear_names(name, opts.linear, params, opts.nondiff)
    partly = False
    if linear:
        partly = _linearity.check(name, rules, transposes_wrt, params, opts.nondiff, linear,
                                  opts.linear)
    else:
        _check_not_linear(name, rules, transposes_wrt, opts.multilinear)
    if opts.multilinear:
        _check_multilinear(name, rules, transposes_wrt, params, opts.nondiff)
    _check_forms(name, rules)
    _check_keywords(name, rules, transposes_wrt)
    declared = _sharding_of(name, options, params, rules)
    lead = tuple(p for p in params if p not in linear) if linear else \
        tuple(p for p in params if p in opts.nondiff)
    _signatures.check_rules(name, rules, transposes_wrt, params, opts.nondiff, lead)
    keeps = _residuals.declare(name, rules, transposes_wrt, params,
                               (bool(linear) and not partly) or opts.multilinear,
                               _signatures.method_inputs, partly)
    device_rules, device_wrt = _device_rules.declare(name, device, rules, transposes_wrt)
    jvp = rules.get("jvp")
    wanted_by = frozenset(kind for kind, rule in (
        ("vjp", rules.get("vjp")), ("transpose", rules.get("transpose") or rules.get("adjoint")))
        if rule is not None and rule.wanted)
    return OpSpec(name=name, params=params, rules=rules, transposes_wrt=transposes_wrt,
                  linear=linear, multilinear=opts.multilinear, nondiff=opts.nondiff,
                  batch_mode=opts.batch_mode, sharding=declared, keeps=keeps,
                  device_rules=device_rules, device_transposes_wrt=device_wrt,
                  partly_linear=partly, zero_tangents=jvp is None or jvp.zeros,
                  wanted_by=wanted_by)


def _read_options(name: str, options: dict) -> _Options:
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise DeclarationError(
            f"{name}: unknown option(s) {sorted(unknown)}; jaxdecl options are {list(OPTIONS)}")
    linear = _linearity.read(name, options.get("linear", False))
    multilinear = bool(options.get("multilinear", False))
    batch_mode = options.get("batch", "loop")
    nondiff = options.get("nondiff", ())
    if isinstance(nondiff, str):
        nondiff = (nondiff,)
    if linear and multilinear:
        raise DeclarationError(
            f"{name}: choose one of linear=True and multilinear=True"
            + ("" if linear is True else
               f" (linear={options['linear']!r} is linear in the named inputs jointly; "
               f"multilinear=True is linear in each differentiable input separately)"))
    if batch_mode not in BATCH_MODES:
        raise DeclarationError(f"{name}: batch={batch_mode!r} is not one of {BATCH_MODES}")
    return _Options(linear, multilinear, frozenset(nondiff), batch_mode)


def _collect(name: str, cls) -> tuple[dict, dict, list]:
    """``(rules by kind, multilinear transposes by input, device rules)``: one method per
    role (device rules are checked apart, see :mod:`jaxdecl._spec.device_rules`)."""
    rules: dict[str, Rule] = {}
    transposes_wrt: dict[str, Rule] = {}
    device: list[Rule] = []
    for rule in collect_rules(cls):
        if rule.platform is not None:
            device.append(rule)
            continue
        if rule.kind == "transpose" and rule.wrt is not None:
            if rule.wrt in transposes_wrt:
                raise DeclarationError(
                    f"{name}: two @transpose(wrt={rule.wrt!r}) methods, "
                    f"{transposes_wrt[rule.wrt].name} and {rule.name}")
            transposes_wrt[rule.wrt] = rule
            continue
        if rule.kind in rules:
            raise DeclarationError(
                f"{name}: two @{rule.kind} methods, {rules[rule.kind].name} and {rule.name}; "
                f"keep one")
        rules[rule.kind] = rule
    return rules, transposes_wrt, device


def _check_rule_kinds(name: str, rules: dict) -> None:
    """The rules that must be Python methods are, and the two required ones are there."""
    for kind in ("abstract", "batch", "residuals", "sharding"):
        if kind in rules and isinstance(rules[kind].function, CFunction):
            raise DeclarationError(f"{name}: @{kind} must be a Python method, not a C kernel")
    for kind in ("forward", "abstract"):
        if kind not in rules:
            raise DeclarationError(
                f"{name} has no @jd.{kind} method; every primitive needs "
                + ("`@jd.forward def apply(self, ...)`" if kind == "forward"
                   else "`@jd.abstract def shapes(self, ...)` returning jax.ShapeDtypeStruct(s)"))


def _check_nondiff(name: str, nondiff: frozenset, params: tuple, rules: dict) -> None:
    for input_name in nondiff:
        if input_name not in params:
            raise DeclarationError(
                f"{name}: nondiff names {input_name!r}, which is not an input of "
                f"{name}.{rules['forward'].name}{params}")


def _check_not_linear(name: str, rules: dict, transposes_wrt: dict, multilinear: bool) -> None:
    """A transpose needs linear=True, a transpose(wrt=) multilinear=True."""
    method = rules.get("transpose") or rules.get("adjoint")
    if method is not None:
        raise DeclarationError(
            f"{name}.{method.name}: @{method.kind} needs a linear op; declare the class with "
            f"linear=True"
            + (" (or multilinear=True with @transpose(wrt=...))" if not multilinear else
               "; a multilinear op takes one @transpose(wrt=...) per input instead"))
    if transposes_wrt and not multilinear:
        rule = next(iter(transposes_wrt.values()))
        raise DeclarationError(
            f"{name}.{rule.name}: @transpose(wrt=...) needs multilinear=True on the class")


def _check_multilinear(name: str, rules: dict, transposes_wrt: dict, params: tuple,
                       nondiff: frozenset) -> None:
    """No @jvp/@vjp, and one @transpose(wrt=) per differentiable input."""
    for kind in ("jvp", "vjp"):
        if kind in rules:
            raise DeclarationError(
                f"{name}.{rules[kind].name}: a multilinear=True op derives @{kind} from "
                f"@forward and its @transpose(wrt=...) rules; remove it")
    for wrt, rule in transposes_wrt.items():
        if wrt not in params:
            raise DeclarationError(
                f"{name}.{rule.name}: @transpose(wrt={wrt!r}) names no input of {params}")
        if wrt in nondiff:
            raise DeclarationError(
                f"{name}.{rule.name}: @transpose(wrt={wrt!r}) names a nondiff input")
    missing = [p for p in params if p not in nondiff and p not in transposes_wrt]
    if missing:
        raise DeclarationError(
            f"{name} is multilinear but has no @jd.transpose(wrt=...) for input(s) "
            f"{missing}; add one per differentiable input, or list integer inputs in nondiff=")


def _check_forms(name: str, rules: dict) -> None:
    """Rules that return JAX values (traceable, @batch, @sharding) take no `out`."""
    for rule in rules.values():
        if rule.traceable and rule.zero_copy:
            raise DeclarationError(
                f"{name}.{rule.name}: a traceable rule returns JAX values; it cannot take `out`")
    for kind in ("batch", "sharding"):
        if kind in rules and rules[kind].zero_copy:
            raise DeclarationError(
                f"{name}.{rules[kind].name}: @{kind} {'rules ' if kind == 'batch' else ''}"
                f"cannot take `out`")


def _check_keywords(name: str, rules: dict, transposes_wrt: dict) -> None:
    """``wanted`` is for the rules that return cotangents; ``zeros=`` for Python @jvp rules."""
    for rule in list(rules.values()) + list(transposes_wrt.values()):
        if rule.wanted and (rule.kind not in ("vjp", "transpose", "adjoint") or rule.wrt):
            fix = ("; a @jvp declares `@jd.jvp(zeros=True)` to receive None for the tangents "
                   "that are zero" if rule.kind == "jvp" else "")
            raise DeclarationError(
                f"{name}.{rule.name} (@{rule.kind}{'(wrt=...)' if rule.wrt else ''}) takes "
                f"`wanted`, which jaxdecl passes only to a @vjp and to a linear op's "
                f"@transpose or @adjoint (one bool per cotangent it returns){fix}")
    jvp = rules.get("jvp")
    if jvp is not None and jvp.zeros and isinstance(jvp.function, CFunction):
        raise DeclarationError(
            f"{name}.{jvp.name} (@jvp): a C kernel cannot receive None for a zero tangent; "
            f"drop zeros=True (it then receives every tangent, zeros included)")


def _sharding_of(name: str, options: dict, params: tuple, rules: dict):
    """The class options' sharding declaration (or None); not with a @jd.sharding too."""
    declared = from_options(name, options, params)
    if declared is not None and "sharding" in rules:
        raise DeclarationError(
            f"{name}: give sharding= or a @jd.sharding method ({rules['sharding'].name}), not "
            f"both (a subclass removes an inherited method with `{rules['sharding'].name} = "
            f"None`)")
    return declared
