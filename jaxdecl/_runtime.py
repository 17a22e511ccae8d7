"""Host kernels: the Python callables the C++ dispatcher runs inside XLA.

A host kernel receives ``(inputs, outputs, eager)``: two tuples of NumPy
views of XLA's buffers, and whether an eager caller waits for this call (and
can take the rule's exception back). It calls one user rule and returns None,
or an error message that the dispatcher hands back to XLA. Kernels are built
once per compiled shape and registered as a :class:`Kernel`.

Who owns what (an arrow is a strong reference; ``~>`` a weak one)::

    op instance --anchor--> OpHandle --> Kernel (Python) --slot--> Kernel (C++)
    Kernel (C++) --> the kernel function --> rule ~> op instance
    Python executable --keep-alive--> Kernel (Python), op instance
    XLA executable --> CallSite (C++) --> Kernel (C++), op instance
    eager call (blocks until done) --> op instance, Kernel (Python)

- A registration (slot) lives while its Python :class:`Kernel` does: while an
  op of its configuration lives (the handle's cache) or a Python executable
  that lowered it does (a lowering keep-alive).
- A compiled program resolves each of its kernels once, when XLA instantiates
  the executable (after compiling or loading it), into a ``CallSite`` that XLA
  owns: it holds the C++ kernel and the op instance the kernel calls, and XLA
  destroys it with the executable, after the executable's last run. So a
  program that is queued or running always has its kernels, even when every
  Python object that built it is gone (a temporary ``jax.jit`` returns before
  XLA runs it), and nothing is looked up per call.
- The eager executables name no kernel (the slot is an operand): the caller
  pins the op and waits for the call.
- Kernels refer to their op weakly, so an op is freed once no handle cache,
  executable or eager call needs it: memory is bounded by what is alive.
- Split programs (``custom_partitioning``) build their per-shard kernels in
  the partition callback, which only a compilation runs; their cache keys are
  unique to one lowering (see :mod:`jaxdecl._lowering`), so a program loaded
  from the persistent cache never calls kernels this process did not build.

The per-call path is deliberately plain: a zero-copy rule is one Python call
inside a ``try``; the return form adds one shape/dtype comparison and one copy
per output.
"""

from __future__ import annotations

import bdb
import gc
import itertools
import signal
import sys
import types
import weakref

import jax
import numpy as np

from . import _compat, _dispatch, _dtypes, _errors
from ._cfunction import CFunction
from ._errors import BufferEscapeError, RuleError
from ._layout import RuleIO

_DISPATCHER_READY = False


def _setup_dispatcher() -> None:
    """Teaches the dispatcher NumPy's dtypes and registers the FFI targets, once.

    Run before anything can compile or load a program that calls jaxdecl: when
    the first kernel is registered, and when a serialized executable's
    keep-alives are unpickled (a process that loads a program before it
    creates its ops reaches jaxdecl's handler, whose error names the op).
    """
    global _DISPATCHER_READY
    if _DISPATCHER_READY:
        return
    # XLA takes FFI types only before the handlers that use them, and a CPU
    # client registers queued handlers before queued types: start the client
    # first, so that both are registered now, in order.
    jax.devices("cpu")
    for name, code in _dispatch.element_types().items():
        _dispatch.set_dtype(code, _dtypes.numpy_dtype(name))
    _dispatch.set_worker_hooks(_compat.forbid_host_transfers, _compat.restore_host_transfers)
    _dispatch.set_collect(_release_stale_references)
    # The state type first: the compiled target's instantiate stage creates it.
    _compat.register_ffi_state_type("jaxdecl_call_site", _dispatch.call_site_type())
    for target, handler in _dispatch.registrations().items():
        jax.ffi.register_ffi_target(target, handler, platform="cpu")
    _compat.register_batch_partitionable(SPLIT_TARGET)
    _DISPATCHER_READY = True


