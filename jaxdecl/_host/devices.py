"""Device arrays: what a device rule (``platform="gpu"``) receives instead of NumPy views.

A :class:`DeviceArray` is a view of one of XLA's device buffers for the duration of
one call, with no copy. It has a shape and a dtype, and exposes the buffer the two
ways GPU libraries take one, so that CuPy, Numba-CUDA and PyTorch wrap it without
copying:

- ``__cuda_array_interface__`` (version 3), with XLA's stream as the stream the data
  is ready on (``cupy.asarray(x)``, ``numba.cuda.as_cuda_array(x)``,
  ``torch.as_tensor(x, device="cuda")``);
- ``__dlpack__`` / ``__dlpack_device__`` (``kDLCUDA`` and the device's ordinal;
  ``cupy.from_dlpack(x)``, ``torch.from_dlpack(x)``), which makes the consumer's
  stream wait for XLA's.

Inputs are read-only (the flag is in the interface and in a versioned DLPack
capsule). A device array is valid only during the rule call that received it: the
dispatcher checks that the rule kept none, and releases every one after the call.

Example:
    >>> import numpy as np
    >>> from jaxdecl._host.devices import DeviceArray
    >>> x = DeviceArray(0x7F0000000000, (2, 3), np.dtype("float32"), read_only=True,
    ...                 stream=0x5EED, ordinal=0)
    >>> x.__cuda_array_interface__["data"], x.__dlpack_device__()
    ((139637976727552, False), (2, 0))
    >>> Stream(0x5EED).__cuda_stream__()
    (0, 24301)
"""

from __future__ import annotations

import math

import numpy as np

from .. import _dtypes
from . import registry as _registry  # noqa: F401 - first: says how to build a missing extension
from ._dispatch import dlpack_capsule, element_types, stream_wait

#: DLPack's device type of CUDA memory (``kDLCUDA``).
KDL_CUDA = 2
_CODES = {_dtypes.numpy_dtype(name): code for name, code in element_types().items()}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


def dtype_of(code: int) -> np.dtype:
    """The NumPy dtype of an XLA element type code."""
    return _DTYPES[code]


class Stream(int):
    """XLA's CUDA stream, as the ``stream`` a device rule receives: an int (the
    ``cudaStream_t``), and an object of the CUDA stream protocol (``__cuda_stream__``), so
    ``cupy.cuda.Stream.from_external(stream)`` wraps it as ``cupy.cuda.ExternalStream(stream)``
    does."""

    __slots__ = ()

    def __cuda_stream__(self) -> tuple:
        return 0, int(self)


class DeviceArray:
    """One of XLA's device buffers, viewed during one call of a device rule.

    Attributes:
      shape: the dimensions, a tuple.
      dtype: the NumPy dtype.
      ptr: the device address (an int).
      device: the CUDA device ordinal.
      stream: XLA's CUDA stream the data is ready on, and that the rule enqueues on.
      read_only: True for the rule's inputs.
    """

    __slots__ = ("shape", "dtype", "_address", "read_only", "stream", "device", "__weakref__")

    def __init__(self, address: int, shape, dtype, *, read_only: bool, stream: int,
                 ordinal: int):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self._address = address
        self.read_only = read_only
        self.stream = stream
        self.device = ordinal

    @property
    def ptr(self) -> int:
        if self._address is None:
            raise RuntimeError(
                "this device array belonged to a rule call that has returned: XLA has reused "
                "its buffer. Copy what a rule must keep (e.g. cupy.asarray(x).copy())")
        return self._address

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def release(self) -> None:
        """Ends the view (the dispatcher does, when the call returns)."""
        self._address = None

    @property
    def __cuda_array_interface__(self) -> dict:
        # CAI v3: stream 0 is disallowed (1 is the legacy default stream, what 0 means).
        # Never flagged read-only: PyTorch (2.11) refuses such arrays outright, so an input
        # is read-only by contract (``read_only``), as in DLPack below.
        return {"shape": self.shape, "typestr": self.dtype.str,
                "data": (self.ptr, False), "strides": None, "version": 3,
                "stream": self.stream or 1}

    def __dlpack_device__(self) -> tuple:
        return KDL_CUDA, self.device

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule of the buffer, for ``from_dlpack`` (the array API's protocol).

        `stream` is the consumer's: it is made to wait for the work XLA queued
        on its own stream (None: the legacy default stream; -1: no wait).
        """
        if copy:
            raise BufferError("a jaxdecl device array is shared without a copy (copy=True was "
                              "asked); copy it on the consumer's side")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"a jaxdecl device array lives on CUDA device {self.device}; "
                              f"it cannot be exported to device {tuple(dl_device)}")
        address = self.ptr
        consumer = 1 if stream is None else stream
        if consumer != -1 and consumer != self.stream:
            stream_wait(consumer, self.stream)
        versioned = max_version is not None and tuple(max_version)[0] >= 1
        # Never flagged read-only: PyTorch (2.11) refuses such capsules outright, so an
        # input is read-only by contract here (and by flag in the CUDA array interface).
        return dlpack_capsule(self, address, list(self.shape), _CODES[self.dtype], KDL_CUDA,
                              self.device, False, versioned)

    def __repr__(self) -> str:
        state = "released" if self._address is None else f"at {self._address:#x}"
        kind = "input" if self.read_only else "output"
        return (f"DeviceArray(shape={self.shape}, dtype={self.dtype}, {kind}, cuda:{self.device}"
                f", {state})")
