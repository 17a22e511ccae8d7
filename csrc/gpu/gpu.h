// What the rest of the extension sees of csrc/gpu/: the CUDA handlers'
// registrations and the Python functions of the GPU room (module_gpu.cc).

#ifndef JAXDECL_CSRC_GPU_GPU_H_
#define JAXDECL_CSRC_GPU_GPU_H_

#include <string>

#include "xla/ffi/api/ffi.h"

namespace pybind11 {
class module_;
}  // namespace pybind11

namespace jaxdecl::gpu {

namespace ffi = xla::ffi;

// The eager CUDA handler's body: reads the kernel's slot from the device,
// then runs the kernel on the call.  "" or the message the call fails with.
std::string RunEager(const ffi::AnyBuffer& slot, ffi::RemainingArgs args,
                     ffi::RemainingRets rets, void* stream, int ordinal);

// Adds the GPU room's functions to the extension module.
void DefineModule(pybind11::module_& m);

}  // namespace jaxdecl::gpu

#endif  // JAXDECL_CSRC_GPU_GPU_H_
