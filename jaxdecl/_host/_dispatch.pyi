"""jaxdecl's XLA FFI dispatcher (CPU), built from csrc/ (module.cc is its Python face)."""

from collections.abc import Callable, Sequence
from typing import Any

#: ``(major, minor)``: the XLA FFI API version of the headers the dispatcher is built against.
FFI_API_VERSION: tuple[int, int]

def registrations() -> dict[str, Any]:
    """FFI targets to pass to jax.ffi.register_ffi_target on 'cpu': a PyCapsule, or a dict
    of PyCapsules by execution stage ('instantiate', 'execute')."""

def call_site_type() -> dict[str, Any]:
    """The FFI state type of compiled call sites ({'type_id': ..., 'type_info': ...})."""

def register_kernel(fingerprint_hi: int, fingerprint_lo: int, name: str,
                    call: Callable[[tuple, tuple, bool], str | None],
                    on_escape: Callable[[bool, int, str | None, bool], str],
                    instance_ref: Any, direct: Callable[..., None] | None = None,
                    on_failure: Callable[..., str] | None = None,
                    rows: Sequence[int] = ()) -> int:
    """Registers a host kernel until release_kernel; returns its slot (>= 1).

    With `direct` (a zero-copy rule taking ``[instance,] *inputs, out=output``)
    the dispatcher calls the rule itself, and ``on_failure(exc, returned,
    inputs, outputs, eager)`` makes the error message when it fails. With
    `rows` (``batch="loop"``'s batch dims) it runs the kernel once per row."""

def register_c_kernel(fingerprint_hi: int, fingerprint_lo: int, name: str, address: int,
                      keepalive: Any, operands: Sequence[int] = (), rows: Sequence[int] = (),
                      conj_from: int = -1) -> int:
    """Registers a C kernel (jaxdecl.h) until release_kernel; returns its slot.

    `operands`: the indices of the operands it takes (all if empty); `rows`:
    ``batch="loop"``'s batch dims, run once per row; `conj_from`: for an
    adjoint, the first operand conjugated before the call (results after)."""

def release_kernel(slot: int) -> bool:
    """Drops a registration; False if the slot held none."""

def set_dtype(code: int, dtype: Any) -> None:
    """Maps an XLA element type code to a NumPy dtype."""

def set_collect(collect: Callable[[], Any]) -> None:
    """The callable run before an escaped view is reported (default gc.collect)."""

def set_worker_guard(state: Callable[[], Any] | None, name: str, value: Any) -> None:
    """Around kernels on XLA's worker threads, sets attribute `name` of the thread's
    state() to `value` (restored after the call)."""

def set_resolver(resolver: Callable[[bytes], tuple[int, Any]] | None) -> None:
    """The callable that rebuilds a compiled call site's kernel from its recipe."""

def element_types() -> dict[str, int]:
    """XLA element type codes by NumPy dtype name."""

def kernel_count() -> int:
    """How many kernels are registered now."""

def call_site_count() -> int:
    """How many call sites of live compiled executables hold a kernel."""

def release_pending() -> None:
    """Drops now the references that destroyed call sites left to drop later."""
