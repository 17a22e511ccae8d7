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
import itertools
import re
import secrets
import threading
import traceback

__all__ = ["DeclarationError", "RuleError", "BufferEscapeError", "MissingRuleError",
           "ExportError"]


class DeclarationError(TypeError):
    """A jaxdecl class is declared wrongly.

    Raised when the class is created (a missing rule, a signature that does
    not fit the inputs, conflicting options), or, for the parts of a rule's
    signature that depend on the inputs' dtypes (how many tangents a ``@jvp``
    takes), when the rule is first traced. The message names the class, the
    method and the fix.

    Example:
        >>> import jax, jaxdecl as jd
        >>> try:
        ...     class Half(jd.Primitive):
        ...         @jd.forward
        ...         def apply(self, x):
        ...             return x / 2
        ... except jd.DeclarationError as error:
        ...     print(error)
        Half has no @jd.abstract method; every primitive needs `@jd.abstract def
        shapes(self, ...)` returning jax.ShapeDtypeStruct(s)
    """


class MissingRuleError(NotImplementedError):
    """A transformation needs a rule the class does not declare.

    Raised while tracing, before any rule runs, naming the decorator to add.

    Example:
        >>> import jax, jaxdecl as jd
        >>> class Square(jd.Primitive):
        ...     @jd.abstract
        ...     def shapes(self, x):
        ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
        ...     @jd.forward
        ...     def apply(self, x):
        ...         return x * x
        >>> try:
        ...     jax.grad(Square())(3.0)
        ... except jd.MissingRuleError as error:
        ...     print(str(error).split(":")[0])
        Square has no @vjp
    """


class RuleError(ValueError):
    """A rule returned something that does not match what was declared.

    A shape, dtype, count or pytree structure that differs from ``@abstract``
    (or from the inputs, for a cotangent), or a zero-copy rule that returned a
    value. Under ``jax.jit`` it reaches the caller inside JAX's runtime error.

    Example:
        >>> import jax, jax.numpy as jnp, jaxdecl as jd
        >>> class Short(jd.Primitive):
        ...     @jd.abstract
        ...     def shapes(self, x):
        ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
        ...     @jd.forward
        ...     def apply(self, x):
        ...         return x[1:]
        >>> try:
        ...     Short()(jnp.ones(3))
        ... except jd.RuleError as error:
        ...     print(error)
        Short.apply (@forward) returned shape (2,) for output, but @abstract declared (3,)
    """


class BufferEscapeError(RuntimeError):
    """A rule kept a reference to an XLA buffer view after it returned.

    Inputs and ``out`` are views of XLA's buffers, which XLA frees or reuses
    after the call: a rule must copy what it keeps (``np.array(x)``).

    Example:
        >>> import jax, jax.numpy as jnp, jaxdecl as jd
        >>> kept = []
        >>> class Leaky(jd.Primitive):
        ...     @jd.abstract
        ...     def shapes(self, x):
        ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
        ...     @jd.forward
        ...     def apply(self, x):
        ...         kept.append(x)  # a view of XLA's buffer: must be a copy
        ...         return x + 1
        >>> try:
        ...     Leaky()(jnp.ones(2))
        ... except jd.BufferEscapeError as error:
        ...     print(str(error).split(" after")[0])
        Leaky.apply (@forward) kept a reference to x
    """


class ExportError(TypeError):
    """A program with this op cannot be saved, or a saved one cannot run here.

    Raised by ``jax.export`` (through jaxdecl's lowering) for an op whose class
    another process cannot find (defined inside a function, or in a script's
    ``__main__``) or whose configuration has no saved form, naming the op, the
    attribute and the fix. Loading a program whose ops' modules this process
    has not imported, or one saved by an incompatible jaxdecl, fails with a
    message naming the class and module, or both versions.

    Example:
        >>> import jax, jax.export, jax.numpy as jnp, jaxdecl as jd
        >>> class Holder(jd.Primitive):
        ...     def __init__(self):
        ...         self.lock = object()  # no saved form
        ...     @jd.abstract
        ...     def shapes(self, x):
        ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
        ...     @jd.forward
        ...     def apply(self, x):
        ...         return x
        >>> try:
        ...     jax.export.export(jax.jit(Holder()), disabled_checks=jd.disabled_checks())(
        ...         jnp.ones(2))
        ... except jd.ExportError as error:
        ...     print(str(error).split(", which")[0])
        jaxdecl cannot save Holder in an exported program: Holder.lock (attribute) holds a object
    """


class PlatformError(NotImplementedError):
    """A program calling a jaxdecl op is lowered for a platform jaxdecl cannot run on.

    jaxdecl's handlers exist for CPUs and CUDA GPUs; lowering for another
    platform (ROCm, TPU, ...) fails here, naming the op and the platform,
    rather than in XLA. Catch it as ``NotImplementedError``.
    """

    def __init__(self, what: str, platforms):
        self.what = what
        self.platforms = tuple(platforms)
        listed = ", ".join(repr(p) for p in self.platforms)
        super().__init__(
            f"{what} cannot run on {listed}: jaxdecl runs its ops on CPUs and CUDA GPUs "
            f"(platforms 'cpu' and 'cuda'). Run the program there (e.g. inside "
            f"`with jax.default_device(jax.devices('cpu')[0]):`), or export it for "
            f"platforms=['cpu', 'cuda']")

    def naming(self, what: str) -> PlatformError:
        """The same error about `what` (an eager call learns its op's name later)."""
        return PlatformError(what, self.platforms)


