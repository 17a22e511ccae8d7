// One rule call per row of a batched call (rows.h).

#include "rows.h"

#include "errors.h"
#include "kernels.h"
#include "views.h"

namespace jaxdecl {
namespace {

PyArrayObject* AsArray(PyObject* object) {
  return reinterpret_cast<PyArrayObject*>(object);
}

// Product of the first `rank` dimensions of `array` (which has at least `rank`).
npy_intp LeadingSize(PyArrayObject* array, int rank) {
  npy_intp size = 1;
  for (int d = 0; d < rank; ++d) size *= PyArray_DIM(array, d);
  return size;
}

int FlagsFor(bool writable) { return writable ? NPY_ARRAY_CARRAY : NPY_ARRAY_CARRAY_RO; }

// A view of the first row of `whole` (its leading `rank` dimensions dropped),
// made as WrapBuffer makes views: no base, so the escape check can count it.
PyObject* RowView(PyObject* whole, int rank, bool writable) {
  PyArrayObject* array = AsArray(whole);
  PyArray_Descr* descr = PyArray_DESCR(array);
  Py_INCREF(descr);  // PyArray_NewFromDescr steals it.
  return PyArray_NewFromDescr(&PyArray_Type, descr, PyArray_NDIM(array) - rank,
                              PyArray_DIMS(array) + rank, /*strides=*/nullptr,
                              PyArray_DATA(array), FlagsFor(writable), /*obj=*/nullptr);
}

// True while `view` is exactly as RowView made it from `whole`: a rule may
// reshape its view in place (`x.shape = ...`) or change its flags, and such a
// view must not be handed to the next row.
bool RowViewIntact(PyObject* view, PyObject* whole, int rank, bool writable) {
  PyArrayObject* v = AsArray(view);
  PyArrayObject* w = AsArray(whole);
  int ndim = PyArray_NDIM(w) - rank;
  if (PyArray_BASE(v) != nullptr || PyArray_DESCR(v) != PyArray_DESCR(w) ||
      (PyArray_FLAGS(v) & (NPY_ARRAY_CARRAY | NPY_ARRAY_OWNDATA)) != FlagsFor(writable) ||
      PyArray_NDIM(v) != ndim) {
    return false;
  }
  for (int d = 0; d < ndim; ++d) {
    if (PyArray_DIM(v, d) != PyArray_DIM(w, d + rank) ||
        PyArray_STRIDE(v, d) != PyArray_STRIDE(w, d + rank)) {
      return false;
    }
  }
  return true;
}

bool AnyHeld(PyObject* tuple) {
  if (Py_REFCNT(tuple) != 1) return true;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tuple); ++i) {
    if (Py_REFCNT(PyTuple_GET_ITEM(tuple, i)) != 1) return true;
  }
  return false;
}

// The row views of one side of the call and where each row starts.
struct RowSide {
  PyObject* whole;    // borrowed: the call's tuple of whole-batch views
  PyObject* rows;     // owned: a tuple of row views
  bool writable;
  char* data[kMaxDirectArgs];
  npy_intp step[kMaxDirectArgs];  // bytes from one row to the next; 0: not batched
};

bool MakeRows(RowSide& side, const Kernel& kernel, const bool* batched) {
  Py_ssize_t n = PyTuple_GET_SIZE(side.whole);
  side.rows = PyTuple_New(n);
  if (side.rows == nullptr) return false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* whole = PyTuple_GET_ITEM(side.whole, i);
    PyObject* view = RowView(whole, kernel.row_rank, side.writable);
    if (view == nullptr) return false;
    PyTuple_SET_ITEM(side.rows, i, view);
    side.data[i] = static_cast<char*>(PyArray_DATA(AsArray(whole)));
    side.step[i] = batched[i] ? PyArray_NBYTES(AsArray(view)) : 0;
  }
  return true;
}

