// Python kernels (kernels.h): the per-call path of a rule written in Python.
//
// Kernels built by jaxdecl/_kernels.py get every buffer wrapped as a NumPy
// array on XLA's own memory (views.h), called as `kernel(inputs, outputs,
// eager)` with the GIL held; they return None, or an error message they
// already formatted.  A zero-copy rule with one result is called directly
// instead (Kernel::direct), one Python frame fewer; a looped batch runs one
// row at a time (rows.h).  Kept apart from the
// handlers and the views because this is the only place that takes the GIL
// and calls into Python per call: its cost is the dispatcher's overhead.

#include <Python.h>

#include <functional>

#include "errors.h"
#include "fp_env.h"
#include "kernels.h"
#include "rows.h"
#include "views.h"

namespace jaxdecl {
namespace {

// The guard set around kernels on XLA's worker threads (SetWorkerGuard):
// `g_guard_state()` gives the calling thread's state object, whose attribute
// `g_guard_name` is set to `g_guard_value` for the call.
PyObject* g_guard_state = nullptr;
PyObject* g_guard_name = nullptr;
PyObject* g_guard_value = nullptr;

// This worker thread's guard state object, made once and kept.  GIL held.
PyObject* ThreadGuardState() {
  thread_local PyObject* state = nullptr;
  if (state == nullptr && g_guard_state != nullptr) {
    state = PyObject_CallNoArgs(g_guard_state);
    if (state == nullptr) PyErr_Clear();
  }
  return state;
}

// Sets the guard for a call on this worker thread; returns what to restore
// (a new reference), or null.  GIL held.
PyObject* EnterGuard() {
  PyObject* state = ThreadGuardState();
  if (state == nullptr) return nullptr;
  PyObject* previous = PyObject_GetAttr(state, g_guard_name);
  if (previous == nullptr || PyObject_SetAttr(state, g_guard_name, g_guard_value) < 0) {
    PyErr_Clear();
    Py_XDECREF(previous);
    return nullptr;
  }
  return previous;
}

void LeaveGuard(PyObject* previous) {
  if (previous == nullptr) return;
  PyObject* state = ThreadGuardState();
  if (state == nullptr || PyObject_SetAttr(state, g_guard_name, previous) < 0) PyErr_Clear();
  Py_DECREF(previous);
}

PyObject* CallKernel(const Kernel& kernel, PyObject* inputs, PyObject* outputs,
                     bool eager) {
  PyObject* args[] = {inputs, outputs, eager ? Py_True : Py_False};
  return PyObject_Vectorcall(kernel.call, args, 3, nullptr);
}

// Calls kernel.direct([instance,] *inputs, out=outputs[0]); returns None, or
// the message on_failure made of what went wrong (null: on_failure failed).
PyObject* CallDirect(const Kernel& kernel, PyObject* inputs, PyObject* outputs,
                     bool eager) {
  Py_ssize_t n_in = PyTuple_GET_SIZE(inputs);
  if (n_in + 2 > kMaxDirectArgs || PyTuple_GET_SIZE(outputs) != 1) {
    return CallKernel(kernel, inputs, outputs, eager);
  }
  PyObject* argv[kMaxDirectArgs];
  Py_ssize_t nargs = 0;
  PyObject* instance = kernel.Instance();  // a new reference, or null
  if (kernel.instance_ref != nullptr) {
    if (instance == nullptr) return CallKernel(kernel, inputs, outputs, eager);
    argv[nargs++] = instance;
  }
  for (Py_ssize_t i = 0; i < n_in; ++i) argv[nargs++] = PyTuple_GET_ITEM(inputs, i);
  argv[nargs] = PyTuple_GET_ITEM(outputs, 0);
  PyObject* result = PyObject_Vectorcall(kernel.direct, argv, nargs, OutKeyword());
  Py_XDECREF(instance);
  if (result == Py_None) return result;
  return HandBackFailure(kernel, result, inputs, outputs, eager);
}

// Wraps (or re-points, with `call.cache`) the views, calls the kernel and
// checks that it kept none.  GIL held.
std::string RunWithViews(const Kernel& kernel, const Call& call) {
  ViewCache* cache = call.cache;
  std::string error;
  PyObject* inputs = nullptr;
  PyObject* outputs = nullptr;
  bool reused = false;  // then the cache owns the tuples and we borrow them
  if (cache != nullptr && !cache->busy && cache->inputs != nullptr) {
    if (Repoint(cache->inputs, call.args, false, call.drop) &&
        Repoint(cache->outputs, call.rets, true, call.drop) &&
        Py_REFCNT(cache->inputs) == 1 && Py_REFCNT(cache->outputs) == 1) {
      inputs = cache->inputs;
      outputs = cache->outputs;
      reused = true;
    } else {
      cache->Clear();
    }
  }
  if (!reused) {
    inputs = WrapAll(call.args, false, call.drop, &error);
    outputs = inputs ? WrapAll(call.rets, true, call.drop, &error) : nullptr;
  } else {
    cache->busy = true;  // only the run that reuses the views releases them
  }
  if (outputs != nullptr) {
    if (!kernel.row_dims.empty()) {  // a looped batch (rows.h)
      error = RunRows(kernel, inputs, outputs, call.eager);
    } else {
      PyObject* result = kernel.direct != nullptr
                             ? CallDirect(kernel, inputs, outputs, call.eager)
                             : CallKernel(kernel, inputs, outputs, call.eager);
      error = ErrorOf(result);
      Py_XDECREF(result);
    }
    // An escape outranks the rule's own error: that error may be what holds
    // the view (an exception carrying its output).
    std::string escaped = CheckEscapes(kernel, inputs, outputs, error, call.eager);
    if (!escaped.empty()) error = escaped;
  }
  if (cache != nullptr) {
    if (reused) cache->busy = false;
    if (!error.empty()) {
      // A failed run's views may be held somewhere: never reuse them.
      if (reused) cache->Clear();
    } else if (!reused && !cache->busy && cache->inputs == nullptr &&
               outputs != nullptr) {
      cache->inputs = inputs;  // our references become the cache's
      cache->outputs = outputs;
      return error;
    }
  }
  if (!reused) {
    Py_XDECREF(inputs);
    Py_XDECREF(outputs);
  }
  return error;
}

// True on one of XLA's worker threads: a thread Python had never seen when
// it first ran a kernel (see registry.h's SetWorkerGuard).
// Such a thread keeps a Python thread state from then on: creating and
// destroying one per call (what PyGILState_Ensure/Release do on a thread
// without one) costs far more than the call itself, and a kernel inside an
// XLA loop runs there thousands of times.  GIL not held.
bool OnWorkerThread() {
  thread_local int kind = 0;  // 0: not known yet; 1: a Python thread; 2: a worker
  if (kind == 0) {
    kind = PyGILState_GetThisThreadState() == nullptr ? 2 : 1;
    if (kind == 2) {
      // Made here and never released: each later Ensure/Release pair only
      // takes and drops the GIL.  XLA's worker threads live as long as the
      // process; the interpreter clears the state at exit.
      PyGILState_Ensure();
      PyEval_SaveThread();
    }
  }
  return kind == 2;
}

}  // namespace

PyObject* OutKeyword() {
  static PyObject* names = Py_BuildValue("(s)", "out");  // never freed
  return names;
}

// `eager` calls come from the eager path, whose caller pins the op; compiled
// call sites pin it themselves (see CallSite).
std::string RunInPython(const Kernel& kernel, bool eager,
                        const std::function<std::string()>& body) {
  if (!Py_IsInitialized()) return "jaxdecl: the Python interpreter is gone";
  bool on_worker = OnWorkerThread();
  PyGILState_STATE gil = PyGILState_Ensure();
  // A call site pins its op; an eager caller pins it too, but a slot can be
  // reused once released, so the eager path checks.
  if (eager && !kernel.Alive()) {
    std::string error = "jaxdecl: " + kernel.name + ": the op was deleted";
    PyGILState_Release(gil);
    return error;
  }
  PyObject* previous = on_worker ? EnterGuard() : nullptr;
  std::string error;
  {
    RuleFpEnvironment environment;  // Python's, not XLA's (fp_env.h)
    error = body();
  }
  LeaveGuard(previous);
  PyGILState_Release(gil);
  return error;
}

std::string RunPythonKernel(const Kernel& kernel, const Call& call) {
  return RunInPython(kernel, call.eager, [&] { return RunWithViews(kernel, call); });
}

void SetWorkerGuard(PyObject* state, PyObject* name, PyObject* value) {
  Py_XINCREF(state);
  Py_XINCREF(name);
  Py_XINCREF(value);
  Py_XDECREF(g_guard_state);
  Py_XDECREF(g_guard_name);
  Py_XDECREF(g_guard_value);
  g_guard_state = state;
  g_guard_name = name;
  g_guard_value = value;
}

}  // namespace jaxdecl
