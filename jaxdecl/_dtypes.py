"""Element types jaxdecl can hand to NumPy, and the checks that keep others out."""

from __future__ import annotations

import ml_dtypes
import numpy as np

#: dtypes a jaxdecl op accepts and produces (NumPy names).
SUPPORTED = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
)

#: The same, as NumPy dtypes.
SUPPORTED_DTYPES = frozenset(
    np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name) for name in SUPPORTED
)


#: jaxdecl.h's element type codes (XLA's own) by NumPy name: what a C kernel's
#: ``jaxdecl_buffer.dtype`` says (the dispatcher's table agrees; tests check).
ELEMENT_TYPES = {
    "bool": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "uint8": 6, "uint16": 7,
    "uint32": 8, "uint64": 9, "float16": 10, "float32": 11, "float64": 12, "complex64": 15,
    "bfloat16": 16, "complex128": 18,
}


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype for one of :data:`SUPPORTED`."""
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def is_supported(dtype) -> bool:
    return np.dtype(dtype) in SUPPORTED_DTYPES


#: The supported dtypes that carry tangents: floating and complex ones.
DIFFERENTIABLE = frozenset(d for d in SUPPORTED_DTYPES
                           if d == ml_dtypes.bfloat16 or np.issubdtype(d, np.inexact))


def is_differentiable(dtype) -> bool:
    """Floating and complex values carry tangents; integers and bools do not."""
    return np.dtype(dtype) in DIFFERENTIABLE


def check_supported(dtype, what: str) -> None:
    """Raises TypeError naming `what` when `dtype` cannot cross into NumPy."""
    if not is_supported(dtype):
        raise TypeError(
            f"{what} has dtype {np.dtype(dtype).name}, which jaxdecl cannot pass to a NumPy "
            f"rule; supported dtypes: {', '.join(SUPPORTED)}"
        )