// Points every row view at row `row`, replacing any the rule altered.
bool MoveTo(RowSide& side, const Kernel& kernel, npy_intp row) {
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(side.rows); ++i) {
    PyObject* whole = PyTuple_GET_ITEM(side.whole, i);
    PyObject* view = PyTuple_GET_ITEM(side.rows, i);
    if (!RowViewIntact(view, whole, kernel.row_rank, side.writable)) {
      view = RowView(whole, kernel.row_rank, side.writable);
      if (view == nullptr) return false;
      PyTuple_SetItem(side.rows, i, view);  // releases the altered one
    }
    reinterpret_cast<PyArrayObject_fields*>(view)->data =
        side.data[i] + row * side.step[i];
  }
  return true;
}

}  // namespace

bool RowsFit(const Kernel& kernel, PyObject* inputs, PyObject* outputs) {
  Py_ssize_t n_in = PyTuple_GET_SIZE(inputs);
  if (n_in + 2 > kMaxDirectArgs || PyTuple_GET_SIZE(outputs) != 1 ||
      static_cast<size_t>(n_in) != kernel.row_batched.size()) {
    return false;
  }
  auto fits = [&](PyObject* view, bool batched) {
    PyArrayObject* array = AsArray(view);
    if (PyArray_NDIM(array) < kernel.row_rank) return false;
    return LeadingSize(array, kernel.row_rank) == (batched ? kernel.row_count : 1);
  };
  for (Py_ssize_t i = 0; i < n_in; ++i) {
    if (!fits(PyTuple_GET_ITEM(inputs, i), kernel.row_batched[i])) return false;
  }
  return fits(PyTuple_GET_ITEM(outputs, 0), true);
}

std::string RunRows(const Kernel& kernel, PyObject* inputs, PyObject* outputs,
                    bool eager) {
  PyObject* instance = kernel.Instance();  // a new reference, or null
  if (kernel.instance_ref != nullptr && instance == nullptr) {
    return "jaxdecl: " + kernel.name + ": the op was deleted";
  }
  bool in_batched[kMaxDirectArgs];
  for (size_t i = 0; i < kernel.row_batched.size(); ++i) in_batched[i] = kernel.row_batched[i];
  const bool out_batched[] = {true};
  RowSide in{inputs, nullptr, false, {}, {}};
  RowSide out{outputs, nullptr, true, {}, {}};
  std::string error;
  bool made = MakeRows(in, kernel, in_batched) && MakeRows(out, kernel, out_batched);
  if (!made) error = FetchPythonError();
  bool escape_checked = false;  // `error` already says what a kept view would
  PyObject* argv[kMaxDirectArgs];
  Py_ssize_t first = instance != nullptr ? 1 : 0;
  argv[0] = instance;
  Py_ssize_t n_in = PyTuple_GET_SIZE(inputs);
  for (npy_intp row = 0; error.empty() && row < kernel.row_count; ++row) {
    if (row > 0 && (!MoveTo(in, kernel, row) || !MoveTo(out, kernel, row))) {
      error = FetchPythonError();
      break;
    }
    for (Py_ssize_t i = 0; i < n_in; ++i) argv[first + i] = PyTuple_GET_ITEM(in.rows, i);
    argv[first + n_in] = PyTuple_GET_ITEM(out.rows, 0);
    PyObject* result =
        PyObject_Vectorcall(kernel.direct, argv, first + n_in, OutKeyword());
    if (result != Py_None) {
      PyObject* message = HandBackFailure(kernel, result, in.rows, out.rows, eager);
      error = message == nullptr ? FetchPythonError()
                                 : MessageOf(message, "jaxdecl: a host kernel failed");
      Py_XDECREF(message);
      break;
    }
    Py_DECREF(result);
    // Before the views move on: a rule that kept one would see it change.
    if (AnyHeld(in.rows) || AnyHeld(out.rows)) {
      error = CheckEscapes(kernel, in.rows, out.rows, error, eager);
      escape_checked = !error.empty();
    }
  }
  if (made && !error.empty() && !escape_checked) {
    std::string escaped = CheckEscapes(kernel, in.rows, out.rows, error, eager);
    if (!escaped.empty()) error = escaped;
  }
  Py_XDECREF(in.rows);
  Py_XDECREF(out.rows);
  Py_XDECREF(instance);
  return error;
}

}  // namespace jaxdecl
