"""jaxdecl: declare non-JAX code as first-class JAX primitives.

Write one class, mark its methods with decorators, and get an op that works
under every JAX transformation. See README.md and ``tutorials/``.

Example:
    >>> import jax, numpy as np, jaxdecl as jd
    >>> class Mul(jd.Primitive):
    ...     @jd.abstract
    ...     def shapes(self, x1, x2):
    ...         return jax.ShapeDtypeStruct(x1.shape, x1.dtype)
    ...     @jd.forward
    ...     def apply(self, x1, x2, *, out):
    ...         np.multiply(x1, x2**2, out=out)
    ...     @jd.vjp
    ...     def pull(self, x1, x2, ct):
    ...         return x2**2 * ct, 2 * x1 * x2 * ct
    >>> float(jax.grad(lambda a, b: Mul()(a, b))(1.0, 3.0))
    9.0
"""

import os as _os

from . import _compat
from ._callback import pure_callback
from ._check import check
from ._declare import Primitive, PrimitiveMeta, primitive
from ._dtypes import SUPPORTED as _SUPPORTED
from ._errors import BufferEscapeError, DeclarationError, ExportError, MissingRuleError, RuleError
from ._host import registry as _registry
from ._spec.cfunction import CFunction, cfunction, include_dir
from ._spec.decorators import (
    abstract,
    adjoint,
    batch,
    forward,
    jvp,
    residuals,
    sharding,
    transpose,
    vjp,
)
from ._spec.sharding import ShardingRule

# Importing them registers their rules on the primitive.
from ._transforms import autodiff as _autodiff  # noqa: F401
from ._transforms import batching as _batching  # noqa: F401
from ._transforms import lowering as _lowering  # noqa: F401
from ._transforms import primitive as _primitive  # noqa: F401
from ._transforms import recipes as _recipes
from ._transforms import transposition as _transposition  # noqa: F401
from ._transforms.recipes import disabled_checks
from ._version import __version__ as __version__

# The FFI targets exist from import on: a process that loads a saved program
# before it calls any op finds jaxdecl's handlers (no backend is started).
_registry.set_up(resolver=_recipes.resolve)

#: The dtypes an op accepts and produces, by NumPy name (bool, signed and
#: unsigned integers of 8 to 64 bits, float16, bfloat16 from ``ml_dtypes``,
#: float32, float64, complex64 and complex128). Any other dtype is a
#: ``TypeError`` naming the input or output.
SUPPORTED_DTYPES = _SUPPORTED

_compat.hide_frames(_os.path.dirname(__file__))

__all__ = [
    "Primitive", "PrimitiveMeta", "primitive", "abstract", "forward", "jvp", "vjp",
    "transpose", "adjoint", "batch", "sharding", "residuals", "ShardingRule", "check", "cfunction",
    "CFunction", "include_dir",
    "SUPPORTED_DTYPES", "DeclarationError",
    "MissingRuleError", "RuleError", "BufferEscapeError", "ExportError", "disabled_checks",
    "pure_callback",
]
