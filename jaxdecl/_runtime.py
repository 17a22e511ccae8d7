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

_DTYPES_READY = False


def _setup_dispatcher() -> None:
    """Teaches the dispatcher NumPy's dtypes and registers the FFI target, once."""
    global _DTYPES_READY
    if _DTYPES_READY:
        return
    for name, code in _dispatch.element_types().items():
        _dispatch.set_dtype(code, _dtypes.numpy_dtype(name))
    _dispatch.set_worker_hooks(_compat.forbid_host_transfers, _compat.restore_host_transfers)
    for target, capsule in _dispatch.registrations().items():
        jax.ffi.register_ffi_target(target, capsule, platform="cpu")
    _DTYPES_READY = True


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


def _store(results, outs, io: RuleIO, context: str) -> None:
    """Validates a rule's return value against the declared outputs and copies it in."""
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
        if value.shape != out.shape:
            raise RuleError(
                f"{context} returned shape {value.shape} for {io.out_names[index]}, but "
                f"@abstract declared {out.shape}"
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


def _conjugating(function, zero_copy: bool, n_lead: int):
    """Turns an adjoint rule A^H into the transpose conj(A^H(conj(ct)))."""

    def transpose_from_adjoint(*args, out=None):
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

    return transpose_from_adjoint


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
        def element(ins, outs):
            _store(function(*ins), outs, io, context)

    if loop and batch_shape:
        nb = len(batch_shape)
        # A size-1 batch dimension of an operand broadcasts against the batch.
        broadcast = [tuple(shape[j] == 1 and batch_shape[j] != 1 for j in range(nb))
                     for shape in in_shapes]
        indices = list(itertools.product(*(range(n) for n in batch_shape)))

        def run(ins, outs):
            for index in indices:
                element(
                    [x[tuple(0 if b else i for b, i in zip(bc, index)) + (Ellipsis,)]
                     for x, bc in zip(ins, broadcast)],
                    [o[index + (Ellipsis,)] for o in outs],
                )
    else:
        run = element

    def kernel(ins, outs):
        try:
            run(ins, outs)
        except BaseException as exc:  # noqa: BLE001 - every error goes back to XLA
            return stash(_explain(exc, context), context)
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
