// One rule call per row of a batched call (rows.h).

#include "rows.h"

#include "errors.h"
#include "kernels.h"
#include "views.h"

namespace jaxdecl {

RowCursor::RowCursor(const std::vector<int64_t>& batch)
    : batch_(batch), index_(batch.size(), 0) {
  for (int64_t size : batch_) rows_ *= size;
}

bool RowCursor::Add(const int64_t* dims, int64_t rank, size_t itemsize) {
  size_t n = batch_.size();
  if (rank < static_cast<int64_t>(n)) return false;
  // Row-major strides: the bytes from one index to the next along each dim.
  std::vector<int64_t> stride(rank);
  int64_t bytes = static_cast<int64_t>(itemsize);
  for (int64_t d = rank; d-- > 0;) {
    stride[d] = bytes;
    bytes *= dims[d];
  }
  for (size_t j = 0; j < n; ++j) {
    if (dims[j] != batch_[j] && dims[j] != 1) return false;
    steps_.push_back(dims[j] == 1 ? 0 : stride[j]);  // broadcast: stays put
  }
  offsets_.push_back(0);
  return true;
}

void RowCursor::Next() {
  size_t n = batch_.size();
  size_t operands = offsets_.size();
  for (size_t j = n; j-- > 0;) {
    for (size_t k = 0; k < operands; ++k) offsets_[k] += steps_[k * n + j];
    if (++index_[j] < batch_[j]) return;
    // This dim wraps around: back to its start, and carry into the dim before.
    for (size_t k = 0; k < operands; ++k) offsets_[k] -= steps_[k * n + j] * batch_[j];
    index_[j] = 0;
  }
}

void RowCursor::Seek(int64_t row) {
  size_t n = batch_.size();
  size_t operands = offsets_.size();
  for (size_t k = 0; k < operands; ++k) offsets_[k] = 0;
  for (size_t j = n; j-- > 0;) {
    index_[j] = row % batch_[j];
    row /= batch_[j];
    for (size_t k = 0; k < operands; ++k) offsets_[k] += steps_[k * n + j] * index_[j];
  }
}

namespace {

PyArrayObject* AsArray(PyObject* object) {
  return reinterpret_cast<PyArrayObject*>(object);
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

// One side of the call (its inputs or its outputs): the whole-batch views,
// a tuple of row views, and where each whole view's data starts.
struct RowSide {
  PyObject* whole;  // borrowed: the call's tuple of whole-batch views
  PyObject* rows = nullptr;  // owned: a tuple of row views
  bool writable;
  size_t first;  // the cursor's index of this side's first operand
  std::vector<char*> data;
};

bool AddTo(RowCursor& cursor, const RowSide& side) {
  Py_ssize_t n = PyTuple_GET_SIZE(side.whole);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyArrayObject* array = AsArray(PyTuple_GET_ITEM(side.whole, i));
    std::vector<int64_t> dims(PyArray_DIMS(array), PyArray_DIMS(array) + PyArray_NDIM(array));
    if (!cursor.Add(dims.data(), PyArray_NDIM(array), PyArray_ITEMSIZE(array))) return false;
  }
  return true;
}

bool MakeRows(RowSide& side, int rank) {
  Py_ssize_t n = PyTuple_GET_SIZE(side.whole);
  side.rows = PyTuple_New(n);
  if (side.rows == nullptr) return false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* whole = PyTuple_GET_ITEM(side.whole, i);
    PyObject* view = RowView(whole, rank, side.writable);
    if (view == nullptr) return false;
    PyTuple_SET_ITEM(side.rows, i, view);
    side.data.push_back(static_cast<char*>(PyArray_DATA(AsArray(whole))));
  }
  return true;
}

// Points every row view at the cursor's row, replacing any the rule altered.
bool MoveTo(RowSide& side, const RowCursor& cursor) {
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(side.rows); ++i) {
    PyObject* whole = PyTuple_GET_ITEM(side.whole, i);
    PyObject* view = PyTuple_GET_ITEM(side.rows, i);
    if (!RowViewIntact(view, whole, cursor.rank(), side.writable)) {
      view = RowView(whole, cursor.rank(), side.writable);
      if (view == nullptr) return false;
      PyTuple_SetItem(side.rows, i, view);  // releases the altered one
    }
    reinterpret_cast<PyArrayObject_fields*>(view)->data =
        side.data[i] + cursor.offset(side.first + i);
  }
  return true;
}

// One row: the direct form where the kernel has it, else kernel.call.
// Returns "" or the row's error.
std::string CallRow(const Kernel& kernel, PyObject* instance, const RowSide& in,
                    const RowSide& out, bool eager) {
  Py_ssize_t n_in = PyTuple_GET_SIZE(in.rows);
  if (kernel.direct == nullptr || PyTuple_GET_SIZE(out.rows) != 1 ||
      n_in + 2 > kMaxDirectArgs) {
    PyObject* args[] = {in.rows, out.rows, eager ? Py_True : Py_False};
    PyObject* result = PyObject_Vectorcall(kernel.call, args, 3, nullptr);
    std::string error = ErrorOf(result);
    Py_XDECREF(result);
    return error;
  }
  PyObject* argv[kMaxDirectArgs];
  Py_ssize_t first = instance != nullptr ? 1 : 0;
  argv[0] = instance;
  for (Py_ssize_t i = 0; i < n_in; ++i) argv[first + i] = PyTuple_GET_ITEM(in.rows, i);
  argv[first + n_in] = PyTuple_GET_ITEM(out.rows, 0);
  PyObject* result = PyObject_Vectorcall(kernel.direct, argv, first + n_in, OutKeyword());
  if (result == Py_None) {
    Py_DECREF(result);
    return {};
  }
  PyObject* message = HandBackFailure(kernel, result, in.rows, out.rows, eager);
  std::string error = message == nullptr
                          ? FetchPythonError()
                          : MessageOf(message, "jaxdecl: a host kernel failed");
  Py_XDECREF(message);
  return error;
}

}  // namespace

std::string RunRows(const Kernel& kernel, PyObject* inputs, PyObject* outputs,
                    bool eager) {
  RowCursor cursor(kernel.row_dims);
  RowSide in{inputs, nullptr, false, 0, {}};
  RowSide out{outputs, nullptr, true, static_cast<size_t>(PyTuple_GET_SIZE(inputs)), {}};
  if (!AddTo(cursor, in) || !AddTo(cursor, out)) {
    return "jaxdecl: " + kernel.name + ": the call's buffers do not fit its batch";
  }
  PyObject* instance = kernel.direct != nullptr ? kernel.Instance() : nullptr;  // new ref
  if (kernel.direct != nullptr && kernel.instance_ref != nullptr && instance == nullptr) {
    return "jaxdecl: " + kernel.name + ": the op was deleted";
  }
  std::string error;
  bool made = MakeRows(in, cursor.rank()) && MakeRows(out, cursor.rank());
  if (!made) error = FetchPythonError();
  bool escape_checked = false;  // `error` already says what a kept view would
  for (int64_t row = 0; error.empty() && row < cursor.rows(); ++row) {
    if (row > 0) {
      cursor.Next();
      if (!MoveTo(in, cursor) || !MoveTo(out, cursor)) {
        error = FetchPythonError();
        break;
      }
    }
    error = CallRow(kernel, instance, in, out, eager);
    if (!error.empty()) break;
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
