"""Device rules: the rules a class declares with ``platform="gpu"``, checked at class creation.

A device rule is the GPU form of a host rule of the same kind: where a program runs on a
GPU, the CUDA handler calls it on XLA's device buffers (as device arrays) with XLA's
stream, instead of staging the host rule through host memory. So each device rule
needs its host rule (which serves the CPU, ``jd.check`` and every platform without a
device rule), takes the same arguments as that rule, and adds a keyword-only
``stream``. Device rules exist for the rules that run on buffers (``forward``,
``jvp``, ``vjp``, ``transpose``, ``transpose(wrt=...)``); everything the class
declares beside them (shapes, sharding, residuals, batching) is platform-blind.

Example:
    >>> import jax, numpy as np, jaxdecl as jd
    >>> class Twice(jd.Primitive):
    ...     @jd.abstract
    ...     def shapes(self, x):
    ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
    ...     @jd.forward
    ...     def apply(self, x, *, out):
    ...         np.multiply(x, 2, out=out)
    ...     @jd.forward(platform="gpu")
    ...     def apply_gpu(self, x, *, out, stream):
    ...         pass  # e.g. cupy.multiply(cupy.asarray(x), 2, out=cupy.asarray(out))
    >>> sorted(Twice.__jaxdecl_spec__.device_rules)
    ['forward']
"""

from __future__ import annotations

from .._errors import DeclarationError
from .cfunction import CFunction
from .signatures import parameters

#: The rules that have device forms, and the host rules that must come with them.
_HOST_KINDS = {"forward": ("forward",), "jvp": ("jvp",), "vjp": ("vjp",),
               "transpose": ("transpose", "adjoint")}
_KEYWORDS = ("saved", "result")  # what a device rule takes exactly as its host rule does


def _where(name: str, rule) -> str:
    wrt = f"wrt={rule.wrt!r}, " if rule.wrt is not None else ""
    return f"{name}.{rule.name} (@{rule.kind}({wrt}platform='gpu'))"


def declare(name: str, device: list, rules: dict, transposes_wrt: dict) -> tuple:
    """``(device rules by kind, device transposes by input)``; raises DeclarationError.

    `device` lists the rules marked ``platform="gpu"``; `rules` and `transposes_wrt`
    are the host rules, already checked.
    """
    by_kind, by_wrt = {}, {}
    for rule in device:
        where = _where(name, rule)
        if rule.kind == "adjoint":
            raise DeclarationError(
                f"{where}: jaxdecl derives a transpose from an adjoint by conjugating its "
                f"arrays, which it does on the host only; declare the device rule as "
                f"@jd.transpose(platform='gpu') instead, computing conj(A^H conj(ct)) itself")
        table, key = (by_wrt, rule.wrt) if rule.wrt is not None else (by_kind, rule.kind)
        if key in table:
            raise DeclarationError(
                f"{name}: two device rules for the same role, {table[key].name} and "
                f"{rule.name}; keep one")
        host = _host_rule(name, rule, rules, transposes_wrt)
        _check_signature(name, rule, host)
        table[key] = rule
    return by_kind, by_wrt


def _host_rule(name: str, rule, rules: dict, transposes_wrt: dict):
    """The host rule `rule` is the device form of."""
    where = _where(name, rule)
    if rule.wrt is not None:
        host = transposes_wrt.get(rule.wrt)
        wanted = f"@jd.transpose(wrt={rule.wrt!r})"
    else:
        host = next((rules[k] for k in _HOST_KINDS[rule.kind] if k in rules), None)
        wanted = f"@jd.{rule.kind}"
    if host is None:
        raise DeclarationError(
            f"{where} has no host rule: declare {wanted} too (without platform=). It serves "
            f"the CPU, jd.check and any platform without a device rule; the device rule "
            f"replaces it where the program runs on a GPU")
    if host.traceable:
        raise DeclarationError(
            f"{where}: {name}.{host.name} is traceable (JAX code, which runs on the GPU "
            f"already), so the device rule would never run; remove it")
    return host


def _keywords_of(rule, found) -> set:
    if isinstance(rule.function, CFunction):
        return set(rule.function.takes)
    return set(found.keyword_only if found is not None else ()) & set(_KEYWORDS)


def _check_signature(name: str, rule, host) -> None:
    """A device rule takes what its host rule takes, plus a keyword-only `stream`."""
    where = _where(name, rule)
    found = None if isinstance(rule.function, CFunction) else parameters(
        rule.function, any_callable=True)
    host_found = None if isinstance(host.function, CFunction) else parameters(
        host.function, any_callable=True)
    if found is not None:
        if "stream" in found.positional:
            raise DeclarationError(
                f"{where}: `stream` is a positional parameter; jaxdecl passes XLA's stream by "
                f"keyword: make it keyword-only (`def {rule.name}(self, ..., *, stream)`)")
        if "stream" not in found.keyword_only and not found.varkw:
            out = ", out" if rule.zero_copy else ""
            raise DeclarationError(
                f"{where} must take XLA's CUDA stream as the keyword-only parameter `stream` "
                f"(an int), and enqueue its work there: `def {rule.name}(self, ...,"
                f" *{out}, stream)`")
        unknown = [k for k in found.required_keywords
                   if k not in ("out", "stream", "wanted") + _KEYWORDS]
        if unknown:
            raise DeclarationError(
                f"{where}: keyword-only parameter(s) {unknown} have no default, but jaxdecl "
                f"passes only `out`, `stream`, `saved`, `result` and `wanted` by keyword")
        if host_found is not None and not (found.varargs or host_found.varargs) and \
                len(found.positional) != len(host_found.positional):
            raise DeclarationError(
                f"{where} takes ({', '.join(found.positional)}), but its host rule "
                f"{name}.{host.name} takes ({', '.join(host_found.positional)}): a device rule "
                f"takes the same arguments as its host rule, plus `stream`")
    _check_partial_inputs(name, rule, host)
    mine, theirs = _keywords_of(rule, found), _keywords_of(host, host_found)
    if mine != theirs:
        raise DeclarationError(
            f"{where} takes {sorted(mine) or 'no'} of `saved`/`result`, but its host rule "
            f"{name}.{host.name} takes {sorted(theirs) or 'none'}: both receive the same "
            f"operands, so they must ask for the same ones")
    if rule.kind == "forward" and "saved" in mine and not rule.zero_copy:
        raise DeclarationError(
            f"{where} takes `saved`, so it must fill `out` as well (the zero-copy form "
            f"`def {rule.name}(self, ..., *, out, saved=None, stream)`): on the device, "
            f"jaxdecl writes what a rule returns only into XLA's buffers")


def _check_partial_inputs(name: str, rule, host) -> None:
    """Zero tangents and wanted cotangents shape the equation both rules serve: a device
    rule sees part of the inputs exactly where its host rule does."""
    where = _where(name, rule)
    if rule.zeros != host.zeros:
        raise DeclarationError(
            f"{where} is declared with zeros={rule.zeros}, but its host rule "
            f"{name}.{host.name} with zeros={host.zeros}: both serve the same equations, "
            f"which pass None for a zero tangent only where the host rule takes it; declare "
            f"both with zeros={host.zeros}")
    if rule.wanted != host.wanted:
        have, lack = (rule, host) if rule.wanted else (host, rule)
        raise DeclarationError(
            f"{where}: {name}.{have.name} takes the keyword-only `wanted` but "
            f"{name}.{lack.name} does not; both serve the same equations, which return only "
            f"the wanted cotangents where the host rule takes `wanted`: give both rules the "
            f"keyword, or neither")
