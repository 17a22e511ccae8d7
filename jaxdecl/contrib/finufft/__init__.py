"""finufft's non-uniform FFTs as jaxdecl ops, call-compatible with jax-finufft 1.3.1.

``nufft1``, ``nufft2`` and ``nufft3`` take jax-finufft's arguments, shapes,
batching, dtypes and options (``Opts``, ``NestedOpts``), so code written for
jax-finufft switches by changing its import::

    from jaxdecl.contrib.finufft import nufft1, nufft2, nufft3, Opts

They run on PyPI's ``finufft`` package (``pip install 'jaxdecl[finufft]'``):
each call is one C kernel over the C library that package ships, run by XLA
without Python and without the GIL, with finufft's plans kept between calls.
They are linear in their values, differentiable in the points, batch a
``vmap`` into finufft's own batch of transforms, and run per shard on
several devices. On a GPU they run host-staged (the same kernels on pinned
host copies of XLA's buffers); there are no cufinufft device rules. See
``docs/contrib-finufft.md``.

Modules: ``_library`` (finufft's C library and the kernels, ``_kernels.cc``),
``_options`` (``Opts`` and the packing of settings for the kernels),
``_shapes`` (jax-finufft's broadcasting), ``_ops`` (the three ops; types 1 and 2 masked),
``_derivatives`` (their derivatives in the points), ``_api`` (the functions).
``options`` re-exports the options under jax-finufft's module name.

Example:
    >>> import numpy as np
    >>> from jaxdecl.contrib.finufft import Opts, nufft1
    >>> x = np.linspace(-3, 3, 5); c = np.ones(5, np.complex128)
    >>> nufft1(8, c, x, eps=1e-9, opts=Opts(nthreads=1)).shape
    (8,)
"""

from . import options as options
from ._api import nufft1 as nufft1
from ._api import nufft2 as nufft2
from ._api import nufft3 as nufft3
from ._options import NestedOpts as NestedOpts
from ._options import Opts as Opts

__all__ = ["NestedOpts", "Opts", "nufft1", "nufft2", "nufft3", "options"]
