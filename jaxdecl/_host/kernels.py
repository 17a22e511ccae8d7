"""Host kernels: the Python callables that the C++ dispatcher runs inside XLA.

A host kernel receives ``(inputs, outputs, eager)``: two tuples of NumPy
views of XLA's buffers, and whether an eager caller waits for this call (and
can take the rule's exception back). It calls one user rule and returns None,
or an error message that the dispatcher hands back to XLA. :func:`make_kernel`
builds one per rule and compiled shape, with what the rule needs around it:
the checks and copies of the return form, and the failures (see
:mod:`jaxdecl._host.failures`) and escaped views that it reports as errors naming
the rule. It returns a :class:`HostKernel`, the record that
:func:`jaxdecl._host.registry.register` hands to the dispatcher. Under
``batch="loop"`` the dispatcher runs the kernel once per row of the batch
(``HostKernel.rows``): a kernel only ever sees one element.

The per-call path is deliberately plain: a zero-copy rule is one Python call
inside a ``try`` (with one result, not even that: the dispatcher calls the
rule itself, ``HostKernel.direct``); the return form adds one shape/dtype
comparison and one copy per output.

Example:
    >>> import numpy as np
    >>> from jaxdecl._host.kernels import make_kernel
    >>> from jaxdecl._spec.rule_io import RuleIO
    >>> io = RuleIO(in_names=("x",), out_names=("out",), out_avals=(), single_result=True,
    ...             real_results=(False,))
    >>> host = make_kernel(lambda x: 2 * x, zero_copy=False, io=io,
    ...                    context="Double.apply (@forward)")
    >>> out = np.zeros(3)
    >>> host.call((np.arange(3.0),), (out,), False), out.tolist()
    (None, [0.0, 2.0, 4.0])
    >>> message = host.call((np.arange(3.0),), (np.zeros(2),), False)  # goes back to XLA
    >>> print(message.splitlines()[0].split(" raised ")[1])
    RuleError: Double.apply (@forward) returned shape (3,) for out, but @abstract declared (2,)
"""

from __future__ import annotations

import dataclasses
import types
import weakref
from collections.abc import Callable

import numpy as np

from .. import _errors
from .._errors import BufferEscapeError, RuleError
from .._spec.cfunction import CFunction
from .._spec.rule_io import RuleIO
from . import failures as _failures
from . import processes as _processes


@dataclasses.dataclass(frozen=True)
class HostKernel:
    """What the dispatcher needs of one host kernel (made by :func:`make_kernel`).

    Attributes:
      call: ``call(inputs, outputs, eager) -> None | message``: the rule on views.
      on_escape: ``on_escape(is_output, index, pending, eager) -> message``, when
        a view outlived the call.
      direct: a zero-copy rule with one result, which the dispatcher calls
        itself as ``direct([instance,] *inputs, out=output)``; else None.
      on_failure: with `direct`: ``on_failure(exc, returned, inputs, outputs,
        eager) -> message`` when it raised or returned something.
      rows: ``batch="loop"``'s batch dims: the dispatcher runs the kernel once
        per row, on views of one element; ``()``: once, on the whole call.
    """

    call: Callable
    on_escape: Callable
    direct: Callable | None = None
    on_failure: Callable | None = None
    rows: tuple = ()


def _store(results, outs, io: RuleIO, context: str, batch_rank: int = 0) -> None:
    """Validates a rule's return value against the declared outputs and copies it in.

    `batch_rank` leading dimensions are a vectorized batch: there a result may
    have size 1 (computed from unbatched inputs only) and is broadcast.
    """
    if io.single_result and type(results) is np.ndarray:
        # The common case, checked in three comparisons: inside an XLA loop this
        # runs once per iteration.
        out = outs[0]
        if results.shape == out.shape and results.dtype == out.dtype:
            np.copyto(out, results)
            return
    if io.single_result and not (isinstance(results, (tuple, list)) and len(results) == 1):
        results = (results,)
    elif not isinstance(results, (tuple, list)) or len(results) != len(outs):
        got = len(results) if isinstance(results, (tuple, list)) else 1
        raise RuleError(
            f"{context} returned {got} result(s), but {len(outs)} were expected "
            f"({', '.join(io.out_names)})"
        )
    for index, (value, out) in enumerate(zip(results, outs)):
        if value is None and io.zeros_ok:  # None: a zero cotangent
            out[...] = 0
            continue
        value = np.asarray(value)
        if value.shape != out.shape and not _broadcasts(value.shape, out.shape, batch_rank):
            batch = (f" (with batch dimensions {out.shape[:batch_rank]} in front)"
                     if batch_rank else "")
            raise RuleError(
                f"{context} returned shape {value.shape} for {io.out_names[index]}, but "
                f"@abstract declared {out.shape[batch_rank:]}{batch}"
            )
        if value.dtype != out.dtype:
            if io.real_results[index] and np.iscomplexobj(value) and \
                    value.real.dtype == out.dtype:
                value = value.real  # JAX's convention: a real input's cotangent is real
            else:
                raise RuleError(
                    f"{context} returned dtype {value.dtype} for {io.out_names[index]}, but "
                    f"@abstract declared {out.dtype}: {_dtype_fix(value.dtype, out.dtype)}"
                )
        np.copyto(out, value, casting="no")


