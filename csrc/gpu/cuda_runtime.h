// The CUDA runtime, found at run time: the table of the few CUDA runtime
// functions the GPU handlers call.
//
// jaxdecl's wheel is the CPU one: it is built without CUDA headers, without
// nvcc and without linking libcudart.  The functions below are declared here
// with their C ABI (every CUDA handle is a pointer, every cudaError_t an int)
// and looked up with dlsym in the libcudart that JAX's CUDA plugin has already
// loaded, the first time a CUDA handler runs (never at import or lowering, so
// a CPU-only install never maps it).  Only when no loaded libcudart is found
// are the candidate paths tried that Python found at set-up (the `nvidia`
// wheels matching the installed plugin's CUDA major).
//
// The table can be replaced by a fake whose "device" is host memory (memcpy,
// malloc) and which fails on the N-th call of a chosen function: tests drive
// the exact staging path of the CUDA handlers on a machine without a GPU.

#ifndef JAXDECL_CSRC_GPU_CUDA_RUNTIME_H_
#define JAXDECL_CSRC_GPU_CUDA_RUNTIME_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace jaxdecl::gpu {

// cudaMemcpyKind
constexpr int kHostToDevice = 1;
constexpr int kDeviceToHost = 2;
constexpr int kDeviceToDevice = 3;
constexpr unsigned kHostAllocPortable = 0x01;  // cudaHostAllocPortable
constexpr unsigned kEventDisableTiming = 0x02;  // cudaEventDisableTiming

// The CUDA runtime functions the handlers call, with their C signatures
// (cudaError_t is an int; 0 is cudaSuccess).
struct CudaRuntime {
  std::string origin;  // where the functions come from, for messages
  int (*SetDevice)(int device);
  int (*MemcpyAsync)(void* dst, const void* src, size_t bytes, int kind, void* stream);
  int (*MemsetAsync)(void* dst, int value, size_t bytes, void* stream);
  int (*StreamSynchronize)(void* stream);
  int (*HostAlloc)(void** pointer, size_t bytes, unsigned flags);
  int (*FreeHost)(void* pointer);
  int (*EventCreateWithFlags)(void** event, unsigned flags);
  int (*EventRecord)(void* event, void* stream);
  int (*EventSynchronize)(void* event);
  int (*EventDestroy)(void* event);
  int (*StreamWaitEvent)(void* stream, void* event, unsigned flags);
  const char* (*GetErrorName)(int error);
  const char* (*GetErrorString)(int error);
};

// The runtime the handlers use now, loaded on first use; null with `error`
// set when no CUDA runtime can be found.  Thread-safe.
const CudaRuntime* Runtime(std::string* error);

// "cudaErrorX: text" for a CUDA error code of `runtime`.
std::string ErrorText(const CudaRuntime& runtime, int code);

// Where to look for libcudart when JAX's plugin has loaded none (set once
// from Python, at set-up; tried in order).
void SetCandidates(std::vector<std::string> paths);

// Tests: replaces the runtime with the fake, whose device is host memory.
// `fail_function` (a name of CudaRuntime's fields, e.g. "MemcpyAsync"; empty:
// none) fails with `fail_code` on its `fail_on`-th call (1-based) and every
// call after it when `sticky`.
void UseFake(const std::string& fail_function, int fail_on, int fail_code, bool sticky);

// Tests: the real runtime again (loaded on first use, as before UseFake).
void UseReal();

// Tests: the fake's calls so far, oldest first, as (function, arguments) with
// pointers and sizes as integers; and forgets them.
std::vector<std::tuple<std::string, std::vector<int64_t>>> TakeFakeLog();

// The fake runtime's counts of live pinned allocations and events (tests
// prove that nothing leaks).
int64_t FakeLiveAllocations();
int64_t FakeLiveEvents();

}  // namespace jaxdecl::gpu

#endif  // JAXDECL_CSRC_GPU_CUDA_RUNTIME_H_
