"""Which inputs an op is linear in (``linear=``), and the rules that follow from it.

``linear=True`` declares an op linear in all its differentiable inputs
jointly; ``linear=("strengths",)`` (a string names one input) declares it
linear in the named inputs jointly, for any fixed value of the others. The
others are the *lead* inputs of its ``@transpose``: it takes them, in input
order, then the cotangents, and returns the cotangents of the linear inputs.
A lead input that is floating and not ``nondiff=`` stays differentiable,
through ``@jvp``/``@vjp``: the op is then *partly linear*.

This module reads the option into the names it covers (:func:`linear_names`)
and refuses, when the class is created, every declaration that cannot hold
(:func:`check`), naming the class and the fix. Which rule runs for which
derivative is :mod:`jaxdecl._transforms.autodiff`'s.

Example:
    >>> from jaxdecl._spec.linearity import linear_names, read
    >>> linear_names("Nufft", read("Nufft", "strengths"), ("points", "strengths"), frozenset())
    ('strengths',)
    >>> linear_names("Fft", True, ("x", "axes"), frozenset({"axes"}))
    ('x',)
"""

from __future__ import annotations

from .._errors import DeclarationError
from .signatures import decorator_label, parameters, suggested_def


def read(name: str, value) -> object:
    """The ``linear=`` option as given: False, True or a tuple of names (a str is one)."""
    if value is None or value is False:
        return False
    if value is True:
        return True
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise DeclarationError(
        f"{name}: linear={value!r} is not True or a tuple of input names; write linear=True "
        f"(linear in every differentiable input) or linear=(\"strengths\",) (linear in the "
        f"named inputs, differentiable in the others through @jvp/@vjp)")


def linear_names(name: str, option, params: tuple, nondiff: frozenset) -> tuple:
    """The inputs the op is linear in (``()``: none), checked against its inputs."""
    if option is False:
        return ()
    if option is True:
        return tuple(p for p in params if p not in nondiff)
    unknown = [p for p in option if p not in params]
    if unknown:
        raise DeclarationError(
            f"{name}: linear={option!r} names {', '.join(map(repr, unknown))}, which "
            f"{'is not an input' if len(unknown) == 1 else 'are not inputs'} of {name} "
            f"(its inputs are {params}, named by @abstract)")
    both = [p for p in option if p in nondiff]
    if both:
        raise DeclarationError(
            f"{name}: {', '.join(map(repr, both))} {'is' if len(both) == 1 else 'are'} in both "
            f"linear= and nondiff=; an input the op is linear in is differentiated (by the "
            f"forward and its transpose): remove it from nondiff=")
    if len(set(option)) != len(option):
        raise DeclarationError(f"{name}: linear={option!r} names an input twice")
    return tuple(p for p in params if p in option)  # in input order


def check(name: str, rules: dict, transposes_wrt: dict, params: tuple, nondiff: frozenset,
          linear: tuple, option) -> bool:
    """Refuses a linear declaration that cannot hold; returns whether it is partly linear."""
    lead = tuple(p for p in params if p not in linear)
    partly = any(p not in nondiff for p in lead)
    shown = "linear=True" if option is True else f"linear={option!r}"
    if "transpose" in rules and "adjoint" in rules:
        raise DeclarationError(
            f"{name}: give @transpose or @adjoint, not both "
            f"({rules['transpose'].name}, {rules['adjoint'].name})")
    if transposes_wrt:
        rule = next(iter(transposes_wrt.values()))
        raise DeclarationError(
            f"{name}.{rule.name}: @transpose(wrt=...) is for multilinear=True ops; {name} is "
            f"{shown}, so it takes one @jd.transpose (without wrt=) for its linear inputs "
            f"together")
    if "transpose" not in rules and "adjoint" not in rules:
        fix = f"`@jd.transpose def apply_t(self, {', '.join(lead + ('ct',))})`"
        raise DeclarationError(
            f"{name} is declared {shown} but has no @jd.transpose (or @jd.adjoint) method; add "
            f"{fix}, returning the cotangent(s) of {', '.join(map(repr, linear))}")
    if not partly:
        for kind in ("jvp", "vjp"):
            if kind in rules:
                why = "" if option is True else (
                    f" ({shown} names every input of {name} not in nondiff=; to differentiate "
                    f"an input through @{kind}, leave it out of linear=)")
                raise DeclarationError(
                    f"{name}.{rules[kind].name}: a {shown} op derives @{kind} from @forward and "
                    f"@transpose; remove it{why}")
        return False
    _check_transpose_leads(name, rules.get("transpose") or rules["adjoint"], lead, linear)
    return True


def _check_transpose_leads(name: str, rule, lead: tuple, linear: tuple) -> None:
    """A partly linear op's transpose takes the other inputs, in order, then cotangents."""
    found = parameters(rule.function)
    if found is None or found.varargs:
        return
    what = "ct" if rule.kind == "transpose" else "y"
    expected = suggested_def(rule, lead + (what,))
    taken = found.positional[1:]
    if len(taken) < len(lead) + 1:
        raise DeclarationError(
            f"{name}.{rule.name} ({decorator_label(rule)}) takes ({', '.join(found.positional)}), "
            f"but jaxdecl passes the inputs {name} is not linear in ({', '.join(lead)}), then "
            f"one {'cotangent' if what == 'ct' else 'value'} per floating output: {expected}")
    for position, (given, wanted) in enumerate(zip(taken, lead)):
        if given in linear:
            raise DeclarationError(
                f"{name}.{rule.name} ({decorator_label(rule)}) takes {given!r}, an input "
                f"{name} is linear in: its transpose receives the other inputs "
                f"({', '.join(lead)}), then the cotangents, and returns the cotangent(s) of "
                f"{', '.join(map(repr, linear))}: {expected}")
        if given in lead and given != wanted:
            raise DeclarationError(
                f"{name}.{rule.name} ({decorator_label(rule)}) takes {given!r} as parameter "
                f"{position + 1}, but jaxdecl passes the inputs {name} is not linear in, in "
                f"input order ({', '.join(lead)}): {expected}")
