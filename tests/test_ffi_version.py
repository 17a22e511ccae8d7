"""The XLA FFI API version the dispatcher is built against stays accepted by this jaxlib.

The extension is compiled against the vendored headers of XLA FFI API 0.1
(``csrc/third_party``), the only version the oldest supported jaxlib accepts.
XLA promises each API version for at least 12 months, then may raise the
minimum it accepts. A probe handler that reports a chosen API version finds
the range the running jaxlib accepts (its registration is refused outside it);
the dispatcher's version must lie inside. On the first jaxlib that drops it,
this test fails and says what to do.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jaxlib
import pytest

from jaxdecl._host import _dispatch

# A handler that answers XLA's metadata query with the API version in g_version;
# XLA asks it when the target is registered and refuses versions it does not accept.
_PROBE_SOURCE = r"""
#include "xla/ffi/api/c_api.h"

extern "C" {
int g_version[2] = {0, 0};

static XLA_FFI_Error* Probe(XLA_FFI_CallFrame* frame) {
  if (frame->extension_start != nullptr &&
      frame->extension_start->type == XLA_FFI_Extension_Metadata) {
    auto* extension = reinterpret_cast<XLA_FFI_Metadata_Extension*>(frame->extension_start);
    extension->metadata->api_version = XLA_FFI_Api_Version{
        XLA_FFI_Api_Version_STRUCT_SIZE, nullptr, g_version[0], g_version[1]};
    extension->metadata->traits = 0;
  }
  return nullptr;
}

void* probe_address() { return reinterpret_cast<void*>(&Probe); }
}
"""

# Registers the probe at API versions 0.0 to 0.MAX in a fresh process (the
# backend started first: a refused registration queued before it would stop it).
_REGISTER = textwrap.dedent("""
    import ctypes, json, sys
    import jax

    library = ctypes.CDLL(sys.argv[1])
    library.probe_address.restype = ctypes.c_void_p
    version = (ctypes.c_int * 2).in_dll(library, "g_version")
    capsule = ctypes.pythonapi.PyCapsule_New
    capsule.restype = ctypes.py_object
    capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    jax.devices()
    accepted = []
    for minor in range(int(sys.argv[2]) + 1):
        version[0], version[1] = 0, minor
        try:
            jax.ffi.register_ffi_target(f"jaxdecl_api_probe_{minor}",
                                        capsule(library.probe_address(), None, None),
                                        platform="cpu")
        except Exception as error:  # refused: outside the accepted range
            if "incompatible" not in str(error):
                raise
        else:
            accepted.append([0, minor])
    print(json.dumps(accepted))
""")


def _header_version(include_dir: str) -> tuple:
    """``(major, minor)`` from the c_api.h under `include_dir`."""
    values = {}
    with open(os.path.join(include_dir, "xla", "ffi", "api", "c_api.h")) as header:
        for line in header:
            parts = line.split()
            if len(parts) == 3 and parts[0] == "#define" and parts[1] in (
                    "XLA_FFI_API_MAJOR", "XLA_FFI_API_MINOR"):
                values[parts[1]] = int(parts[2])
    return values["XLA_FFI_API_MAJOR"], values["XLA_FFI_API_MINOR"]


@pytest.fixture(scope="module")
def accepted(tmp_path_factory) -> list:
    """The API versions ``(0, minor)`` this jaxlib accepts, probed up to its own."""
    compiler = os.environ.get("CXX", "c++")
    folder = tmp_path_factory.mktemp("probe")
    source, library = folder / "probe.cc", folder / "probe.so"
    source.write_text(_PROBE_SOURCE)
    built = subprocess.run([compiler, "-shared", "-fPIC", "-O1", f"-I{jax.ffi.include_dir()}",
                            str(source), "-o", str(library)], capture_output=True, text=True)
    if built.returncode != 0:
        pytest.skip(f"no C++ compiler to build the probe: {built.stderr[-300:]}")
    newest = _header_version(jax.ffi.include_dir())[1]
    done = subprocess.run([sys.executable, "-c", _REGISTER, str(library), str(newest + 1)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [tuple(v) for v in json.loads(done.stdout.strip().splitlines()[-1])]


def test_this_jaxlib_accepts_the_dispatchers_ffi_api_version(accepted):
    built = tuple(_dispatch.FFI_API_VERSION)
    lowest, highest = min(accepted), max(accepted)
    assert built in accepted, (
        f"jaxlib {jaxlib.__version__} accepts "
        f"XLA FFI API {lowest[0]}.{lowest[1]} to {highest[0]}.{highest[1]}, but jaxdecl's "
        f"dispatcher is built against {built[0]}.{built[1]} (csrc/third_party): vendor the "
        f"headers of the oldest API this jaxlib accepts, and raise the oldest supported "
        f"jaxlib to the first that accepts them (README, 'Supported JAX versions')")
    # The probe itself is right: this jaxlib accepts its own headers' version, no newer.
    own = _header_version(jax.ffi.include_dir())
    assert highest == own


def test_the_dispatcher_is_built_against_the_vendored_headers():
    vendored = os.path.join(os.path.dirname(__file__), "..", "csrc", "third_party")
    if not os.path.isdir(vendored):
        pytest.skip("the source tree's csrc/ is not beside these tests")
    assert tuple(_dispatch.FFI_API_VERSION) == _header_version(vendored) == (0, 1)
