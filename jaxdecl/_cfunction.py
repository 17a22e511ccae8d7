"""C kernels as rules: ``jd.cfunction`` wraps a C function with jaxdecl.h's signature.

XLA then calls the function directly on its buffers, without the GIL and
without Python: the cheapest possible dispatch. The header lives in
``jaxdecl/include/jaxdecl.h`` (``jaxdecl.include_dir()``).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from . import _dispatch

_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def include_dir() -> str:
    """The folder holding ``jaxdecl.h``, for compiling C kernels."""
    return os.path.join(os.path.dirname(__file__), "include")


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

    The C function has the signature ``jaxdecl_kernel`` of ``jaxdecl.h``: it
    receives the rule's operands and results (in the order the Python rule
    would) as dense row-major buffers and returns 0, or non-zero with a
    message. It runs without the GIL and must be thread-safe. Under
    ``batch="loop"`` it is called once per batch element; under
    ``"vectorized"`` it sees the leading batch dimensions.

    Calling the object from Python runs the kernel on NumPy arrays
    (``kernel(*inputs, out=outputs)``), which is what ``jd.check`` does.

    Residuals (``@jd.residuals``): a C ``@forward`` declared with
    ``saved=True`` receives, when a derivative follows, the residual buffers
    after its output buffers (in the residual pytree's leaf order) and fills
    them; on a plain call it receives its outputs only, so ``n_out`` tells the
    two apart. A C ``@jvp``/``@vjp`` declared with ``result=True`` and/or
    ``saved=True`` receives, after its usual operands, the forward's output
    buffers (all of them, integer ones too), then the residual buffers.

    Args:
      function: a PyCapsule holding the function pointer (from your own
        pybind11 module), a ctypes function, or the address as an int.
      keepalive: an object that owns the function's code (e.g. the ctypes
        library); kept for the life of the process. Defaults to `function`.
      name: the rule's name in messages.
      saved: the kernel takes the residuals (see above).
      result: the kernel (a ``@jvp``/``@vjp``) takes the forward's outputs.

    Example:
        >>> import ctypes, jaxdecl as jd
        >>> lib = ctypes.CDLL(None)  # any library exporting a jaxdecl_kernel
        >>> isinstance(jd.cfunction(ctypes.cast(lib.abs, ctypes.c_void_p).value), jd.CFunction)
        True
    """

    def __init__(self, function, *, keepalive=None, name: str | None = None,
                 saved: bool = False, result: bool = False):
        self.address = _address_of(function)
        if not self.address:
            raise ValueError("jd.cfunction: the function pointer is NULL")
        self.keepalive = function if keepalive is None else keepalive
        self.__name__ = name or getattr(function, "__name__", "c_kernel")
        # The keyword arguments a Python rule would take (see jaxdecl._residuals).
        self.takes = frozenset(k for k, on in (("saved", saved), ("result", result)) if on)

    def __repr__(self) -> str:
        return f"<jd.cfunction {self.__name__} at {self.address:#x}>"

    def __get__(self, instance, owner=None):
        return self  # C kernels take no configuration

    def __call__(self, *inputs, out):
        outputs = out if isinstance(out, tuple) else (out,)
        inputs = tuple(np.ascontiguousarray(x) for x in inputs)
        error = _dispatch.call_c_kernel(self.address, inputs, outputs)
        if error is not None:
            raise RuntimeError(f"{self.__name__}: {error}")

    def register(self) -> int:
        """Registers the kernel with the dispatcher; returns its key."""
        return _dispatch.register_c_kernel(self.address, self.keepalive)


def cfunction(function, *, keepalive=None, name: str | None = None, saved: bool = False,
              result: bool = False) -> CFunction:
    """Wraps a C function with jaxdecl.h's ``jaxdecl_kernel`` signature as a rule.

    See :class:`CFunction`.
    """
    return CFunction(function, keepalive=keepalive, name=name, saved=saved, result=result)
