// batch="loop" in the dispatcher: one rule call per row of a batched call,
// for every kind of kernel.
//
// Under `vmap` a rule declared with batch="loop" runs once per batch element,
// inside one XLA call.  The dispatcher walks the rows itself: Python kernels
// get one view per operand per call, re-pointed at each row (a row costs the
// rule's call and a few pointer writes); C kernels get their buffer
// descriptions moved along the rows without taking the GIL.  An operand of
// size 1 along a batch dimension (vmap's in_axes=None, broadcast) stays put
// along it.  The guarantees are the unbatched call's: after each row no view
// may be held by the rule (the escape check runs per row, before a view
// moves), and a view the rule changed in place is replaced, never re-pointed.

#ifndef JAXDECL_CSRC_ROWS_H_
#define JAXDECL_CSRC_ROWS_H_

#include <Python.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "registry.h"

namespace jaxdecl {

// Where each operand's current row starts: a row-major walk over the batch
// dimensions, by byte offsets from each operand's first element.
class RowCursor {
 public:
  explicit RowCursor(const std::vector<int64_t>& batch);

  // Adds an operand (dense, row-major) of `rank` dims `dims` and `itemsize`
  // bytes per element; false unless each of its leading dims is the batch's
  // or 1 (it broadcasts there).
  bool Add(const int64_t* dims, int64_t rank, size_t itemsize);

  int64_t rows() const { return rows_; }
  int rank() const { return static_cast<int>(batch_.size()); }
  int64_t offset(size_t operand) const { return offsets_[operand]; }

  // Moves every operand on to the next row.
  void Next();

  // Moves every operand to row `row` (row-major over the batch dims), from anywhere.
  void Seek(int64_t row);

 private:
  std::vector<int64_t> batch_;
  std::vector<int64_t> index_;    // the current row's index along each batch dim
  std::vector<int64_t> steps_;    // operand-major: bytes per step along each batch dim
  std::vector<int64_t> offsets_;  // per operand
  int64_t rows_ = 1;
};

// Runs a looped Python kernel (Kernel::row_dims) on the whole call's views:
// kernel.direct([instance,] *row_inputs, out=row_output) per row where the
// kernel has that form, kernel.call(row_inputs, row_outputs, eager) per row
// otherwise.  Returns "" or the message the call fails with.  GIL held.
std::string RunRows(const Kernel& kernel, PyObject* inputs, PyObject* outputs,
                    bool eager);

}  // namespace jaxdecl

#endif  // JAXDECL_CSRC_ROWS_H_
