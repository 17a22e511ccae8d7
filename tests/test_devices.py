"""Device arrays (jaxdecl/_host/devices.py): the CUDA array interface, DLPack capsules read
back with ctypes, the stream a consumer waits on, and the end of a view."""

import ctypes

import numpy as np
import pytest
from helpers_gpu import calls, fake_cuda

from jaxdecl._host import _dispatch
from jaxdecl._host.devices import DeviceArray

ADDRESS, STREAM = 0x7F00DEAD0000, 0x5EED


def array(shape=(2, 3), dtype="float32", read_only=True, stream=STREAM, ordinal=1):
    return DeviceArray(ADDRESS, shape, np.dtype(dtype), read_only=read_only, stream=stream,
                       ordinal=ordinal)


@pytest.mark.parametrize(("dtype", "typestr"), [("float32", "<f4"), ("complex128", "<c16"),
                                                ("bool", "|b1"), ("int64", "<i8")])
def test_the_cuda_array_interface(dtype, typestr):
    x = array(dtype=dtype)
    assert x.__cuda_array_interface__ == {
        "shape": (2, 3), "typestr": typestr, "data": (ADDRESS, False), "strides": None,
        "version": 3, "stream": STREAM}
    assert (x.ndim, x.size, x.nbytes) == (2, 6, 6 * np.dtype(dtype).itemsize)
    # inputs are read-only by contract, never by flag: PyTorch refuses flagged arrays
    assert array(read_only=True).read_only and not array(read_only=False).read_only


def test_the_null_stream_is_named_as_the_interface_requires():
    assert array(stream=0).__cuda_array_interface__["stream"] == 1  # (0 is disallowed)


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                            ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor)))]


class DLManagedTensorVersioned(ctypes.Structure):
    pass


DLManagedTensorVersioned._fields_ = [
    ("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("manager_ctx", ctypes.c_void_p),
    ("deleter", ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))),
    ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_set_name = ctypes.pythonapi.PyCapsule_SetName
_set_name.argtypes = [ctypes.py_object, ctypes.c_char_p]


def consume(capsule, name: bytes, struct):
    """Reads a capsule as a DLPack consumer does: takes the tensor, renames the capsule
    ("used_..."), and calls the tensor's deleter when done."""
    managed = struct.from_address(_get_pointer(capsule, name))
    _set_name(capsule, b"used_" + name)
    tensor = managed.dl_tensor
    read = {"data": tensor.data, "device": (tensor.device.device_type, tensor.device.device_id),
            "shape": [tensor.shape[i] for i in range(tensor.ndim)],
            "dtype": (tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes),
            "strides": bool(tensor.strides), "offset": tensor.byte_offset}
    if struct is DLManagedTensorVersioned:
        read["version"], read["flags"] = (managed.major, managed.minor), managed.flags
    managed.deleter(ctypes.pointer(managed))
    return read


@pytest.mark.parametrize(("dtype", "code"), [("float32", (2, 32, 1)), ("complex64", (5, 64, 1)),
                                             ("int8", (0, 8, 1)), ("uint16", (1, 16, 1)),
                                             ("bool", (6, 8, 1)), ("bfloat16", (4, 16, 1))])
def test_a_dlpack_capsule_read_back(dtype, code):
    import ml_dtypes  # noqa: F401 - bfloat16's dtype

    x = array(shape=(4, 5), dtype=dtype, stream=STREAM)
    assert x.__dlpack_device__() == (2, 1)  # kDLCUDA, the ordinal
    with fake_cuda():
        read = consume(x.__dlpack__(stream=-1), b"dltensor", DLManagedTensor)
    assert read == {"data": ADDRESS, "device": (2, 1), "shape": [4, 5], "dtype": code,
                    "strides": False, "offset": 0}


@pytest.mark.parametrize("read_only", [True, False])
def test_a_versioned_capsule_is_never_flagged_read_only(read_only):
    # (PyTorch refuses read-only capsules: an input is read-only by contract in DLPack)
    x = array(read_only=read_only)
    read = consume(x.__dlpack__(stream=-1, max_version=(1, 0)), b"dltensor_versioned",
                   DLManagedTensorVersioned)
    assert read["version"] == (1, 0) and read["flags"] == 0 and read["shape"] == [2, 3]


def test_a_capsule_holds_its_array_until_the_consumer_is_done():
    import sys

    x = array()
    before = sys.getrefcount(x)
    capsule = x.__dlpack__(stream=-1)
    assert sys.getrefcount(x) == before + 1
    del capsule  # never consumed: its destructor deletes the tensor
    assert sys.getrefcount(x) == before
    capsule = x.__dlpack__(stream=-1)
    consume(capsule, b"dltensor", DLManagedTensor)  # consumed: the consumer's deleter does
    assert sys.getrefcount(x) == before
    del capsule
    assert sys.getrefcount(x) == before


@pytest.mark.parametrize(("stream", "waits"), [(None, 1), (7, 7), (-1, None), (STREAM, None)])
def test_the_consumer_stream_waits_for_xla_s(stream, waits):
    with fake_cuda():
        array().__dlpack__(stream=stream)
        log = _dispatch.fake_cuda_log()
    if waits is None:
        assert log == []
    else:
        assert calls(log) == ["EventCreateWithFlags", "EventRecord", "StreamWaitEvent",
                              "EventDestroy"]
        assert log[1][1][1] == STREAM and log[2][1][0] == waits


def test_what_a_device_array_cannot_do():
    x = array()
    with pytest.raises(BufferError, match="shared without a copy"):
        x.__dlpack__(copy=True)
    with pytest.raises(BufferError, match="lives on CUDA device 1; it cannot be exported to "
                                          r"device \(1, 0\)"):
        x.__dlpack__(dl_device=(1, 0))
    x.release()
    with pytest.raises(RuntimeError, match="belonged to a rule call that has returned"):
        x.__cuda_array_interface__  # noqa: B018
    with pytest.raises(RuntimeError, match="belonged to a rule call that has returned"):
        x.__dlpack__()
    assert "released" in repr(x)
