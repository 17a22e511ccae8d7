"""finufft's options under jax-finufft's module name: ``from ...finufft.options import Opts``.

Code that imports ``jax_finufft.options`` switches by changing that import
too; everything here is defined in ``_options``.

Example:
    >>> from jaxdecl.contrib.finufft.options import Opts, SpreadSort
    >>> Opts(spread_sort=SpreadSort.Sort).spread_sort == 1
    True
"""

from ._options import DebugLevel as DebugLevel
from ._options import FftwFlags as FftwFlags
from ._options import GpuDebugLevel as GpuDebugLevel
from ._options import GpuMethod as GpuMethod
from ._options import NestedOpts as NestedOpts
from ._options import Opts as Opts
from ._options import SpreadSort as SpreadSort
from ._options import SpreadThread as SpreadThread
from ._options import unpack_opts as unpack_opts

__all__ = ["DebugLevel", "FftwFlags", "GpuDebugLevel", "GpuMethod", "NestedOpts", "Opts",
           "SpreadSort", "SpreadThread", "unpack_opts"]
