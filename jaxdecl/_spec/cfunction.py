"""C kernels as rules: ``jd.cfunction`` wraps a C function with jaxdecl.h's signature.

XLA then calls the function directly on its buffers, without the GIL and
without Python: the cheapest possible dispatch. The header lives in
``jaxdecl/include/jaxdecl.h`` (``jaxdecl.include_dir()``).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from .. import _dtypes

_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def include_dir() -> str:
    """The folder holding ``jaxdecl.h``, for compiling C kernels (``-I`` on the command line).

    Example:
        >>> import os, jaxdecl as jd
        >>> sorted(os.listdir(jd.include_dir()))
        ['jaxdecl.h']
    """
    return os.path.join(os.path.dirname(os.path.dirname(__file__)), "include")


def _address_of(function) -> int:
    if isinstance(function, int):
        return function
    if type(function).__name__ == "PyCapsule":
        return _capsule_pointer(function, _capsule_name(function))
    if isinstance(function, ctypes._CFuncPtr):
        return ctypes.cast(function, ctypes.c_void_p).value
    raise TypeError(
        f"jd.cfunction takes a PyCapsule, a ctypes function or an address, got {function!r}"
    )


class CFunction:
    """A C kernel usable as any rule: ``apply = jd.forward(jd.cfunction(lib.scale))``.

    Made by :func:`cfunction`, which documents the calling convention.
    Calling the object from Python runs the kernel on NumPy arrays
    (``kernel(*inputs, out=outputs)``), which is what ``jd.check`` does.

    Example:
        >>> import ctypes, numpy as np, jaxdecl as jd
        >>> libc = ctypes.CDLL(None)  # an address to wrap (never called here)
        >>> kernel = jd.cfunction(ctypes.cast(libc.abs, ctypes.c_void_p).value, name="demo")
        >>> isinstance(kernel, jd.CFunction), kernel.__name__
        (True, 'demo')
    """

    def __init__(self, function, *, keepalive=None, name: str | None = None,
                 saved: bool = False, result: bool = False, platform: str | None = None):
        if platform not in (None, "gpu"):
            raise TypeError(f"jd.cfunction(platform={platform!r}): a C kernel is for the CPU "
                            f"(no platform=) or for the GPU (platform='gpu')")
        self.platform = platform
        self.address = _address_of(function)
        if not self.address:
            raise ValueError("jd.cfunction: the function pointer is NULL")
        self.keepalive = function if keepalive is None else keepalive
        self.__name__ = name or getattr(function, "__name__", "c_kernel")
        # The keyword arguments a Python rule would take (see jaxdecl._spec.residuals).
        self.takes = frozenset(k for k, on in (("saved", saved), ("result", result)) if on)

    def __repr__(self) -> str:
        where = ", platform='gpu'" if self.platform else ""
        return f"<jd.cfunction {self.__name__} at {self.address:#x}{where}>"

    def __get__(self, instance, owner=None):
        return self  # C kernels take no configuration

    def __call__(self, *inputs, out):
        if self.platform == "gpu":
            raise TypeError(f"{self.__name__} is a GPU C kernel: it runs on device buffers, "
                            f"inside a program on a GPU; on NumPy arrays, call the host rule")
        outputs = out if isinstance(out, tuple) else (out,)
        inputs = tuple(np.ascontiguousarray(x) for x in inputs)
        if not all(isinstance(o, np.ndarray) and o.flags.c_contiguous and o.flags.writeable
                   for o in outputs):
            raise TypeError(f"{self.__name__}: out must be writable C-contiguous NumPy arrays")
        error = _run(self.address, _describe(inputs), _describe(outputs))
        if error is not None:
            raise RuntimeError(f"{self.__name__}: {error}")


# --- calling a C kernel from Python (jd.check, a rule calling one) ------------------------
# Through ctypes, which releases the GIL around the call: XLA's dispatcher is
# not needed to run a kernel on NumPy arrays.

class _Buffer(ctypes.Structure):
    """``jaxdecl_buffer`` (jaxdecl.h)."""

    _fields_ = [("data", ctypes.c_void_p), ("dims", ctypes.POINTER(ctypes.c_int64)),
                ("rank", ctypes.c_int64), ("dtype", ctypes.c_int32)]


_KERNEL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_Buffer), ctypes.c_int64,
                           ctypes.POINTER(_Buffer), ctypes.c_int64, ctypes.c_char_p,
                           ctypes.c_int64)
_MESSAGE_SIZE = 64 * 1024  # as the dispatcher gives a kernel run by XLA
_CODES = {_dtypes.numpy_dtype(name): code for name, code in _dtypes.ELEMENT_TYPES.items()}


def _describe(arrays) -> tuple:
    """``(buffers, keep)``: a ctypes array of jaxdecl_buffers over `arrays` (and what
    must stay alive while it is used: the dims arrays)."""
    buffers = (_Buffer * max(len(arrays), 1))()
    keep = []
    for buffer, array in zip(buffers, arrays):
        code = _CODES.get(array.dtype)
        if code is None:
            raise TypeError(f"a C kernel cannot take dtype {array.dtype}")
        dims = (ctypes.c_int64 * max(array.ndim, 1))(*array.shape)
        keep.append(dims)
        buffer.data, buffer.dims = array.ctypes.data, dims
        buffer.rank, buffer.dtype = array.ndim, code
    return buffers, len(arrays), keep


def _run(address: int, inputs, outputs) -> str | None:
    """Calls the kernel at `address`; None, or the message it failed with."""
    message = ctypes.create_string_buffer(_MESSAGE_SIZE)
    status = _KERNEL(address)(inputs[0], inputs[1], outputs[0], outputs[1], message,
                              _MESSAGE_SIZE)
    if status == 0:
        return None
    text = message.value.decode("utf-8", "backslashreplace")
    if b"\0" not in message.raw:
        text += " [message truncated]"
    return f"C kernel failed with status {status}" + (f": {text}" if text else "")


def cfunction(function, *, keepalive=None, name: str | None = None, saved: bool = False,
              result: bool = False, platform: str | None = None) -> CFunction:
    """Wraps a C function with jaxdecl.h's ``jaxdecl_kernel`` signature as a rule.

    XLA's handler then calls it directly on XLA's buffers, without the GIL and
    without Python. The function receives the rule's operands and results (in
    the order the Python rule would take them) as ``jaxdecl_buffer`` structs
    (data pointer, dims, rank, dtype code; dense, row-major) and returns 0, or
    non-zero after writing a message, which becomes the op's error. It must be
    thread-safe. Under ``batch="loop"`` it is called once per batch element;
    under ``"vectorized"`` it sees the leading batch dimensions. C kernels take
    no instance configuration. Compile against :func:`include_dir`.

    Args:
      function: a PyCapsule holding the function pointer (from your own
        pybind11 module), a ctypes function, or the address as an int.
      keepalive: an object that owns the function's code (e.g. the ctypes
        library); kept as long as the kernel is registered. Defaults to
        `function`.
      name: the rule's name in messages.
      saved: the kernel takes the residuals (``@jd.residuals``): as ``@forward``
        it receives, when a derivative follows, the residual buffers after its
        output buffers (in the residual pytree's leaf order) and fills them; on
        a plain call it receives its outputs only, so ``num_outputs`` tells the
        two apart. As ``@jvp``/``@vjp`` it receives them, read only, after its
        usual operands (and after the forward's outputs, with `result`).
      result: the kernel (a ``@jvp``/``@vjp``) receives the forward's output
        buffers (all of them, integer ones too) after its usual operands.
      platform: ``"gpu"`` for a kernel with jaxdecl.h's ``jaxdecl_gpu_kernel``
        signature (the same plus XLA's CUDA stream, called with device
        pointers): a device rule, declared beside the host rule of its kind
        (``apply_gpu = jd.forward(jd.cfunction(lib.scale_gpu, platform="gpu"))``).

    Returns:
      A :class:`CFunction`, to pass to a rule decorator.

    Example:
        A ctypes callback stands in for a compiled function here (a real
        kernel is C or C++: ``tutorials/06_cpp_extension.py`` compiles one).

        >>> import ctypes, jax, numpy as np, jaxdecl as jd
        >>> class Buffer(ctypes.Structure):  # jaxdecl_buffer, from jaxdecl.h
        ...     _fields_ = [("data", ctypes.c_void_p), ("dims", ctypes.POINTER(ctypes.c_int64)),
        ...                 ("rank", ctypes.c_int64), ("dtype", ctypes.c_int32)]
        >>> KERNEL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(Buffer), ctypes.c_int64,
        ...                           ctypes.POINTER(Buffer), ctypes.c_int64, ctypes.c_char_p,
        ...                           ctypes.c_int64)
        >>> @KERNEL
        ... def negate(inputs, n_in, outputs, n_out, message, message_size):  # 1-d int32
        ...     view = lambda b: np.ctypeslib.as_array(
        ...         ctypes.cast(b.data, ctypes.POINTER(ctypes.c_int32)), (b.dims[0],))
        ...     np.negative(view(inputs[0]), out=view(outputs[0]))
        ...     return 0
        >>> class Negate(jd.Primitive):
        ...     @jd.abstract
        ...     def shapes(self, x):
        ...         return jax.ShapeDtypeStruct(x.shape, x.dtype)
        ...     apply = jd.forward(jd.cfunction(negate))
        >>> jax.jit(Negate())(np.arange(3, dtype=np.int32)).tolist()
        [0, -1, -2]
    """
    return CFunction(function, keepalive=keepalive, name=name, saved=saved, result=result,
                     platform=platform)
