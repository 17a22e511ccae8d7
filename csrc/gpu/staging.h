// Host rules on a GPU: staging a call's buffers through pinned host memory.
//
// A kernel without a device rule runs on the GPU exactly as on the CPU, on
// host memory: its operands are copied device-to-host on XLA's stream into
// pinned buffers, the stream is synchronised once (without the GIL), the
// same kernel runs on a host mirror of the call frame (so the views, the view
// cache, the row loop, the escape check, the floating-point environment and
// the C kernels are the CPU's, unchanged), and its results are copied back
// host-to-device on the same stream.  An event recorded after those copies
// lets the next run wait for them before it reuses the buffers, so a call
// synchronises once, not twice.
//
// The pinned buffers belong to a kernel (its compiled and eager calls share
// them), one pool per device, allocated at the first run and reused while
// the shapes fit; a run that finds its pool busy (the same kernel running
// concurrently on one device) stages through a temporary pool.  Every CUDA
// failure becomes a message naming the op and the CUDA error, never an abort.

#ifndef JAXDECL_CSRC_GPU_STAGING_H_
#define JAXDECL_CSRC_GPU_STAGING_H_

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../kernels.h"
#include "../registry.h"
#include "cuda_runtime.h"
#include "xla/ffi/api/ffi.h"

namespace jaxdecl::gpu {

// A call frame's buffers as XLA_FFI_Args/Rets of their own, whose data
// pointers can be pointed elsewhere (at pinned host copies): what
// ffi::RemainingArgs/Rets decode.
class Frame {
 public:
  void Reset(size_t n_args, size_t n_rets);
  XLA_FFI_Buffer& arg(size_t i) { return args_[i]; }
  XLA_FFI_Buffer& ret(size_t i) { return rets_[i]; }
  ffi::RemainingArgs Args(size_t offset = 0) const {
    return ffi::RemainingArgs(&c_args_, offset);
  }
  ffi::RemainingRets Rets() const { return ffi::RemainingRets(&c_rets_, 0); }

 private:
  std::vector<XLA_FFI_Buffer> args_, rets_;
  std::vector<XLA_FFI_ArgType> arg_types_;
  std::vector<XLA_FFI_RetType> ret_types_;
  std::vector<void*> arg_pointers_, ret_pointers_;
  XLA_FFI_Args c_args_{};
  XLA_FFI_Rets c_rets_{};
};

// Copies `buffer`'s description (type, shape) into `out`, data pointing at `data`.
void Describe(const ffi::AnyBuffer& buffer, void* data, XLA_FFI_Buffer* out);

// Pinned host buffers for one device: one per operand, then one per result.
struct PinnedPool {
  const CudaRuntime* runtime = nullptr;  // the runtime that allocated them
  int ordinal = -1;
  std::vector<void*> buffers;
  std::vector<size_t> capacities;
  void* event = nullptr;  // recorded after the last run's copies back
  bool pending = false;   // that event has not been waited for
  bool busy = false;      // a run is using the pool (guarded by Staging::mutex)
  Frame frame;            // the host mirror of the call frame

  ~PinnedPool();
};

// The pools of one kernel's GPU runs, one per device.
struct Staging {
  std::mutex mutex;
  std::vector<std::unique_ptr<PinnedPool>> pools;
};

// One run of a kernel on a GPU, as the CUDA handler received it.
struct DeviceCall {
  ffi::RemainingArgs args;  // device buffers
  ffi::RemainingRets rets;
  bool eager;
  ViewCache* cache;  // the views' cache of the call site (or kernel)
  int drop;          // trailing dims the rule does not see (split call sites)
  void* stream;      // XLA's stream
  int ordinal;       // the device's CUDA ordinal
};

// "jaxdecl: Op.rule (@forward) on GPU 1: what failed: cudaErrorX (n): text".
std::string CudaFailure(const CudaRuntime& runtime, const Kernel& kernel, int ordinal,
                        const std::string& what, int code);

// Runs `kernel` on the GPU call `call`: its device rule where it has one,
// else staged through `staging`'s pinned buffers.  Returns "" or the message
// the call fails with.  Called without the GIL.
std::string RunOnDevice(const Kernel& kernel, const DeviceCall& call, Staging& staging);

// The staged path alone (RunOnDevice without a device rule).
std::string RunStaged(const CudaRuntime& runtime, const Kernel& kernel,
                      const DeviceCall& call, Staging& staging);

// The device-rule path (device_rules.cc).
std::string RunDeviceRule(const CudaRuntime& runtime, const Kernel& kernel,
                          const DeviceCall& call);

}  // namespace jaxdecl::gpu

#endif  // JAXDECL_CSRC_GPU_STAGING_H_
