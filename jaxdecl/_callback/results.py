"""What a callback declares and returns, checked as ``jax.pure_callback`` checks it.

The rules are JAX's: ``result_shape_dtypes`` is any pytree whose leaves have
``shape`` and ``dtype`` (``jax.ShapeDtypeStruct``, an array, a tracer); with
``jax_enable_x64`` off none may be 64-bit (``ValueError``). A callback may
return anything ``np.asarray`` takes (arrays, NumPy scalars, Python numbers,
objects with ``__array__``); with x64 off its 64-bit values become 32-bit, as
JAX's do. Only the leaves are compared, in order: their count, then each
one's shape and dtype, exactly (a ``RuntimeError``, as JAX raises, whose
message names the callback and what differed).

Example:
    >>> import numpy as np
    >>> from jaxdecl._callback.results import write_results
    >>> out = np.zeros(3, np.float32)
    >>> write_results([np.arange(3, dtype=np.float32)], [out], "f")
    >>> out.tolist()
    [0.0, 1.0, 2.0]
"""

from __future__ import annotations

import jax
import numpy as np

from .._errors import RuleError


class CallbackResultError(RuleError, RuntimeError):
    """A callback returned results that differ from its ``result_shape_dtypes``.

    A ``RuntimeError``, as ``jax.pure_callback`` raises for the same mistake, and
    a :class:`~jaxdecl.RuleError`.
    """


def declared(result_shape_dtypes, name: str):
    """``(tree, leaves)``: the declared results as ``jax.ShapeDtypeStruct`` leaves."""
    leaves, tree = jax.tree_util.tree_flatten(result_shape_dtypes)
    structs = []
    x64 = jax.config.jax_enable_x64
    for index, leaf in enumerate(leaves):
        try:
            shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
        except (AttributeError, TypeError) as error:
            raise TypeError(
                f"jd.pure_callback({name}): result_shape_dtypes leaf #{index} is a "
                f"{type(leaf).__name__} ({leaf!r:.60}); each leaf needs a shape and a dtype "
                f"(jax.ShapeDtypeStruct, say) ({error})") from None
        if not x64 and jax.dtypes.canonicalize_dtype(dtype) != dtype:
            raise ValueError(
                "result_shape_dtypes cannot specify 64-bit types when `jax_enable_x64` is "
                f"disabled: jd.pure_callback({name}) declares {dtype} for result #{index}")
        structs.append(jax.ShapeDtypeStruct(shape, dtype))
    return tree, tuple(structs)


def write_results(results, outs, name: str) -> None:
    """Checks the callback's result leaves against the output buffers and fills them."""
    if len(results) != len(outs):
        raise CallbackResultError(
            f"jd.pure_callback({name}) returned {len(results)} array(s) where its "
            f"result_shape_dtypes declares {len(outs)} (Mismatched number of outputs from "
            f"callback. Expected: {len(outs)}, Actual: {len(results)})")
    for index, (value, out) in enumerate(zip(results, outs)):
        if type(value) is not np.ndarray or value.dtype != out.dtype:
            value = _as_array(value, index, name)
        if value.shape != out.shape:
            raise CallbackResultError(
                f"jd.pure_callback({name}): result #{index} has shape {value.shape} where "
                f"result_shape_dtypes declares {out.shape} (Incorrect output shape for return "
                f"value #{index}: Expected: {out.shape}, Actual: {value.shape})")
        if value.dtype != out.dtype:
            raise CallbackResultError(
                f"jd.pure_callback({name}): result #{index} has dtype {value.dtype} where "
                f"result_shape_dtypes declares {out.dtype} (Incorrect output dtype for return "
                f"value #{index}: Expected: {out.dtype}, Actual: {value.dtype})")
        if out.size:
            out[...] = value


def _as_array(value, index: int, name: str) -> np.ndarray:
    try:
        array = np.asarray(value)
    except Exception as error:  # noqa: BLE001 - any failure to convert names the result
        raise CallbackResultError(
            f"jd.pure_callback({name}): result #{index} is a {type(value).__name__}, which "
            f"np.asarray cannot convert ({type(error).__name__}: {error})") from error
    if array.dtype.hasobject:
        raise CallbackResultError(
            f"jd.pure_callback({name}): result #{index} is a {type(value).__name__} that "
            f"converts to an object array, not numbers")
    if not jax.config.jax_enable_x64:
        wanted = jax.dtypes.canonicalize_dtype(array.dtype)
        if wanted != array.dtype:  # (JAX's canonicalize_value: f64 -> f32, i64 -> i32)
            array = array.astype(wanted)
    return array
