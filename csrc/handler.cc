// The XLA FFI handler behind every jaxdecl primitive on CPU.
//
// XLA calls `jaxdecl_dispatch` with an integer attribute `key` and the op's
// buffers.  The key indexes a registry of kernels that holds strong
// references for the process's lifetime, so a compiled executable keeps
// working after the user drops the op: the key, never an object address, is
// what the HLO carries.
//
// Python kernels (built by jaxdecl/_runtime.py) get every buffer wrapped as a
// NumPy array on XLA's own memory (inputs read-only, outputs writable, no
// copy), called as `kernel(inputs, outputs)` with the GIL held; they return
// None, or an error message they already formatted.  C kernels (jaxdecl.h)
// get the raw buffers and run without the GIL.  Nothing escapes as an
// exception: every failure becomes an `ffi::Error`.
//
// After a Python kernel returns, every view must be referenced by its tuple
// alone.  A rule that kept one (or a slice of one: NumPy's slices reference
// the view they came from, because the view does not own its data) would
// read freed memory once XLA reuses the buffer, so the call fails instead.

#include <Python.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL JAXDECL_ARRAY_API
#define NO_IMPORT_ARRAY
#include <numpy/arrayobject.h>

#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxdecl {
namespace {

static_assert(JAXDECL_BOOL == static_cast<int>(ffi::DataType::PRED));
static_assert(JAXDECL_INT8 == static_cast<int>(ffi::DataType::S8));
static_assert(JAXDECL_UINT64 == static_cast<int>(ffi::DataType::U64));
static_assert(JAXDECL_FLOAT16 == static_cast<int>(ffi::DataType::F16));
static_assert(JAXDECL_FLOAT64 == static_cast<int>(ffi::DataType::F64));
static_assert(JAXDECL_COMPLEX64 == static_cast<int>(ffi::DataType::C64));
static_assert(JAXDECL_BFLOAT16 == static_cast<int>(ffi::DataType::BF16));
static_assert(JAXDECL_COMPLEX128 == static_cast<int>(ffi::DataType::C128));

// A fixed table of pointers, so that C kernels can be looked up without the
// GIL while Python registers new ones: slots are written once, before their
// key is handed out, and never change.  1M slots of 8 bytes are reserved
// address space; only the pages in use are ever touched.
constexpr int64_t kMaxKernels = int64_t{1} << 20;
std::array<std::atomic<const Kernel*>, kMaxKernels> g_table{};
std::atomic<int64_t> g_next_key{1};
std::mutex g_register_mutex;

std::array<PyArray_Descr*, 256> g_descrs{};
PyObject* g_gc_collect = nullptr;
PyObject* g_worker_enter = nullptr;  // () -> token
PyObject* g_worker_exit = nullptr;   // (token) -> None

constexpr int64_t kMessageSize = 2048;

// ---------------------------------------------------------------------------
// Python kernels
// ---------------------------------------------------------------------------

// A NumPy array viewing `buffer` without copying.  No base object: NumPy then
// never frees the memory, and every slice taken from the view references the
// view itself, which is what the escape check counts.
PyObject* WrapBuffer(const ffi::AnyBuffer& buffer, bool writable,
                     std::string* error) {
  auto dtype = static_cast<uint8_t>(buffer.element_type());
  PyArray_Descr* descr = g_descrs[dtype];
  if (descr == nullptr) {
    *error = "jaxdecl: XLA element type " + std::to_string(dtype) +
             " has no NumPy equivalent";
    return nullptr;
  }
  auto dims = buffer.dimensions();
  if (dims.size() > NPY_MAXDIMS) {
    *error = "jaxdecl: rank " + std::to_string(dims.size()) +
             " exceeds NumPy's limit";
    return nullptr;
  }
  std::array<npy_intp, NPY_MAXDIMS> shape;
  for (size_t i = 0; i < dims.size(); ++i) shape[i] = dims[i];
  int flags = writable ? NPY_ARRAY_CARRAY : NPY_ARRAY_CARRAY_RO;
  Py_INCREF(descr);  // PyArray_NewFromDescr steals it.
  PyObject* array = PyArray_NewFromDescr(
      &PyArray_Type, descr, static_cast<int>(dims.size()), shape.data(),
      /*strides=*/nullptr, buffer.untyped_data(), flags, /*obj=*/nullptr);
  if (array == nullptr) {
    *error = "jaxdecl: could not wrap an XLA buffer as a NumPy array";
    PyErr_Clear();
  }
  return array;
}

template <typename Buffers>
std::optional<ffi::AnyBuffer> BufferAt(const Buffers& buffers, size_t i) {
  auto buffer = buffers.template get<ffi::AnyBuffer>(i);
  if (!buffer.has_value()) return std::nullopt;
  if constexpr (std::is_same_v<Buffers, ffi::RemainingArgs>) {
    return *buffer;
  } else {
    return **buffer;
  }
}

// Wraps every buffer of `buffers` into a new tuple.
template <typename Buffers>
PyObject* WrapAll(const Buffers& buffers, bool writable, std::string* error) {
  size_t count = buffers.size();
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(count));
  if (tuple == nullptr) {
    PyErr_Clear();
    *error = "jaxdecl: out of memory";
    return nullptr;
  }
  for (size_t i = 0; i < count; ++i) {
    auto buffer = BufferAt(buffers, i);
    PyObject* array = nullptr;
    if (!buffer.has_value()) {
      *error = "jaxdecl: operand " + std::to_string(i) + " is not a buffer";
    } else {
      array = WrapBuffer(*buffer, writable, error);
    }
    if (array == nullptr) {
      Py_DECREF(tuple);
      return nullptr;
    }
    PyTuple_SET_ITEM(tuple, static_cast<Py_ssize_t>(i), array);
  }
  return tuple;
}

