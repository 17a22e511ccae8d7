"""Ops with device rules whose "device" is host memory: for the fake CUDA runtime.

The device rules read and write their device arrays through :func:`host`, a NumPy array
over the address the array's ``__cuda_array_interface__`` gives, which is host memory
only under ``_dispatch.use_fake_cuda()``. Each device rule computes something its host
rule does not (3 x where the host computes 2 x), so a test sees which one ran. A module
of its own so that recipes can name the classes.
"""

import ctypes

import jax
import numpy as np

import jaxdecl as jd

#: (rule, stream) of every device rule call, for the tests to read.
CALLS = []


def host(array) -> np.ndarray:
    """A NumPy view of a device array (or anything with __cuda_array_interface__) whose
    memory is host memory (the fake runtime's)."""
    interface = array.__cuda_array_interface__
    size = int(np.prod(interface["shape"])) * np.dtype(interface["typestr"]).itemsize
    buffer = (ctypes.c_char * max(size, 1)).from_address(interface["data"][0])
    return np.frombuffer(buffer, dtype=interface["typestr"], count=int(np.prod(
        interface["shape"]))).reshape(interface["shape"])


class HostArray:
    """A "device" array a return-form device rule returns: host memory, exposed through
    __cuda_array_interface__ as CuPy exposes device memory."""

    def __init__(self, values, stream=None):
        self.values = np.ascontiguousarray(values)
        self.stream = stream

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.values.shape, "typestr": self.values.dtype.str,
                "data": (self.values.ctypes.data, False), "strides": None, "version": 3,
                "stream": self.stream}


class Scale(jd.Primitive, linear=True):
    """factor * x; the device rules compute (factor + 1) * x."""

    def __init__(self, factor):
        self.factor = factor

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, *, out):
        np.multiply(x, self.factor, out=out)

    @jd.forward(platform="gpu")
    def apply_gpu(self, x, *, out, stream):
        CALLS.append(("apply_gpu", stream))
        np.multiply(host(x), self.factor + 1, out=host(out))

    @jd.transpose
    def back(self, ct):
        return self.factor * ct

    @jd.transpose(platform="gpu")
    def back_gpu(self, ct, *, stream):
        CALLS.append(("back_gpu", stream))
        return HostArray((self.factor + 1) * host(ct), stream=stream)


class Mul(jd.Primitive, batch="loop"):
    """x * y (two results in the return form: x * y and x + y), a @vjp with a None."""

    @jd.abstract
    def shapes(self, x, y):
        return jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, y):
        return x * y, x + y

    @jd.forward(platform="gpu")
    def apply_gpu(self, x, y, *, stream):
        CALLS.append(("mul_gpu", stream, host(x).shape))
        return HostArray(host(x) * host(y) * 3), HostArray(host(x) + host(y))

    @jd.vjp
    def pull(self, x, y, ct_prod, ct_sum):
        return y * ct_prod + ct_sum, None

    @jd.vjp(platform="gpu")
    def pull_gpu(self, x, y, ct_prod, ct_sum, *, stream):
        return HostArray(3 * host(y) * host(ct_prod) + host(ct_sum)), None
