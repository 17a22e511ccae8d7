"""Shared by the GPU tests: kernels of ops, buffers described for the CUDA handlers' test
entry (``_dispatch.StagedSite``), and whether a GPU is at hand."""

from __future__ import annotations

import contextlib
import importlib.util

import numpy as np
import pytest

from jaxdecl._call import flatten_inputs
from jaxdecl._host import _dispatch
from jaxdecl._op.equation import Equation
from jaxdecl._op.handle import BoundOp
from jaxdecl._op.identity import handle_of
from jaxdecl._spec.interface import FORWARD

CODES = _dispatch.element_types()


def kernel_of(op, *args, batch: tuple = ()):
    """``(kernel, pin)``: the registered kernel of `op`'s forward at `args`, under a vmap of
    `batch` (hold `pin`)."""
    handle = handle_of(op)
    operands, signature = flatten_inputs(handle.spec, args)
    eqn = Equation(BoundOp(handle, op), FORWARD, signature, batch)
    shapes = tuple(batch + tuple(np.shape(x)) for x in operands)
    return eqn.kernel(shapes)


def kernel_for(op, args, rule: str, operand_shapes: tuple, wrt: int = -1):
    """``(kernel, pin)``: the kernel of `op`'s equation `rule` (an interface rule name:
    "forward", "jvp", "vjp", "transpose", ...) at inputs `args`, on operands of
    `operand_shapes`."""
    handle = handle_of(op)
    _, signature = flatten_inputs(handle.spec, args)
    return Equation(BoundOp(handle, op), rule, signature, (), wrt).kernel(operand_shapes)


def describe(array: np.ndarray) -> tuple:
    """``(address, shape, type code)``: a NumPy array as a "device" buffer of the fake."""
    return array.ctypes.data, list(array.shape), CODES[array.dtype.name]


@contextlib.contextmanager
def fake_cuda(fail: str = "", on: int = 0, code: int = 700, sticky: bool = False):
    """The fake CUDA runtime for the block (the real one, loaded on first use, after)."""
    _dispatch.use_fake_cuda(fail, on, code, sticky)
    _dispatch.fake_cuda_log()
    try:
        yield
    finally:
        _dispatch.use_real_cuda()


def calls(log) -> list:
    """The function names of a fake runtime log."""
    return [name for name, _ in log]


def has_gpu() -> bool:
    """A CUDA device is visible to JAX (its CUDA plugin is installed and starts)."""
    if importlib.util.find_spec("jax_cuda13_plugin") is None and \
            importlib.util.find_spec("jax_cuda12_plugin") is None:
        return False
    import jax

    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


#: Tests that run on a GPU, on the CUDA backend (tools/gpu-check runs them).
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(
    not has_gpu(), reason="needs a CUDA GPU and JAX's CUDA plugin (jax[cuda13] or jax[cuda12]); "
                          "tools/gpu-check runs these on a GPU machine")
