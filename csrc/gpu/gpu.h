// What the rest of the extension sees of csrc/gpu/: the CUDA handlers'
// registrations and the Python functions of the GPU room (module_gpu.cc).

#ifndef JAXDECL_CSRC_GPU_GPU_H_
#define JAXDECL_CSRC_GPU_GPU_H_

#include <cstdint>
#include <string>
#include <string_view>

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

// The compiled CUDA handlers' body: finds the kernel by its fingerprint (or
// rebuilds it from `recipe`), then runs it on the call.  "" or the message.
std::string RunCompiled(int64_t hi, int64_t lo, std::string_view name,
                        std::string_view recipe, ffi::RemainingArgs args,
                        ffi::RemainingRets rets, void* stream, int ordinal, int drop);

// Adds the GPU room's functions to the extension module.
void DefineModule(pybind11::module_& m);

}  // namespace jaxdecl::gpu

#endif  // JAXDECL_CSRC_GPU_GPU_H_
