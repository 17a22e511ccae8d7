"""The kernel registry: the dispatcher's FFI targets, and who owns each kernel.

Kernels (host kernels built by :mod:`jaxdecl._host.kernels`, and C kernels) are
registered with the C++ dispatcher once per compiled shape, and stay
registered while the returned :class:`Kernel` lives. Compiled HLO names a
kernel by its fingerprint; the shared eager executables pass its slot as an
operand.

Who owns what (an arrow is a strong reference; ``~>`` a weak one)::

    op instance --anchor--> OpHandle --> Kernel (Python) --slot--> Kernel (C++)
    Kernel (C++) --> the kernel function --> rule ~> op instance
    Python executable --keep-alive--> Kernel (Python), op instance (not when exported)
    XLA executable --> CallSite (C++) --> Kernel (C++), op instance
    CallSite (C++), no live kernel --recipe--> op restored by _recipes.resolve
    eager call (blocks until done) --> op instance, Kernel (Python)

- A registration (slot) lives while its Python :class:`Kernel` does: while an
  op of its configuration lives (the handle's cache) or a Python executable
  that lowered it does (a lowering keep-alive).
- The registry is a cache that can always be refilled: a compiled call names
  its kernel by fingerprint and carries its recipe (:mod:`jaxdecl._transforms.recipes`),
  so a process that loads a program (``jax.export``, a serialized executable,
  the persistent cache) and lacks the kernel rebuilds it, op included.
- A compiled program resolves each of its kernels once, when XLA instantiates
  the executable (after compiling or loading it), into a ``CallSite`` that XLA
  owns: it holds the C++ kernel and the op instance the kernel calls, and XLA
  destroys it with the executable, after the executable's last run. So a
  program that is queued or running always has its kernels, even when every
  Python object that built it is gone (a temporary ``jax.jit`` returns before
  XLA runs it), and nothing is looked up per call. On CUDA, whose compiler
  refuses handlers with an instantiate stage, each run looks its kernel up by
  fingerprint instead and pins the op for the run; a kernel gone by then is
  rebuilt from the recipe (csrc/gpu/handlers.cc).
- The eager executables name no kernel (the slot is an operand): the caller
  pins the op and waits for the call.
- Kernels refer to their op weakly, so an op is freed once no handle cache,
  executable or eager call needs it: memory is bounded by what is alive.
- Split programs (``custom_partitioning``) build their per-shard kernels in
  the partition callback, which only a compilation runs; a program loaded from
  the persistent cache instead rebuilds them from their recipes, and its cache
  key names the ops it splits (see :mod:`jaxdecl._transforms.lowering`).

Example:
    >>> from jaxdecl._host import registry
    >>> from jaxdecl._host.kernels import HostKernel
    >>> def kernel(ins, outs, eager):
    ...     outs[0][...] = 2 * ins[0]
    >>> registered = registry.register((1, 2), "Double.apply (@forward)",
    ...                                HostKernel(kernel, on_escape=None), instance_ref=None)
    >>> slot = registered.slot
    >>> del registered  # the last reference: the registration goes with it
    >>> registry.release_kernel(slot)  # nothing left to release
    False
"""

from __future__ import annotations

import bdb
import gc
import signal
import sys

import jax
import numpy as np

from .. import _compat, _dtypes
from .._spec.cfunction import CFunction

try:
    from ._dispatch import (
        call_site_type,
        element_types,
        register_c_kernel,
        register_kernel,
        registrations,
        release_kernel,
        set_collect,
        set_dtype,
        set_resolver,
        set_worker_guard,
    )
except ImportError as error:  # a source tree whose extension was never built
    raise ImportError(
        f"jaxdecl's compiled extension (jaxdecl._host._dispatch, built from csrc/) is not "
        f"built or does not load ({error}): run `pip install -e .` in the source tree, or "
        f"install jaxdecl with `pip install jaxdecl`") from None

from . import cuda as _cuda  # noqa: E402 - once the extension is known to load

_SET_UP = False


def set_up(resolver) -> None:
    """Configures the dispatcher, once: the one place that does.

    Teaches it NumPy's dtypes, the transfer guard of XLA's worker threads, the
    stale-reference hook of its escape check and `resolver` (which rebuilds a
    compiled call's kernel from its recipe, see
    :func:`jaxdecl._transforms.recipes.resolve`), and registers its FFI
    targets on CPU and on CUDA (:mod:`jaxdecl._host.cuda`). ``import jaxdecl``
    runs it, so that a process that loads a saved program before it creates
    any op finds the handlers. It starts no backend
    (a program may still call ``jax.distributed.initialize`` or set the device
    count after importing jaxdecl).
    """
    global _SET_UP
    if _SET_UP:
        return
    for name, code in element_types().items():
        set_dtype(code, _dtypes.numpy_dtype(name))
    set_worker_guard(*_compat.worker_transfer_guard())
    set_collect(_release_stale_references)
    set_resolver(resolver)
    # The state type first (registered at once, not queued behind the handlers
    # for the CPU client): the compiled target's instantiate stage creates it.
    _compat.register_ffi_state_type("jaxdecl_call_site", call_site_type())
    for target, handler in registrations().items():
        jax.ffi.register_ffi_target(target, handler, platform="cpu")
    _cuda.set_up()  # the same targets on CUDA (queued; nothing is loaded)
    _compat.register_batch_partitionable(SPLIT_TARGET)
    _SET_UP = True


