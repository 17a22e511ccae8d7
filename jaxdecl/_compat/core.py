"""JAX's core, as this JAX spells it: its version, the primitive's registries, tracing
state, the values traceable rules receive, and the runtime hooks the dispatcher sets.

Example:
    >>> from jaxdecl._compat import core
    >>> isinstance(core.JAX_VERSION, tuple), core.not_tracing()
    (True, True)
"""

from __future__ import annotations

import jax
import numpy as np
from jax._src import core as _core
from jax.extend.core import Primitive  # noqa: F401 - re-exported
from jax.interpreters import ad, batching

#: The running JAX's version, as text (for messages) and as a comparable tuple.
JAX_VERSION_TEXT = jax.__version__
JAX_VERSION = tuple(int(part) for part in JAX_VERSION_TEXT.split(".")[:3] if part.isdigit())

Zero = ad.Zero
UndefinedPrimal = ad.UndefinedPrimal
is_undefined_primal = ad.is_undefined_primal
instantiate_zeros = ad.instantiate_zeros
# vmap marks an unbatched operand with None (a NotMapped sentinel in older JAX).
not_mapped = getattr(batching, "not_mapped", None)
Tracer = jax.core.Tracer
JaxRuntimeError = getattr(jax.errors, "JaxRuntimeError", RuntimeError)
get_aval = jax.typeof

#: The class of every concrete JAX array (jax.Array is its abstract base): a type
#: check against it is the cheapest test for "a JAX array" on the eager path.
from jax._src.array import ArrayImpl  # noqa: E402, F401


#: True while no JAX trace is active (jit, vmap, grad, scan, eval_shape, ...).
#: Arguments alone cannot tell: a constant passed to an op inside ``jit`` is a
#: NumPy array, yet the op must be staged into the trace, not run. Every eager
#: call asks: see :func:`_not_tracing_function` for the fastest form this JAX allows.
def _not_tracing_function():
    """``trace_state_clean``, or the same test with fewer Python frames.

    JAX >= 0.10 keeps the trace and the axis environment in two thread-local
    states that ``TracingContext.is_top_level`` reads through two properties;
    reading them directly halves the cost. Used only where the code of those
    properties still reads what this function reads.
    """
    context = getattr(_core, "TracingContext", None)
    try:
        reads = (set(context.is_top_level.__code__.co_names),
                 set(context.trace.fget.__code__.co_names),
                 set(context.axis_env.fget.__code__.co_names))
        trace_state, axis_state = _core.trace_state_strong_ref, _core.axis_env_state
        top_trace, top_axis_env = _core.eval_trace, _core.top_axis_env
    except AttributeError:
        return _core.trace_state_clean
    if reads != ({"trace", "eval_trace", "axis_env", "top_axis_env"},
                 {"trace_state_strong_ref", "value"}, {"axis_env_state", "value"}):
        return _core.trace_state_clean

    def not_tracing() -> bool:
        return trace_state.value is top_trace and axis_state.value is top_axis_env

    return not_tracing


not_tracing = _not_tracing_function()


def hold_weakly_in_caches(cls) -> None:
    """Lets JAX's parameter-keyed caches (abstract evaluation) hold `cls` values weakly.

    Primitive parameters are cache keys; held strongly, an op's parameter would
    keep the op alive for as long as the cache remembers it.
    """
    try:
        from jax._src import util

        util.weakref_cache_key_types.add(cls)
    except (ImportError, AttributeError):  # pragma: no cover - other jax versions
        pass


# --- values a traceable rule receives ------------------------------------------------------
def _literal_types() -> tuple:
    try:  # JAX >= 0.7
        from jax._src import literals
    except ImportError:  # JAX 0.6: constants are NumPy or JAX arrays
        return ()
    names = ("LiteralArray", "LiteralInt", "LiteralFloat", "LiteralComplex",  # JAX 0.7
             "TypedNdArray", "TypedInt", "TypedFloat", "TypedComplex")  # JAX >= 0.8
    return tuple(t for t in (getattr(literals, n, None) for n in names) if isinstance(t, type))


