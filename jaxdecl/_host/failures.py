"""A failing rule: errors that say what went wrong, and no views carried out of the call.

A rule's exception leaves the call that XLA made, and may outlive the buffers
the rule saw: :func:`detach_views` replaces the views it carries by copies.
:func:`explain` and :func:`explain_read_only` turn JAX's and NumPy's messages
for two common mistakes (calling JAX inside a rule, writing into an input)
into ones that name the rule and the fix.

Example:
    >>> import numpy as np
    >>> from jaxdecl._host.failures import detach_views
    >>> buffer = np.zeros(3)  # stands for a view of XLA's buffer
    >>> error = ArithmeticError("not converged", buffer[1:])
    >>> detach_views(error, (buffer,))
    >>> np.shares_memory(error.args[1], buffer), error.args[1].tolist()
    (False, [0.0, 0.0])
"""

from __future__ import annotations

import numpy as np

from .. import _compat, _errors
from .._spec.rule_io import RuleIO

_NESTED_JAX_HINT = (
    "it called JAX on one of XLA's worker threads (where the rule runs for large or "
    "multi-device calls); the nested computation would wait for the one running the rule, "
    "a deadlock. Write the rule with NumPy, or declare it traceable=True (jvp/vjp) so JAX "
    "inlines it, or call the JAX code outside the op"
)


def explain(exc: BaseException, context: str) -> BaseException:
    """`exc`, or an error that names its cause where JAX's own message would not.

    A rule that calls JAX on one of XLA's worker threads fails with a host
    transfer that jaxdecl disallows there; the error says why and what to do.
    """
    if isinstance(exc, _compat.JaxRuntimeError) and "Disallowed host-to-device" in str(exc):
        explained = RuntimeError(f"{context}: {_NESTED_JAX_HINT}")
        explained.__cause__ = exc
        return explained
    return exc


_READ_ONLY = ("output array is read-only", "assignment destination is read-only",
              "array is read-only")
_INPUTS_ARE_VIEWS = "read-only views of XLA's buffers"


def explain_read_only(exc: BaseException, context: str, io: RuleIO, zero_copy: bool) -> None:
    """Says, in NumPy's own error, that a rule's inputs are read-only views and how to copy.

    NumPy reports a write into an input as "output array is read-only". The
    exception keeps its type and identity (an eager caller gets it as itself);
    only its message grows.
    """
    if not isinstance(exc, ValueError) or len(exc.args) != 1 or \
            not isinstance(exc.args[0], str):
        return
    message = exc.args[0]
    if not message.endswith(_READ_ONLY) or _INPUTS_ARE_VIEWS in message:
        return
    names = [n for n in io.in_names if "[" not in n] or list(io.in_names)
    first = names[0] if names and names[0].isidentifier() else "x"
    instead = ", or write the result into `out`" if zero_copy else \
        ", or compute a new array and return it"
    exc.args = (
        f"{message}: the inputs of {context} ({', '.join(io.in_names)}) are "
        f"{_INPUTS_ARE_VIEWS}, shared with JAX, and cannot be written. Copy an input "
        f"before changing it (`{first} = np.array({first})`){instead}",)


def detach_views(exc: BaseException, views: tuple) -> None:
    """Replaces arrays on `views` that the exception (or its chain) carries by copies.

    A rule that raises ``NotConverged(residual=out)`` hands the caller an
    exception that outlives XLA's buffers; a copy is what the caller can use.
    Arguments, attributes, and lists/tuples/dicts among them are searched.

    Written without closures and with no reference to `views` left behind: the
    escape check that follows counts references to the views, and a reference
    cycle here (a recursive inner function holds its own cell) would keep them
    until a garbage collection that another thread may be running.
    """
    detacher = _Detacher(views)
    try:
        for current in _errors.chain_of(exc):
            try:
                current.args = tuple(detacher.detach(a, 0) for a in current.args)
                for name, value in list(vars(current).items()):
                    detached = detacher.detach(value, 0)
                    if detached is not value:
                        setattr(current, name, detached)
            except Exception:  # noqa: BLE001, S110 - an exotic exception keeps its state;
                pass           # the escape check still catches what remains
    finally:
        detacher.views = detacher.copies = None


class _Detacher:
    """Copies arrays that share memory with `views`, each once (see detach_views)."""

    __slots__ = ("views", "roots", "copies")

    def __init__(self, views: tuple):
        self.views = views
        self.roots = {id(v) for v in views}
        self.copies: dict = {}  # id -> copy: one per array, however many places carry it

    def _on_buffer(self, value) -> bool:
        base = value
        while isinstance(base, np.ndarray):
            if id(base) in self.roots:
                return True
            base = base.base
        return any(np.may_share_memory(value, v) for v in self.views)

    def detach(self, value, depth: int):
        if isinstance(value, np.ndarray):
            if id(value) not in self.copies:
                self.copies[id(value)] = np.array(value) if self._on_buffer(value) else value
            return self.copies[id(value)]
        if depth > 4:
            return value
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            detached = [self.detach(v, depth + 1) for v in value]
            if any(a is not b for a, b in zip(detached, value)):
                return type(value)(detached)
            return value
        if type(value) is dict:
            detached = {k: self.detach(v, depth + 1) for k, v in value.items()}
            if any(detached[k] is not value[k] for k in value):
                return detached
            return value
        return value