def _release_stale_references() -> None:
    """Run before an escaped view is reported: frees what only garbage still holds.

    JAX's own reference cycles are collected. A debugger (pdb) that stopped
    inside the rule keeps a snapshot of the rule's locals after ``continue``,
    until it next stops; that snapshot is stale once the rule has returned, so
    it is dropped, and a rule can be debugged without a false escape.
    """
    gc.collect()
    for hook in (sys.gettrace(), _sigint_handler()):
        debugger = getattr(hook, "__self__", None)
        # Only a debugger that is not stopped now (curframe None): a live
        # debugging session keeps its state.
        if isinstance(debugger, bdb.Bdb) and getattr(debugger, "curframe", None) is None \
                and isinstance(getattr(debugger, "curframe_locals", None), dict):
            debugger.curframe_locals = {}


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


_READ_ONLY = ("output array is read-only", "assignment destination is read-only",
              "array is read-only")
_INPUTS_ARE_VIEWS = "read-only views of XLA's buffers"


def _explain_read_only(exc: BaseException, context: str, io: RuleIO, zero_copy: bool) -> None:
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
    full = [tuple(shape[:nb]) == tuple(batch_shape) for shape in in_shapes]
    none = [all(n == 1 for n in shape[:nb]) and not f for shape, f in zip(in_shapes, full)]
    if all(f or n for f, n in zip(full, none)):

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
        _explain_read_only(exc, context, io, zero_copy)
        # The reported traceback starts at the rule, not at jaxdecl's wrappers.
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None and \
                tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        exc.__traceback__ = tb
        _detach_views(exc, ins + outs)
        return stash(_explain(exc, context), context, keep=eager)

    hot = run is element and zero_copy and single and not is_c
    if hot:
        # The hot path of an unbatched zero-copy rule. The dispatcher calls the
        # rule itself (``kernel.direct``: ``method([instance,] *ins, out=out)``)
        # and hands failures to ``kernel.on_failure``; `kernel` below is the
        # same call in Python, for the dispatcher's other paths.
        def on_failure(exc, returned, ins, outs, eager):
            if exc is None:
                exc = _returned_value(context, returned)
            return fail(exc, ins, outs, eager)

        if ref is None:
            def kernel(ins, outs, eager):
                try:
                    result = method(*ins, out=outs[0])
                    if result is not None:
                        raise _returned_value(context, result)
                except BaseException as exc:  # noqa: BLE001 - every error goes back to XLA
                    return fail(exc, ins, outs, eager)
                return None
        else:
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

    if hot:
        kernel.direct, kernel.on_failure = method, on_failure

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


def _detach_views(exc: BaseException, views: tuple) -> None:
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
    """Copies arrays that share memory with `views`, each once (see _detach_views)."""

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
        release = getattr(_dispatch, "release_kernel", None)  # None at interpreter exit
        if release is not None:
            release(self.slot)

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
    """A loaded executable's keep-alive: readies the dispatcher before XLA loads it."""
    _setup_dispatcher()
    return KeepAlive(None, None)


def register(fingerprint: tuple, name: str, kernel, on_escape, instance_ref) -> Kernel:
    """Registers a host kernel; it stays registered while the returned Kernel lives."""
    _setup_dispatcher()
    hi, lo = fingerprint
    slot = _dispatch.register_kernel(hi, lo, name, kernel, on_escape, instance_ref,
                                     getattr(kernel, "direct", None),
                                     getattr(kernel, "on_failure", None))
    return Kernel(slot, fingerprint, name, instance_ref)


def register_c(fingerprint: tuple, name: str, function: CFunction) -> Kernel:
    """Registers a :class:`~jaxdecl.CFunction`; XLA calls it without the GIL."""
    _setup_dispatcher()
    hi, lo = fingerprint
    slot = _dispatch.register_c_kernel(hi, lo, name, function.address, function.keepalive)
    return Kernel(slot, fingerprint, name, None)

