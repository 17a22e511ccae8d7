"""DUCC transforms (FFTs, Hartley, spherical harmonics, NUFFT, radio gridding) as jaxdecl ops.

Each transform is a short linear jaxdecl class: ``@forward`` calls ``ducc0``,
``@transpose`` or ``@adjoint`` calls ``ducc0`` again, and JAX derives every
derivative from those two. Static settings (axes, normalisation, ``nside``,
``lmax``, pixel sizes, thread count) live on the instance, so equal settings share
compiled code.

One private module per family, re-exported here: ``_fft`` (``c2c``, ``r2c``,
``c2r``, ``genuine_fht``), ``_sht`` (``healpix_synthesis``, ``synthesis_2d``,
``nalm``), ``_nufft`` (``u2nu``, ``nu2u``) and ``_wgridder`` (``dirty2vis``,
``vis2dirty``); ``_checks`` holds the dtype checks they share.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxdecl.contrib import ducc
    >>> fft = ducc.c2c(axes=(0,))
    >>> fft(jnp.ones(4, jnp.complex64)).tolist()
    [(4+0j), 0j, 0j, 0j]
"""

from ._fft import c2c as c2c
from ._fft import c2r as c2r
from ._fft import genuine_fht as genuine_fht
from ._fft import r2c as r2c
from ._nufft import nu2u as nu2u
from ._nufft import u2nu as u2nu
from ._sht import healpix_synthesis as healpix_synthesis
from ._sht import nalm as nalm
from ._sht import synthesis_2d as synthesis_2d
from ._wgridder import dirty2vis as dirty2vis
from ._wgridder import vis2dirty as vis2dirty

__all__ = [
    "c2c",
    "c2r",
    "dirty2vis",
    "genuine_fht",
    "healpix_synthesis",
    "nalm",
    "nu2u",
    "r2c",
    "synthesis_2d",
    "u2nu",
    "vis2dirty",
]
