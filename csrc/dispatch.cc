// The XLA FFI handler behind every jaxdecl primitive on CPU.
//
// XLA calls `jaxdecl_dispatch` with an integer attribute `key` and the op's
// buffers.  The key indexes a registry of Python callables ("host kernels",
// built by jaxdecl/_runtime.py) that this module holds strong references to,
// so a compiled executable keeps working after the user drops the op: the
// key, never an object address, is what the HLO carries.
//
// Per call the handler wraps every buffer as a NumPy array on XLA's own
// memory (inputs read-only, outputs writable, no copy), takes the GIL, calls
// the kernel as `kernel(inputs, outputs)` and turns whatever goes wrong into
// an `ffi::Error`.  A kernel returns None on success or an error message (a
// str) it has already formatted; no Python or C++ exception crosses into XLA.
//
// After the kernel returns, every view must be referenced by its tuple alone.
// A rule that kept one (or a slice of one: NumPy's slices reference the view
// they came from, because the view does not own its data) would read freed
// memory once XLA reuses the buffer, so the call fails instead.

#include <Python.h>

#include <array>
#include <chrono>
#include <thread>
#include <cstdint>
#include <string>
#include <vector>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL JAXDECL_ARRAY_API
#include <numpy/arrayobject.h>

#include <pybind11/pybind11.h>

#include "xla/ffi/api/ffi.h"

namespace py = pybind11;
namespace ffi = xla::ffi;

namespace {

// ---------------------------------------------------------------------------
// State shared with Python.  Every access happens with the GIL held.
// ---------------------------------------------------------------------------

struct Kernel {
  PyObject* call = nullptr;       // kernel(inputs, outputs) -> None | str
  PyObject* on_escape = nullptr;  // on_escape(is_output, index) -> str
};

// Index = key.  Entries are never removed: a compiled executable may hold a
// key for as long as the process lives.
std::vector<Kernel> g_kernels;

// NumPy dtype for each XLA element type (indexed by ffi::DataType).  Filled
// from Python, which knows ml_dtypes' bfloat16.
std::array<PyArray_Descr*, 256> g_descrs{};

PyObject* g_gc_collect = nullptr;

// Called around a kernel that runs on one of XLA's worker threads (a thread
// Python has never seen), where a rule that calls JAX would deadlock: the
// enter hook makes such a call fail fast instead (see jaxdecl/_runtime.py).
PyObject* g_worker_enter = nullptr;  // () -> token
PyObject* g_worker_exit = nullptr;   // (token) -> None

// ---------------------------------------------------------------------------
// Buffer wrapping
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
  std::array<npy_intp, NPY_MAXDIMS> shape;
  if (dims.size() > NPY_MAXDIMS) {
    *error = "jaxdecl: rank " + std::to_string(dims.size()) +
             " exceeds NumPy's limit";
    return nullptr;
  }
  for (size_t i = 0; i < dims.size(); ++i) shape[i] = dims[i];
  int flags = writable ? NPY_ARRAY_CARRAY : NPY_ARRAY_CARRAY_RO;
  void* data = buffer.untyped_data();
  Py_INCREF(descr);  // PyArray_NewFromDescr steals it.
  PyObject* array = PyArray_NewFromDescr(
      &PyArray_Type, descr, static_cast<int>(dims.size()), shape.data(),
      /*strides=*/nullptr, data, flags, /*obj=*/nullptr);
  if (array == nullptr) {
    *error = "jaxdecl: could not wrap an XLA buffer as a NumPy array";
    PyErr_Clear();
  }
  return array;
}

