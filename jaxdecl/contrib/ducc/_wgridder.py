"""Radio-interferometric (w-)gridding: ``dirty2vis`` and ``vis2dirty`` (``ducc0.wgridder``).

Degridding and gridding are each other's adjoint, so both ops are the same
two DUCC calls in opposite roles; ``uvw`` and ``freq`` are non-differentiable
inputs.

Sharding: ``dirty2vis`` declares its rows and channels
independent (a visibility needs the whole image and its own row's ``uvw`` and
channel's frequency), so visibilities sharded along rows or channels are
predicted on each device without a gather; the transpose sums the
per-device images. ``vis2dirty`` sums over rows and channels (``reduce``):
each device grids its own visibilities and the partial images are added up.
The image dims are factors no input has (replicated).
"""

from __future__ import annotations

import ducc0
import jax
import numpy as np

import jaxdecl as jd

from ._checks import COMPLEX_OF, REAL_OF, check_dtype


def _check_visibility_coords(name: str, uvw, freq) -> None:
    for label, array in (("uvw", uvw), ("freq", freq)):
        check_dtype(f"{name} {label}", array.dtype, COMPLEX_OF)
    if len(uvw.shape) != 2 or uvw.shape[1] != 3:
        raise ValueError(f"{name}: uvw must have shape (nrows, 3), got {tuple(uvw.shape)}")
    if len(freq.shape) != 1:
        raise ValueError(f"{name}: freq must have shape (nchan,), got {tuple(freq.shape)}")


def _check_image_shape(name: str, shape) -> None:
    if len(shape) != 2 or any(n < 32 or n % 2 for n in shape):
        raise ValueError(
            f"{name}: the dirty image must be 2-D with even sides of at least 32 pixels "
            f"(a DUCC requirement), got {tuple(shape)}"
        )


class _WGridder:
    """Settings and DUCC calls shared by :class:`dirty2vis` and :class:`vis2dirty`."""

    def __init__(self, pixsize_x: float, pixsize_y: float, epsilon: float | None = None,
                 do_wgridding: bool = False, nthreads: int = 1):
        self.pixsize_x = float(pixsize_x)
        self.pixsize_y = float(pixsize_y)
        self.epsilon = None if epsilon is None else float(epsilon)
        self.do_wgridding = bool(do_wgridding)
        self.nthreads = int(nthreads)

    def _ducc_args(self, uvw, freq, real_dtype) -> dict:
        if self.epsilon is not None:
            epsilon = self.epsilon
        else:  # DUCC needs epsilon > 1e-5 in single and > 2e-13 in double precision
            epsilon = 1e-4 if np.dtype(real_dtype) == np.float32 else 1e-10
        # DUCC takes coordinates in double precision only; without jax_enable_x64
        # they arrive as float32 and are widened here (a small copy).
        return {"uvw": np.asarray(uvw, np.float64), "freq": np.asarray(freq, np.float64),
                "pixsize_x": self.pixsize_x, "pixsize_y": self.pixsize_y, "epsilon": epsilon,
                "do_wgridding": self.do_wgridding, "nthreads": self.nthreads}

    # Each op's adjoint is the other op, so both ops are made of these two calls,
    # in opposite roles.
    def _degrid(self, uvw, freq, dirty, vis) -> None:
        ducc0.wgridder.experimental.dirty2vis(dirty=dirty, vis=vis,
                                              **self._ducc_args(uvw, freq, dirty.dtype))

    def _grid(self, uvw, freq, vis, dirty) -> None:
        ducc0.wgridder.experimental.vis2dirty(vis=vis, dirty=dirty,
                                              **self._ducc_args(uvw, freq, dirty.dtype))


