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
// A compiled call site's state on CUDA is a call site (call_site.h) plus its
// pinned buffers, a state type of its own: the CUDA plugin keeps a type
// registry apart from the CPU client's, and each assigns its own type id.
// The handlers are not command-buffer compatible (they synchronise and run
// host code), so XLA never captures them into a CUDA graph.

#include <Python.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "../call_site.h"
#include "../ffi_state.h"
#include "gpu.h"
#include "staging.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxdecl::gpu {

// A compiled call site on CUDA: the platform-blind call site and its pinned
// buffers, destroyed together with the executable.
struct CudaCallSite {
  static XLA_FFI_TypeId id;  // the CUDA plugin's id for this type
  CallSite site;
  Staging staging;
};

XLA_FFI_TypeId CudaCallSite::id = {0};

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

void DeleteCudaCallSite(void* state) { delete static_cast<CudaCallSite*>(state); }

ffi::Error CudaInstantiateImpl(StateAccess access, int64_t hi, int64_t lo,
                               std::string_view name, std::string_view recipe) {
  auto state = std::make_unique<CudaCallSite>();
  ffi::Error failed = InitCallSite(state->site, hi, lo, name, recipe);
  if (failed.failure()) return failed;
  XLA_FFI_Error* error = SetState(access, &CudaCallSite::id, state.get(), &DeleteCudaCallSite);
  if (error != nullptr) {
    DestroyError(access.api, error);
    return ffi::Error(ffi::ErrorCode::kInternal,
                      "jaxdecl: XLA refused the call site's state on CUDA (" +
                          state->site.name + ")");
  }
  state.release();  // XLA owns it now
  return ffi::Error::Success();
}

ffi::Error ExecuteSite(StateAccess access, void* stream, int32_t ordinal,
                       ffi::RemainingArgs args, ffi::RemainingRets rets, int drop) {
  auto* state = static_cast<CudaCallSite*>(GetState(access, &CudaCallSite::id));
  if (state == nullptr) return AsError("jaxdecl: the CUDA call site was not instantiated");
  CallSite& site = state->site;
  if (!Resolve(site)) return AsError(NotAvailable(site));
  return AsError(RunOnDevice(*site.kernel,
                             DeviceCall{args, rets, false, &site.views, drop, stream, ordinal},
                             state->staging));
}

ffi::Error CudaDispatchImpl(StateAccess access, int64_t, int64_t, std::string_view,
                            std::string_view, void* stream, int32_t ordinal,
                            ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return ExecuteSite(access, stream, ordinal, args, rets, /*drop=*/0);
}

// See handler.cc: every buffer carries a trailing unit dim for XLA's batch
// partitioner, which the rule does not see.
ffi::Error CudaDispatchSplitImpl(StateAccess access, int64_t, int64_t, std::string_view,
                                 std::string_view, void* stream, int32_t ordinal,
                                 ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return ExecuteSite(access, stream, ordinal, args, rets, /*drop=*/1);
}

ffi::Error CudaDispatchEagerImpl(void* stream, int32_t ordinal, ffi::AnyBuffer slot,
                                 ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return AsError(RunEager(slot, args, rets, stream, ordinal));
}

}  // namespace

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
  std::shared_ptr<Staging> staging;
  {
    std::lock_guard<std::mutex> lock(kernel->gpu_mutex);
    if (kernel->eager_staging == nullptr) kernel->eager_staging = std::make_shared<Staging>();
    staging = kernel->eager_staging;
  }
  return RunOnDevice(*kernel,
                     DeviceCall{args, rets, true, &kernel->eager_views, 0, stream, ordinal},
                     *staging);
}

void* CudaCallSiteTypeId() { return &CudaCallSite::id; }

const void* CudaCallSiteTypeInfo() {
  static const TypeInfoV2 info{sizeof(TypeInfoV2), nullptr, &DeleteCudaCallSite};
  return &info;
}

}  // namespace jaxdecl::gpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxdeclInstantiateCuda, jaxdecl::gpu::CudaInstantiateImpl,
    // the call site's context and attributes, as its execute stages bind them
    jaxdecl::BindCallSite<ffi::ExecutionStage::kInstantiate>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxdeclDispatchCuda, jaxdecl::gpu::CudaDispatchImpl,
    jaxdecl::BindCallSite<ffi::ExecutionStage::kExecute>()   // the call site
        .Ctx<ffi::PlatformStream<void*>>()                   // XLA's CUDA stream
        .Ctx<jaxdecl::gpu::DeviceOrdinal>()                  // the device it runs on
        .RemainingArgs()                                     // the rule's operands, in order
        .RemainingRets());                                   // the rule's results, in order

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxdeclDispatchSplitCuda, jaxdecl::gpu::CudaDispatchSplitImpl,
    jaxdecl::BindCallSite<ffi::ExecutionStage::kExecute>()   // the call site
        .Ctx<ffi::PlatformStream<void*>>()                   // XLA's CUDA stream
        .Ctx<jaxdecl::gpu::DeviceOrdinal>()                  // the device it runs on
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
