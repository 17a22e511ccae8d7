"""finufft's C library, and the C kernels that call it (``_kernels``, built with jaxdecl).

The ``finufft`` Python package ships its C library (``libfinufft.so``,
``.dylib`` or ``finufft.dll`` beside its modules). This module opens that
library, hands the addresses of the guru interface's functions to the kernels
once, and wraps each kernel with ``jd.cfunction``. Nothing is compiled here:
the kernels were built with jaxdecl, against ``jaxdecl.h`` alone.
"""

from __future__ import annotations

import ctypes
import pathlib

import finufft

import jaxdecl as jd

try:
    from . import _kernels
except ImportError as error:  # a source tree whose extensions were not built
    raise ImportError(
        "jaxdecl.contrib.finufft needs its compiled kernels (jaxdecl/contrib/finufft/_kernels), "
        "built with jaxdecl: reinstall it (pip install 'jaxdecl[finufft]'), or in a source "
        "checkout run `python setup.py build_ext --inplace`"
    ) from error

_FUNCTIONS = ("_default_opts", "_makeplan", "_setpts", "_execute", "_destroy")


def library_path() -> pathlib.Path:
    """The C library inside the installed ``finufft`` package."""
    folder = pathlib.Path(finufft.__file__).resolve().parent
    found = sorted(p for p in folder.iterdir()
                   if "finufft" in p.name and p.suffix in (".so", ".dylib", ".dll"))
    if not found:
        raise ImportError(f"jaxdecl.contrib.finufft: no finufft C library in {folder}; "
                          f"reinstall finufft (pip install 'finufft>=2.5')")
    return found[0]


def _bind() -> dict:
    """Opens finufft's library, gives its functions to the kernels; the kernels by name."""
    library = ctypes.CDLL(str(library_path()))  # the handle the finufft package holds too
    addresses = {}
    for prefix in ("finufft", "finufftf"):
        for name in _FUNCTIONS:
            try:
                function = getattr(library, prefix + name)
            except AttributeError:
                raise ImportError(
                    f"jaxdecl.contrib.finufft: {library_path()} has no {prefix + name}; it needs "
                    f"finufft >= 2.5 (pip install 'finufft>=2.5')") from None
            addresses[prefix + name] = ctypes.cast(function, ctypes.c_void_p).value
    _kernels.bind(addresses)
    return {name: jd.cfunction(address, keepalive=(library, _kernels), name=f"finufft_{name}")
            for name, address in _kernels.kernels().items()}


KERNELS = _bind()
CONFIG_SIZE = _kernels.CONFIG_SIZE
CONFIG_MAGIC = _kernels.CONFIG_MAGIC


def counters() -> dict:
    """What the kernels did in this process: plans made, setpts run and skipped, executes
    and transforms by finufft type, plans kept."""
    return dict(_kernels.counters())


def clear_plans() -> int:
    """Destroys the kept plans that no call is using; returns how many."""
    return _kernels.clear()