class dirty2vis(_WGridder, jd.Primitive, linear=True, nondiff=("uvw", "freq")):
    """Radio-interferometric degridding: dirty image -> visibilities (``ducc0.wgridder``).

    Args:
        pixsize_x, pixsize_y: angular pixel size of the image (projected radians).
        epsilon: requested accuracy; default 1e-4 (float32) or 1e-10 (float64).
        do_wgridding: apply the full w-term; otherwise w is taken as zero.
        nthreads: DUCC threads per call.

    Inputs: ``uvw`` (nrows, 3) in metres and ``freq`` (nchan,) in Hz, never
    differentiated; ``dirty`` (npix_x, npix_y), float32/float64, both sides
    even and at least 32. Output: visibilities (nrows, nchan), complex64 or
    complex128 to match, V = A d with A = exp(-2πi f/c (u l + v m + w (n-1))) / n.

    The map d ↦ A d is real-linear from real images to complex visibilities;
    its adjoint is :class:`vis2dirty`, d = Re(Aᴴ V), so JAX's transpose of a
    cotangent ct is ``vis2dirty(conj(ct))``. Both directions are exact only to
    `epsilon`, so dot-product tests hold to that accuracy.

    Example:
        >>> import numpy as np
        >>> from jaxdecl.contrib import ducc
        >>> dirty = np.zeros((32, 32)); dirty[16, 16] = 1.0  # a source at the phase centre
        >>> vis = ducc.dirty2vis(1e-5, 1e-5)(np.array([[100.0, 50.0, 0.0]]), np.array([1e9]), dirty)
        >>> np.allclose(vis, 1.0)
        True
    """

    @jd.abstract
    def shapes(self, uvw, freq, dirty):
        dtype = check_dtype("dirty2vis dirty", dirty.dtype, COMPLEX_OF)
        _check_visibility_coords("dirty2vis", uvw, freq)
        _check_image_shape("dirty2vis", dirty.shape)
        return jax.ShapeDtypeStruct((uvw.shape[0], freq.shape[0]), COMPLEX_OF[dtype])

    @jd.sharding
    def partition(self, uvw, freq, dirty):
        return jd.ShardingRule("r t, c, x y -> r c", replicate=("t", "x", "y"))

    @jd.forward
    def apply(self, uvw, freq, dirty, *, out):
        self._degrid(uvw, freq, dirty, vis=out)

    @jd.adjoint
    def apply_adjoint(self, uvw, freq, vis, *, out):
        self._grid(uvw, freq, vis, dirty=out)


class vis2dirty(_WGridder, jd.Primitive, linear=True, nondiff=("uvw", "freq")):
    """Radio-interferometric gridding: visibilities -> dirty image (``ducc0.wgridder``).

    Args:
        npix_x, npix_y: image size, both even and at least 32.
        pixsize_x, pixsize_y, epsilon, do_wgridding, nthreads: as :class:`dirty2vis`.

    Inputs: ``uvw`` (nrows, 3) and ``freq`` (nchan,), never differentiated;
    ``vis`` (nrows, nchan), complex64/complex128. Output: the dirty image
    (npix_x, npix_y), float32 or float64 to match, d = Re(Aᴴ V) with A as in
    :class:`dirty2vis`.

    The map is real-linear; JAX's transpose of a (real) image cotangent ct is
    ``conj(dirty2vis(ct))``: Re Σ ct·Re(Aᴴ V) = Re Σ conj(A ct)·V.

    Example:
        >>> import numpy as np
        >>> from jaxdecl.contrib import ducc
        >>> op = ducc.vis2dirty(32, 32, 1e-5, 1e-5)
        >>> dirty = op(np.array([[100.0, 50.0, 0.0]]), np.array([1e9]), np.array([[1.0 + 0j]]))
        >>> bool(np.isclose(dirty[16, 16], 1.0))
        True
    """

    def __init__(self, npix_x: int, npix_y: int, pixsize_x: float, pixsize_y: float,
                 epsilon: float | None = None, do_wgridding: bool = False, nthreads: int = 1):
        super().__init__(pixsize_x, pixsize_y, epsilon, do_wgridding, nthreads)
        self.npix_x = int(npix_x)
        self.npix_y = int(npix_y)
        _check_image_shape("vis2dirty", (self.npix_x, self.npix_y))

    @jd.abstract
    def shapes(self, uvw, freq, vis):
        dtype = check_dtype("vis2dirty vis", vis.dtype, REAL_OF)
        _check_visibility_coords("vis2dirty", uvw, freq)
        expected = (uvw.shape[0], freq.shape[0])
        if tuple(vis.shape) != expected:
            raise ValueError(
                f"vis2dirty: vis must have shape (nrows, nchan) = {expected} to match uvw and "
                f"freq, got {tuple(vis.shape)}"
            )
        return jax.ShapeDtypeStruct((self.npix_x, self.npix_y), REAL_OF[dtype])

    @jd.sharding
    def partition(self, uvw, freq, vis):
        return jd.ShardingRule("r t, c, r c -> x y", replicate=("t", "x", "y"),
                               reduce=("r", "c"))

    @jd.forward
    def apply(self, uvw, freq, vis, *, out):
        self._grid(uvw, freq, vis, dirty=out)

    @jd.adjoint
    def apply_adjoint(self, uvw, freq, dirty, *, out):
        self._degrid(uvw, freq, dirty, vis=out)
