"""Residuals: what the forward keeps so that a derivative does not run it again.

An op declares with ``@jd.residuals`` the arrays its forward keeps; its
``@forward`` takes a keyword-only ``saved``; any ``@jvp``/``@vjp`` may take the
keyword-only ``saved`` (those arrays, read only) and ``result`` (the forward's
output, as the op returns it). How the values travel:

- A plain call binds the ``forward`` rule: the forward gets ``saved=None`` and
  nothing is allocated for it.
- When a derivative is taken (the jvp rule of a ``forward`` equation sees a
  tangent), :mod:`jaxdecl._transforms.autodiff` binds ``forward_saving`` instead: the
  same forward, whose results are followed by the residual leaves, which the
  rule fills through ``saved`` (writable views). The ``jvp`` equation then
  takes, after its usual operands, the forward's outputs (when some rule takes
  ``result``) and the residuals. Transposing ``jvp`` into ``vjp`` (and back)
  passes those extras along unchanged, so under ``grad`` the one
  ``forward_saving`` equation is the known part that runs once, and the
  ``vjp`` reads what it kept. ``jax.checkpoint`` recomputes it as JAX
  recomputes any primal value. An op whose rules take only ``result`` binds
  the plain forward and passes its outputs along.
- Kernels deal in flat arrays: :mod:`jaxdecl._host.keyword_rules` turns the
  extras back into the keyword arguments each rule asks for
  (:class:`~jaxdecl._spec.interface.Keyword`).

This module validates the declaration (:func:`declare`), at class creation.

Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxdecl as jd
    >>> calls = []
    >>> class Exp(jd.Primitive):
    ...     @jd.abstract
    ...     def shapes(self, x):
    ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
    ...     @jd.forward
    ...     def apply(self, x):
    ...         calls.append("forward")
    ...         return np.exp(x)
    ...     @jd.vjp
    ...     def pull(self, x, ct, *, result):  # d/dx exp(x) = exp(x): the forward's result
    ...         return ct * result
    >>> float(jax.grad(Exp())(1.0)) == float(np.exp(1.0)), calls
    (True, ['forward'])
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping

from .._errors import DeclarationError
from .cfunction import CFunction

KEYWORDS = ("saved", "result")
_DERIVATIVES = ("jvp", "vjp")


@dataclasses.dataclass(frozen=True)
class Keeps:
    """What an op's rules take besides their operands, collected at class creation."""

    method: str | None  # the @jd.residuals method's name (None: the rules take result only)
    takes: Mapping  # rule kind ("forward", "jvp", "vjp") -> the keywords it takes
    result: bool  # jvp/vjp equations carry the forward's outputs
    saved: bool  # the op keeps residuals: jvp/vjp equations carry them


def takes_of(rule) -> frozenset:
    """The keyword-only parameters among `saved`/`result` that a rule accepts."""
    function = rule.function
    if isinstance(function, CFunction):
        return function.takes
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(name for name in KEYWORDS if name in parameters
                     and parameters[name].kind is inspect.Parameter.KEYWORD_ONLY)


def _fix(kind: str) -> str:
    return {"forward": "`def apply(self, ..., *, saved=None)`",
            "jvp": "`def push(self, ..., *, saved)`",
            "vjp": "`def pull(self, ..., *, saved)`"}[kind]


def declare(name: str, rules: dict, transposes_wrt: dict, params: tuple, linear: bool,
            input_names: Callable, partly_linear: bool = False) -> Keeps | None:
    """Validates residuals and ``saved=``/``result=`` parameters; None when nothing uses them.

    Raises DeclarationError naming the class and the rule. `input_names` reads
    a rule's inputs as :mod:`jaxdecl._declare` does. A `linear` (or multilinear)
    op keeps nothing; a partly linear one keeps what its @jvp/@vjp read, but
    its transpose takes nothing from the forward.
    """
    method = rules.get("residuals")
    takes = {kind: takes_of(rules[kind]) for kind in ("forward",) + _DERIVATIVES
             if kind in rules}
    for rule in [rules[k] for k in ("transpose", "adjoint") if k in rules and partly_linear]:
        asked = takes_of(rule)
        if asked:
            raise DeclarationError(
                f"{name}.{rule.name} (@{rule.kind}) takes {' and '.join(sorted(asked))}, but "
                f"the transpose of a partly linear op reads only the other inputs and the "
                f"cotangents (it transposes the forward applied to a tangent, which keeps "
                f"nothing): remove the parameter")
    if linear:
        if method is not None:
            raise DeclarationError(
                f"{name}.{method.name} (@residuals): {name} is linear (or multilinear), so its "
                f"derivatives are the op itself and its transpose, which need nothing the "
                f"forward could keep; remove @jd.residuals")
        for rule in [r for k, r in rules.items() if k in ("forward", "transpose", "adjoint")] \
                + list(transposes_wrt.values()):
            asked = takes_of(rule)
            if asked:
                raise DeclarationError(
                    f"{name}.{rule.name} (@{rule.kind}) takes {' and '.join(sorted(asked))}, "
                    f"but {name} is linear (or multilinear): its transpose needs nothing from "
                    f"the forward; remove the parameter")
        return None
    for kind, asked in takes.items():
        rule = rules[kind]
        if kind == "forward" and "result" in asked:  # pragma: no cover - input_names refuses it
            raise DeclarationError(f"{name}.{rule.name} (@forward) cannot take `result`")
        if "saved" in asked and method is None:
            raise DeclarationError(
                f"{name}.{rule.name} (@{kind}) takes `saved`, but {name} has no @jd.residuals "
                f"method declaring what the forward keeps; add one, e.g. `@jd.residuals def "
                f"keeps(self, {', '.join(params)}): return {{'name': "
                f"jax.ShapeDtypeStruct(shape, dtype)}}`")
    if method is not None:
        method_params = input_names(name, method)
        if method_params != params:
            raise DeclarationError(
                f"{name}.{method.name} (@residuals) takes inputs {method_params}, but the op's "
                f"inputs are {params}; they must match")
        forward = rules["forward"]
        if "saved" not in takes["forward"]:
            raise DeclarationError(
                f"{name} declares residuals ({name}.{method.name}), but {name}.{forward.name} "
                f"(@forward) does not accept `saved`: add the keyword-only parameter, "
                f"{_fix('forward')}, and fill saved[...] when it is not None")
        if not any("saved" in takes.get(kind, ()) for kind in _DERIVATIVES):
            raise DeclarationError(
                f"{name} declares residuals ({name}.{method.name}), but no @jvp or @vjp takes "
                f"`saved`: add it to the rule that uses them, e.g. {_fix('vjp')}, or remove "
                f"@jd.residuals")
    result = any("result" in takes.get(kind, ()) for kind in _DERIVATIVES)
    if method is None and not result:
        return None
    return Keeps(None if method is None else method.name, takes, result, method is not None)
