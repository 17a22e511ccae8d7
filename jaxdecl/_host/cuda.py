"""The dispatcher on CUDA: its handlers registered for JAX's CUDA plugin, and where the CUDA
runtime is.

jaxdecl's wheel is the CPU one; the CUDA handlers (``csrc/gpu/``) are in the same
extension and need no CUDA to build or to import. :func:`set_up` (run by
:func:`jaxdecl._host.registry.set_up`, at import) registers them for the platform
``"CUDA"`` under the CPU targets' names, so that one lowering serves both platforms.
Without JAX's CUDA plugin the registrations only wait in JAX's queue for a CUDA backend
that never starts: nothing is loaded. The CUDA runtime itself is looked up when a CUDA
handler first runs: the ``libcudart`` JAX's plugin loaded, else one of the paths
:func:`candidate_runtimes` finds here.

Example:
    >>> from jaxdecl._host import cuda
    >>> isinstance(cuda.candidate_runtimes(), list)
    True
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import jax

from ._dispatch import gpu_registrations, set_cuda_candidates

#: JAX's CUDA plugins, newest first: (plugin module, the nvidia package holding the CUDA
#: runtime it uses, that runtime's soname).
_PLUGINS = (("jax_cuda13_plugin", "nvidia.cu13", "libcudart.so.13"),
            ("jax_cuda12_plugin", "nvidia.cuda_runtime", "libcudart.so.12"))


def candidate_runtimes() -> list:
    """Paths of the CUDA runtime of each installed JAX CUDA plugin's major version, from
    the ``nvidia`` wheels it depends on; none without a plugin. Finding them imports
    nothing but the ``nvidia`` namespace package, and loads no library."""
    paths = []
    for plugin, package, soname in _PLUGINS:
        if importlib.util.find_spec(plugin) is None:
            continue
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        for folder in (spec.submodule_search_locations or ()) if spec else ():
            path = os.path.join(folder, "lib", soname)
            if os.path.exists(path):
                paths.append(path)
    return paths


def set_up() -> None:
    """Registers the CUDA handlers under the CPU targets'
    names (queued by JAX until a CUDA backend starts), and where the runtime may be.

    A CUDA plugin that is already running and refuses them leaves jaxdecl working on
    the CPU, with a warning that says why: it must not stop ``import jaxdecl``.
    """
    set_cuda_candidates(candidate_runtimes())
    try:
        for target, handler in gpu_registrations().items():
            jax.ffi.register_ffi_target(target, handler, platform="CUDA")
    except Exception as error:  # noqa: BLE001 - reported, and the CPU keeps working
        warnings.warn(
            f"jaxdecl could not register its CUDA handlers with JAX's CUDA plugin "
            f"({type(error).__name__}: {error}); programs with jaxdecl ops run on CPUs only "
            f"in this process", RuntimeWarning, stacklevel=2)