_LITERAL_TYPES = _literal_types()


def _ordinary_array(value):
    from jax._src.lax import lax as lax_internal

    aval = jax.typeof(value)
    return lax_internal._convert_element_type(
        np.asarray(value), jax.dtypes.canonicalize_dtype(aval.dtype), aval.weak_type)


def plain_values(values) -> list:
    """`values` with JAX's constant literals turned into ordinary arrays of the same type.

    From JAX 0.7 a constant that a traced program holds reaches a primitive's
    rules as JAX's own host-side literal (``LiteralArray`` in 0.7,
    ``TypedNdArray`` from 0.8, or a scalar subclass of ``int``/``float``/
    ``complex``). It has only some of an array's operators (0.7's lacks ``**``,
    0.8's unary minus), and from 0.8 its arithmetic yields NumPy arrays
    (float64 cotangents for float32 inputs without x64). A traceable rule gets
    a JAX array of the literal's dtype and weak type instead, as on JAX 0.6.
    """
    if not _LITERAL_TYPES:
        return list(values)
    return [_ordinary_array(v) if isinstance(v, _LITERAL_TYPES) else v for v in values]


def float0_zero(aval) -> Zero:
    """The symbolic zero tangent of a primal value (float0 for integers)."""
    return Zero(aval.to_tangent_aval())


def worker_transfer_guard():
    """``(state, attribute, value)`` that forbids host-to-device transfers on a thread.

    While a rule runs on one of XLA's own worker threads, a rule that calls JAX
    there waits on a computation that waits on the rule (a deadlock); so the
    first transfer of a NumPy value into JAX fails instead. The dispatcher sets
    ``state().attribute = value`` around each such call itself (what
    ``jax.transfer_guard_host_to_device("disallow")`` does, less a context
    manager: inside an XLA loop this runs once per iteration).
    """
    from jax._src.lib import guard_lib

    return (guard_lib.thread_local_state, "host_to_device",
            guard_lib.TransferGuardLevel.DISALLOW)


def hide_frames(path: str) -> None:
    """Leaves jaxdecl's own frames out of JAX's filtered tracebacks."""
    try:
        from jax._src import traceback_util

        traceback_util.register_exclusion(path)
    except (ImportError, AttributeError):  # pragma: no cover - older/newer jax
        pass


def register_ffi_state_type(name: str, registration: dict, platform: str = "cpu") -> None:
    """Registers an FFI state type (``{"type_id": capsule, "type_info": capsule}``).

    On CPU, now: XLA takes a type only before the handlers that use it, and a
    CPU client that starts later registers JAX's queued handlers before its
    queued types: so the type goes straight to XLA's process-wide registry,
    which needs no client. Newer jaxlibs take the type's deleter with it
    (``register_custom_type``); older ones only its id.

    On another platform (``"CUDA"``) through JAX, which queues it until that
    platform's plugin starts (its registry is the plugin's own, with ids of its
    own: each platform needs a type id of its own). A CPU-only install only
    queues it.
    """
    import jax

    if platform != "cpu":
        register = getattr(jax.ffi, "register_ffi_type", None)
        if register is not None:
            register(name, registration, platform=platform)
        else:  # pragma: no cover - older
            jax.ffi.register_ffi_type_id(name, registration["type_id"], platform=platform)
        return
    from jaxlib import xla_client

    xla_module = xla_client._xla
    direct = getattr(xla_module, "register_custom_type", None)
    if direct is not None:
        direct(name, registration)
        return
    direct = getattr(xla_module, "register_custom_type_id", None)  # pragma: no cover - older
    direct(name, registration["type_id"])  # pragma: no cover - older


# ``jax_enable_x64`` as a state whose ``.value`` reads it (thread-local settings
# included) several times faster than ``jax.config.jax_enable_x64``: an eager call's
# lookup of its op reads it every time.
try:
    from jax._src.config import enable_x64 as X64
except ImportError:  # (a JAX that moves it: the public flag, read the same way)
    class _PublicX64:
        @property
        def value(self):
            return jax.config.jax_enable_x64

    X64 = _PublicX64()
