// C kernels (kernels.h, jaxdecl.h): a rule compiled to a C function, run on
// descriptions of XLA's buffers without the GIL: once, or once per row of a
// looped batch (rows.h); given only the operands it takes; conjugated around
// the call where the rule is an adjoint.  (From Python, jaxdecl/_cfunction.py
// calls a kernel through ctypes.)
//
// Kept apart because it is the one path that touches no Python object per
// call: the buffer descriptions and the error message buffer are all it needs.

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fp_env.h"
#include "kernels.h"
#include "rows.h"
#include "views.h"

namespace jaxdecl {
namespace {

// jaxdecl.h's element type codes are XLA's, so a buffer's code passes through.
static_assert(JAXDECL_BOOL == static_cast<int>(ffi::DataType::PRED));
static_assert(JAXDECL_INT8 == static_cast<int>(ffi::DataType::S8));
static_assert(JAXDECL_UINT64 == static_cast<int>(ffi::DataType::U64));
static_assert(JAXDECL_FLOAT16 == static_cast<int>(ffi::DataType::F16));
static_assert(JAXDECL_FLOAT64 == static_cast<int>(ffi::DataType::F64));
static_assert(JAXDECL_COMPLEX64 == static_cast<int>(ffi::DataType::C64));
static_assert(JAXDECL_BFLOAT16 == static_cast<int>(ffi::DataType::BF16));
static_assert(JAXDECL_COMPLEX128 == static_cast<int>(ffi::DataType::C128));

// Room for a C kernel's error message; the buffer is per thread, allocated
// once, and only its first byte is cleared per call.
constexpr int64_t kMessageSize = 64 * 1024;

std::string RunCFunction(jaxdecl_kernel function,
                         const std::vector<jaxdecl_buffer>& inputs,
                         const std::vector<jaxdecl_buffer>& outputs) {
  thread_local std::vector<char> message(kMessageSize);
  message[0] = '\0';
  int status = function(inputs.data(), static_cast<int64_t>(inputs.size()),
                        outputs.data(), static_cast<int64_t>(outputs.size()),
                        message.data(), kMessageSize);
  if (status == 0) return {};
  bool truncated = std::memchr(message.data(), '\0', kMessageSize) == nullptr;
  message[kMessageSize - 1] = '\0';
  std::string text = message.data();
  if (truncated) text += " [message truncated]";
  return "C kernel failed with status " + std::to_string(status) +
         (text.empty() ? std::string() : ": " + text);
}

// Complex elements are (real, imaginary) pairs: negating every second value
// conjugates them in place.
template <typename Real>
void Conjugate(void* data, int64_t count) {
  Real* values = static_cast<Real*>(data);
  for (int64_t i = 1; i < 2 * count; i += 2) values[i] = -values[i];
}

bool ConjugateIfComplex(const jaxdecl_buffer& buffer) {
  int64_t count = 1;
  for (int64_t d = 0; d < buffer.rank; ++d) count *= buffer.dims[d];
  if (buffer.dtype == JAXDECL_COMPLEX64) {
    Conjugate<float>(buffer.data, count);
  } else if (buffer.dtype == JAXDECL_COMPLEX128) {
    Conjugate<double>(buffer.data, count);
  } else {
    return false;
  }
  return true;
}

size_t ElementBytes(int32_t dtype) {
  return ffi::ByteWidth(static_cast<ffi::DataType>(dtype));
}

// One call of the kernel's function on `inputs` (all of the rule's operands)
// and `outputs`, as the kernel's record says: only the operands it takes,
// and around an adjoint the conjugations that make it the transpose (the
// conjugated operands are copies: XLA's input buffers are not ours to write).
std::string CallFunction(const Kernel& kernel, std::vector<jaxdecl_buffer> inputs,
                         const std::vector<jaxdecl_buffer>& outputs) {
  thread_local std::vector<std::vector<char>> copies;
  if (kernel.c_conj_from >= 0) {
    if (copies.size() < inputs.size()) copies.resize(inputs.size());
    for (size_t i = kernel.c_conj_from; i < inputs.size(); ++i) {
      jaxdecl_buffer& buffer = inputs[i];
      if (buffer.dtype != JAXDECL_COMPLEX64 && buffer.dtype != JAXDECL_COMPLEX128) continue;
      int64_t count = 1;
      for (int64_t d = 0; d < buffer.rank; ++d) count *= buffer.dims[d];
      size_t bytes = static_cast<size_t>(count) * ElementBytes(buffer.dtype);
      copies[i].resize(bytes);
      std::memcpy(copies[i].data(), buffer.data, bytes);
      buffer.data = copies[i].data();
      ConjugateIfComplex(buffer);
    }
  }
  std::string error;
  if (kernel.c_operands.empty()) {
    error = RunCFunction(kernel.c_function, inputs, outputs);
  } else {
    std::vector<jaxdecl_buffer> taken;
    taken.reserve(kernel.c_operands.size());
    for (int index : kernel.c_operands) taken.push_back(inputs[index]);
    error = RunCFunction(kernel.c_function, taken, outputs);
  }
  if (error.empty() && kernel.c_conj_from >= 0) {
    for (const jaxdecl_buffer& buffer : outputs) ConjugateIfComplex(buffer);
  }
  return error;
}

// batch="loop": the function once per row, on descriptions of each row (the
// batch dimensions dropped) moved along the buffers.  No Python, no GIL.
std::string RunRowsOf(const Kernel& kernel, std::vector<jaxdecl_buffer> inputs,
                      std::vector<jaxdecl_buffer> outputs) {
  RowCursor cursor(kernel.row_dims);
  std::vector<void*> starts;
  for (auto* side : {&inputs, &outputs}) {
    for (jaxdecl_buffer& buffer : *side) {
      if (!cursor.Add(buffer.dims, buffer.rank, ElementBytes(buffer.dtype))) {
        return "jaxdecl: the call's buffers do not fit its batch";
      }
      starts.push_back(buffer.data);
      buffer.dims += cursor.rank();
      buffer.rank -= cursor.rank();
    }
  }
  for (int64_t row = 0; row < cursor.rows(); ++row) {
    if (row > 0) cursor.Next();
    size_t k = 0;
    for (auto* side : {&inputs, &outputs}) {
      for (jaxdecl_buffer& buffer : *side) {
        buffer.data = static_cast<char*>(starts[k]) + cursor.offset(k);
        ++k;
      }
    }
    std::string error = CallFunction(kernel, inputs, outputs);
    if (!error.empty()) return error;
  }
  return {};
}

}  // namespace

std::string RunCKernel(const Kernel& kernel, const Call& call) {
  std::vector<jaxdecl_buffer> inputs, outputs;
  if (!DescribeForC(call.args, call.drop, &inputs) ||
      !DescribeForC(call.rets, call.drop, &outputs)) {
    return "jaxdecl: an operand is not a buffer";
  }
  std::string error;
  {
    RuleFpEnvironment environment;  // the caller's usual one, not XLA's (fp_env.h)
    error = kernel.row_dims.empty()
                ? CallFunction(kernel, std::move(inputs), outputs)
                : RunRowsOf(kernel, std::move(inputs), std::move(outputs));
  }
  return error.empty() ? error : kernel.name + ": " + error;
}

}  // namespace jaxdecl
