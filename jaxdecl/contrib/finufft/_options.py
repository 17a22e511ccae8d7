"""finufft's options (``Opts``, ``NestedOpts``), as jax-finufft 1.3.1 names them, and their packing.

``Opts`` has jax-finufft's fields, defaults and enums, so code written for
``jax_finufft.options`` runs unchanged; any object with those attributes
(jax-finufft's own ``Opts`` too) is accepted wherever an ``Opts`` is. The GPU
fields are kept for that compatibility and ignored on the CPU.

The C kernels take no instance configuration, so an op's settings travel as
its first operand: :func:`pack` writes them (tolerance, sign, options; the
forward's and its transpose's) into 152 bytes that the kernels read
(``Settings``/``Config`` in ``_kernels.cc``).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from enum import IntEnum

import numpy as np

from ._library import CONFIG_MAGIC, CONFIG_SIZE


class DebugLevel(IntEnum):
    """finufft's ``debug`` and ``spread_debug`` levels."""

    Silent = 0
    Verbose = 1
    Noisy = 2


class GpuDebugLevel(IntEnum):
    """cufinufft's debug levels (kept for compatibility; unused on the CPU)."""

    Silent = 0
    Verbose = 1


class FftwFlags(IntEnum):
    """FFTW's planner flags (``fftw=``)."""

    Estimate = 64
    Measure = 0
    Patient = 32
    Exhaustive = 8
    WisdomOnly = 2097152


class SpreadSort(IntEnum):
    """Whether the spreader sorts the points: never, always, or as a heuristic says."""

    NoSort = 0
    Sort = 1
    Heuristic = 2


class SpreadThread(IntEnum):
    """How a batch of transforms is spread over threads."""

    Auto = 0
    Sequential = 1
    Parallel = 2


class GpuMethod(IntEnum):
    """cufinufft's spreading method (kept for compatibility; unused on the CPU)."""

    Auto = 0
    Driven = 1
    Shared = 2


_CASTS = {bool: bool, int: int, float: float}


@functools.cache
def _field_types() -> dict:
    return typing.get_type_hints(Opts)


@dataclasses.dataclass(frozen=True)
class Opts:
    """finufft's options, as jax-finufft 1.3.1's ``Opts`` (same fields and defaults).

    ``nthreads=0`` lets finufft use every core (OpenMP); ``nthreads=1`` runs
    each transform on the calling thread, which is what several devices or
    threads calling at once want. ``modeord=True`` orders modes as an FFT does
    (zero first) instead of from -N/2. The ``gpu_*`` fields are accepted and
    ignored.

    Example:
        >>> from jaxdecl.contrib.finufft import Opts
        >>> Opts(nthreads=1, modeord=True).nthreads
        1
    """

    modeord: bool = False
    debug: DebugLevel = DebugLevel.Silent
    spread_debug: DebugLevel = DebugLevel.Silent
    showwarn: bool = False
    nthreads: int = 0
    fftw: int = FftwFlags.Estimate
    spread_sort: SpreadSort = SpreadSort.Heuristic
    spread_kerevalmeth: bool = True
    spread_kerpad: bool = True
    upsampfac: float = 0.0
    spread_thread: SpreadThread = SpreadThread.Auto
    maxbatchsize: int = 0
    spread_nthr_atomic: int = -1
    spread_max_sp_size: int = 0

    gpu_upsampfac: float = 2.0
    gpu_method: GpuMethod = GpuMethod.Auto
    gpu_sort: bool = True
    gpu_binsizex: int = 0
    gpu_binsizey: int = 0
    gpu_binsizez: int = 0
    gpu_obinsizex: int = 0
    gpu_obinsizey: int = 0
    gpu_obinsizez: int = 0
    gpu_maxsubprobsize: int = 1024
    gpu_kerevalmeth: bool = True
    gpu_spreadinterponly: bool = False
    gpu_maxbatchsize: int = 0
    gpu_debug: GpuDebugLevel = GpuDebugLevel.Silent

    def __post_init__(self):
        # As jax-finufft's pydantic dataclass: values are coerced to the field's type.
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            kind = _field_types()[field.name]
            cast = kind if issubclass(kind, IntEnum) else _CASTS[kind]
            try:
                converted = cast(value)
            except (TypeError, ValueError):
                raise TypeError(f"Opts.{field.name} takes {kind.__name__}, got {value!r}") from None
            object.__setattr__(self, field.name, converted)

    def to_finufft_opts(self):
        """finufft's own options (``finufft_opts``) as a plain object of ints and floats,
        as jax-finufft's method of this name gives them."""
        native = {name: int(getattr(self, name)) for name in _INTS[1:]}
        return types.SimpleNamespace(**native, upsampfac=float(self.upsampfac))

    def to_cufinufft_opts(self):
        """cuFINUFFT's options as a plain object, as jax-finufft's method of this name gives
        them (here only for callers that read them: contrib runs no cuFINUFFT)."""
        return types.SimpleNamespace(
            modeord=int(self.modeord), upsampfac=float(self.gpu_upsampfac),
            gpu_method=int(self.gpu_method), gpu_sort=int(self.gpu_sort),
            gpu_kerevalmeth=int(self.gpu_kerevalmeth),
            gpu_maxbatchsize=int(self.gpu_maxbatchsize), debug=int(self.gpu_debug))


