// batch="loop" in the dispatcher: one rule call per row of a batched call.
//
// Under `vmap` a rule declared with batch="loop" runs once per batch element.
// Python iterating the batch makes two new NumPy arrays per row; here one
// view per operand is made per call and re-pointed at each row, so a row
// costs the rule's call and a few pointer writes.  The guarantees are the
// unbatched call's: after each row no view may be held by the rule (the escape
// check runs per row, before a view moves), and a view the rule reshaped in
// place is replaced, never re-pointed.  Apart from python_kernel.cc because
// only batched calls take this path.  GIL held throughout.

#ifndef JAXDECL_CSRC_ROWS_H_
#define JAXDECL_CSRC_ROWS_H_

#include <Python.h>

#include <string>

#include "registry.h"

namespace jaxdecl {

// True when the call's whole-batch views match the kernel's row description
// (Kernel::row_count and friends), so RunRows may run it.
bool RowsFit(const Kernel& kernel, PyObject* inputs, PyObject* outputs);

// Calls kernel.direct([instance,] *row_inputs, out=row_output) once per row;
// returns "" or the message the call fails with.
std::string RunRows(const Kernel& kernel, PyObject* inputs, PyObject* outputs,
                    bool eager);

}  // namespace jaxdecl

#endif  // JAXDECL_CSRC_ROWS_H_
