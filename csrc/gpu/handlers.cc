// The XLA FFI handlers behind every jaxdecl primitive on CUDA.
//
// The same three targets as on the CPU (handler.cc), registered for the
// platform "CUDA" under the same names, so that one lowering serves both
// platforms and a program exported for ["cpu", "cuda"] is one artifact.  They
// differ from the CPU's only in data movement and streams: each binds XLA's
// stream and the device's ordinal (a multi-GPU program runs each shard on its
// own device), and runs its kernel through RunOnDevice (staging.h): a device
// rule on the device buffers, or the host rule on pinned host copies.
//
// A compiled call site on CUDA keeps no FFI state: XLA's CUDA backend (seen
// with JAX 0.11) crashes while compiling a custom call whose handler has an
// instantiate stage, before that stage runs.  So each run finds its kernel by
// the fingerprint its attributes carry (a hash lookup), pins the op for the
// run, and stages through the kernel's own pinned pools.  The Python
// executable's keep-alive holds the kernel while the program can be called
// (jaxdecl/_host/registry.py); a loaded program whose ops this process never
// made rebuilds them from their recipes, once.
// The handlers are not command-buffer compatible (they synchronise and run
// host code), so XLA never captures them into a CUDA graph.

#include <Python.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>

#include "../call_site.h"
#include "gpu.h"
#include "staging.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxdecl::gpu {

// The device's ordinal as a handler argument: `.Ctx<DeviceOrdinal>()`.
struct DeviceOrdinal {};

}  // namespace jaxdecl::gpu

namespace xla::ffi {

template <>
struct CtxDecoding<jaxdecl::gpu::DeviceOrdinal> {
  using Type = int32_t;

  static std::optional<Type> Decode(const XLA_FFI_Api* api, XLA_FFI_ExecutionContext* ctx,
                                    DiagnosticEngine& diagnostic) {
    XLA_FFI_DeviceOrdinal_Get_Args args{XLA_FFI_DeviceOrdinal_Get_Args_STRUCT_SIZE, nullptr,
                                        ctx, 0};
    if (XLA_FFI_Error* error = api->XLA_FFI_DeviceOrdinal_Get(&args)) {
      diagnostic.Emit("Failed to get the device ordinal: ")
          << internal::GetErrorMessage(api, error);
      internal::DestroyError(api, error);
      return std::nullopt;
    }
    return args.device_ordinal;
  }
};

}  // namespace xla::ffi

namespace jaxdecl::gpu {
namespace {

ffi::Error AsError(const std::string& error) {
  if (error.empty()) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal, error);
}

// Loaded programs' call sites whose kernels were rebuilt from their recipes
// (or could not be: the failure is said once), by fingerprint, for the
// process: as many as the ops of the programs it loaded.  GIL held.
using RebuiltSiteMap =
    std::unordered_map<Fingerprint, std::unique_ptr<CallSite>, FingerprintHash>;
RebuiltSiteMap& RebuiltSites() {
  static auto* sites = new RebuiltSiteMap();
  return *sites;  // never destroyed: the interpreter may be gone at exit
}

// A compiled call's kernel and a strong reference to its op for the run.
struct FoundKernel {
  KernelPtr kernel;
  PyObject* pin = nullptr;
  std::string error;
};

FoundKernel FindCompiledKernel(int64_t hi, int64_t lo, std::string_view name,
                               std::string_view recipe) {
  FoundKernel found;
  if (!Py_IsInitialized()) {
    found.error = "jaxdecl: the Python interpreter is gone";
    return found;
  }
  PyGILState_STATE gil = PyGILState_Ensure();
  Fingerprint fingerprint{static_cast<uint64_t>(hi), static_cast<uint64_t>(lo)};
  found.kernel = FindLiveByFingerprint(fingerprint);
  if (found.kernel != nullptr) {
    found.pin = found.kernel->Instance();
  } else {
    std::unique_ptr<CallSite>& site = RebuiltSites()[fingerprint];
    if (site == nullptr) {
      site = std::make_unique<CallSite>();
      InitCallSite(*site, hi, lo, name, recipe);  // (its failure, if any, is kept)
    }
    if (Resolve(*site)) {
      found.kernel = site->kernel;
      found.pin = site->pin;
      Py_XINCREF(found.pin);
    } else {
      found.error = NotAvailable(*site);
    }
  }
  PyGILState_Release(gil);
  return found;
}

void DropPin(PyObject* pin) {
  if (pin == nullptr || !Py_IsInitialized()) return;
  PyGILState_STATE gil = PyGILState_Ensure();
  Py_DECREF(pin);
  PyGILState_Release(gil);
}

// The kernel's pinned pools, made at its first GPU run (shared with its eager calls).
std::shared_ptr<Staging> StagingOf(const Kernel& kernel) {
  std::lock_guard<std::mutex> lock(kernel.gpu_mutex);
  if (kernel.eager_staging == nullptr) kernel.eager_staging = std::make_shared<Staging>();
  return kernel.eager_staging;
}

ffi::Error ExecuteSite(int64_t hi, int64_t lo, std::string_view name, std::string_view recipe,
                       void* stream, int32_t ordinal, ffi::RemainingArgs args,
                       ffi::RemainingRets rets, int drop) {
  return AsError(RunCompiled(hi, lo, name, recipe, args, rets, stream, ordinal, drop));
}

ffi::Error CudaDispatchImpl(int64_t hi, int64_t lo, std::string_view name,
                            std::string_view recipe, void* stream, int32_t ordinal,
                            ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return ExecuteSite(hi, lo, name, recipe, stream, ordinal, args, rets, /*drop=*/0);
}

// See handler.cc: every buffer carries a trailing unit dim for XLA's batch
// partitioner, which the rule does not see.
ffi::Error CudaDispatchSplitImpl(int64_t hi, int64_t lo, std::string_view name,
                                 std::string_view recipe, void* stream, int32_t ordinal,
                                 ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return ExecuteSite(hi, lo, name, recipe, stream, ordinal, args, rets, /*drop=*/1);
}

ffi::Error CudaDispatchEagerImpl(void* stream, int32_t ordinal, ffi::AnyBuffer slot,
                                 ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return AsError(RunEager(slot, args, rets, stream, ordinal));
}

}  // namespace

