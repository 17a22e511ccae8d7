// NumPy views over XLA's buffers: what a Python kernel's rule receives.
//
// Owns how an XLA buffer becomes a NumPy array without a copy (inputs
// read-only, outputs writable), how a compiled call site points last run's
// arrays at this run's buffers instead of making new ones, which trailing
// unit dimension the rule never sees, and the check that no view outlives
// its call.  Kept apart from the handlers because none of it depends on how
// the kernel was found; the templates sit in this header so that the
// per-call path (Repoint) still inlines into its caller.
//
// After a Python kernel returns, every view must be referenced by its tuple
// alone.  A rule that kept one (or a slice of one: NumPy's slices reference
// the view they came from, because the view does not own its data) would
// read freed memory once XLA reuses the buffer, so the call fails instead.
//
// Every file that uses NumPy's C API includes this header: it names the API
// table that module.cc imports.

#ifndef JAXDECL_CSRC_VIEWS_H_
#define JAXDECL_CSRC_VIEWS_H_

#include <Python.h>

#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <type_traits>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL JAXDECL_ARRAY_API
#define NO_IMPORT_ARRAY
#include <numpy/arrayobject.h>

#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace jaxdecl {

namespace ffi = xla::ffi;

// NumPy dtype by XLA element type code (see SetDescr); null where NumPy has
// no equivalent.  Owns a reference to each.
extern std::array<PyArray_Descr*, 256> g_descrs;

// The dimensions the rule sees: all of the buffer's but the last `drop`.
// Split call sites (see JaxdeclDispatchSplitImpl) carry one trailing unit
// dimension that exists only for XLA's batch partitioner.
inline ffi::AnyBuffer::Dimensions ViewDims(const ffi::AnyBuffer& buffer, int drop) {
  auto dims = buffer.dimensions();
  return dims.first(dims.size() - static_cast<size_t>(drop));
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

// A NumPy array viewing `buffer` without copying (a new reference), or null
// with `error` set.
PyObject* WrapBuffer(const ffi::AnyBuffer& buffer, bool writable, int drop,
                     std::string* error);

// Wraps every buffer of `buffers` into a new tuple.
template <typename Buffers>
PyObject* WrapAll(const Buffers& buffers, bool writable, int drop,
                  std::string* error) {
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
      array = WrapBuffer(*buffer, writable, drop, error);
    }
    if (array == nullptr) {
      Py_DECREF(tuple);
      return nullptr;
    }
    PyTuple_SET_ITEM(tuple, static_cast<Py_ssize_t>(i), array);
  }
  return tuple;
}

// Points every view of `tuple` at the matching buffer; false (nothing
// changed that matters) if any view is no longer as WrapBuffer made it.
template <typename Buffers>
bool Repoint(PyObject* tuple, const Buffers& buffers, bool writable, int drop) {
  size_t count = buffers.size();
  if (static_cast<size_t>(PyTuple_GET_SIZE(tuple)) != count) return false;
  int flags = writable ? NPY_ARRAY_CARRAY : NPY_ARRAY_CARRAY_RO;
  for (size_t i = 0; i < count; ++i) {
    auto buffer = BufferAt(buffers, i);
    auto* view = reinterpret_cast<PyArrayObject*>(
        PyTuple_GET_ITEM(tuple, static_cast<Py_ssize_t>(i)));
    if (!buffer.has_value() || Py_REFCNT(view) != 1 ||
        PyArray_DESCR(view) !=
            g_descrs[static_cast<uint8_t>(buffer->element_type())] ||
        (PyArray_FLAGS(view) & (NPY_ARRAY_CARRAY | NPY_ARRAY_OWNDATA)) != flags ||
        PyArray_BASE(view) != nullptr) {
      return false;
    }
    auto dims = ViewDims(*buffer, drop);
    if (static_cast<size_t>(PyArray_NDIM(view)) != dims.size()) return false;
    npy_intp stride = PyArray_ITEMSIZE(view);
    for (size_t d = dims.size(); d-- > 0;) {
      if (PyArray_DIM(view, d) != dims[d] || PyArray_STRIDE(view, d) != stride) {
        return false;
      }
      stride *= dims[d];
    }
  }
  for (size_t i = 0; i < count; ++i) {
    auto* fields = reinterpret_cast<PyArrayObject_fields*>(
        PyTuple_GET_ITEM(tuple, static_cast<Py_ssize_t>(i)));
    fields->data = static_cast<char*>(BufferAt(buffers, i)->untyped_data());
  }
  return true;
}

// Checks that the rule kept no view of either tuple; returns "" or the
// message to fail the call with (which replaces the rule's own `error`).
// `eager`: whether the caller waits for this call (see RunPythonKernel).
std::string CheckEscapes(const Kernel& kernel, PyObject* inputs,
                         PyObject* outputs, const std::string& error,
                         bool eager);

}  // namespace jaxdecl

#endif  // JAXDECL_CSRC_VIEWS_H_
