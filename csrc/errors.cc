// A Python kernel's failures as messages (errors.h).  Nothing here runs on a
// call that succeeds.

#include "errors.h"

namespace jaxdecl {

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

std::string MessageOf(PyObject* result, const char* fallback) {
  PyObject* bytes = PyUnicode_Check(result)
                        ? PyUnicode_AsEncodedString(result, "utf-8", "backslashreplace")
                        : nullptr;
  std::string message = bytes ? std::string(PyBytes_AS_STRING(bytes),
                                            PyBytes_GET_SIZE(bytes))
                              : fallback;
  Py_XDECREF(bytes);
  PyErr_Clear();
  return message;
}

std::string ErrorOf(PyObject* result) {
  if (result == nullptr) return FetchPythonError();
  if (result == Py_None) return {};
  return MessageOf(result, "jaxdecl: a host kernel returned a non-string");
}

// The exception goes back normalized, its traceback attached, as an
// `except` clause sees it: on_failure is that clause of the kernel's own
// Python path (jaxdecl/_kernels.py), which reports the rule's frames.
PyObject* HandBackFailure(const Kernel& kernel, PyObject* result,
                          PyObject* inputs, PyObject* outputs, bool eager) {
  PyObject* exc = Py_NewRef(Py_None);
  PyObject* returned = Py_NewRef(Py_None);
  if (result == nullptr) {
    Py_DECREF(exc);
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (value != nullptr && traceback != nullptr) {
      PyException_SetTraceback(value, traceback);
    }
    exc = value != nullptr ? value : Py_NewRef(Py_None);
    Py_XDECREF(type);
    Py_XDECREF(traceback);
  } else {
    Py_SETREF(returned, result);
  }
  PyObject* args[] = {exc, returned, inputs, outputs, eager ? Py_True : Py_False};
  PyObject* message = PyObject_Vectorcall(kernel.on_failure, args, 5, nullptr);
  Py_DECREF(exc);
  Py_DECREF(returned);
  return message;
}

}  // namespace jaxdecl