#: A 64-bit result where @abstract declared its 32-bit kind: NumPy and SciPy computing in
#: double precision from the float32 arrays that JAX makes by default.
_WIDENED = {("float64", "float32"), ("complex128", "complex64"), ("int64", "int32"),
            ("uint64", "uint32")}


def _dtype_fix(got: np.dtype, declared: np.dtype) -> str:
    """The fix of a rule's result dtype that differs from @abstract's."""
    module = "np" if getattr(np, declared.name, None) is declared.type else "ml_dtypes"
    cast = f"cast it in the rule, `.astype({module}.{declared.name})`"
    if (got.name, declared.name) in _WIDENED:
        return (f"{cast} (JAX makes {declared.name} arrays unless 64-bit mode is on, while "
                f"NumPy and SciPy often compute in {got.name}), or, where @abstract "
                f"declares the inputs' dtype, turn 64-bit mode on "
                f"(`jax.config.update(\"jax_enable_x64\", True)`) and pass {got.name} inputs")
    return f"{cast}, or declare {got.name} in @abstract"


def _broadcasts(shape, target, batch_rank: int) -> bool:
    """Same element shape, and each batch dimension equal or 1."""
    return (len(shape) == len(target) and batch_rank > 0
            and shape[batch_rank:] == target[batch_rank:]
            and all(s in (1, t) for s, t in zip(shape[:batch_rank], target[:batch_rank])))


def transpose_from_adjoint(function, zero_copy: bool, n_lead: int,
                           takes_instance: bool = False):
    """Turns an adjoint rule A^H into the transpose conj(A^H(conj(ct))).

    `n_lead` leading operands (non-differentiable inputs) pass unchanged, after
    the instance when `takes_instance` (see :func:`weak_binding`).
    """
    lead = n_lead + (1 if takes_instance else 0)

    def transpose(*args, out=None):
        args = args[:lead] + tuple(np.conj(a) if np.iscomplexobj(a) else a
                                   for a in args[lead:])
        if zero_copy:
            result = function(*args, out=out)
            for o in (out if isinstance(out, tuple) else (out,)):
                if np.iscomplexobj(o):
                    np.conjugate(o, out=o)
            return result
        result = function(*args)
        if isinstance(result, (tuple, list)):
            return tuple(None if r is None else np.conj(r) for r in result)
        return None if result is None else np.conj(result)

    return transpose


def _returned_value(context: str, value) -> RuleError:
    return RuleError(
        f"{context} takes `out` (the zero-copy form), so it must fill `out` and return "
        f"None, but it returned a {type(value).__name__}. Write the result into out "
        f"(e.g. `out[...] = result`), or drop the `out` parameter to return results instead"
    )


def weak_binding(rule, instance):
    """``(function, instance_ref)`` for calling `rule` on `instance` from a kernel.

    With an instance_ref, the kernel calls ``function(instance_ref(), ...)``:
    it keeps the op alive only through whoever holds it strongly (see the
    module docstring). C kernels take no instance; an instance that cannot be
    weakly referenced (``__slots__`` without ``__weakref__``) is bound strongly.
    """
    function = rule.function
    if isinstance(function, CFunction):
        return function, None
    try:
        ref = weakref.ref(instance)
    except TypeError:
        return rule.bind(instance), None
    if not isinstance(function, types.FunctionType):  # another descriptor: bind per call
        def function(instance, *args, _descriptor=function, **kwargs):
            return _descriptor.__get__(instance, type(instance))(*args, **kwargs)
    return function, ref


def make_kernel(function, *, zero_copy: bool, io: RuleIO, context: str,
                batch_rank: int = 0, rows: tuple = (), instance_ref=None) -> HostKernel:
    """Builds the host kernel for one rule at one set of shapes.

    Args:
      function: the rule; called as ``function(instance_ref(), *args)`` when
        `instance_ref` is given, else as ``function(*args)``.
      zero_copy: the rule fills a keyword-only ``out`` instead of returning.
      io: operand/result names and result avals (for messages and checks).
      context: ``Class.method (@kind)``, for messages.
      batch_rank: leading dims of a vectorized batch (``batch="vectorized"``),
        where a returned result may have size 1 and broadcast.
      rows: ``batch="loop"``'s batch dims; the dispatcher calls the kernel once
        per row (see :class:`HostKernel`).
      instance_ref: a weak reference to the op instance, or None.

    Returns:
      The :class:`HostKernel` to register.
    """
    fail = _failure_report(context, io, zero_copy)
    direct = zero_copy and io.single_result
    call = _kernel_call(function, instance_ref, fail,
                        _element_call(zero_copy, io, context, batch_rank), direct, context)
    if not direct:
        return HostKernel(call, _escape_report(context, io), rows=tuple(rows))

    def on_failure(exc, returned, ins, outs, eager):
        if exc is None:
            exc = _returned_value(context, returned)
        return fail(exc, ins, outs, eager)

    return HostKernel(call, _escape_report(context, io), function, on_failure, tuple(rows))


