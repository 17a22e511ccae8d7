"""Marking a method with the role it plays in an op, and collecting the marks.

The decorators (``@jd.abstract``, ``@jd.forward``, ``@jd.jvp`` and the others,
each made by :func:`make_decorator`; their public faces are in
:mod:`jaxdecl._spec.decorators`) attach a :class:`Rule` to the method (its
kind, and how it wants to be called: traceable, zero-copy, ``zeros=``,
``wanted``, its platform) and return the method unchanged, so a class stays a
plain class until :mod:`jaxdecl._declare` reads the marks.
:func:`collect_rules` gathers them from a class and its bases.

Example:
    >>> import jaxdecl as jd
    >>> from jaxdecl._spec.rules import collect_rules
    >>> class Copy:
    ...     @jd.forward
    ...     def apply(self, x, *, out):
    ...         out[...] = x
    ...     @jd.vjp(traceable=True)
    ...     def pull(self, x, ct):
    ...         return ct
    >>> [(r.kind, r.name, r.zero_copy, r.traceable) for r in collect_rules(Copy)]
    [('forward', 'apply', True, False), ('vjp', 'pull', False, True)]
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

from .._errors import DeclarationError
from .cfunction import CFunction

RULE_KINDS = ("abstract", "forward", "jvp", "vjp", "transpose", "adjoint", "batch", "sharding",
              "residuals")
_MARK = "__jaxdecl_rule__"


@dataclasses.dataclass(frozen=True)
class Rule:
    """One decorated method: what it is for and how it wants to be called."""

    kind: str
    name: str  # the method's name, for messages
    function: Callable
    traceable: bool = False  # takes and returns JAX values (jax.numpy, other ops)
    wrt: str | None = None  # multilinear transpose: which input
    zero_copy: bool = False  # fills a keyword-only `out` instead of returning
    platform: str | None = None  # "gpu": a device rule (device arrays, XLA's stream)
    zeros: bool = False  # @jvp(zeros=True): symbolically zero tangents arrive as None
    wanted: bool = False  # takes the keyword-only `wanted` (@vjp, @transpose, @adjoint)

    def bind(self, instance) -> Callable:
        return self.function.__get__(instance, type(instance))


#: The platforms a rule may be declared for besides the host: ``"gpu"``, a device rule.
PLATFORMS = ("gpu",)


def make_decorator(kind: str, doc: str, *, traceable_ok: bool = False, wrt_ok: bool = False,
                    zeros_ok: bool = False, platform_ok: bool = False):
    def decorator(function=None, *, traceable: bool = False, wrt: str | None = None,
                  zeros: bool = False, platform: str | None = None):
        if traceable and not traceable_ok:
            raise TypeError(f"@jd.{kind} takes no traceable= option")
        if wrt is not None and not wrt_ok:
            raise TypeError(f"@jd.{kind} takes no wrt= option")
        _check_platform(kind, platform, platform_ok, traceable)
        if zeros and not zeros_ok:
            raise TypeError(f"@jd.{kind} takes no zeros= option (only @jd.jvp does: a @vjp or "
                            f"@transpose takes the keyword-only `wanted` instead)")

        def mark(fn):
            if not callable(fn):
                raise TypeError(f"@jd.{kind} decorates a method, got {fn!r}")
            where = _platform_of(kind, fn, platform)
            existing = rule_of(fn)
            if existing is not None and (existing.kind, existing.wrt, existing.platform) != (
                    kind, wrt, where):
                raise DeclarationError(
                    f"{existing.name} is already marked "
                    f"{_label(existing.kind, existing.wrt, existing.platform)}; a method has "
                    f"one role, so {_label(kind, wrt, where)} cannot also apply. To use one "
                    f"function for both, give the second role its own method that calls the first"
                )
            setattr(fn, _MARK, Rule(kind, fn.__name__, fn, traceable, wrt, _takes_out(fn),
                                    platform=where, zeros=bool(zeros),
                                    wanted=_takes_keyword(fn, "wanted")))
            return fn

        return mark if function is None else mark(function)

    decorator.__name__ = kind
    decorator.__qualname__ = kind
    decorator.__doc__ = doc
    # help() and the API reference show the options this decorator takes, not all of them.
    keywords = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
                for name, default, ok in (("traceable", False, traceable_ok), ("wrt", None, wrt_ok),
                                          ("zeros", False, zeros_ok),
                                          ("platform", None, platform_ok))
                if ok]
    decorator.__signature__ = inspect.Signature(
        [inspect.Parameter("function", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                           default=None if keywords else inspect.Parameter.empty), *keywords])
    return decorator


def _label(kind: str, wrt: str | None, platform: str | None = None) -> str:
    options = [f"{k}={v!r}" for k, v in (("wrt", wrt), ("platform", platform)) if v is not None]
    return f"@jd.{kind}" + (f"({', '.join(options)})" if options else "")


def _check_platform(kind: str, platform, platform_ok: bool, traceable: bool) -> None:
    if platform is None:
        return
    if not platform_ok:
        raise TypeError(
            f"@jd.{kind} takes no platform= option: it runs when the op is traced, the same "
            f"for every platform; only the rules that run on buffers (forward, jvp, vjp, "
            f"transpose) have device forms")
    if platform not in PLATFORMS:
        raise TypeError(
            f"@jd.{kind}(platform={platform!r}): the platform of a device rule is 'gpu' (the "
            f"rule without platform= serves the CPU, and every platform without a device rule)")
    if traceable:
        raise TypeError(
            f"@jd.{kind}(traceable=True, platform='gpu'): a traceable rule is JAX code, which "
            f"runs on every platform already; a device rule receives device arrays instead")


def _platform_of(kind: str, fn, platform):
    """The rule's platform: given, or "gpu" for a C kernel built for the GPU."""
    compiled_for = getattr(fn, "platform", None) if isinstance(fn, CFunction) else None
    if platform == "gpu" and isinstance(fn, CFunction) and compiled_for != "gpu":
        raise TypeError(
            f"@jd.{kind}(platform='gpu') got the C kernel {fn.__name__}, built for the CPU; a "
            f"GPU C kernel takes XLA's stream too (jaxdecl.h's jaxdecl_gpu_kernel): wrap it "
            f"with jd.cfunction(fn, platform='gpu')")
    return compiled_for or platform


