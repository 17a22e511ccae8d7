// C kernels (kernels.h, jaxdecl.h): a rule compiled to a C function, run on
// descriptions of XLA's buffers (or of NumPy arrays, for a rule looped over a
// batch in Python) without the GIL.
//
// Kept apart because it is the one path that touches no Python object per
// call: the buffer descriptions and the error message buffer are all it needs.

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels.h"
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

// The buffers as jaxdecl.h describes them; the dimensions point into XLA's
// own shape, less the last `drop` (see ViewDims).
template <typename Buffers>
bool Describe(const Buffers& buffers, int drop, std::vector<jaxdecl_buffer>* out) {
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

}  // namespace

std::string RunCKernel(const Kernel& kernel, const Call& call) {
  std::vector<jaxdecl_buffer> inputs, outputs;
  if (!Describe(call.args, call.drop, &inputs) ||
      !Describe(call.rets, call.drop, &outputs)) {
    return "jaxdecl: an operand is not a buffer";
  }
  std::string error = RunCFunction(kernel.c_function, inputs, outputs);
  return error.empty() ? error : kernel.name + ": " + error;
}

std::string CallCKernel(jaxdecl_kernel function, PyObject* inputs,
                        PyObject* outputs) {
  std::vector<jaxdecl_buffer> described[2];
  std::vector<std::vector<int64_t>> dims;
  PyObject* tuples[2] = {inputs, outputs};
  dims.reserve(PyTuple_GET_SIZE(inputs) + PyTuple_GET_SIZE(outputs));
  for (int side = 0; side < 2; ++side) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tuples[side]); ++i) {
      PyObject* item = PyTuple_GET_ITEM(tuples[side], i);
      if (!PyArray_Check(item) ||
          !PyArray_IS_C_CONTIGUOUS(reinterpret_cast<PyArrayObject*>(item))) {
        return "jaxdecl: C kernels take C-contiguous NumPy arrays";
      }
      auto* array = reinterpret_cast<PyArrayObject*>(item);
      int code = -1;
      for (int c = 0; c < 256; ++c) {
        if (g_descrs[c] != nullptr &&
            PyArray_EquivTypes(g_descrs[c], PyArray_DESCR(array))) {
          code = c;
          break;
        }
      }
      if (code < 0) return "jaxdecl: unsupported dtype for a C kernel";
      npy_intp* shape = PyArray_SHAPE(array);
      dims.emplace_back(shape, shape + PyArray_NDIM(array));
      described[side].push_back(jaxdecl_buffer{
          PyArray_DATA(array), dims.back().data(), PyArray_NDIM(array), code});
    }
  }
  std::string error;
  Py_BEGIN_ALLOW_THREADS
  error = RunCFunction(function, described[0], described[1]);
  Py_END_ALLOW_THREADS
  return error;
}

}  // namespace jaxdecl
