"""Host kernels: the Python callables that the C++ dispatcher runs inside XLA.

A host kernel receives ``(inputs, outputs, eager)``: two tuples of NumPy
views of XLA's buffers, and whether an eager caller waits for this call (and
can take the rule's exception back). It calls one user rule and returns None,
or an error message that the dispatcher hands back to XLA. :func:`make_kernel`
builds one per rule and compiled shape, with what the rule needs around it:
the checks and copies of the return form, the loop of ``batch="loop"``, and
the failures (see :mod:`jaxdecl._failures`) and escaped views that it reports
as errors naming the rule. :func:`jaxdecl._runtime.register` registers it.

The per-call path is deliberately plain: a zero-copy rule is one Python call
inside a ``try``; the return form adds one shape/dtype comparison and one copy
per output.

Example:
    >>> import numpy as np
    >>> from jaxdecl._kernels import make_kernel
    >>> from jaxdecl._layout import RuleIO
    >>> io = RuleIO(in_names=("x",), out_names=("out",), out_avals=(), single_result=True,
    ...             real_results=(False,))
    >>> kernel, on_escape = make_kernel(lambda x: 2 * x, zero_copy=False, io=io,
    ...                                 context="Double.apply (@forward)")
    >>> out = np.zeros(3)
    >>> kernel((np.arange(3.0),), (out,), False), out.tolist()
    (None, [0.0, 2.0, 4.0])
    >>> message = kernel((np.arange(3.0),), (np.zeros(2),), False)  # goes back to XLA
    >>> print(message.splitlines()[0].split(" raised ")[1])
    RuleError: Double.apply (@forward) returned shape (3,) for out, but @abstract declared (2,)
"""

from __future__ import annotations

import itertools
import types
import weakref

import numpy as np

from . import _dispatch, _errors, _failures
from ._cfunction import CFunction
from ._errors import BufferEscapeError, RuleError
from ._layout import RuleIO


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
                    f"@abstract declared {out.dtype}"
                )
        np.copyto(out, value, casting="no")


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


def _streams(x, count: int, nb: int, batched: bool):
    """Per-element views of `x` along its `nb` flattened batch dims (or `x` repeated)."""
    element_shape = x.shape[nb:]
    if not batched:
        return itertools.repeat(x.reshape(element_shape), count)
    flat = x.reshape((count,) + element_shape)
    if element_shape:
        return flat  # iterating yields views: NumPy's cheapest way to make them
    # Iterating a 1-d array yields scalars; indexing with an Ellipsis keeps a 0-d view.
    return map(flat.__getitem__, zip(range(count), itertools.repeat(Ellipsis)))


def _rows(batch_shape: tuple, in_shapes) -> list[bool] | None:
    """Per operand, whether it has every batch dim (else it has none: all 1); None if mixed.

    Then the batch flattens into rows: an operand advances one row per call
    or stays put.
    """
    nb = len(batch_shape)
    full = [tuple(shape[:nb]) == tuple(batch_shape) for shape in in_shapes]
    none = [all(n == 1 for n in shape[:nb]) and not f for shape, f in zip(in_shapes, full)]
    return full if all(f or n for f, n in zip(full, none)) else None