// Index of the first view referenced by more than its tuple, or -1.  Read
// with PyTuple_GET_ITEM: an accessor that caches references would count.
Py_ssize_t FirstEscaped(PyObject* tuple) {
  Py_ssize_t n = PyTuple_GET_SIZE(tuple);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (Py_REFCNT(PyTuple_GET_ITEM(tuple, i)) != 1) return i;
  }
  return Py_REFCNT(tuple) != 1 ? n : -1;
}

std::string FetchPythonError() {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  std::string message = "jaxdecl: a host kernel raised ";
  if (type) message += reinterpret_cast<PyTypeObject*>(type)->tp_name;
  PyObject* text = value ? PyObject_Str(value) : nullptr;
  const char* utf8 = text ? PyUnicode_AsUTF8(text) : nullptr;
  if (utf8) message += std::string(": ") + utf8;
  PyErr_Clear();
  Py_XDECREF(text);
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(traceback);
  return message;
}

// str(result) of a kernel that returned something other than None.
std::string MessageOf(PyObject* result, const char* fallback) {
  const char* utf8 = PyUnicode_Check(result) ? PyUnicode_AsUTF8(result) : nullptr;
  std::string message = utf8 ? utf8 : fallback;
  PyErr_Clear();
  return message;
}

// Asks Python to describe (and record) an escaped view.
std::string DescribeEscape(const Kernel& kernel, bool is_output,
                           Py_ssize_t index) {
  PyObject* text = PyObject_CallFunction(
      kernel.on_escape, "On", is_output ? Py_True : Py_False, index);
  if (text == nullptr) return FetchPythonError();
  std::string message =
      MessageOf(text, "jaxdecl: a rule kept a reference to a buffer view");
  Py_DECREF(text);
  return message;
}

// Checks both tuples.  Before reporting an escape it collects garbage once
// (JAX's own reference cycles can hold a view) and then gives other threads up
// to ~50 ms: a JAX array made from a view inside the rule lets go of the view
// only when its device buffer is released, which XLA may do on another thread
// just after the computation completes.  Only the failing path waits.
std::string CheckEscapes(const Kernel& kernel, PyObject* inputs,
                         PyObject* outputs) {
  auto clean = [&] {
    return FirstEscaped(inputs) < 0 && FirstEscaped(outputs) < 0;
  };
  if (clean()) return {};
  PyObject* collected = PyObject_CallNoArgs(g_gc_collect);
  if (collected == nullptr) PyErr_Clear();
  Py_XDECREF(collected);
  for (int attempt = 0; attempt < 50 && !clean(); ++attempt) {
    Py_BEGIN_ALLOW_THREADS
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    Py_END_ALLOW_THREADS
  }
  Py_ssize_t in = FirstEscaped(inputs);
  if (in >= 0) return DescribeEscape(kernel, false, in);
  Py_ssize_t out = FirstEscaped(outputs);
  if (out >= 0) return DescribeEscape(kernel, true, out);
  return {};
}

std::string RunPythonKernel(const Kernel& kernel, ffi::RemainingArgs args,
                            ffi::RemainingRets rets) {
  std::string error;
  PyObject* inputs = WrapAll(args, false, &error);
  PyObject* outputs = inputs ? WrapAll(rets, true, &error) : nullptr;
  if (outputs != nullptr) {
    PyObject* result =
        PyObject_CallFunctionObjArgs(kernel.call, inputs, outputs, nullptr);
    if (result == nullptr) {
      error = FetchPythonError();
    } else if (result != Py_None) {
      error = MessageOf(result, "jaxdecl: a host kernel returned a non-string");
    }
    Py_XDECREF(result);
    std::string escaped = CheckEscapes(kernel, inputs, outputs);
    if (error.empty()) error = escaped;
  }
  Py_XDECREF(inputs);
  Py_XDECREF(outputs);
  return error;
}

