"""Error types, and the hand-over of exceptions raised inside rules.

A rule runs inside XLA, which only carries an error *message* back to JAX. So
that an eager caller still gets the rule's own exception (same type, same
message), the host kernel keeps the exception here under a number that it
writes into the message; the eager call path finds the number in JAX's
runtime error and re-raises the original. Under a user's ``jax.jit`` the
runtime error itself carries the type, message and traceback.
"""

from __future__ import annotations

import collections
import re
import threading
import traceback

__all__ = ["DeclarationError", "RuleError", "BufferEscapeError", "MissingRuleError"]


class DeclarationError(TypeError):
    """A jaxdecl class is declared wrongly (raised when the class is created)."""


class MissingRuleError(NotImplementedError):
    """A transformation needs a rule the class does not declare."""


class RuleError(ValueError):
    """A rule returned something that does not match what was declared."""


class BufferEscapeError(RuntimeError):
    """A rule kept a reference to an XLA buffer view after it returned."""


_MARK = "[jaxdecl error #{}]"
_MARK_RE = re.compile(r"\[jaxdecl error #(\d+)\]")
# Exceptions raised under a user's jit are never collected by an eager caller;
# keep only the most recent ones.
_KEEP = 256
_pending: collections.OrderedDict[int, BaseException] = collections.OrderedDict()
_lock = threading.Lock()
_counter = 0


def stash(exc: BaseException, context: str) -> str:
    """Keeps `exc` for an eager caller; returns the message XLA should carry.

    The traceback is kept as text only (a note on the exception and part of
    the message): its frames hold the rule's locals, among them views of XLA
    buffers that are freed after the call, and each frame holds its caller.
    """
    global _counter
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    _drop_tracebacks(exc)
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(f"Raised inside {context}, called by XLA:\n{tb}")
    with _lock:
        _counter += 1
        number = _counter
        _pending[number] = exc
        while len(_pending) > _KEEP:
            _pending.popitem(last=False)
    kind = type(exc).__qualname__
    return f"{context} raised {kind}: {exc} {_MARK.format(number)}\n{tb}"


def _drop_tracebacks(exc: BaseException) -> None:
    """Clears the traceback of `exc` and of every exception chained to it."""
    pending, seen = [exc], set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = None
        pending += [current.__cause__, current.__context__]


def reraise_original(error: BaseException) -> None:
    """Re-raises the rule's exception that `error` (JAX's runtime error) carries, if any."""
    match = _MARK_RE.search(str(error))
    if match is None:
        return
    with _lock:
        original = _pending.pop(int(match.group(1)), None)
    if original is not None:
        raise original from None