def _loop(element, zero_copy_single: bool, batch_shape: tuple, in_shapes, context: str):
    """Runs a rule once per batch element on views (``batch="loop"``).

    Fast path: when every operand is either batched in all batch dimensions or
    in none, the batch dimensions are flattened into one (a reshape of a
    contiguous view) and the operands are streamed along it. Otherwise each
    element's operand index is computed as it is needed. Nothing is kept per
    element between calls. The returned ``run(fn, ins, outs)`` calls the rule
    `fn`, bound once per call.
    """
    nb = len(batch_shape)
    count = int(np.prod(batch_shape))
    full = _rows(batch_shape, in_shapes)
    if full is not None:

        def streams(ins, outs):
            operands = [_streams(x, count, nb, f) for x, f in zip(ins, full)]
            results = [_streams(o, count, nb, True) for o in outs]
            return operands, results

        # Unpacking a variable number of operands per element costs as much as
        # NumPy's own call here, so the common arities get their own loops.
        if zero_copy_single and len(in_shapes) == 1:
            def run(fn, ins, outs):
                (x1,), (out,) = streams(ins, outs)
                for a, o in zip(x1, out):
                    result = fn(a, out=o)
                    if result is not None:
                        raise _returned_value(context, result)
        elif zero_copy_single and len(in_shapes) == 2:
            def run(fn, ins, outs):
                (x1, x2), (out,) = streams(ins, outs)
                for a, b, o in zip(x1, x2, out):
                    result = fn(a, b, out=o)
                    if result is not None:
                        raise _returned_value(context, result)
        else:
            def run(fn, ins, outs):
                operands, results = streams(ins, outs)
                if not operands:  # zero inputs: zip(*operands) would be empty
                    for os in zip(*results):
                        element(fn, (), os)
                    return
                for xs, os in zip(zip(*operands), zip(*results)):
                    element(fn, xs, os)
        return run

    # Per operand and batch dim: does it broadcast there (size 1 in a wider batch)?
    broadcast = [tuple(shape[j] == 1 and batch_shape[j] != 1 for j in range(nb))
                 for shape in in_shapes]

    def run(fn, ins, outs):
        for index in itertools.product(*(range(n) for n in batch_shape)):
            operands = [x[tuple(0 if b else i for i, b in zip(index, flags)) + (Ellipsis,)]
                        for x, flags in zip(ins, broadcast)]
            element(fn, operands, [o[index + (Ellipsis,)] for o in outs])

    return run


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
                batch_shape: tuple = (), loop: bool = False, in_shapes: tuple = (),
                instance_ref=None):
    """Builds the host kernel for one rule at one set of shapes.

    Args:
      function: the rule; called as ``function(instance_ref(), *args)`` when
        `instance_ref` is given, else as ``function(*args)``.
      zero_copy: the rule fills a keyword-only ``out`` instead of returning.
      io: operand/result names and result avals (for messages and checks).
      context: ``Class.method (@kind)``, for messages.
      batch_shape: leading batch dimensions of every operand and result.
      loop: call the rule once per batch element (``batch="loop"``); otherwise
        the rule sees the whole batch (``batch="vectorized"``, or no batch).
      in_shapes: operand shapes (with batch dims), to index broadcast operands.
      instance_ref: a weak reference to the op instance, or None.

    Returns:
      ``(kernel, on_escape)`` for :func:`register`.
    """
    stash = _errors.stash
    single = io.single_result
    method, ref = function, instance_ref
    is_c = isinstance(method, CFunction)

    # `element(fn, ins, outs)` calls the rule `fn` once; the kernel binds `fn`
    # to the op instance once per call, so no wrapper frame runs per element.
    if is_c:
        # Looped C kernels fail as the direct ones do: with the kernel's message
        # as the op's error (a JaxRuntimeError), not as a Python exception.
        address = method.address

        def element(fn, ins, outs):
            error = _dispatch.call_c_kernel(address, tuple(ins), tuple(outs))
            if error is not None:
                raise _KernelFailure(f"{context}: {error}")
    elif zero_copy:
        if single:
            def element(fn, ins, outs):
                result = fn(*ins, out=outs[0])
                if result is not None:
                    raise _returned_value(context, result)
        else:
            def element(fn, ins, outs):
                result = fn(*ins, out=tuple(outs))
                if result is not None:
                    raise _returned_value(context, result)
    else:
        batch_rank = 0 if loop else len(batch_shape)

        def element(fn, ins, outs):
            _store(fn(*ins), outs, io, context, batch_rank)

    if loop and batch_shape:
        run = _loop(element, zero_copy and single and not is_c, batch_shape, in_shapes,
                    context)
    else:
        run = element

    def fail(exc: BaseException, ins, outs, eager) -> str:
        if isinstance(exc, _KernelFailure):
            return str(exc)
        _failures.explain_read_only(exc, context, io, zero_copy)
        # The reported traceback starts at the rule, not at jaxdecl's wrappers.
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None and \
                tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        exc.__traceback__ = tb
        _failures.detach_views(exc, ins + outs)
        return stash(_failures.explain(exc, context), context, keep=eager)

    # The direct form: the dispatcher calls the rule itself
    # (``kernel.direct``: ``method([instance,] *ins, out=out)``), once, or once
    # per row of a looped batch (``kernel.rows``, see csrc/rows.h), and hands
    # failures to ``kernel.on_failure``. `kernel` below is the same call in
    # Python, for the dispatcher's other paths.
    direct_form = zero_copy and single and not is_c
    hot = run is element and direct_form
    rows = _rows(batch_shape, in_shapes) if direct_form and run is not element else None

    def on_failure(exc, returned, ins, outs, eager):
        if exc is None:
            exc = _returned_value(context, returned)
        return fail(exc, ins, outs, eager)

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
                run(method, ins, outs)
            except BaseException as exc:  # noqa: BLE001 - every error goes back to XLA
                return fail(exc, ins, outs, eager)
            return None
    else:
        def kernel(ins, outs, eager):
            try:
                run(method.__get__(ref()), ins, outs)
            except BaseException as exc:  # noqa: BLE001 - every error goes back to XLA
                return fail(exc, ins, outs, eager)
            return None

    if hot or rows is not None:
        kernel.direct, kernel.on_failure = method, on_failure
    if rows is not None:
        kernel.rows = (len(batch_shape), int(np.prod(batch_shape)), rows)

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
        return stash(error, context, keep=eager)

    return kernel, on_escape


class _KernelFailure(Exception):
    """A C kernel's failure inside a looped call: its message is the op's error."""