std::string RunPythonKernelWithGil(const Kernel& kernel,
                                   ffi::RemainingArgs args,
                                   ffi::RemainingRets rets) {
  if (!Py_IsInitialized()) return "jaxdecl: the Python interpreter is gone";
  // A thread Python has never seen is one of XLA's workers (see
  // g_worker_enter in registry.h's SetWorkerHooks).
  bool on_worker = PyGILState_GetThisThreadState() == nullptr;
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* token = nullptr;
  if (on_worker && g_worker_enter != nullptr) {
    token = PyObject_CallNoArgs(g_worker_enter);
    if (token == nullptr) PyErr_Clear();
  }
  std::string error = RunPythonKernel(kernel, args, rets);
  if (token != nullptr) {
    PyObject* done = PyObject_CallOneArg(g_worker_exit, token);
    if (done == nullptr) PyErr_Clear();
    Py_XDECREF(done);
    Py_DECREF(token);
  }
  PyGILState_Release(gil);
  return error;
}

// ---------------------------------------------------------------------------
// C kernels
// ---------------------------------------------------------------------------

template <typename Buffers>
bool Describe(const Buffers& buffers, std::vector<jaxdecl_buffer>* out) {
  out->resize(buffers.size());
  for (size_t i = 0; i < buffers.size(); ++i) {
    auto buffer = BufferAt(buffers, i);
    if (!buffer.has_value()) return false;
    auto dims = buffer->dimensions();
    (*out)[i] = jaxdecl_buffer{buffer->untyped_data(), dims.begin(),
                               static_cast<int64_t>(dims.size()),
                               static_cast<int32_t>(buffer->element_type())};
  }
  return true;
}

std::string RunCKernel(jaxdecl_kernel function,
                       const std::vector<jaxdecl_buffer>& inputs,
                       const std::vector<jaxdecl_buffer>& outputs) {
  char message[kMessageSize] = {0};
  int status = function(inputs.data(), static_cast<int64_t>(inputs.size()),
                        outputs.data(), static_cast<int64_t>(outputs.size()),
                        message, kMessageSize);
  if (status == 0) return {};
  message[kMessageSize - 1] = '\0';
  std::string text = message;
  return "jaxdecl: C kernel failed with status " + std::to_string(status) +
         (text.empty() ? std::string() : ": " + text);
}

ffi::Error Dispatch(int64_t key, ffi::RemainingArgs args,
                    ffi::RemainingRets rets) {
  const Kernel* kernel = FindKernel(key);
  std::string error;
  if (kernel == nullptr) {
    error = "jaxdecl: no kernel is registered under key " +
            std::to_string(key) +
            " (was this executable compiled in another process?)";
  } else if (kernel->c_function != nullptr) {
    std::vector<jaxdecl_buffer> inputs, outputs;
    if (!Describe(args, &inputs) || !Describe(rets, &outputs)) {
      error = "jaxdecl: an operand is not a buffer";
    } else {
      error = RunCKernel(kernel->c_function, inputs, outputs);
    }
  } else {
    error = RunPythonKernelWithGil(*kernel, args, rets);
  }
  if (error.empty()) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal, error);
}

}  // namespace

// ---------------------------------------------------------------------------
// Registry (registry.h)
// ---------------------------------------------------------------------------

int64_t RegisterKernel(const Kernel& kernel) {
  std::lock_guard<std::mutex> lock(g_register_mutex);
  int64_t key = g_next_key.load();
  if (key >= kMaxKernels) return -1;
  g_table[key].store(new Kernel(kernel), std::memory_order_release);
  g_next_key.store(key + 1);
  return key;
}

const Kernel* FindKernel(int64_t key) {
  if (key <= 0 || key >= kMaxKernels) return nullptr;
  return g_table[key].load(std::memory_order_acquire);
}

int64_t KernelCount() { return g_next_key.load() - 1; }

bool Initialize() {
  PyObject* gc = PyImport_ImportModule("gc");
  if (gc == nullptr) return false;
  g_gc_collect = PyObject_GetAttrString(gc, "collect");
  Py_DECREF(gc);
  return g_gc_collect != nullptr;
}

void SetDescr(int code, PyObject* descr) {
  Py_XDECREF(g_descrs[code]);
  g_descrs[code] = reinterpret_cast<PyArray_Descr*>(descr);
}

void SetWorkerHooks(PyObject* enter, PyObject* exit) {
  Py_XINCREF(enter);
  Py_XINCREF(exit);
  Py_XDECREF(g_worker_enter);
  Py_XDECREF(g_worker_exit);
  g_worker_enter = enter;
  g_worker_exit = exit;
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
  error = RunCKernel(function, described[0], described[1]);
  Py_END_ALLOW_THREADS
  return error;
}

}  // namespace jaxdecl

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxdeclDispatch, jaxdecl::Dispatch,
    ffi::Ffi::Bind()
        .Attr<int64_t>("key")  // registry index of the kernel
        .RemainingArgs()       // the rule's operands, in order
        .RemainingRets());     // the rule's results, in order
