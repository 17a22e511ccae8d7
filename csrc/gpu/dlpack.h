// DLPack capsules of device buffers: what a device array's `__dlpack__`
// hands CuPy, PyTorch or Numba.
//
// The structs are DLPack's ABI (https://dmlc.github.io/dlpack/latest/), both
// the legacy `DLManagedTensor` ("dltensor" capsules) and the versioned one of
// DLPack 1.0 ("dltensor_versioned", which carries the read-only flag).  The
// tensor holds a reference to the Python object that owns the memory (the
// device array) until the consumer's deleter runs, with or without the GIL.

#ifndef JAXDECL_CSRC_GPU_DLPACK_H_
#define JAXDECL_CSRC_GPU_DLPACK_H_

#include <Python.h>

#include <cstdint>
#include <vector>

namespace jaxdecl::gpu {

// A capsule of `owner`'s memory at `address` (a new reference), or null with
// a Python error set.  `code` is an XLA element type; `device_type` DLPack's
// (kDLCUDA is 2, kDLCPU 1).
PyObject* DlpackCapsule(PyObject* owner, uintptr_t address, const std::vector<int64_t>& shape,
                        int code, int device_type, int device_id, bool read_only,
                        bool versioned);

}  // namespace jaxdecl::gpu

#endif  // JAXDECL_CSRC_GPU_DLPACK_H_
