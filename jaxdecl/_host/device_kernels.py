"""Device kernels: a device rule (``platform="gpu"``) as the CUDA handler calls it.

The handler (``csrc/gpu/device_rules.cc``) calls ``kernel(inputs, outputs, stream,
ordinal, eager)``: each buffer an ``(address, shape, type code)`` on the device,
XLA's stream and the device's ordinal. The kernel makes the
:class:`~jaxdecl._host.devices.DeviceArray` objects the rule receives, calls it with
``stream=`` (once, or once per row under ``batch="loop"``), and in the return form
copies each returned device array into XLA's buffer on the stream, after the checks
a host kernel makes (count, shape, dtype). Its failures are reported as a host
kernel's are (:mod:`jaxdecl._host.kernels`); a rule that kept a device array fails
the call, and every device array is released when the call returns.

The user's rule takes ``stream`` by keyword; the wrappers that hand rules their
pytrees and ``saved=``/``result=`` (shared with host kernels) do not know it, so the
rule is first made a function of the kernel's current stream (:func:`taking_stream`).

Example:
    >>> from jaxdecl._host.device_kernels import rows_of
    >>> [offsets for offsets in rows_of([(2, 3), (1, 3)], [8, 8], (2,))]
    [[0, 0], [24, 0]]
"""

from __future__ import annotations

import gc
import itertools
import math
import sys
import threading

import numpy as np

from .. import _errors
from .._errors import BufferEscapeError, RuleError
from .._spec.rule_io import RuleIO
from . import kernels as _kernels
from . import registry as _registry  # noqa: F401 - first: says how to build a missing extension
from ._dispatch import copy_on_device, stream_wait, synchronize_stream, zero_on_device
from .devices import DeviceArray, Stream, dtype_of

_current = threading.local()  # .stream: XLA's stream of the call this thread runs


def taking_stream(function):
    """`function` (a device rule) called with ``stream=`` the current call's stream."""
    def rule(*args, **kwargs):
        return function(*args, stream=_current.stream, **kwargs)

    rule.__name__ = getattr(function, "__name__", "rule")
    return rule


def rows_of(shapes, itemsizes, batch: tuple):
    """Per row of a looped batch, each operand's byte offset (an operand of size 1 along a
    batch dim stays put along it), in row-major order."""
    strides = []
    for shape, itemsize in zip(shapes, itemsizes):
        step = [itemsize * math.prod(shape[d + 1:]) for d in range(len(batch))]
        strides.append([0 if shape[d] == 1 else s for d, s in enumerate(step)])
    for index in itertools.product(*(range(n) for n in batch)):
        yield [sum(i * s for i, s in zip(index, stride)) for stride in strides]


def make_device_kernel(function, *, zero_copy: bool, io: RuleIO, context: str,
                       rows: tuple = (), instance_ref=None):
    """The device kernel of one device rule at one set of shapes (see the module docstring).

    Args:
      function: the rule, made a function of flat operands (and taking the stream
        through :func:`taking_stream`); called as ``function(instance_ref(), ...)``
        when `instance_ref` is given.
      zero_copy: the rule fills ``out`` instead of returning.
      io: its operands' and results' names (for messages) and result types.
      context: ``Class.method (@kind, platform='gpu')``, for messages.
      rows: ``batch="loop"``'s batch dims: the rule runs once per row.
      instance_ref: a weak reference to the op instance, or None.
    """
    fail = _kernels._failure_report(context, io, zero_copy)
    escaped = _escape_report(context, io)
    element = _element(function, zero_copy, io, context)
    n_rows = len(rows)

    def kernel(ins, outs, stream, ordinal, eager):
        _current.stream = Stream(stream)
        inputs = [DeviceArray(a, s, dtype_of(c), read_only=True, stream=stream, ordinal=ordinal)
                  for a, s, c in ins]
        outputs = [DeviceArray(a, s, dtype_of(c), read_only=False, stream=stream,
                               ordinal=ordinal) for a, s, c in outs]
        head = () if instance_ref is None else (instance_ref(),)
        if not n_rows:
            return _run(element, head, inputs, outputs, stream, fail, escaped, eager)
        wholes = inputs + outputs
        for offsets in rows_of([a.shape for a in wholes], [a.dtype.itemsize for a in wholes],
                               rows):
            # (two lists, each row array in one: the escape check counts references)
            row_in = [_row(a, o, n_rows) for a, o in zip(inputs, offsets)]
            row_out = [_row(a, o, n_rows) for a, o in zip(outputs, offsets[len(inputs):])]
            error = _run(element, head, row_in, row_out, stream, fail, escaped, eager)
            if error is not None:
                return error
        return None

    return kernel


def _row(whole: DeviceArray, offset: int, n_rows: int) -> DeviceArray:
    return DeviceArray(whole.ptr + offset, whole.shape[n_rows:], whole.dtype,
                       read_only=whole.read_only, stream=whole.stream, ordinal=whole.device)