def _element_call(zero_copy: bool, io: RuleIO, context: str, batch_rank: int):
    """``element(fn, ins, outs)``: one call of the bound rule `fn`, its results stored."""
    if zero_copy and io.single_result:
        def element(fn, ins, outs):
            result = fn(*ins, out=outs[0])
            if result is not None:
                raise _returned_value(context, result)
    elif zero_copy:
        def element(fn, ins, outs):
            result = fn(*ins, out=tuple(outs))
            if result is not None:
                raise _returned_value(context, result)
    else:
        def element(fn, ins, outs):
            _store(fn(*ins), outs, io, context, batch_rank)
    return element


def _kernel_call(method, ref, fail, element, hot: bool, context: str):
    """``kernel(ins, outs, eager)``: the rule bound to its instance, every error caught.

    The hot variants (a zero-copy rule with one result) inline the call: they
    run when the dispatcher cannot call the rule directly (more than its
    argument limit), and every frame counts there.
    """
    if hot and ref is None:
        def kernel(ins, outs, eager):
            try:
                result = method(*ins, out=outs[0])
                if result is not None:
                    raise _returned_value(context, result)
            except BaseException as exc:  # noqa: BLE001 - every error goes back to XLA
                return fail(exc, ins, outs, eager)
            return None
    elif hot:
        def kernel(ins, outs, eager):
            try:
                result = method(ref(), *ins, out=outs[0])
                if result is not None:
                    raise _returned_value(context, result)
            except BaseException as exc:  # noqa: BLE001 - every error goes back to XLA
                return fail(exc, ins, outs, eager)
            return None
    elif ref is None:
        def kernel(ins, outs, eager):
            try:
                element(method, ins, outs)
            except BaseException as exc:  # noqa: BLE001 - every error goes back to XLA
                return fail(exc, ins, outs, eager)
            return None
    else:
        def kernel(ins, outs, eager):
            try:
                element(method.__get__(ref()), ins, outs)
            except BaseException as exc:  # noqa: BLE001 - every error goes back to XLA
                return fail(exc, ins, outs, eager)
            return None
    return kernel


def _failure_report(context: str, io: RuleIO, zero_copy: bool):
    """``fail(exc, ins, outs, eager) -> message``: a rule's exception, made an XLA error.

    The exception keeps its type; views it carries are copied out (they die
    with the call); an eager caller gets it back by the message's key.
    """
    def fail(exc: BaseException, ins, outs, eager) -> str:
        _failures.explain_read_only(exc, context, io, zero_copy)
        # The reported traceback starts at the rule, not at jaxdecl's wrappers.
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None and \
                tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        exc.__traceback__ = tb
        _failures.detach_views(exc, ins + outs)
        error = _failures.explain(exc, context)
        _processes.report(f"{context} raised {type(error).__qualname__}: "
                          f"{_errors.describe(error)}", eager)
        return _errors.stash(error, context, keep=eager)

    return fail


def _escape_report(context: str, io: RuleIO):
    """``on_escape(is_output, index, pending, eager) -> message``: a view outlived its call."""
    def on_escape(is_output: bool, index: int, pending: str | None, eager: bool) -> str:
        names = io.out_names if is_output else io.in_names
        what = names[index] if index < len(names) else "its arguments tuple"
        # The rule's own exception (if any) may be what holds the view: it must
        # not reach the caller, so only its text goes into this error.
        original = _errors.forget(pending)
        carried = ""
        if original is not None:
            carried = (f" It raised {type(original).__qualname__}: "
                       f"{_errors.describe(original)}, and the exception carries the view "
                       f"(copy arrays you attach to an exception).")
        elif pending:
            carried = f" It also failed: {pending.splitlines()[0] if pending else ''}"
        error = BufferEscapeError(
            f"{context} kept a reference to {what} after returning. The array is a view of "
            f"XLA's buffer, which XLA frees or reuses after the call; copy what you keep "
            f"(np.array(x)).{carried}"
        )
        _processes.report(f"{context} raised BufferEscapeError: {error}", eager)
        return _errors.stash(error, context, keep=eager)

    return on_escape
