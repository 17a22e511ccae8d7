"""Argument checks, dtype pairs and sharding support shared by every DUCC transform family.

DUCC computes in float32/float64 and complex64/complex128 only, and many of
its transforms map one precision's real type to the same precision's complex
type (or back); the two dicts below hold that pairing. Their keys double as
the set of dtypes a transform accepts: ``check_dtype(name, x.dtype, REAL_OF)``
admits the complex types, ``COMPLEX_OF`` the real ones.
"""

from __future__ import annotations

import numpy as np

COMPLEX_OF = {np.dtype("float32"): np.dtype("complex64"),
              np.dtype("float64"): np.dtype("complex128")}
REAL_OF = {c: r for r, c in COMPLEX_OF.items()}


def check_dtype(name: str, dtype, allowed) -> np.dtype:
    """`dtype` as a NumPy dtype; a TypeError naming `name` if it is not in `allowed`."""
    dtype = np.dtype(dtype)
    if dtype not in allowed:
        raise TypeError(
            f"{name} takes {' or '.join(str(d) for d in allowed)} input, got {dtype}"
        )
    return dtype