#: The platforms whose runtimes run jaxdecl's ops (its FFI handlers are registered there).
PLATFORMS = ("cpu", "cuda")


def refuse_other_platforms(platforms, what: str) -> None:
    """Raises :class:`PlatformError` when `platforms` (a lowering's) name one jaxdecl
    cannot run on."""
    others = [p for p in platforms if p not in PLATFORMS]
    if others:
        raise PlatformError(what, others)

# The mark carries a per-process nonce so that text a rule happens to print
# cannot pose as one, and it goes last in the message so that an inner op's
# error quoted inside an outer rule's message never wins.
_NONCE = secrets.token_hex(6)
_MARK = "[jaxdecl error #{}:" + _NONCE + "]"
_MARK_RE = re.compile(r"\[jaxdecl error #(\d+):" + _NONCE + r"\]")
# Exceptions raised under a user's jit are never collected by an eager caller;
# keep only the most recent ones.
_KEEP = 256
_pending: collections.OrderedDict[int, BaseException] = collections.OrderedDict()
_lock = threading.Lock()
_counter = itertools.count(1)


def describe(exc: BaseException) -> str:
    """``str(exc)``, or a placeholder when the exception's ``__str__`` itself fails."""
    try:
        return str(exc)
    except BaseException:  # noqa: BLE001 - a broken __str__ must not hide the error
        return f"<{type(exc).__qualname__} whose str() raised>"


def _format(exc: BaseException) -> str:
    try:
        return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except BaseException:  # noqa: BLE001
        return f"{type(exc).__qualname__}: {describe(exc)}\n"


def stash(exc: BaseException, context: str, keep: bool = True) -> str:
    """Keeps `exc` for an eager caller; returns the message XLA should carry.

    The traceback is kept as text only (a note on the exception and part of
    the message): its frames hold the rule's locals, among them views of XLA
    buffers that are freed after the call, and each frame holds its caller.
    With `keep` False (a compiled executable's call, which no eager caller
    collects) only the message is made.
    """
    tb = _format(exc)
    _drop_tracebacks(exc)
    message = xla_safe(f"{context} raised {type(exc).__qualname__}: {describe(exc)}\n{tb}")
    if not keep:
        return message
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(f"Raised inside {context}, called by XLA:\n{tb}")
    number = next(_counter)
    with _lock:
        _pending[number] = exc
        while len(_pending) > _KEEP:
            _pending.popitem(last=False)
    return message + _MARK.format(number)


def xla_safe(message: str) -> str:
    """`message` as XLA can carry it: valid UTF-8 (lone surrogates escaped), no NUL.

    XLA's error API takes C strings; a NUL would cut the message (and its mark).
    """
    return message.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")


def _drop_tracebacks(exc: BaseException) -> None:
    """Clears the traceback of `exc` and of every exception chained to it."""
    for current in chain_of(exc):
        current.__traceback__ = None


def chain_of(exc: BaseException) -> list:
    """`exc` and every exception reachable through __cause__/__context__ (no cycles)."""
    pending, seen, found = [exc], set(), []
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        found.append(current)
        pending += [current.__cause__, current.__context__]
    return found


def take_original(error: BaseException) -> BaseException | None:
    """The rule's exception that `error` (JAX's runtime error) carries, if still kept."""
    return forget(describe(error))


def forget(message: str | None) -> BaseException | None:
    """Removes (and returns) the exception that `message` marks, if still kept.

    The last mark is the outermost rule's: marks of inner ops can only appear
    before it, inside its message or traceback.
    """
    marks = _MARK_RE.findall(message) if message else ()
    if not marks:
        return None
    with _lock:
        return _pending.pop(int(marks[-1]), None)


def missing_rule(spec, rule: str) -> MissingRuleError:
    """The error for a transformation whose rule (``"jvp"`` or ``"vjp"``) the class lacks."""
    params = ", ".join(spec.params)
    if rule == "jvp":
        tangents = ", ".join("d" + p for p in spec.params)
        return MissingRuleError(
            f"{spec.name} has no @jvp: forward-mode differentiation (jax.jvp, jacfwd, "
            f"evaluating a linearized function) needs one; add "
            f"`@jd.jvp def push(self, {params}, {tangents})`"
        )
    return MissingRuleError(
        f"{spec.name} has no @vjp: reverse-mode differentiation (grad, vjp, jacrev, "
        f"linear_transpose) needs one; add `@jd.vjp def pull(self, {params}, ct)`, or make "
        f"the @jvp traceable (`@jd.jvp(traceable=True)`) so JAX can transpose it"
    )