def _takes_out(fn) -> bool:
    return isinstance(fn, CFunction) or _takes_keyword(fn, "out")  # C kernels always do


def _takes_keyword(fn, name: str) -> bool:
    """Whether `fn` has the keyword-only parameter `name` (C kernels have none)."""
    if isinstance(fn, CFunction):
        return False
    try:
        parameter = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.kind is inspect.Parameter.KEYWORD_ONLY


def rule_of(value) -> Rule | None:
    """The Rule a decorator attached to `value`, or None for an unmarked attribute."""
    rule = getattr(value, _MARK, None)
    return rule if isinstance(rule, Rule) else None


def collect_rules(cls) -> list[Rule]:
    """Marked methods of `cls` and its bases, the most derived one winning by name.

    A subclass that overrides a rule method without repeating the decorator
    keeps the method's role (as overriding any method keeps its meaning);
    overriding it with a non-callable removes the rule.
    """
    seen: dict[str, Rule] = {}
    for klass in reversed(cls.__mro__):
        for attr, value in vars(klass).items():
            rule = rule_of(value)
            if rule is not None:
                seen[attr] = rule
            elif attr in seen:
                if callable(value):
                    seen[attr] = dataclasses.replace(
                        seen[attr], name=attr, function=value, zero_copy=_takes_out(value),
                        wanted=_takes_keyword(value, "wanted"))
                else:
                    del seen[attr]
    return list(seen.values())
