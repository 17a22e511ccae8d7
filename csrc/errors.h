// How a Python kernel's failure becomes text that XLA can carry.
//
// Owns turning a raised exception or a rule's non-None return into the
// message of the call's `ffi::Error`, and handing a directly called rule's
// exception back to Python (Kernel::on_failure), which keeps it for an eager
// caller to re-raise.  Apart from the handlers because every path that runs
// Python (the call itself, the escape check) fails through these, and none
// of them may let an exception cross into XLA.  GIL held throughout.

#ifndef JAXDECL_CSRC_ERRORS_H_
#define JAXDECL_CSRC_ERRORS_H_

#include <Python.h>

#include <string>

#include "registry.h"

namespace jaxdecl {

// The pending Python exception as "jaxdecl: a host kernel raised Type: text";
// clears it.
std::string FetchPythonError();

// str(result) of a kernel that returned something other than None, as UTF-8
// (lone surrogates escaped rather than failing); `fallback` if it is not a
// string.
std::string MessageOf(PyObject* result, const char* fallback);

// The message of what a kernel call returned: "" for None, the pending
// exception's for null, else str(result).
std::string ErrorOf(PyObject* result);

// Hands what a direct call (Kernel::direct) did wrong to kernel.on_failure:
// `result` (stolen) is null with the exception pending, or what the rule
// returned instead of None.  Returns on_failure's message (a new
// reference), or null with on_failure's own exception pending.
PyObject* HandBackFailure(const Kernel& kernel, PyObject* result,
                          PyObject* inputs, PyObject* outputs, bool eager);

}  // namespace jaxdecl

#endif  // JAXDECL_CSRC_ERRORS_H_
