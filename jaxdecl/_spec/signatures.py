"""Rules' signatures, checked against the op's inputs: at class creation, then at first trace.

jaxdecl calls a rule positionally: the op instance (``self``), then the values
that :mod:`jaxdecl._spec.interface` lists for that rule, and ``out=`` by keyword in
the zero-copy form. A signature that cannot take them must fail when the class
is written, naming the class, the rule, what it should look like and the fix,
not later inside ``jax.grad`` as Python's ``pull() takes 3 positional
arguments but 4 were given``.

Most of a signature is known from the class alone: the inputs are named by
``@abstract``, ``nondiff=`` names the inputs without tangents. How many
tangents a ``@jvp`` takes and how many cotangents a ``@vjp`` takes also depend
on the dtypes (an integer input has no tangent, an integer output no
cotangent) and on how many outputs ``@abstract`` returns, so that part is
checked when the rule is first traced at a set of input types
(:func:`check_traced`).

Example:
    >>> import jax, jaxdecl as jd
    >>> try:
    ...     class Mul(jd.Primitive):
    ...         @jd.abstract
    ...         def shapes(self, x1, x2):
    ...             return jax.ShapeDtypeStruct(x1.shape, x1.dtype)
    ...         @jd.forward
    ...         def apply(self, x1, x2, out):
    ...             out[...] = x1 * x2
    ... except jd.DeclarationError as error:
    ...     print(str(error)[:72])
    Mul.apply (@forward): `out` is a positional parameter; jaxdecl passes it
"""

from __future__ import annotations

import dataclasses
import inspect
import types

from .._errors import DeclarationError
from .cfunction import CFunction

#: Keyword-only parameters jaxdecl fills in when a rule declares them: the
#: zero-copy outputs, the residuals and forward's result (which rules may
#: take them is checked by :mod:`jaxdecl._spec.residuals`), and which
#: cotangents are asked for (``wanted``: @vjp, @transpose, @adjoint).
PASSED_BY_KEYWORD = ("out", "saved", "result", "wanted")

# Rules whose arguments are the op's inputs, named as @abstract names them, and
# the keyword-only parameters each may have besides.
_INPUT_RULES = {"abstract": ("out",), "forward": ("out", "saved"), "sharding": ("out",),
                "residuals": ("out",)}


@dataclasses.dataclass(frozen=True)
class Parameters:
    """What a rule's signature accepts."""

    positional: tuple  # names of the positional parameters, the instance first
    varargs: bool  # has *args: takes any number of positional values
    keyword_only: tuple  # names of keyword-only parameters
    required_keywords: tuple  # keyword-only parameters without a default
    varkw: bool  # has **kwargs


def parameters(function, *, any_callable: bool = False) -> Parameters | None:
    """The signature of a rule's function; None when it cannot be read (C kernels, builtins).

    Only plain Python functions are read unless `any_callable`: other callables
    (a ``functools.partial``, an object with ``__call__``) bind differently.
    """
    if isinstance(function, CFunction) or (
            not isinstance(function, types.FunctionType) and not any_callable):
        return None
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    kinds = inspect.Parameter
    values = list(signature.parameters.values())
    return Parameters(
        positional=tuple(p.name for p in values
                         if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)),
        varargs=any(p.kind is kinds.VAR_POSITIONAL for p in values),
        keyword_only=tuple(p.name for p in values if p.kind is kinds.KEYWORD_ONLY),
        required_keywords=tuple(p.name for p in values if p.kind is kinds.KEYWORD_ONLY
                                and p.default is inspect.Parameter.empty),
        varkw=any(p.kind is kinds.VAR_KEYWORD for p in values),
    )


def _where(cls_name: str, rule) -> str:
    return f"{cls_name}.{rule.name} ({decorator_label(rule)})"


def decorator_label(rule) -> str:
    return f"@{rule.kind}" + (f"(wrt={rule.wrt!r})" if rule.wrt is not None else "")


def suggested_def(rule, names, zero_copy: bool | None = None) -> str:
    """``def name(self, a, b, *, out)``: a signature to show in a message."""
    zero_copy = rule.zero_copy if zero_copy is None else zero_copy
    listed = ", ".join(["self", *names] + (["*", "out"] if zero_copy else []))
    return f"`def {rule.name}({listed})`"