def _release_stale_references() -> None:
    """Run before an escaped view is reported: frees what only garbage still holds.

    JAX's own reference cycles are collected. A debugger (pdb) that stopped
    inside the rule keeps the rule's locals after ``continue``, until it next
    stops: a snapshot of them (``curframe_locals``; from Python 3.13 a proxy
    that holds the rule's frame, PEP 667) and the last frame it traced
    (``enterframe``, Python 3.13). Both are stale once the rule has returned,
    so they are dropped, and a rule can be debugged without a false escape.
    """
    gc.collect()
    for hook in (sys.gettrace(), _sigint_handler()):
        debugger = getattr(hook, "__self__", None)
        # Only a debugger that is not stopped now (curframe None): a live
        # debugging session keeps its state.
        if not isinstance(debugger, bdb.Bdb) or getattr(debugger, "curframe", None) is not None:
            continue
        if getattr(debugger, "curframe_locals", None) is not None:
            debugger.curframe_locals = {}
        entered = getattr(debugger, "enterframe", None)
        if entered is not None and not _on_this_stack(entered):
            debugger.enterframe = None


def _on_this_stack(frame) -> bool:
    """True while `frame` is still running on the calling thread."""
    current = sys._getframe()
    while current is not None:
        if current is frame:
            return True
        current = current.f_back
    return False


def _sigint_handler():
    try:
        return signal.getsignal(signal.SIGINT)
    except (ValueError, OSError):  # pragma: no cover - no signal support here
        return None


TARGET = "jaxdecl_dispatch"  # compiled HLO: the kernel named by its fingerprint
EAGER_TARGET = "jaxdecl_dispatch_eager"  # eager path: the kernel's slot is operand 0
#: A compiled call that XLA splits along its leading dims itself (no partitioning
#: callback); every buffer carries a trailing unit dim the rule does not see.
SPLIT_TARGET = "jaxdecl_dispatch_split"

class Kernel:
    """A registered kernel: owns its dispatcher slot and releases it when dropped.

    `slot` is what the eager path passes at run time; `fingerprint` is what
    compiled HLO names it by.
    """

    __slots__ = ("slot", "fingerprint", "name", "instance_ref", "_slot_operand", "__weakref__")

    def __init__(self, slot: int, fingerprint: tuple, name: str, instance_ref):
        self.slot = slot
        self.fingerprint = fingerprint
        self.name = name
        self.instance_ref = instance_ref
        self._slot_operand = None

    def slot_operand(self):
        """The slot as a device scalar, made once: a host scalar would cost a
        transfer per eager call. Uncommitted, so it follows the other operands'
        device."""
        if self._slot_operand is None:
            self._slot_operand = jax.numpy.asarray(np.int32(self.slot))
        return self._slot_operand

    def pin(self):
        """A strong reference that keeps the kernel's op alive while held, or None if
        the op is gone. Whoever runs the kernel holds it for the call (C kernels
        and strongly bound rules need nothing: True)."""
        return True if self.instance_ref is None else self.instance_ref()

    def __copy__(self):
        return self  # a copy would release the registration twice

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        raise TypeError("a jaxdecl kernel is a process-local registration; it cannot be pickled")

    def __del__(self):
        try:
            release_kernel(self.slot)
        except (NameError, TypeError):  # at interpreter exit, the module is torn down
            pass

    def __repr__(self) -> str:
        return f"<jaxdecl kernel {self.name} slot {self.slot}>"


class KeepAlive:
    """What an executable holds while it lives: a kernel and the op instance it calls.

    Pickles to nothing (``jax.experimental.serialize_executable`` pickles an
    executable's keep-alives): a loaded executable finds its kernels by
    fingerprint in the process that runs it.
    """

    __slots__ = ("kernel", "pin")

    def __init__(self, kernel: Kernel | None, pin=None):
        self.kernel = kernel
        self.pin = pin

    def __reduce__(self):
        return (_unpickled_keepalive, ())


def _unpickled_keepalive() -> KeepAlive:
    """A loaded executable's keep-alive (importing this module imported jaxdecl, whose
    set-up registered the handlers before XLA loads the executable)."""
    return KeepAlive(None, None)


def _device_arguments(device) -> dict:
    """What the dispatcher takes of a device rule: a Python device kernel
    (:mod:`jaxdecl._host.device_kernels`), or a GPU C kernel and its code's owner."""
    if device is None:
        return {}
    if isinstance(device, CFunction):
        return {"gpu_address": device.address, "gpu_keepalive": device.keepalive}
    return {"device_call": device}


def register(fingerprint: tuple, name: str, host, instance_ref, *, device=None,
             operands=()) -> Kernel:
    """Registers a :class:`~jaxdecl._host.kernels.HostKernel`; it stays registered while
    the returned Kernel lives.

    `device`: the kernel's device rule, run by the CUDA handlers instead of staging
    the host one (a device kernel, or a GPU C kernel given `operands` as
    :func:`register_c` is).
    """
    hi, lo = fingerprint
    slot = register_kernel(hi, lo, name, host.call, host.on_escape, instance_ref,
                           host.direct, host.on_failure, host.rows,
                           gpu_operands=list(operands), **_device_arguments(device))
    return Kernel(slot, fingerprint, name, instance_ref)


def register_c(fingerprint: tuple, name: str, function: CFunction, *, operands=(),
               rows=(), conj_from: int = -1, device=None) -> Kernel:
    """Registers a :class:`~jaxdecl.CFunction`; XLA calls it without the GIL.

    `operands`: the indices of the operands it takes (all if empty); `rows`:
    ``batch="loop"``'s batch dims, run one row at a time by the dispatcher;
    `conj_from`: for an adjoint rule, the first operand conjugated (see
    :func:`jaxdecl._host.kernels.transpose_from_adjoint`), else -1; `device`: as
    for :func:`register`.
    """
    hi, lo = fingerprint
    slot = register_c_kernel(hi, lo, name, function.address, function.keepalive,
                             operands, rows, conj_from, **_device_arguments(device))
    return Kernel(slot, fingerprint, name, None)