def _run(element, head, inputs, outputs, stream, fail, escaped, eager):
    """One call of the rule on device arrays; None or the message the call fails with."""
    try:
        element(head, inputs, outputs, stream)
    except BaseException as exc:  # noqa: BLE001 - every error goes back to XLA
        message = fail(exc, (), (), eager)
        del exc
    else:
        message = _escape(inputs, outputs, escaped, eager)
    for array in inputs + outputs:
        array.release()  # a reference the rule kept now fails when used
    return message


def _escape_report(context: str, io: RuleIO):
    """``escaped(is_output, index, eager) -> message``: a device array outlived its call."""
    def escaped(is_output: bool, index: int, eager: bool) -> str:
        names = io.out_names if is_output else io.in_names
        what = names[index] if index < len(names) else "an argument"
        error = BufferEscapeError(
            f"{context} kept a reference to {what} after returning. A device array views "
            f"XLA's device buffer during the call only, and XLA reuses the buffer after it; "
            f"copy what you keep on the device (e.g. cupy.asarray(x).copy())")
        return _errors.stash(error, context, keep=eager)

    return escaped


def _escape(inputs, outputs, escaped, eager):
    """The message of a device array the rule kept (referenced beyond our own list), or None."""
    def first_kept():
        for is_output, arrays in ((False, inputs), (True, outputs)):
            for index in range(len(arrays)):
                if sys.getrefcount(arrays[index]) > 2:  # the list, getrefcount's argument
                    return is_output, index
        return None

    if first_kept() is None:
        return None
    gc.collect()  # a reference cycle of the rule's own may still hold one
    kept = first_kept()
    return None if kept is None else escaped(kept[0], kept[1], eager)


def _element(function, zero_copy: bool, io: RuleIO, context: str):
    """``element(head, inputs, outputs, stream)``: one call of the rule, its results stored."""
    if zero_copy and io.single_result:
        def element(head, inputs, outputs, stream):
            result = function(*head, *inputs, out=outputs[0])
            if result is not None:
                raise _kernels._returned_value(context, result)
    elif zero_copy:
        def element(head, inputs, outputs, stream):
            result = function(*head, *inputs, out=tuple(outputs))
            if result is not None:
                raise _kernels._returned_value(context, result)
    else:
        def element(head, inputs, outputs, stream):
            _store(function(*head, *inputs), outputs, io, context, stream)

    return element


def _interface(value, context: str, name: str):
    """``(address, shape, dtype, stream)`` of a returned device array."""
    interface = getattr(value, "__cuda_array_interface__", None)
    if interface is None:
        raise RuleError(
            f"{context} returned a {type(value).__name__} for {name}, but a device rule returns "
            f"device arrays (CuPy, Numba-CUDA or PyTorch CUDA arrays: anything with "
            f"__cuda_array_interface__), or fills `out`")
    shape = tuple(interface["shape"])
    dtype = np.dtype(interface["typestr"])
    strides = interface.get("strides")
    if strides is not None and math.prod(shape) > 1:
        dense = [dtype.itemsize * math.prod(shape[d + 1:]) for d in range(len(shape))]
        if any(s != d for s, d, n in zip(strides, dense, shape) if n > 1):
            raise RuleError(
                f"{context} returned a non-contiguous array for {name} (strides {tuple(strides)}"
                f"); return a C-contiguous one (e.g. cupy.ascontiguousarray(y))")
    return interface["data"][0], shape, dtype, interface.get("stream")


def _store(results, outputs, io: RuleIO, context: str, stream: int) -> None:
    """Copies a device rule's returned arrays into XLA's buffers on `stream`, after the
    checks of the host kernels' return form."""
    if io.single_result and not (isinstance(results, (tuple, list)) and len(results) == 1):
        results = (results,)
    elif not isinstance(results, (tuple, list)) or len(results) != len(outputs):
        got = len(results) if isinstance(results, (tuple, list)) else 1
        raise RuleError(f"{context} returned {got} result(s), but {len(outputs)} were expected "
                        f"({', '.join(io.out_names)})")
    copied = False
    for index, (value, out) in enumerate(zip(results, outputs)):
        name = io.out_names[index]
        if value is None and io.zeros_ok:  # None: a zero cotangent
            zero_on_device(out.ptr, out.nbytes, stream)
            continue
        address, shape, dtype, ready_on = _interface(value, context, name)
        if shape != out.shape:
            raise RuleError(f"{context} returned shape {shape} for {name}, but @abstract "
                            f"declared {out.shape}")
        if dtype != out.dtype:
            hint = (" (a real input's cotangent is real: return its real part)"
                    if dtype.kind == "c" and out.dtype.kind != "c" else "")
            raise RuleError(f"{context} returned dtype {dtype} for {name}, but @abstract "
                            f"declared {out.dtype}{hint}")
        if ready_on not in (None, stream) and not (ready_on == 1 and not stream):
            stream_wait(stream, ready_on)
        if out.nbytes:
            copy_on_device(out.ptr, address, out.nbytes, stream)
            copied = True
    if copied:
        # The returned arrays may own the memory the copies read: they are dropped
        # (with the rule's results) only once the copies are done.
        synchronize_stream(stream)
