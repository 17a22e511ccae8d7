"""Builds jaxdecl's C++ dispatcher (jaxdecl._dispatch) against jaxlib's XLA FFI headers."""

import importlib.util
import os

import numpy
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup


def xla_ffi_include_dir() -> str:
    """jaxlib's bundled header-only XLA FFI API (what jax.ffi.include_dir() returns)."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("building jaxdecl needs jaxlib installed (for the XLA FFI headers)")
    include = os.path.join(list(spec.submodule_search_locations)[0], "include")
    if not os.path.exists(os.path.join(include, "xla", "ffi", "api", "ffi.h")):
        raise RuntimeError(f"jaxlib at {include} ships no XLA FFI headers")
    return include


dispatch = Pybind11Extension(
    "jaxdecl._dispatch",
    ["csrc/handler.cc", "csrc/module.cc"],
    include_dirs=["jaxdecl/include", xla_ffi_include_dir(), numpy.get_include()],
    cxx_std=17,
    # api.h trips -Wreturn-type on g++ 12 in code we do not own.
    extra_compile_args=["-O2", "-Wno-return-type", "-Wno-sign-compare"],
)

setup(ext_modules=[dispatch], cmdclass={"build_ext": build_ext})
