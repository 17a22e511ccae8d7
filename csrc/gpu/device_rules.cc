// Device rules (platform="gpu"): kernels that run on XLA's device buffers,
// on XLA's stream, with no staging.
//
// A Python device rule is called through its kernel (jaxdecl/_host/
// device_kernels.py) with each buffer as (address, shape, type code), XLA's
// stream and the device's ordinal: the kernel makes the device arrays the
// rule sees, walks the rows of batch="loop" and copies a returned array into
// XLA's buffer on the stream.  A C device rule (jaxdecl_gpu_kernel) gets the
// buffers' descriptions and the stream, without the GIL, once or once per row.

#include <cstring>
#include <string>
#include <vector>

#include "../errors.h"
#include "../rows.h"
#include "../views.h"
#include "staging.h"

namespace jaxdecl::gpu {
namespace {

// Room for a C kernel's error message, as on the CPU.
constexpr int64_t kMessageSize = 64 * 1024;

// ((address, shape, type code), ...) of `buffers`, less `drop` trailing dims
// (a new reference), or null with a Python error set.
template <typename Buffers>
PyObject* Descriptions(const Buffers& buffers, int drop) {
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(buffers.size()));
  for (size_t i = 0; tuple != nullptr && i < buffers.size(); ++i) {
    auto buffer = BufferAt(buffers, i);
    if (!buffer.has_value()) {
      PyErr_SetString(PyExc_TypeError, "an operand is not a buffer");
      Py_CLEAR(tuple);
      break;
    }
    auto dims = ViewDims(*buffer, drop);
    PyObject* shape = PyTuple_New(static_cast<Py_ssize_t>(dims.size()));
    for (size_t d = 0; shape != nullptr && d < dims.size(); ++d) {
      PyTuple_SET_ITEM(shape, d, PyLong_FromLongLong(dims[d]));
    }
    PyObject* item = shape == nullptr ? nullptr : Py_BuildValue(
        "(KNi)", static_cast<unsigned long long>(
                     reinterpret_cast<uintptr_t>(buffer->untyped_data())),
        shape, static_cast<int>(buffer->element_type()));
    if (item == nullptr) {
      Py_CLEAR(tuple);
      break;
    }
    PyTuple_SET_ITEM(tuple, static_cast<Py_ssize_t>(i), item);
  }
  return tuple;
}

// Calls the Python device kernel.  GIL held.
std::string CallDeviceKernel(const Kernel& kernel, const DeviceCall& call) {
  PyObject* inputs = Descriptions(call.args, call.drop);
  PyObject* outputs = inputs == nullptr ? nullptr : Descriptions(call.rets, call.drop);
  if (outputs == nullptr) {
    Py_XDECREF(inputs);
    return FetchPythonError();
  }
  PyObject* stream = PyLong_FromUnsignedLongLong(
      static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(call.stream)));
  PyObject* ordinal = PyLong_FromLong(call.ordinal);
  PyObject* result = nullptr;
  if (stream != nullptr && ordinal != nullptr) {
    PyObject* args[] = {inputs, outputs, stream, ordinal, call.eager ? Py_True : Py_False};
    result = PyObject_Vectorcall(kernel.device_call, args, 5, nullptr);
  }
  std::string error = ErrorOf(result);
  Py_XDECREF(result);
  Py_XDECREF(stream);
  Py_XDECREF(ordinal);
  Py_DECREF(inputs);
  Py_DECREF(outputs);
  return error;
}

std::string CallGpuFunction(const Kernel& kernel, const std::vector<jaxdecl_buffer>& inputs,
                            const std::vector<jaxdecl_buffer>& outputs, void* stream) {
  thread_local std::vector<char> message(kMessageSize);
  message[0] = '\0';
  const std::vector<jaxdecl_buffer>* taken = &inputs;
  std::vector<jaxdecl_buffer> picked;
  if (!kernel.c_operands.empty()) {  // only the operands the rule takes
    for (int index : kernel.c_operands) picked.push_back(inputs[index]);
    taken = &picked;
  }
  int status = kernel.gpu_function(taken->data(), static_cast<int64_t>(taken->size()),
                                   outputs.data(), static_cast<int64_t>(outputs.size()),
                                   message.data(), kMessageSize, stream);
  if (status == 0) return {};
  bool truncated = std::memchr(message.data(), '\0', kMessageSize) == nullptr;
  message[kMessageSize - 1] = '\0';
  std::string text = message.data();
  if (truncated) text += " [message truncated]";
  return "jaxdecl: " + kernel.name + ": GPU C kernel failed with status " +
         std::to_string(status) + (text.empty() ? std::string() : ": " + text);
}

// A C device rule, once or once per row of batch="loop" (device pointers
// moved along the rows; no Python, no GIL).
std::string RunGpuFunction(const Kernel& kernel, const DeviceCall& call) {
  std::vector<jaxdecl_buffer> inputs, outputs;
  if (!DescribeForC(call.args, call.drop, &inputs) ||
      !DescribeForC(call.rets, call.drop, &outputs)) {
    return "jaxdecl: " + kernel.name + ": an operand is not a buffer";
  }
  if (kernel.row_dims.empty()) return CallGpuFunction(kernel, inputs, outputs, call.stream);
  RowCursor cursor(kernel.row_dims);
  std::vector<char*> starts;
  for (auto* side : {&inputs, &outputs}) {
    for (jaxdecl_buffer& buffer : *side) {
      size_t itemsize = ffi::ByteWidth(static_cast<ffi::DataType>(buffer.dtype));
      if (!cursor.Add(buffer.dims, buffer.rank, itemsize)) {
        return "jaxdecl: " + kernel.name + ": the call's buffers do not fit its batch";
      }
      starts.push_back(static_cast<char*>(buffer.data));
      buffer.dims += cursor.rank();
      buffer.rank -= cursor.rank();
    }
  }
  for (int64_t row = 0; row < cursor.rows(); ++row) {
    if (row > 0) cursor.Next();
    size_t k = 0;
    for (auto* side : {&inputs, &outputs}) {
      for (jaxdecl_buffer& buffer : *side) {
        buffer.data = starts[k] + cursor.offset(k);
        ++k;
      }
    }
    std::string error = CallGpuFunction(kernel, inputs, outputs, call.stream);
    if (!error.empty()) return error;
  }
  return {};
}

}  // namespace

std::string RunDeviceRule(const CudaRuntime&, const Kernel& kernel, const DeviceCall& call) {
  if (kernel.gpu_function != nullptr) return RunGpuFunction(kernel, call);
  return RunInPython(kernel, call.eager, [&] { return CallDeviceKernel(kernel, call); });
}

}  // namespace jaxdecl::gpu