std::string RunCompiled(int64_t hi, int64_t lo, std::string_view name,
                        std::string_view recipe, ffi::RemainingArgs args,
                        ffi::RemainingRets rets, void* stream, int ordinal, int drop) {
  FoundKernel found = FindCompiledKernel(hi, lo, name, recipe);
  if (found.kernel == nullptr) return found.error;
  std::shared_ptr<Staging> staging = StagingOf(*found.kernel);
  std::string error = RunOnDevice(
      *found.kernel,
      DeviceCall{args, rets, false, &found.kernel->eager_views, drop, stream, ordinal},
      *staging);
  DropPin(found.pin);
  return error;
}

std::string RunEager(const ffi::AnyBuffer& slot, ffi::RemainingArgs args,
                     ffi::RemainingRets rets, void* stream, int ordinal) {
  std::string error;
  const CudaRuntime* rt = Runtime(&error);
  if (rt == nullptr) return "jaxdecl: " + error;
  // The kernel's slot is an operand, so it lives on the device: read it first.
  int64_t key = -1;
  size_t width = slot.element_type() == ffi::DataType::S64   ? 8
                 : slot.element_type() == ffi::DataType::S32 ? 4
                                                             : 0;
  if (width != 0) {
    int64_t value = 0;  // (little-endian: an int32 lands in the low half)
    int code = rt->SetDevice(ordinal);
    if (code == 0) {
      code = rt->MemcpyAsync(&value, slot.untyped_data(), width, kDeviceToHost, stream);
    }
    if (code == 0) code = rt->StreamSynchronize(stream);
    if (code != 0) {
      return "jaxdecl: reading an eager call's kernel slot on GPU " + std::to_string(ordinal) +
             " failed: " + ErrorText(*rt, code);
    }
    key = width == 8 ? value : static_cast<int32_t>(value);
  }
  KernelPtr kernel = FindBySlot(key);
  if (kernel == nullptr) return "jaxdecl: no kernel is registered in slot " + std::to_string(key);
  std::shared_ptr<Staging> staging = StagingOf(*kernel);
  return RunOnDevice(*kernel,
                     DeviceCall{args, rets, true, &kernel->eager_views, 0, stream, ordinal},
                     *staging);
}

}  // namespace jaxdecl::gpu

// What a compiled call binds on CUDA: the call site's attributes (as on the
// CPU, without its state), XLA's stream, the device, the rule's buffers.
static auto BindCudaCallSite() {
  return ffi::Ffi::Bind()
      .Attr<int64_t>("fingerprint_hi")       // which kernel: a stable fingerprint
      .Attr<int64_t>("fingerprint_lo")
      .Attr<std::string_view>("name")        // Class.method, for messages
      .Attr<std::string_view>("recipe")      // how to rebuild it anywhere
      .Ctx<ffi::PlatformStream<void*>>()     // XLA's CUDA stream
      .Ctx<jaxdecl::gpu::DeviceOrdinal>();   // the device it runs on
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxdeclDispatchCuda, jaxdecl::gpu::CudaDispatchImpl,
    BindCudaCallSite()
        .RemainingArgs()    // the rule's operands, in order
        .RemainingRets());  // the rule's results, in order

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxdeclDispatchSplitCuda, jaxdecl::gpu::CudaDispatchSplitImpl,
    BindCudaCallSite()
        .RemainingArgs()    // the rule's operands, each with a trailing unit dim
        .RemainingRets());  // the rule's results, likewise

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxdeclDispatchEagerCuda, jaxdecl::gpu::CudaDispatchEagerImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<void*>>()    // XLA's CUDA stream
        .Ctx<jaxdecl::gpu::DeviceOrdinal>()   // the device it runs on
        .Arg<ffi::AnyBuffer>()                // the kernel's slot, an int32 or int64 scalar
        .RemainingArgs()                      // the rule's operands, in order
        .RemainingRets());                    // the rule's results, in order
