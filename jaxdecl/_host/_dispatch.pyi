"""jaxdecl's XLA FFI dispatcher (CPU and CUDA), built from csrc/ (module.cc and
csrc/gpu/module_gpu.cc are its Python face)."""

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
                    rows: Sequence[int] = (),
                    device_call: Callable[[tuple, tuple, int, int, bool], str | None] | None
                    = None, gpu_address: int = 0, gpu_keepalive: Any = None,
                    gpu_operands: Sequence[int] = ()) -> int:
    """Registers a host kernel until release_kernel; returns its slot (>= 1).

    With `direct` (a zero-copy rule taking ``[instance,] *inputs, out=output``)
    the dispatcher calls the rule itself, and ``on_failure(exc, returned,
    inputs, outputs, eager)`` makes the error message when it fails. With
    `rows` (``batch="loop"``'s batch dims) it runs the kernel once per row.
    `device_call` (a device kernel: ``(inputs, outputs, stream, ordinal, eager)``,
    each buffer an ``(address, shape, type code)``) or `gpu_address` (a
    ``jaxdecl_gpu_kernel``, taking the operands `gpu_operands`; all if empty) is
    the kernel's device rule, which the CUDA handlers run instead of staging."""

def register_c_kernel(fingerprint_hi: int, fingerprint_lo: int, name: str, address: int,
                      keepalive: Any, operands: Sequence[int] = (), rows: Sequence[int] = (),
                      conj_from: int = -1,
                      device_call: Callable[[tuple, tuple, int, int, bool], str | None] | None
                      = None, gpu_address: int = 0, gpu_keepalive: Any = None) -> int:
    """Registers a C kernel (jaxdecl.h) until release_kernel; returns its slot.

    `operands`: the indices of the operands it takes (all if empty); `rows`:
    ``batch="loop"``'s batch dims, run once per row; `conj_from`: for an
    adjoint, the first operand conjugated before the call (results after);
    `device_call`/`gpu_address`: a device rule, as for register_kernel."""

def set_row_threads(threads: int) -> None:
    """The most threads one call's rows run on (a looped C kernel's, on XLA's intra-op
    pool): 0 for as many as the pool has, 1 for in sequence. JAXDECL_ROW_THREADS sets it at
    start-up."""

def row_threads() -> int:
    """See set_row_threads."""

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


# --- CUDA (csrc/gpu/) ------------------------------------------------------------------------

def gpu_registrations() -> dict[str, Any]:
    """The CUDA handlers, for jax.ffi.register_ffi_target on 'CUDA' (the CPU targets' names)."""

def set_cuda_candidates(paths: Sequence[str]) -> None:
    """Where to look for libcudart when JAX's CUDA plugin has loaded none."""

def cuda_runtime_origin() -> str | None:
    """Where the CUDA runtime the handlers use comes from (loading it if needed), or None."""

def copy_on_device(dst: int, src: int, bytes: int, stream: int) -> None:
    """Enqueues a device-to-device copy on `stream` (RuntimeError naming the CUDA error)."""

def zero_on_device(dst: int, bytes: int, stream: int) -> None:
    """Enqueues zeroing `bytes` bytes of device memory on `stream`."""

def synchronize_stream(stream: int) -> None:
    """Waits, without the GIL, until `stream` is idle."""

def stream_wait(consumer: int, producer: int) -> None:
    """Makes `consumer` wait for the work queued so far on `producer`."""

def dlpack_capsule(owner: Any, address: int, shape: Sequence[int], code: int, device_type: int,
                   device_id: int, read_only: bool, versioned: bool) -> Any:
    """A DLPack capsule ("dltensor" or "dltensor_versioned") of `owner`'s memory."""

def use_fake_cuda(fail: str = "", on: int = 0, code: int = 0, sticky: bool = False) -> None:
    """Tests: the fake CUDA runtime (host memory as the device); `fail` (a runtime function
    such as 'MemcpyAsync') fails with `code` on its `on`-th call (and after, if `sticky`)."""

def use_real_cuda() -> None:
    """Tests: the real CUDA runtime again (loaded on first use)."""

def fake_cuda_log() -> list[tuple[str, list[int]]]:
    """Tests: the fake runtime's calls since the last look, as (function, arguments)."""

def fake_cuda_live() -> tuple[int, int]:
    """Tests: the fake runtime's live (pinned allocations, events)."""

class StagedSite:
    """Tests: a CUDA call site whose device buffers are host memory (use the fake runtime)."""

    def run(self, slot: int, inputs: Sequence[tuple], outputs: Sequence[tuple],
            ordinal: int = 0, stream: int = 0, drop: int = 0) -> str | None:
        """Runs the kernel in `slot` as the CUDA handler does; None or the error message."""

    def run_eager(self, slot: tuple, inputs: Sequence[tuple], outputs: Sequence[tuple],
                  ordinal: int = 0, stream: int = 0) -> str | None:
        """Runs the eager CUDA handler: `slot` is the device scalar naming the kernel."""

    def run_compiled(self, fingerprint_hi: int, fingerprint_lo: int, name: str, recipe: str,
                     inputs: Sequence[tuple], outputs: Sequence[tuple], ordinal: int = 0,
                     stream: int = 0) -> str | None:
        """Runs the compiled CUDA handler: the kernel found by its fingerprint (or rebuilt
        from `recipe`), staged through the kernel's pools; None or the error message."""

    def pools(self) -> list[tuple[int, list[int], list[int]]]:
        """(ordinal, pinned addresses, capacities) of each pool kept."""
