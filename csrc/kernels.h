// Running one kernel on the buffers of one call: what every execute handler
// does once it has found its kernel.
//
// Python kernels (python_kernel.cc) get NumPy views of the buffers, with the
// GIL held; C kernels (c_kernel.cc, jaxdecl.h) get the raw buffers and run
// without it.  Both return "" or the message the call fails with, and never
// let an exception out.  A header of its own because the handlers
// (handler.cc) choose between the two and the two share nothing else.

#ifndef JAXDECL_CSRC_KERNELS_H_
#define JAXDECL_CSRC_KERNELS_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "registry.h"
#include "views.h"
#include "xla/ffi/api/ffi.h"

namespace jaxdecl {

// One execution of a kernel, as the handler that received it describes it.
struct Call {
  ffi::RemainingArgs args;  // the rule's operands, in order
  ffi::RemainingRets rets;  // the rule's results, in order
  // An eager caller waits for this call and holds the op, so it can take the
  // rule's exception back (a compiled executable's caller cannot).
  bool eager;
  ViewCache* cache;  // a compiled call site's reusable views, or null (eager)
  int drop;          // trailing dimensions of every buffer the rule does not see
  // XLA's intra-op thread pool, where a C kernel's rows may run (rows.h); null
  // where the handler has none (a staged GPU call).
  ffi::ThreadPool* pool = nullptr;
};

// The most positional arguments a direct rule call passes ([instance,]
// inputs, output); a rule with more inputs is called through its kernel.
constexpr Py_ssize_t kMaxDirectArgs = 64;

// ("out",): the keyword names of a direct rule call.  GIL held.
PyObject* OutKeyword();

// The most threads one call's rows run on (c_kernel.cc): 0 for as many as XLA's
// pool has, 1 for in sequence.  JAXDECL_ROW_THREADS sets it at start-up.
int64_t RowThreads();
void SetRowThreads(int64_t threads);

// Calls a Python kernel as kernel(inputs, outputs, eager) (or its direct
// form), taking the GIL.
std::string RunPythonKernel(const Kernel& kernel, const Call& call);

// Runs `body` as every Python kernel runs: with the GIL, in the rules'
// floating-point environment, under the worker-thread guard, after checking
// that an eager kernel's op still lives.  (A device rule runs so too.)
std::string RunInPython(const Kernel& kernel, bool eager,
                        const std::function<std::string()>& body);

// Calls a C kernel on the call's buffers, without the GIL.
std::string RunCKernel(const Kernel& kernel, const Call& call);

// The buffers as jaxdecl.h describes them to a C kernel (host or GPU); the
// dimensions point into XLA's own shape, less the last `drop` (see ViewDims).
template <typename Buffers>
bool DescribeForC(const Buffers& buffers, int drop, std::vector<jaxdecl_buffer>* out) {
  out->resize(buffers.size());
  for (size_t i = 0; i < buffers.size(); ++i) {
    auto buffer = BufferAt(buffers, i);
    if (!buffer.has_value()) return false;
    auto dims = ViewDims(*buffer, drop);
    (*out)[i] = jaxdecl_buffer{buffer->untyped_data(), dims.begin(),
                               static_cast<int64_t>(dims.size()),
                               static_cast<int32_t>(buffer->element_type())};
  }
  return true;
}

}  // namespace jaxdecl

#endif  // JAXDECL_CSRC_KERNELS_H_
