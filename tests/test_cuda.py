"""The CUDA handlers' registration (jaxdecl/_host/cuda.py): queued by JAX on a CPU-only
install (nothing is loaded), the runtime's candidate paths, a refusing plugin."""

import importlib.util

import jax
import pytest

from jaxdecl._host import cuda

PLUGIN = importlib.util.find_spec("jax_cuda13_plugin") or importlib.util.find_spec(
    "jax_cuda12_plugin")


@pytest.mark.skipif(bool(PLUGIN), reason="JAX's CUDA plugin is installed: it took them")
def test_without_a_cuda_plugin_the_registrations_wait_in_jax_s_queue():
    from jaxlib import xla_client

    queued = [entry[0] for entry in xla_client._custom_callback.get("CUDA", [])]
    assert {"jaxdecl_dispatch", "jaxdecl_dispatch_split", "jaxdecl_dispatch_eager"} <= \
        set(queued)
    assert cuda.candidate_runtimes() == []  # no plugin: no runtime to look for


def test_a_plugin_that_refuses_the_handlers_leaves_the_cpu_working(monkeypatch):
    def refuse(name, handler, platform="cpu", **kwargs):
        raise RuntimeError("the plugin refused " + name)

    monkeypatch.setattr(jax.ffi, "register_ffi_target", refuse)
    with pytest.warns(RuntimeWarning, match=r"jaxdecl could not register its CUDA handlers "
                                            r"with JAX's CUDA plugin \(RuntimeError: the plugin "
                                            r"refused jaxdecl_dispatch\); programs with jaxdecl "
                                            r"ops run on CPUs only"):
        cuda.set_up()