def _check_form(cls_name: str, rule, found: Parameters) -> None:
    """Checks what every rule shares: `out` keyword-only, no unknown required keywords."""
    where = _where(cls_name, rule)
    if "out" in found.positional:
        names = [n for n in found.positional if n != "out"]
        inputs = names[1:] if names and names[0] == "self" else names
        raise DeclarationError(
            f"{where}: `out` is a positional parameter; jaxdecl passes it by keyword (the "
            f"zero-copy form), so the rule would take it for an input. Make it keyword-only: "
            f"{suggested_def(rule, inputs, zero_copy=True)}")
    unknown = [n for n in found.required_keywords if n not in PASSED_BY_KEYWORD]
    if unknown:
        raise DeclarationError(
            f"{where}: keyword-only parameter(s) {unknown} have no default, but jaxdecl passes "
            f"only {', '.join(f'`{k}`' for k in PASSED_BY_KEYWORD)} by keyword; make "
            f"{'them' if len(unknown) > 1 else 'it'} positional (an input) or give a default")
    if not found.positional and not found.varargs:
        raise DeclarationError(
            f"{where} takes no parameters; a rule is a method, so its first parameter is the "
            f"op instance: add `self`")


def _input_names(cls_name: str, rule, found: Parameters) -> tuple:
    """The positional names of a method that takes the op's inputs, `self` included."""
    allowed = _INPUT_RULES.get(rule.kind, ("out",))
    if found.varargs or found.varkw or any(n not in allowed for n in found.keyword_only):
        raise DeclarationError(
            f"{_where(cls_name, rule)}: every parameter must be a plain positional input, one "
            f"per input of the op (no *args, **kwargs, or keyword-only other than "
            f"{' or '.join(f'`{k}`' for k in allowed)}), because jaxdecl learns the op's inputs "
            f"from it")
    return found.positional


def method_inputs(cls_name: str, rule) -> tuple:
    """The input names a method takes after `self` (@abstract, @forward, @sharding, ...).

    Raises DeclarationError when its parameters are not plain positional inputs.
    """
    found = parameters(rule.function, any_callable=True)
    if found is None:
        raise DeclarationError(f"{_where(cls_name, rule)}: jaxdecl cannot read its signature")
    return _input_names(cls_name, rule, found)[1:]


def _missing_self(cls_name: str, rule, names: tuple, expected: tuple) -> DeclarationError:
    return DeclarationError(
        f"{_where(cls_name, rule)} has no `self`: its first parameter {names[0]!r} would "
        f"receive the op instance, not the input {names[0]!r}. Write "
        f"{suggested_def(rule, expected)}")


def op_inputs(cls_name: str, rules: dict, transposes_wrt: dict) -> tuple:
    """Checks every rule's signature that the class alone decides; returns the input names.

    The op's inputs are the parameters of ``@abstract`` after ``self``; ``@forward``
    (unless it is a C kernel) and ``@sharding`` must name the same inputs.
    """
    signatures = {}
    for rule in list(rules.values()) + list(transposes_wrt.values()):
        found = parameters(rule.function, any_callable=rule.kind in _INPUT_RULES)
        if found is not None:
            _check_form(cls_name, rule, found)
            signatures[id(rule)] = found
    if id(rules["abstract"]) not in signatures:
        raise DeclarationError(
            f"{_where(cls_name, rules['abstract'])}: jaxdecl cannot read its signature; "
            f"@abstract must be a method whose parameters name the op's inputs")
    abstract, forward = rules["abstract"], rules["forward"]
    declared = _input_names(cls_name, abstract, signatures[id(abstract)])
    forward_found = signatures.get(id(forward))
    taken = None if forward_found is None else _input_names(cls_name, forward, forward_found)
    if taken is not None and declared[0] != "self" and taken[0] == "self" \
            and declared == taken[1:]:
        raise _missing_self(cls_name, abstract, declared, declared)
    params = declared[1:]
    if not params and declared[0] != "self":
        raise DeclarationError(
            f"{_where(cls_name, abstract)} takes only {declared[0]!r}, which jaxdecl passes "
            f"the op instance to. If {declared[0]!r} is an input, add `self` first: "
            f"{suggested_def(abstract, declared)}; an op without inputs names its only parameter "
            f"`self`")
    for rule in (forward, rules.get("sharding")):  # (@residuals: see residuals.declare)
        found = None if rule is None else signatures.get(id(rule))
        if found is None:
            continue
        names = _input_names(cls_name, rule, found)
        if names == params and names and names[0] != "self":
            raise _missing_self(cls_name, rule, names, params)
        if names[1:] != params:
            raise DeclarationError(
                f"{_where(cls_name, abstract)} takes inputs {params}, but "
                f"{_where(cls_name, rule)} takes {names[1:]}; they must match (the op's "
                f"inputs are named by @abstract): {suggested_def(rule, params)}")
    return params