// Wraps buffers [0, count) of `source` into a new tuple.
template <typename Source>
PyObject* WrapAll(const Source& source, size_t count, bool writable,
                  std::string* error) {
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(count));
  if (tuple == nullptr) {
    PyErr_Clear();
    *error = "jaxdecl: out of memory";
    return nullptr;
  }
  for (size_t i = 0; i < count; ++i) {
    PyObject* array = nullptr;
    if constexpr (std::is_same_v<Source, ffi::RemainingArgs>) {
      auto buffer = source.template get<ffi::AnyBuffer>(i);
      if (!buffer.has_value()) {
        *error = "jaxdecl: operand " + std::to_string(i) + " is not a buffer";
      } else {
        array = WrapBuffer(*buffer, writable, error);
      }
    } else {
      auto buffer = source.template get<ffi::AnyBuffer>(i);
      if (!buffer.has_value()) {
        *error = "jaxdecl: result " + std::to_string(i) + " is not a buffer";
      } else {
        array = WrapBuffer(**buffer, writable, error);
      }
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
  PyObject* text = value ? PyObject_Str(value) : nullptr;
  if (type) message += reinterpret_cast<PyTypeObject*>(type)->tp_name;
  if (text) {
    const char* utf8 = PyUnicode_AsUTF8(text);
    if (utf8) message += std::string(": ") + utf8;
  }
  PyErr_Clear();
  Py_XDECREF(text);
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(traceback);
  return message;
}

// Asks Python to describe (and record) an escaped view.
std::string DescribeEscape(const Kernel& kernel, bool is_output,
                           Py_ssize_t index) {
  PyObject* text = PyObject_CallFunction(kernel.on_escape, "On",
                                         is_output ? Py_True : Py_False,
                                         index);
  if (text == nullptr) return FetchPythonError();
  std::string message;
  const char* utf8 = PyUnicode_Check(text) ? PyUnicode_AsUTF8(text) : nullptr;
  message = utf8 ? utf8 : "jaxdecl: a rule kept a reference to a buffer view";
  PyErr_Clear();
  Py_DECREF(text);
  return message;
}

// Checks both tuples.  Before reporting an escape it collects garbage (JAX's
// own reference cycles can hold a view) and gives other threads a few
// milliseconds: a JAX array made from a view inside the rule lets go of the
// view only when its device buffer is released, which XLA may do on another
// thread just after the computation completes.  Only the failing path waits.
std::string CheckEscapes(const Kernel& kernel, PyObject* inputs,
                         PyObject* outputs) {
  if (FirstEscaped(inputs) < 0 && FirstEscaped(outputs) < 0) return {};
  for (int attempt = 0; attempt < 20; ++attempt) {
    PyObject* collected = PyObject_CallNoArgs(g_gc_collect);
    if (collected == nullptr) PyErr_Clear();
    Py_XDECREF(collected);
    if (FirstEscaped(inputs) < 0 && FirstEscaped(outputs) < 0) return {};
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

ffi::Error RunKernel(int64_t key, ffi::RemainingArgs args,
                     ffi::RemainingRets rets) {
  if (!Py_IsInitialized()) {
    return ffi::Error::Internal("jaxdecl: the Python interpreter is gone");
  }
  bool on_worker = PyGILState_GetThisThreadState() == nullptr;
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* worker_token = nullptr;
  if (on_worker && g_worker_enter != nullptr) {
    worker_token = PyObject_CallNoArgs(g_worker_enter);
    if (worker_token == nullptr) PyErr_Clear();
  }
  std::string error;
  if (key <= 0 || static_cast<size_t>(key) >= g_kernels.size()) {
    error = "jaxdecl: no host kernel is registered under key " +
            std::to_string(key) +
            " (was this executable compiled in another process?)";
  } else {
    const Kernel& kernel = g_kernels[key];
    PyObject* inputs = WrapAll(args, args.size(), false, &error);
    PyObject* outputs =
        inputs ? WrapAll(rets, rets.size(), true, &error) : nullptr;
    if (outputs != nullptr) {
      PyObject* result =
          PyObject_CallFunctionObjArgs(kernel.call, inputs, outputs, nullptr);
      if (result == nullptr) {
        error = FetchPythonError();
      } else if (result != Py_None) {
        const char* utf8 =
            PyUnicode_Check(result) ? PyUnicode_AsUTF8(result) : nullptr;
        error = utf8 ? utf8 : "jaxdecl: a host kernel returned a non-string";
        PyErr_Clear();
      }
      Py_XDECREF(result);
      std::string escaped = CheckEscapes(kernel, inputs, outputs);
      if (error.empty()) error = escaped;
    }
    Py_XDECREF(inputs);
    Py_XDECREF(outputs);
  }
  if (worker_token != nullptr) {
    PyObject* done = PyObject_CallOneArg(g_worker_exit, worker_token);
    if (done == nullptr) PyErr_Clear();
    Py_XDECREF(done);
    Py_DECREF(worker_token);
  }
  PyGILState_Release(gil);
  if (error.empty()) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal, error);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxdeclDispatch, RunKernel,
    ffi::Ffi::Bind()
        .Attr<int64_t>("key")  // registry index of the host kernel
        .RemainingArgs()       // the op's operands, in order
        .RemainingRets());     // the op's results, in order

// ---------------------------------------------------------------------------
// Python module
// ---------------------------------------------------------------------------

namespace {

int64_t RegisterKernel(py::object call, py::object on_escape) {
  if (g_kernels.empty()) g_kernels.emplace_back();  // key 0 stays invalid
  Kernel kernel;
  kernel.call = call.release().ptr();  // owned for the process's lifetime
  kernel.on_escape = on_escape.release().ptr();
  g_kernels.push_back(kernel);
  return static_cast<int64_t>(g_kernels.size() - 1);
}

void SetDtype(int code, py::object dtype) {
  if (code < 0 || code >= static_cast<int>(g_descrs.size())) {
    throw py::value_error("element type code out of range");
  }
  PyArray_Descr* descr = nullptr;
  if (!PyArray_DescrConverter(dtype.ptr(), &descr)) {
    throw py::error_already_set();
  }
  Py_XDECREF(g_descrs[code]);
  g_descrs[code] = descr;
}

py::dict ElementTypes() {
  py::dict codes;
  auto put = [&](const char* name, ffi::DataType type) {
    codes[name] = static_cast<int>(type);
  };
  put("bool", ffi::DataType::PRED);
  put("int8", ffi::DataType::S8);
  put("int16", ffi::DataType::S16);
  put("int32", ffi::DataType::S32);
  put("int64", ffi::DataType::S64);
  put("uint8", ffi::DataType::U8);
  put("uint16", ffi::DataType::U16);
  put("uint32", ffi::DataType::U32);
  put("uint64", ffi::DataType::U64);
  put("float16", ffi::DataType::F16);
  put("bfloat16", ffi::DataType::BF16);
  put("float32", ffi::DataType::F32);
  put("float64", ffi::DataType::F64);
  put("complex64", ffi::DataType::C64);
  put("complex128", ffi::DataType::C128);
  return codes;
}

}  // namespace

PYBIND11_MODULE(_dispatch, m) {
  m.doc() = "jaxdecl's XLA FFI dispatcher (CPU).";
  if (_import_array() < 0) throw py::error_already_set();
  g_gc_collect = py::object(py::module_::import("gc").attr("collect")).release().ptr();

  m.def("registrations", []() {
    py::dict targets;
    targets["jaxdecl_dispatch"] =
        py::capsule(reinterpret_cast<void*>(&JaxdeclDispatch));
    return targets;
  }, "FFI targets to pass to jax.ffi.register_ffi_target (platform 'cpu').");
  m.def("register_kernel", &RegisterKernel, py::arg("call"),
        py::arg("on_escape"),
        "Stores a host kernel for the process's lifetime; returns its key.");
  m.def("set_dtype", &SetDtype, py::arg("code"), py::arg("dtype"),
        "Maps an XLA element type code to a NumPy dtype.");
  m.def("set_worker_hooks", [](py::object enter, py::object exit) {
    Py_XDECREF(g_worker_enter);
    Py_XDECREF(g_worker_exit);
    g_worker_enter = enter.release().ptr();
    g_worker_exit = exit.release().ptr();
  }, py::arg("enter"), py::arg("exit"),
        "Hooks run around kernels on XLA worker threads: enter() -> token, exit(token).");
  m.def("element_types", &ElementTypes,
        "XLA element type codes by NumPy dtype name.");
  m.def("kernel_count", []() {
    return g_kernels.empty() ? 0 : g_kernels.size() - 1;
  }, "How many host kernels are registered.");
}
