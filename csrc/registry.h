// Shared between the FFI handler (handler.cc) and the Python module
// (module.cc): the kernel registry and the dtype table.  Every function here
// that touches Python objects must be called with the GIL held.

#ifndef JAXDECL_CSRC_REGISTRY_H_
#define JAXDECL_CSRC_REGISTRY_H_

#include <Python.h>

#include <cstdint>
#include <string>

#include "jaxdecl.h"

namespace jaxdecl {

// What XLA runs for one key: a Python host kernel, or a C kernel that runs
// without the GIL.
struct Kernel {
  PyObject* call = nullptr;        // kernel(inputs, outputs) -> None | str
  PyObject* on_escape = nullptr;   // on_escape(is_output, index) -> str
  jaxdecl_kernel c_function = nullptr;
  PyObject* keepalive = nullptr;   // owner of c_function's code (capsule, ctypes)
};

// Looks up what the handler needs from Python (gc.collect); false with a
// Python error set on failure.  Called once, when the module is imported.
bool Initialize();

// Registers a kernel for the process's lifetime; returns its key (>= 1), or
// -1 when the registry is full.  Keys are never reused: a compiled executable
// may carry one for as long as the process lives.
int64_t RegisterKernel(const Kernel& kernel);

// The kernel under `key`, or nullptr.  Safe without the GIL.
const Kernel* FindKernel(int64_t key);

int64_t KernelCount();

// NumPy dtype for an XLA element type code (a new reference), or nullptr.
void SetDescr(int code, PyObject* descr);

// Python callables run around kernels on XLA's worker threads.
void SetWorkerHooks(PyObject* enter, PyObject* exit);

// Calls a C kernel on NumPy arrays (C-contiguous); returns "" or the error.
std::string CallCKernel(jaxdecl_kernel function, PyObject* inputs,
                        PyObject* outputs);

}  // namespace jaxdecl

#endif  // JAXDECL_CSRC_REGISTRY_H_