def check_rules(cls_name: str, rules: dict, transposes_wrt: dict, params: tuple,
                nondiff: frozenset, lead: tuple = ()) -> None:
    """Checks the derivative and batching rules' arity as far as the class decides it.

    Lower bounds only where the count depends on dtypes: every such rule takes
    the values it is linear in, at least one of them. `lead` names the inputs
    a linear op's transpose takes before the cotangents (those it is not linear in).
    """
    n = len(params)
    may_diff = [p for p in params if p not in nondiff]
    fixed = list(lead)
    partly = any(p not in nondiff for p in fixed)
    checks = []  # (rule, least count after self, most count or None, expected names, why)
    if "jvp" in rules:
        if not may_diff:
            raise DeclarationError(
                f"{_where(cls_name, rules['jvp'])}: every input of {cls_name} is listed in "
                f"nondiff=, so nothing has a tangent and the rule would never run; remove it "
                f"(or take the input out of nondiff=)")
        checks.append((rules["jvp"], n + 1, n + len(may_diff),
                       list(params) + ["d" + p for p in may_diff],
                       "the op's inputs, then one tangent per differentiable input (floating "
                       "or complex, not in nondiff=; integer inputs take none), in input order"))
    if "vjp" in rules:
        checks.append((rules["vjp"], n + 1, None, list(params) + ["ct"],
                       "the op's inputs, then one cotangent per floating or complex output"))
    for kind in ("transpose", "adjoint"):
        if kind in rules:
            what = "y" if kind == "adjoint" else "ct"
            checks.append((rules[kind], len(fixed) + 1, None, fixed + [what],
                           ("the inputs the op is not linear in" if partly else
                            "the op's nondiff= and integer inputs") + ", then one "
                           + ("value per output (it returns the adjoint A^H y)"
                              if kind == "adjoint" else "cotangent per floating output")))
    for wrt, rule in transposes_wrt.items():
        checks.append((rule, n, None, [p for p in params if p != wrt] + ["ct"],
                       f"every input but {wrt!r}, then one cotangent per floating output"))
    if "batch" in rules:
        checks.append((rules["batch"], 2, 2, ["args", "axes"],
                       "the tuple of (batched) inputs and the tuple of their batch axes"))
    for rule, least, most, expected, why in checks:
        found = parameters(rule.function)
        if found is None or found.varargs:
            continue
        names = found.positional
        if params and names[0] == params[0] and rule.kind != "batch":
            raise _missing_self(cls_name, rule, names, tuple(expected))
        count = len(names) - 1
        if count < least or (most is not None and count > most):
            raise DeclarationError(
                f"{_where(cls_name, rule)} takes ({', '.join(names)}), but jaxdecl passes "
                f"{why}: {suggested_def(rule, expected)}"
                f"{_missing(rule.kind, names, least, most, params)}")


def _missing(kind: str, names: tuple, least: int, most, params: tuple) -> str:
    """What is wrong with a count of parameters, in words, for the end of a message."""
    count = len(names) - 1
    if kind == "batch":
        return ""
    if most is not None and count > most:
        return f" ({count} parameters after self; at most {most})"
    if count == least - 1 and names[0] != "self":
        return f" (no `self`? The first parameter, {names[0]!r}, receives the op instance)"
    absent = [p for p in params if p not in names] if kind in ("jvp", "vjp") else []
    if absent:
        return f" ({', '.join(absent)} {'is' if len(absent) == 1 else 'are'} missing)"
    what = {"jvp": "a tangent", "adjoint": "a value"}.get(kind, "a cotangent")
    return f" ({what} is missing)" if count == least - 1 else \
        f" ({count} parameters after self; at least {least})"