@dataclasses.dataclass(frozen=True)
class NestedOpts:
    """Different options per transform, as jax-finufft 1.3.1's ``NestedOpts``.

    ``forward`` (or ``type1``/``type2``/``type3``, by the transform's type)
    applies to a transform itself; ``backward`` to the transforms its
    derivatives run in the other direction (a ``NestedOpts`` there nests).
    An entry left ``None`` means the default ``Opts()``.

    Example:
        >>> from jaxdecl.contrib.finufft import NestedOpts, Opts
        >>> NestedOpts(forward=Opts(nthreads=1), backward=Opts(nthreads=2)).backward.nthreads
        2
    """

    type1: Opts | None = None
    type2: Opts | None = None
    type3: Opts | None = None
    forward: Opts | None = None
    backward: Opts | NestedOpts | None = None


def as_opts(value):
    """None, an :class:`Opts` or a :class:`NestedOpts` from `value` (any object with their
    attributes, jax-finufft's own options too)."""
    if value is None or isinstance(value, (Opts, NestedOpts)):
        return value
    if all(hasattr(value, name) for name in ("forward", "backward", "type1")):
        return NestedOpts(**{f.name: as_opts(getattr(value, f.name))
                             for f in dataclasses.fields(NestedOpts)})
    if hasattr(value, "modeord") and hasattr(value, "nthreads"):
        return Opts(**{f.name: getattr(value, f.name) for f in dataclasses.fields(Opts)
                       if hasattr(value, f.name)})
    raise TypeError(f"opts takes jaxdecl.contrib.finufft.Opts, NestedOpts or None, got {value!r}")


def unpack_opts(opts, finufft_type, forward):
    """The options that apply to a transform of `finufft_type` (`forward`), or to the
    transforms in the other direction (not `forward`), as jax-finufft chooses them (its
    ``unpack_opts``, with its parameter names: callers pass them by keyword).

    Example:
        >>> from jaxdecl.contrib.finufft.options import NestedOpts, Opts, unpack_opts
        >>> nested = NestedOpts(type2=Opts(modeord=True))
        >>> unpack_opts(nested, finufft_type=2, forward=True).modeord
        True
    """
    if not isinstance(opts, NestedOpts):
        return opts
    if forward:
        if opts.forward is not None:
            return opts.forward
        if finufft_type in (1, 2, 3):
            return getattr(opts, f"type{finufft_type}")
        return opts
    return opts.backward if opts.backward is not None else opts


def resolved(opts, nufft_type: int) -> Opts:
    """The :class:`Opts` that a transform of `nufft_type` itself runs with."""
    chosen = unpack_opts(opts, nufft_type, True)
    return Opts() if chosen is None else chosen


TRANSPOSED_TYPE = {1: 2, 2: 1, 3: 3}

_INTS = ("iflag", "modeord", "debug", "spread_debug", "showwarn", "nthreads", "fftw",
         "spread_sort", "spread_kerevalmeth", "spread_kerpad", "spread_thread", "maxbatchsize",
         "spread_nthr_atomic", "spread_max_sp_size")
SETTINGS_DTYPE = np.dtype([("eps", "<f8"), ("upsampfac", "<f8")] + [(n, "<i4") for n in _INTS])
CONFIG_DTYPE = np.dtype([("magic", "<u4"), ("size", "<u4"), ("forward", SETTINGS_DTYPE),
                         ("transpose", SETTINGS_DTYPE)])
assert CONFIG_DTYPE.itemsize == CONFIG_SIZE, "CONFIG_DTYPE must match _kernels.cc's Config"


def _settings(record, opts: Opts, eps: float, iflag: int) -> None:
    record["eps"], record["upsampfac"], record["iflag"] = eps, opts.upsampfac, iflag
    for name in _INTS[1:]:
        record[name] = int(getattr(opts, name))


def pack(nufft_type: int, eps: float, iflag: int, opts) -> np.ndarray:
    """The kernels' first operand: (152,) uint8, the forward's settings and its transpose's."""
    config = np.zeros((), CONFIG_DTYPE)
    config["magic"], config["size"] = CONFIG_MAGIC, CONFIG_SIZE
    _settings(config["forward"], resolved(opts, nufft_type), eps, iflag)
    back = TRANSPOSED_TYPE[nufft_type]
    _settings(config["transpose"], resolved(unpack_opts(opts, nufft_type, False), back), eps, iflag)
    packed = np.frombuffer(config.tobytes(), np.uint8).copy()
    packed.flags.writeable = False
    return packed
