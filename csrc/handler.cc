// The XLA FFI execute handlers behind every jaxdecl primitive on CPU.
//
// `jaxdecl_dispatch` is what compiled HLO calls: its attributes carry the
// kernel's fingerprint (and name, for messages), never an object address or
// a process-local number, so that a program compiled, cached or serialized
// in one process runs the same op in another, or fails with an error that
// names it.  It has two stages: the instantiate stage (call_site.cc)
// resolves the fingerprint once per call site of an executable, and the
// execute stage here finds that call site and runs its kernel.
// `jaxdecl_dispatch_split` is the same for a call that XLA's batch
// partitioner splits.  `jaxdecl_dispatch_eager` is the eager path's: one
// compiled executable per signature serves every op, the kernel's slot
// arriving as the first operand (the eager caller holds the op while it
// waits).
//
// This file owns only what differs between the three: how each finds its
// kernel and describes the call.  Running the kernel is one step they share
// (Run); the views, the call sites, the error messages and the two kinds of
// kernel each have a file of their own, because each keeps invariants the
// others need not know.  Nothing escapes as an exception: every failure
// becomes an `ffi::Error`.

#include <Python.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "call_site.h"
#include "ffi_state.h"
#include "kernels.h"
#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxdecl {
namespace {

ffi::Error AsError(const std::string& error) {
  if (error.empty()) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal, error);
}

// Runs `kernel` for one call: the step all three handlers share once they
// have their kernel.
ffi::Error Run(const Kernel& kernel, const Call& call) {
  return AsError(kernel.c_function == nullptr ? RunPythonKernel(kernel, call)
                                              : RunCKernel(kernel, call));
}

// The attributes are the call site's; it already holds what they say.
// `drop`: see JaxdeclDispatchSplitImpl.
ffi::Error ExecuteSite(StateAccess access, ffi::ThreadPool& pool, ffi::RemainingArgs args,
                       ffi::RemainingRets rets, int drop) {
  CallSite* site = GetCallSite(access);
  if (site == nullptr) {
    return AsError("jaxdecl: the call site was not instantiated");
  }
  if (!Resolve(*site)) return AsError(NotAvailable(*site));
  return Run(*site->kernel, Call{args, rets, /*eager=*/false, &site->views, drop, &pool});
}

ffi::Error JaxdeclDispatchImpl(StateAccess access, int64_t, int64_t,
                               std::string_view, std::string_view, ffi::ThreadPool pool,
                               ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return ExecuteSite(access, pool, args, rets, /*drop=*/0);
}

// A call site that XLA's batch partitioner splits: every operand and result
// carries one trailing unit dimension, so that its leading dimensions, all
// the rule's own, can be declared batch dimensions (XLA leaves an operand
// that has nothing but batch dimensions whole).  The rule's views leave that
// unit dimension out.
ffi::Error JaxdeclDispatchSplitImpl(StateAccess access, int64_t, int64_t,
                                    std::string_view, std::string_view,
                                    ffi::ThreadPool pool, ffi::RemainingArgs args,
                                    ffi::RemainingRets rets) {
  return ExecuteSite(access, pool, args, rets, /*drop=*/1);
}

ffi::Error JaxdeclDispatchEagerImpl(ffi::ThreadPool pool, ffi::AnyBuffer slot,
                                    ffi::RemainingArgs args, ffi::RemainingRets rets) {
  int64_t key = -1;
  if (slot.element_type() == ffi::DataType::S64) {
    key = *static_cast<const int64_t*>(slot.untyped_data());
  } else if (slot.element_type() == ffi::DataType::S32) {
    key = *static_cast<const int32_t*>(slot.untyped_data());
  }
  KernelPtr kernel = FindBySlot(key);
  if (kernel == nullptr) {
    return AsError("jaxdecl: no kernel is registered in slot " +
                   std::to_string(key));
  }
  // The kernel's own views: its shapes are fixed, so they serve every eager
  // call as a call site's serve every run.
  return Run(*kernel,
             Call{args, rets, /*eager=*/true, &kernel->eager_views, /*drop=*/0, &pool});
}

}  // namespace
}  // namespace jaxdecl

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxdeclDispatch, jaxdecl::JaxdeclDispatchImpl,
    jaxdecl::BindCallSite<ffi::ExecutionStage::kExecute>()  // the call site
        .Ctx<ffi::ThreadPool>()                             // where rows may run
        .RemainingArgs()                                    // the rule's operands, in order
        .RemainingRets());                                  // the rule's results, in order

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxdeclDispatchSplit, jaxdecl::JaxdeclDispatchSplitImpl,
    jaxdecl::BindCallSite<ffi::ExecutionStage::kExecute>()  // the call site
        .Ctx<ffi::ThreadPool>()  // where rows may run
        .RemainingArgs()    // the rule's operands, each with a trailing unit dim
        .RemainingRets());  // the rule's results, likewise

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxdeclDispatchEager, jaxdecl::JaxdeclDispatchEagerImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::ThreadPool>()  // where rows may run
        .Arg<ffi::AnyBuffer>()  // the kernel's slot, an int32 or int64 scalar
        .RemainingArgs()        // the rule's operands, in order
        .RemainingRets());      // the rule's results, in order
