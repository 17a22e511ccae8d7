"""Builds jaxdecl's C++ dispatcher (jaxdecl._dispatch).

It compiles against the XLA FFI headers in csrc/third_party (API 0.1, the
oldest that the supported jaxlibs accept): header-only, so nothing links
against jaxlib, and one build loads next to every supported JAX.
"""

import glob
import sys

import numpy
from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

# The sources compile in parallel, one job per core (NPY_NUM_BUILD_JOBS overrides):
# a release builds one wheel per Python.
ParallelCompile("NPY_NUM_BUILD_JOBS").install()

dispatch = Pybind11Extension(
    "jaxdecl._host._dispatch",
    [
        "csrc/handler.cc",  # the execute handlers
        "csrc/call_site.cc",  # the instantiate handler, per-executable state
        "csrc/ffi_state.cc",
        "csrc/python_kernel.cc",
        "csrc/rows.cc",  # batch="loop": one rule call per row
        "csrc/c_kernel.cc",
        "csrc/views.cc",
        "csrc/errors.cc",
        "csrc/registry.cc",
        "csrc/module.cc",  # the Python module
        # CUDA: the runtime found at run time (no CUDA headers, no nvcc), staging
        # through pinned memory, device rules, the handlers, DLPack, their Python face
        "csrc/gpu/cuda_runtime.cc",
        "csrc/gpu/staging.cc",
        "csrc/gpu/device_rules.cc",
        "csrc/gpu/handlers.cc",
        "csrc/gpu/dlpack.cc",
        "csrc/gpu/module_gpu.cc",
    ],
    include_dirs=["jaxdecl/include", "csrc/third_party", numpy.get_include()],
    # A changed header rebuilds every source: the structs in them are shared.
    depends=sorted(glob.glob("csrc/*.h") + glob.glob("csrc/gpu/*.h")),
    cxx_std=17,
    # dlopen (csrc/gpu/cuda_runtime.cc): in libc from glibc 2.34, in libdl before.
    libraries=["dl"] if sys.platform.startswith("linux") else [],
    # api.h trips -Wreturn-type on g++ 12 in code we do not own.
    extra_compile_args=["-O2", "-Wno-return-type", "-Wno-sign-compare"],
)

# jaxdecl.contrib.finufft's C kernels. They reach finufft's library through the function
# addresses its Python package hands over at import: no finufft at build time, and no
# compiler where the contrib package runs.
finufft_kernels = Pybind11Extension(
    "jaxdecl.contrib.finufft._kernels",
    ["jaxdecl/contrib/finufft/_kernels.cc"],
    include_dirs=["jaxdecl/include"],
    depends=["jaxdecl/include/jaxdecl.h"],
    cxx_std=17,
    extra_compile_args=["-O2"],
)

setup(ext_modules=[dispatch, finufft_kernels], cmdclass={"build_ext": build_ext})
