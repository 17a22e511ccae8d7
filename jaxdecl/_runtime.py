"""Host kernels: the Python callables the C++ dispatcher runs inside XLA.

A host kernel receives ``(inputs, outputs)``, two tuples of NumPy views of
XLA's buffers, calls one user rule and returns None, or an error message that
the dispatcher hands back to XLA. Kernels are built once per compiled shape
and registered under an integer key (``jaxdecl._dispatch.register_kernel``);
the key, not an object address, is what the HLO carries.

The per-call path is deliberately plain: a zero-copy rule is one Python call
inside a ``try``; the return form adds one shape/dtype comparison and one copy
per output.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np

from . import _compat, _dispatch, _dtypes, _errors
from ._errors import BufferEscapeError, RuleError
from ._layout import RuleIO

_DISPATCHER_READY = False


def _setup_dispatcher() -> None:
    """Teaches the dispatcher NumPy's dtypes and registers the FFI target, once."""
    global _DISPATCHER_READY
    if _DISPATCHER_READY:
        return
    for name, code in _dispatch.element_types().items():
        _dispatch.set_dtype(code, _dtypes.numpy_dtype(name))
    _dispatch.set_worker_hooks(_compat.forbid_host_transfers, _compat.restore_host_transfers)
    for target, capsule in _dispatch.registrations().items():
        jax.ffi.register_ffi_target(target, capsule, platform="cpu")
    _DISPATCHER_READY = True


TARGET = "jaxdecl_dispatch"

_NESTED_JAX_HINT = (
    "it called JAX on one of XLA's worker threads (where the rule runs for large or "
    "multi-device calls); the nested computation would wait for the one running the rule, "
    "a deadlock. Write the rule with NumPy, or declare it traceable=True (jvp/vjp) so JAX "
    "inlines it, or call the JAX code outside the op"
)


def _explain(exc: BaseException, context: str) -> BaseException:
    if isinstance(exc, _compat.JaxRuntimeError) and "Disallowed host-to-device" in str(exc):
        explained = RuntimeError(f"{context}: {_NESTED_JAX_HINT}")
        explained.__cause__ = exc
        return explained
    return exc


def _store(results, outs, io: RuleIO, context: str, batch_rank: int = 0) -> None:
    """Validates a rule's return value against the declared outputs and copies it in.

    `batch_rank` leading dimensions are a vectorized batch: there a result may
    have size 1 (computed from unbatched inputs only) and is broadcast.
    """
    if io.single_result and not (isinstance(results, (tuple, list)) and len(results) == 1):
        results = (results,)
    elif not isinstance(results, (tuple, list)) or len(results) != len(outs):
        got = len(results) if isinstance(results, (tuple, list)) else 1
        raise RuleError(
            f"{context} returned {got} result(s), but {len(outs)} were expected "
            f"({', '.join(io.out_names)})"
        )
    for index, (value, out) in enumerate(zip(results, outs)):
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


def transpose_from_adjoint(function, zero_copy: bool, n_lead: int):
    """Turns an adjoint rule A^H into the transpose conj(A^H(conj(ct)))."""

    def transpose(*args, out=None):
        args = args[:n_lead] + tuple(np.conj(a) if np.iscomplexobj(a) else a
                                     for a in args[n_lead:])
        if zero_copy:
            function(*args, out=out)
            for o in (out if isinstance(out, tuple) else (out,)):
                if np.iscomplexobj(o):
                    np.conjugate(o, out=o)
            return None
        result = function(*args)
        if isinstance(result, (tuple, list)):
            return tuple(np.conj(r) for r in result)
        return np.conj(result)

    return transpose


