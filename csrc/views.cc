// NumPy views over XLA's buffers (views.h): the dtype table, making one view,
// and the check that a rule kept none.  The per-call templates are in the
// header; what is here runs when a view is first made or a call goes wrong.

#include "views.h"

#include "fp_env.h"

#include <chrono>
#include <thread>

#include "errors.h"

namespace jaxdecl {

std::array<PyArray_Descr*, 256> g_descrs{};

namespace {

PyObject* g_gc_collect = nullptr;

// Index of the first view referenced by more than its tuple, or -1.  Read
// with PyTuple_GET_ITEM: an accessor that caches references would count.
// The empty tuple is a shared singleton: its count says nothing.
Py_ssize_t FirstEscaped(PyObject* tuple) {
  Py_ssize_t n = PyTuple_GET_SIZE(tuple);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (Py_REFCNT(PyTuple_GET_ITEM(tuple, i)) != 1) return i;
  }
  return (n > 0 && Py_REFCNT(tuple) != 1) ? n : -1;
}

// Asks Python to describe (and record) an escaped view.  `error` is the
// message of the rule's own failure, if any: an exception that carries a
// view must not reach the caller, so Python replaces it.
std::string DescribeEscape(const Kernel& kernel, bool is_output,
                           Py_ssize_t index, const std::string& error,
                           bool eager) {
  PyObject* pending = error.empty()
                          ? Py_NewRef(Py_None)
                          : PyUnicode_DecodeUTF8(error.data(), error.size(),
                                                 "replace");
  if (pending == nullptr) return FetchPythonError();
  PyObject* text = PyObject_CallFunction(
      kernel.on_escape, "OnOO", is_output ? Py_True : Py_False, index, pending,
      eager ? Py_True : Py_False);
  Py_DECREF(pending);
  if (text == nullptr) return FetchPythonError();
  std::string message =
      MessageOf(text, "jaxdecl: a rule kept a reference to a buffer view");
  Py_DECREF(text);
  return message;
}

}  // namespace

// No base object: NumPy then never frees the memory, and every slice taken
// from the view references the view itself, which is what the escape check
// counts.
PyObject* WrapBuffer(const ffi::AnyBuffer& buffer, bool writable, int drop,
                     std::string* error) {
  auto dtype = static_cast<uint8_t>(buffer.element_type());
  PyArray_Descr* descr = g_descrs[dtype];
  if (descr == nullptr) {
    *error = "jaxdecl: XLA element type " + std::to_string(dtype) +
             " has no NumPy equivalent";
    return nullptr;
  }
  auto dims = ViewDims(buffer, drop);
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

// Before reporting an escape it collects garbage once (JAX's own reference
// cycles can hold a view; see SetCollect for what else that hook releases)
// and then gives other threads up to ~50 ms: a JAX array made from a view
// inside the rule lets go of the view only when its device buffer is
// released, which XLA may do on another thread just after the computation
// completes.  Only the failing path waits.
std::string CheckEscapes(const Kernel& kernel, PyObject* inputs,
                         PyObject* outputs, const std::string& error,
                         bool eager) {
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
  if (in >= 0) return DescribeEscape(kernel, false, in, error, eager);
  Py_ssize_t out = FirstEscaped(outputs);
  if (out >= 0) return DescribeEscape(kernel, true, out, error, eager);
  return {};
}

// registry.h's hooks for what Python configures.

FpControl& RuleFpControl() {
  static FpControl control = ReadFpControl();
  return control;
}

bool Initialize() {
  RuleFpControl() = ReadFpControl();  // Python's, on the importing thread
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

void SetCollect(PyObject* collect) {
  Py_XINCREF(collect);
  Py_XDECREF(g_gc_collect);
  g_gc_collect = collect;
}

}  // namespace jaxdecl
