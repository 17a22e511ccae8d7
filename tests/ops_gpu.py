"""Ops the GPU tests share (tests/test_gpu_lowering.py, tests/test_gpu.py): the batching
forms beside tests/ops.py's, and ops with device rules written with CuPy."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxdecl as jd


class Vectorized(jd.Primitive, batch="vectorized"):
    """cumsum along the last axis; the rule sees the whole batch."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        return np.cumsum(x, axis=-1)


class Batched(jd.Primitive):
    """x reversed; batched by its own @batch rule (a loop of calls)."""

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x):
        return x[::-1].copy()

    @jd.batch
    def batched(self, args, axes):
        (x,), (axis,) = args, axes
        return jnp.stack([self(row) for row in jnp.moveaxis(x, axis, 0)]), 0


def cupy_stream(stream):
    """XLA's stream as CuPy's current stream (``with cupy_stream(stream): ...``)."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:  # CuPy 14: the CUDA stream protocol (jaxdecl's stream has it)
        return from_external(stream)
    return cupy.cuda.ExternalStream(int(stream))


class CupyScale(jd.Primitive, linear=True):
    """factor * x, its device rules in CuPy (the zero-copy form and the return form);
    `calls` counts which rules ran."""

    calls: list = []

    def __init__(self, factor):
        self.factor = factor

    @jd.abstract
    def shapes(self, x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    @jd.forward
    def apply(self, x, *, out):
        type(self).calls.append("apply")
        np.multiply(x, self.factor, out=out)

    @jd.forward(platform="gpu")
    def apply_gpu(self, x, *, out, stream):
        import cupy

        type(self).calls.append(("apply_gpu", x.device, x.shape))
        with cupy_stream(stream):
            cupy.multiply(cupy.asarray(x), self.factor, out=cupy.asarray(out))

    @jd.transpose
    def back(self, ct):
        type(self).calls.append("back")
        return self.factor * ct

    @jd.transpose(platform="gpu")
    def back_gpu(self, ct, *, stream):
        import cupy

        type(self).calls.append(("back_gpu", ct.device, ct.shape))
        with cupy_stream(stream):
            return cupy.asarray(ct) * self.factor