def _loop(function, element, zero_copy_single: bool, batch_shape: tuple, in_shapes,
          out_element_shapes):
    """Runs a rule once per batch element on views (``batch="loop"``).

    Fast path: when every operand is either batched in all batch dimensions or
    in none, and no element is 0-d, the batch dimensions are flattened into
    one (a reshape of a contiguous view) and the operands are iterated along
    it, which is NumPy's cheapest way to produce views. Otherwise the index of
    every operand for every element is computed once, here.
    """
    nb = len(batch_shape)
    count = int(np.prod(batch_shape))
    full = [tuple(shape[:nb]) == tuple(batch_shape) for shape in in_shapes]
    none = [all(n == 1 for n in shape[:nb]) and not f for shape, f in zip(in_shapes, full)]
    if all(f or n for f, n in zip(full, none)) and \
            all(len(shape) > nb for shape in in_shapes) and \
            all(len(shape) > 0 for shape in out_element_shapes):

        def streams(ins, outs):
            operands = [x.reshape((count,) + x.shape[nb:]) if f else
                        itertools.repeat(x.reshape(x.shape[nb:]), count)
                        for x, f in zip(ins, full)]
            results = [o.reshape((count,) + o.shape[nb:]) for o in outs]
            return operands, results

        # Unpacking a variable number of operands per element costs as much as
        # NumPy's own call here, so the common arities get their own loops.
        if zero_copy_single and len(in_shapes) == 1:
            def run(ins, outs):
                (x1,), (out,) = streams(ins, outs)
                for a, o in zip(x1, out):
                    function(a, out=o)
        elif zero_copy_single and len(in_shapes) == 2:
            def run(ins, outs):
                (x1, x2), (out,) = streams(ins, outs)
                for a, b, o in zip(x1, x2, out):
                    function(a, b, out=o)
        elif zero_copy_single:
            def run(ins, outs):
                operands, (out,) = streams(ins, outs)
                for xs, o in zip(zip(*operands), out):
                    function(*xs, out=o)
        else:
            def run(ins, outs):
                operands, results = streams(ins, outs)
                for xs, os in zip(zip(*operands), zip(*results)):
                    element(xs, os)
        return run

    plan = []
    for index in itertools.product(*(range(n) for n in batch_shape)):
        operand_index = tuple(
            tuple(0 if shape[j] == 1 and batch_shape[j] != 1 else index[j]
                  for j in range(nb)) + (Ellipsis,)
            for shape in in_shapes)
        plan.append((operand_index, index + (Ellipsis,)))

    def run(ins, outs):
        for operand_index, result_index in plan:
            element([x[i] for x, i in zip(ins, operand_index)],
                    [o[result_index] for o in outs])

    return run


def make_kernel(function, *, zero_copy: bool, io: RuleIO, context: str,
                batch_shape: tuple = (), loop: bool = False, in_shapes: tuple = ()):
    """Builds the host kernel for one rule at one set of shapes.

    Args:
      function: the rule, bound to the op instance.
      zero_copy: the rule fills a keyword-only ``out`` instead of returning.
      io: operand/result names and result avals (for messages and checks).
      context: ``Class.method (@kind)``, for messages.
      batch_shape: leading batch dimensions of every operand and result.
      loop: call the rule once per batch element (``batch="loop"``); otherwise
        the rule sees the whole batch (``batch="vectorized"``, or no batch).
      in_shapes: operand shapes (with batch dims), to index broadcast operands.

    Returns:
      ``(kernel, on_escape)`` for ``_dispatch.register_kernel``.
    """
    stash = _errors.stash
    single = io.single_result

    if zero_copy:
        if single:
            def element(ins, outs):
                function(*ins, out=outs[0])
        else:
            def element(ins, outs):
                function(*ins, out=tuple(outs))
    else:
        batch_rank = 0 if loop else len(batch_shape)

        def element(ins, outs):
            _store(function(*ins), outs, io, context, batch_rank)

    if loop and batch_shape:
        run = _loop(function, element, zero_copy and single, batch_shape, in_shapes,
                    [shape for shape, _ in io.out_avals])
    else:
        run = element

    def fail(exc: BaseException) -> str:
        # The reported traceback starts at the rule, not at this wrapper.
        exc.__traceback__ = exc.__traceback__.tb_next
        return stash(_explain(exc, context), context)

    if run is element and zero_copy and single:
        # The hot path of an unbatched zero-copy rule: one Python frame of ours.
        def kernel(ins, outs):
            try:
                function(*ins, out=outs[0])
            except BaseException as exc:  # noqa: BLE001 - every error goes back to XLA
                return fail(exc)
            return None
    else:
        def kernel(ins, outs):
            try:
                run(ins, outs)
            except BaseException as exc:  # noqa: BLE001 - every error goes back to XLA
                return fail(exc)
            return None

    def on_escape(is_output: bool, index: int) -> str:
        names = io.out_names if is_output else io.in_names
        what = names[index] if index < len(names) else "its arguments tuple"
        error = BufferEscapeError(
            f"{context} kept a reference to {what} after returning. The array is a view of "
            f"XLA's buffer, which XLA frees or reuses after the call; copy what you keep "
            f"(np.array(x))."
        )
        return stash(error, context)

    return kernel, on_escape


def register(kernel, on_escape) -> int:
    """Keeps `kernel` for the process's lifetime; returns its dispatcher key."""
    _setup_dispatcher()
    return _dispatch.register_kernel(kernel, on_escape)


def register_c(function) -> int:
    """Registers a :class:`~jaxdecl.CFunction`; XLA calls it without the GIL."""
    _setup_dispatcher()
    return function.register()
