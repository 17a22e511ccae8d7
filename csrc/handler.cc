// The XLA FFI handlers behind every jaxdecl primitive on CPU.
//
// `jaxdecl_dispatch` is what compiled HLO calls: its attributes carry the
// kernel's fingerprint (and name, for messages), never an object address or
// a process-local number, so that a program compiled, cached or serialized
// in one process runs the same op in another, or fails with an error that
// names it.  It has two stages.  When XLA instantiates an executable (after
// compiling it, or loading it from a cache) each call site resolves its
// fingerprint once into a `CallSite`: the kernel and a strong reference to
// the op instance it calls.  XLA owns that state and destroys it with the
// executable, after its last run has finished, so a program that is queued
// or running always finds its kernel, whoever dropped the Python objects
// that built it (async dispatch of a temporary `jax.jit`), and no lookup runs
// per call.  `jaxdecl_dispatch_eager` is the eager path's: one compiled
// executable per signature serves every op, the kernel's slot arriving as the
// first operand (the eager caller holds the op while it waits).
//
// Python kernels (built by jaxdecl/_kernels.py) get every buffer wrapped as a
// NumPy array on XLA's own memory (inputs read-only, outputs writable, no
// copy), called as `kernel(inputs, outputs)` with the GIL held; they return
// None, or an error message they already formatted.  C kernels (jaxdecl.h)
// get the raw buffers and run without the GIL.  Nothing escapes as an
// exception: every failure becomes an `ffi::Error`.
//
// After a Python kernel returns, every view must be referenced by its tuple
// alone.  A rule that kept one (or a slice of one: NumPy's slices reference
// the view they came from, because the view does not own its data) would
// read freed memory once XLA reuses the buffer, so the call fails instead.

#include <Python.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL JAXDECL_ARRAY_API
#define NO_IMPORT_ARRAY
#include <numpy/arrayobject.h>

#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxdecl {
namespace {

static_assert(JAXDECL_BOOL == static_cast<int>(ffi::DataType::PRED));
static_assert(JAXDECL_INT8 == static_cast<int>(ffi::DataType::S8));
static_assert(JAXDECL_UINT64 == static_cast<int>(ffi::DataType::U64));
static_assert(JAXDECL_FLOAT16 == static_cast<int>(ffi::DataType::F16));
static_assert(JAXDECL_FLOAT64 == static_cast<int>(ffi::DataType::F64));
static_assert(JAXDECL_COMPLEX64 == static_cast<int>(ffi::DataType::C64));
static_assert(JAXDECL_BFLOAT16 == static_cast<int>(ffi::DataType::BF16));
static_assert(JAXDECL_COMPLEX128 == static_cast<int>(ffi::DataType::C128));

struct FingerprintHash {
  size_t operator()(const Fingerprint& f) const {
    return static_cast<size_t>(f.hi ^ (f.lo * 0x9E3779B97F4A7C15ull));
  }
};

// Slots and the fingerprint index.  Readers (XLA's threads, possibly without
// the GIL) copy a shared pointer under the shared lock, so a registration
// released while a call runs is destroyed when that call ends.  Allocated
// once and never destroyed: the interpreter may be gone at process exit.
struct Registry {
  std::shared_mutex mutex;
  std::vector<KernelPtr> slots{nullptr};  // slot 0 is never used
  std::vector<int64_t> free_slots;
  std::unordered_map<Fingerprint, std::vector<int64_t>, FingerprintHash> by_fingerprint;
  int64_t live = 0;
};

Registry& registry() {
  static Registry* instance = new Registry();
  return *instance;
}

std::array<PyArray_Descr*, 256> g_descrs{};
PyObject* g_gc_collect = nullptr;
PyObject* g_worker_enter = nullptr;  // () -> token
PyObject* g_worker_exit = nullptr;   // (token) -> None

// Room for a C kernel's error message; the buffer is per thread, allocated
// once, and only its first byte is cleared per call.
constexpr int64_t kMessageSize = 64 * 1024;

// ---------------------------------------------------------------------------
// Python kernels
// ---------------------------------------------------------------------------

// The dimensions the rule sees: all of the buffer's but the last `drop`.
// Split call sites (see JaxdeclDispatchSplit) carry one trailing unit
// dimension that exists only for XLA's batch partitioner.
ffi::AnyBuffer::Dimensions ViewDims(const ffi::AnyBuffer& buffer, int drop) {
  auto dims = buffer.dimensions();
  return dims.first(dims.size() - static_cast<size_t>(drop));
}

// A NumPy array viewing `buffer` without copying.  No base object: NumPy then
// never frees the memory, and every slice taken from the view references the
// view itself, which is what the escape check counts.
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

// str(result) of a kernel that returned something other than None, as UTF-8
// (lone surrogates escaped rather than failing).
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

// Checks both tuples.  Before reporting an escape it collects garbage once
// (JAX's own reference cycles can hold a view; see SetCollect for what else
// that hook releases) and then gives other threads up
// to ~50 ms: a JAX array made from a view inside the rule lets go of the view
// only when its device buffer is released, which XLA may do on another thread
// just after the computation completes.  Only the failing path waits.
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

// `eager`: an eager caller waits for this call and can take the rule's
// exception back (a compiled executable's caller cannot).
// The views one compiled call site handed to its rule last time, kept for the
// next run: XLA's buffers move between runs but keep their shapes and types,
// so pointing the same arrays at the new buffers replaces allocating two
// tuples and their arrays per call.  A view is reused only when nothing else
// holds it (the escape check proved that) and it is exactly as it was made:
// a rule may reshape a view in place (`x.shape = ...`) or change its flags.
// Touched with the GIL held; `busy` while a run uses them (a rule that
// releases the GIL can let another device run the same site meanwhile).
struct ViewCache {
  PyObject* inputs = nullptr;   // tuples owned by the cache
  PyObject* outputs = nullptr;
  bool busy = false;

  void Clear() {
    Py_CLEAR(inputs);
    Py_CLEAR(outputs);
  }
};

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

PyObject* CallKernel(const Kernel& kernel, PyObject* inputs, PyObject* outputs,
                     bool eager) {
  PyObject* args[] = {inputs, outputs, eager ? Py_True : Py_False};
  return PyObject_Vectorcall(kernel.call, args, 3, nullptr);
}

// Calls kernel.direct([instance,] *inputs, out=outputs[0]); returns None, or
// the message on_failure made of what went wrong (null: on_failure failed).
PyObject* CallDirect(const Kernel& kernel, PyObject* inputs, PyObject* outputs,
                     bool eager) {
  static PyObject* out_name = Py_BuildValue("(s)", "out");  // never freed
  constexpr Py_ssize_t kMaxStack = 16;
  Py_ssize_t n_in = PyTuple_GET_SIZE(inputs);
  if (n_in + 2 > kMaxStack || PyTuple_GET_SIZE(outputs) != 1) {
    return CallKernel(kernel, inputs, outputs, eager);
  }
  PyObject* argv[kMaxStack];
  Py_ssize_t nargs = 0;
  PyObject* instance = nullptr;  // a new reference, or null
  if (kernel.instance_ref != nullptr) {
#if PY_VERSION_HEX >= 0x030D0000
    if (PyWeakref_GetRef(kernel.instance_ref, &instance) <= 0) PyErr_Clear();
#else
    instance = PyWeakref_GetObject(kernel.instance_ref);
    if (instance == Py_None) instance = nullptr;
    Py_XINCREF(instance);
#endif
    if (instance == nullptr) return CallKernel(kernel, inputs, outputs, eager);
    argv[nargs++] = instance;
  }
  for (Py_ssize_t i = 0; i < n_in; ++i) argv[nargs++] = PyTuple_GET_ITEM(inputs, i);
  argv[nargs] = PyTuple_GET_ITEM(outputs, 0);
  PyObject* result = PyObject_Vectorcall(kernel.direct, argv, nargs, out_name);
  Py_XDECREF(instance);
  if (result == Py_None) return result;
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

// `cache`: the call site's views, or null (the eager path).
std::string RunPythonKernel(const Kernel& kernel, ffi::RemainingArgs args,
                            ffi::RemainingRets rets, bool eager,
                            ViewCache* cache, int drop) {
  std::string error;
  PyObject* inputs = nullptr;
  PyObject* outputs = nullptr;
  bool reused = false;  // then the cache owns the tuples and we borrow them
  if (cache != nullptr && !cache->busy && cache->inputs != nullptr) {
    if (Repoint(cache->inputs, args, false, drop) &&
        Repoint(cache->outputs, rets, true, drop) &&
        Py_REFCNT(cache->inputs) == 1 && Py_REFCNT(cache->outputs) == 1) {
      inputs = cache->inputs;
      outputs = cache->outputs;
      reused = true;
    } else {
      cache->Clear();
    }
  }
  if (!reused) {
    inputs = WrapAll(args, false, drop, &error);
    outputs = inputs ? WrapAll(rets, true, drop, &error) : nullptr;
  } else {
    cache->busy = true;  // only the run that reuses the views releases them
  }
  if (outputs != nullptr) {
    PyObject* result = kernel.direct != nullptr
                           ? CallDirect(kernel, inputs, outputs, eager)
                           : CallKernel(kernel, inputs, outputs, eager);
    if (result == nullptr) {
      error = FetchPythonError();
    } else if (result != Py_None) {
      error = MessageOf(result, "jaxdecl: a host kernel returned a non-string");
    }
    Py_XDECREF(result);
    // An escape outranks the rule's own error: that error may be what holds
    // the view (an exception carrying its output).
    std::string escaped = CheckEscapes(kernel, inputs, outputs, error, eager);
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

// Runs a Python kernel.  `eager` calls come from the eager path, whose caller
// pins the op; compiled call sites pin it themselves (see CallSite).
std::string RunPythonKernelWithGil(const Kernel& kernel,
                                   ffi::RemainingArgs args,
                                   ffi::RemainingRets rets, bool eager,
                                   ViewCache* cache, int drop) {
  // A thread Python has never seen is one of XLA's workers (see
  // g_worker_enter in registry.h's SetWorkerHooks).
  bool on_worker = PyGILState_GetThisThreadState() == nullptr;
  PyGILState_STATE gil = PyGILState_Ensure();
  // A call site pins its op; an eager caller pins it too, but a slot can be
  // reused once released, so the eager path checks.
  if (eager && !kernel.Alive()) {
    std::string error = "jaxdecl: " + kernel.name + ": the op was deleted";
    PyGILState_Release(gil);
    return error;
  }
  PyObject* token = nullptr;
  if (on_worker && g_worker_enter != nullptr) {
    token = PyObject_CallNoArgs(g_worker_enter);
    if (token == nullptr) PyErr_Clear();
  }
  std::string error = RunPythonKernel(kernel, args, rets, eager, cache, drop);
  if (token != nullptr) {
    PyObject* done = PyObject_CallOneArg(g_worker_exit, token);
    if (done == nullptr) PyErr_Clear();
    Py_XDECREF(done);
    Py_DECREF(token);
  }
  PyGILState_Release(gil);
  return error;
}

// ---------------------------------------------------------------------------
// C kernels
// ---------------------------------------------------------------------------

template <typename Buffers>
bool Describe(const Buffers& buffers, int drop, std::vector<jaxdecl_buffer>* out) {
  out->resize(buffers.size());
  for (size_t i = 0; i < buffers.size(); ++i) {
    auto buffer = BufferAt(buffers, i);
    if (!buffer.has_value()) return false;
    auto dims = ViewDims(*buffer, drop);
    (*out)[i] = jaxdecl_buffer{buffer->untyped_data(), dims.begin(),
                               static_cast<int64_t>(dims.size()),
                               static_cast<int32_t>(buffer->element_type())};
  }
  return true;
}

std::string RunCKernel(jaxdecl_kernel function,
                       const std::vector<jaxdecl_buffer>& inputs,
                       const std::vector<jaxdecl_buffer>& outputs) {
  thread_local std::vector<char> message(kMessageSize);
  message[0] = '\0';
  int status = function(inputs.data(), static_cast<int64_t>(inputs.size()),
                        outputs.data(), static_cast<int64_t>(outputs.size()),
                        message.data(), kMessageSize);
  if (status == 0) return {};
  bool truncated = std::memchr(message.data(), '\0', kMessageSize) == nullptr;
  message[kMessageSize - 1] = '\0';
  std::string text = message.data();
  if (truncated) text += " [message truncated]";
  return "C kernel failed with status " + std::to_string(status) +
         (text.empty() ? std::string() : ": " + text);
}

std::string Hex(const Fingerprint& f) {
  char text[33];
  std::snprintf(text, sizeof(text), "%016llx%016llx",
                static_cast<unsigned long long>(f.hi),
                static_cast<unsigned long long>(f.lo));
  return text;
}

// `cache`: a compiled call site's reusable views, or null (the eager path).
// `drop`: trailing dimensions of every buffer the rule does not see.
std::string Run(const Kernel& kernel, ffi::RemainingArgs args,
                ffi::RemainingRets rets, bool eager, ViewCache* cache,
                int drop = 0) {
  if (kernel.c_function == nullptr) {
    if (!Py_IsInitialized()) return "jaxdecl: the Python interpreter is gone";
    return RunPythonKernelWithGil(kernel, args, rets, eager, cache, drop);
  }
  std::vector<jaxdecl_buffer> inputs, outputs;
  if (!Describe(args, drop, &inputs) || !Describe(rets, drop, &outputs)) {
    return "jaxdecl: an operand is not a buffer";
  }
  std::string error = RunCKernel(kernel.c_function, inputs, outputs);
  return error.empty() ? error : kernel.name + ": " + error;
}

ffi::Error AsError(const std::string& error) {
  if (error.empty()) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal, error);
}

// ---------------------------------------------------------------------------
// Compiled call sites
// ---------------------------------------------------------------------------

// References that destroyed call sites leave for Python to drop.
struct Graveyard {
  std::mutex mutex;
  std::vector<PyObject*> objects;
  std::vector<KernelPtr> kernels;
  bool scheduled = false;
};

Graveyard& graveyard() {
  static Graveyard* instance = new Graveyard();  // outlives the interpreter
  return *instance;
}

// A pending call: the interpreter runs it with the GIL, between bytecodes.
int ReleaseGraveyard(void*) {
  std::vector<PyObject*> objects;
  std::vector<KernelPtr> kernels;
  {
    std::lock_guard<std::mutex> lock(graveyard().mutex);
    objects.swap(graveyard().objects);
    kernels.swap(graveyard().kernels);
    graveyard().scheduled = false;
  }
  for (PyObject* object : objects) Py_DECREF(object);
  kernels.clear();  // a Kernel's destructor takes the GIL itself; reentrant
  return 0;
}

// Safe from any thread, with or without the GIL.  At exit the references
// are left alone: there is no Python left to drop them.
void ReleaseLater(std::initializer_list<PyObject*> objects, KernelPtr kernel) {
  bool schedule = false;
  {
    std::lock_guard<std::mutex> lock(graveyard().mutex);
    for (PyObject* object : objects) {
      if (object != nullptr) graveyard().objects.push_back(object);
    }
    if (kernel != nullptr) graveyard().kernels.push_back(std::move(kernel));
    schedule = !graveyard().scheduled;
    graveyard().scheduled = true;
  }
  if (schedule && Py_IsInitialized() &&
      Py_AddPendingCall(&ReleaseGraveyard, nullptr) != 0) {
    std::lock_guard<std::mutex> lock(graveyard().mutex);
    graveyard().scheduled = false;  // the queue is full: the next site retries
  }
}

// One `jaxdecl_dispatch` call site of one instantiated executable: the kernel
// it runs and the op instance that kernel calls, held strongly.  Ownership:
// XLA's executable -> CallSite -> (Kernel, op instance).  The registry's own
// reference to the kernel may go first (the op's handle and the Python
// executable dropped); this one keeps the kernel runnable until XLA destroys
// the executable, which it does only after the executable's last run.
struct CallSite {
  static XLA_FFI_TypeId id;  // assigned when the type is registered with XLA
  Fingerprint fingerprint;
  std::string name;
  // Set once, under the GIL; read without it once `resolved` is true.
  std::atomic<bool> resolved{false};
  KernelPtr kernel;
  PyObject* pin = nullptr;  // a strong reference to the op instance, or null
  ViewCache views;          // GIL held

  // XLA destroys the state inside its own destructors (a cache being
  // cleared, say), where running Python code (an op's finalizer, JAX's own
  // caches) could re-enter what is being destroyed: the Python references
  // are handed to the interpreter to drop at its next safe point instead.
  ~CallSite() {
    --live_call_sites;
    if (pin == nullptr && kernel == nullptr && views.inputs == nullptr) return;
    ReleaseLater({views.inputs, views.outputs, pin}, std::move(kernel));
  }

  static std::atomic<int64_t> live_call_sites;
};

XLA_FFI_TypeId CallSite::id = {0};
std::atomic<int64_t> CallSite::live_call_sites{0};

// Finds a live registration for the site's fingerprint and pins its op.
// GIL held.  False (site unchanged) when this process has none.
bool ResolveWithGil(CallSite& site) {
  if (site.resolved.load(std::memory_order_acquire)) return true;
  KernelPtr kernel = FindLiveByFingerprint(site.fingerprint);
  if (kernel == nullptr) return false;
  PyObject* pin = nullptr;
  if (kernel->instance_ref != nullptr) {
#if PY_VERSION_HEX >= 0x030D0000
    if (PyWeakref_GetRef(kernel->instance_ref, &pin) <= 0) {
      PyErr_Clear();
      return false;
    }
#else
    pin = PyWeakref_GetObject(kernel->instance_ref);
    if (pin == Py_None) return false;
    Py_INCREF(pin);
#endif
  }
  site.kernel = std::move(kernel);
  site.pin = pin;
  site.resolved.store(true, std::memory_order_release);
  return true;
}

bool Resolve(CallSite& site) {
  if (site.resolved.load(std::memory_order_acquire)) return true;
  if (!Py_IsInitialized()) return false;
  PyGILState_STATE gil = PyGILState_Ensure();
  bool found = ResolveWithGil(site);
  PyGILState_Release(gil);
  return found;
}

std::string NotAvailable(const CallSite& site) {
  return "jaxdecl: " + site.name + " (kernel " + Hex(site.fingerprint) +
         ") is not available in this process. This executable was compiled, "
         "cached or serialized where the op existed; create an equal op here "
         "and call it once (or trace the function again) before running it";
}

// ---------------------------------------------------------------------------
// Per-executable state across XLA FFI API versions
// ---------------------------------------------------------------------------

// jaxdecl is built against the oldest FFI API it supports (0.1, see
// csrc/third_party), so that one build loads next to every jaxlib.  Handlers
// built so run on newer jaxlibs, but the arguments of the two calls that
// set and read a handler's state changed layout after 0.1, so those two are
// made here in the layout of the API version XLA reports at run time.
struct StateArgsV1 {  // API 0.1 (State_Set also passes the deleter)
  size_t struct_size;
  XLA_FFI_Extension_Base* extension_start;
  XLA_FFI_ExecutionContext* ctx;
  XLA_FFI_TypeId* type_id;
  void* state;
  void (*deleter)(void* state);
};
struct StateArgsV2 {  // API 0.2 (the deleter comes with the registered type)
  size_t struct_size;
  XLA_FFI_Extension_Base* extension_start;
  XLA_FFI_ExecutionContext* ctx;
  XLA_FFI_TypeId* type_id;
  void* state;
};
struct StateArgsV3 {  // API 0.3 onwards (states per execution stage)
  size_t struct_size;
  XLA_FFI_Extension_Base* extension_start;
  XLA_FFI_ExecutionContext* ctx;
  int stage;  // XLA_FFI_ExecutionStage; 0 is INSTANTIATE
  XLA_FFI_TypeId* type_id;
  void* state;
};

// What registering the state type with API >= 0.2 takes (XLA_FFI_TypeInfo).
struct TypeInfoV2 {
  size_t struct_size;
  XLA_FFI_Extension_Base* extension_start;
  void (*deleter)(void* object);
};

void DeleteCallSite(void* site) { delete static_cast<CallSite*>(site); }

// The execution context as a handler argument: `.Ctx<StateAccess>()`.
struct StateAccess {
  const XLA_FFI_Api* api;
  XLA_FFI_ExecutionContext* ctx;
};

int ApiMinor(const XLA_FFI_Api* api) { return api->api_version.minor_version; }

using StateCall = XLA_FFI_Error* (*)(void* args);

XLA_FFI_Error* SetState(const StateAccess& access, CallSite* site) {
  auto set = reinterpret_cast<StateCall>(access.api->XLA_FFI_State_Set);
  int minor = ApiMinor(access.api);
  if (minor <= 1) {
    StateArgsV1 args{sizeof(StateArgsV1), nullptr, access.ctx, &CallSite::id, site,
                     &DeleteCallSite};
    return set(&args);
  }
  if (minor == 2) {
    StateArgsV2 args{sizeof(StateArgsV2), nullptr, access.ctx, &CallSite::id, site};
    return set(&args);
  }
  StateArgsV3 args{sizeof(StateArgsV3), nullptr, access.ctx, 0, &CallSite::id, site};
  return set(&args);
}

CallSite* GetState(const StateAccess& access) {
  auto get = reinterpret_cast<StateCall>(access.api->XLA_FFI_State_Get);
  XLA_FFI_Error* error = nullptr;
  void* state = nullptr;
  if (ApiMinor(access.api) <= 2) {
    StateArgsV2 args{sizeof(StateArgsV2), nullptr, access.ctx, &CallSite::id, nullptr};
    error = get(&args);
    state = args.state;
  } else {
    StateArgsV3 args{sizeof(StateArgsV3), nullptr, access.ctx, 0, &CallSite::id, nullptr};
    error = get(&args);
    state = args.state;
  }
  if (error != nullptr) {
    XLA_FFI_Error_Destroy_Args destroy{XLA_FFI_Error_Destroy_Args_STRUCT_SIZE, nullptr,
                                       error};
    access.api->XLA_FFI_Error_Destroy(&destroy);
    return nullptr;
  }
  return static_cast<CallSite*>(state);
}

// Instantiation: once per call site when XLA builds or loads an executable.
// A kernel this process does not have yet is looked up again when the site
// first runs (an executable deserialized before its ops were created).
ffi::Error Instantiate(StateAccess access, int64_t hi, int64_t lo,
                       std::string_view name) {
  auto site = std::make_unique<CallSite>();
  ++CallSite::live_call_sites;
  site->fingerprint = {static_cast<uint64_t>(hi), static_cast<uint64_t>(lo)};
  site->name = std::string(name);
  Resolve(*site);
  XLA_FFI_Error* error = SetState(access, site.get());
  if (error != nullptr) {
    XLA_FFI_Error_Destroy_Args destroy{XLA_FFI_Error_Destroy_Args_STRUCT_SIZE, nullptr,
                                       error};
    access.api->XLA_FFI_Error_Destroy(&destroy);
    return ffi::Error(ffi::ErrorCode::kInternal,
                      "jaxdecl: XLA refused the call site's state (" + site->name + ")");
  }
  site.release();  // XLA owns it now
  return ffi::Error::Success();
}

// The attributes are the call site's (older APIs make every stage decode
// them all); it already holds what they say.  `drop`: see ExecuteSplit.
ffi::Error ExecuteSite(StateAccess access, ffi::RemainingArgs args,
                       ffi::RemainingRets rets, int drop) {
  CallSite* site = GetState(access);
  if (site == nullptr) {
    return AsError("jaxdecl: the call site was not instantiated");
  }
  if (!Resolve(*site)) return AsError(NotAvailable(*site));
  return AsError(Run(*site->kernel, args, rets, /*eager=*/false, &site->views, drop));
}

ffi::Error Execute(StateAccess access, int64_t, int64_t, std::string_view,
                   ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return ExecuteSite(access, args, rets, /*drop=*/0);
}

// A call site that XLA's batch partitioner splits (jaxdecl_dispatch_split):
// every operand and result carries one trailing unit dimension, so that its
// leading dimensions, all the rule's own, can be declared batch dimensions
// (XLA leaves an operand that has nothing but batch dimensions whole).  The
// rule's views leave that unit dimension out.
ffi::Error ExecuteSplit(StateAccess access, int64_t, int64_t, std::string_view,
                        ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return ExecuteSite(access, args, rets, /*drop=*/1);
}

ffi::Error DispatchEager(ffi::AnyBuffer slot, ffi::RemainingArgs args,
                         ffi::RemainingRets rets) {
  int64_t key = -1;
  if (slot.element_type() == ffi::DataType::S64) {
    key = *static_cast<const int64_t*>(slot.untyped_data());
  } else if (slot.element_type() == ffi::DataType::S32) {
    key = *static_cast<const int32_t*>(slot.untyped_data());
  }
  KernelPtr kernel = FindBySlot(key);
  if (kernel == nullptr) {
    return AsError("jaxdecl: no kernel is registered in slot " +
                   std::to_string(key));
  }
  std::string error = Run(*kernel, args, rets, /*eager=*/true, nullptr);
  if (kernel->c_function == nullptr && Py_IsInitialized()) {
    // The last reference may be ours (released meanwhile): drop it with the
    // GIL, which the Kernel's destructor would otherwise take on its own.
    PyGILState_STATE gil = PyGILState_Ensure();
    kernel.reset();
    PyGILState_Release(gil);
  }
  return AsError(error);
}

}  // namespace

// ---------------------------------------------------------------------------
// Registry (registry.h)
// ---------------------------------------------------------------------------

bool Kernel::Alive() const {
  if (instance_ref == nullptr) return true;
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* instance = nullptr;
  int found = PyWeakref_GetRef(instance_ref, &instance);
  if (found < 0) PyErr_Clear();
  Py_XDECREF(instance);
  return found > 0;
#else
  return PyWeakref_GetObject(instance_ref) != Py_None;
#endif
}

Kernel::~Kernel() {
  if (call == nullptr && on_escape == nullptr && keepalive == nullptr &&
      instance_ref == nullptr && direct == nullptr && on_failure == nullptr) {
    return;
  }
  if (!Py_IsInitialized()) return;  // at exit: nothing left to release
  PyGILState_STATE gil = PyGILState_Ensure();
  Py_XDECREF(call);
  Py_XDECREF(on_escape);
  Py_XDECREF(keepalive);
  Py_XDECREF(instance_ref);
  Py_XDECREF(direct);
  Py_XDECREF(on_failure);
  PyGILState_Release(gil);
}

int64_t RegisterKernel(std::unique_ptr<Kernel> kernel) {
  Registry& r = registry();
  std::unique_lock<std::shared_mutex> lock(r.mutex);
  int64_t slot;
  if (!r.free_slots.empty()) {
    slot = r.free_slots.back();
    r.free_slots.pop_back();
  } else {
    slot = static_cast<int64_t>(r.slots.size());
    r.slots.emplace_back();
  }
  r.by_fingerprint[kernel->fingerprint].push_back(slot);
  r.slots[slot] = KernelPtr(kernel.release());
  ++r.live;
  return slot;
}

bool ReleaseKernel(int64_t slot) {
  KernelPtr released;  // destroyed after the lock is let go
  Registry& r = registry();
  std::unique_lock<std::shared_mutex> lock(r.mutex);
  if (slot <= 0 || slot >= static_cast<int64_t>(r.slots.size()) ||
      r.slots[slot] == nullptr) {
    return false;
  }
  released = std::move(r.slots[slot]);
  r.slots[slot] = nullptr;
  auto found = r.by_fingerprint.find(released->fingerprint);
  if (found != r.by_fingerprint.end()) {
    auto& list = found->second;
    for (auto it = list.begin(); it != list.end(); ++it) {
      if (*it == slot) {
        list.erase(it);
        break;
      }
    }
    if (list.empty()) r.by_fingerprint.erase(found);
  }
  r.free_slots.push_back(slot);
  --r.live;
  lock.unlock();
  return true;
}

KernelPtr FindBySlot(int64_t slot) {
  Registry& r = registry();
  std::shared_lock<std::shared_mutex> lock(r.mutex);
  if (slot <= 0 || slot >= static_cast<int64_t>(r.slots.size())) return nullptr;
  return r.slots[slot];
}

KernelPtr FindLiveByFingerprint(const Fingerprint& fingerprint) {
  Registry& r = registry();
  std::shared_lock<std::shared_mutex> lock(r.mutex);
  auto found = r.by_fingerprint.find(fingerprint);
  if (found == r.by_fingerprint.end()) return nullptr;
  for (auto it = found->second.rbegin(); it != found->second.rend(); ++it) {
    if (r.slots[*it]->Alive()) return r.slots[*it];
  }
  return nullptr;
}

int64_t KernelCount() {
  Registry& r = registry();
  std::shared_lock<std::shared_mutex> lock(r.mutex);
  return r.live;
}

bool Initialize() {
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

void SetWorkerHooks(PyObject* enter, PyObject* exit) {
  Py_XINCREF(enter);
  Py_XINCREF(exit);
  Py_XDECREF(g_worker_enter);
  Py_XDECREF(g_worker_exit);
  g_worker_enter = enter;
  g_worker_exit = exit;
}

std::string CallCKernel(jaxdecl_kernel function, PyObject* inputs,
                        PyObject* outputs) {
  std::vector<jaxdecl_buffer> described[2];
  std::vector<std::vector<int64_t>> dims;
  PyObject* tuples[2] = {inputs, outputs};
  dims.reserve(PyTuple_GET_SIZE(inputs) + PyTuple_GET_SIZE(outputs));
  for (int side = 0; side < 2; ++side) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tuples[side]); ++i) {
      PyObject* item = PyTuple_GET_ITEM(tuples[side], i);
      if (!PyArray_Check(item) ||
          !PyArray_IS_C_CONTIGUOUS(reinterpret_cast<PyArrayObject*>(item))) {
        return "jaxdecl: C kernels take C-contiguous NumPy arrays";
      }
      auto* array = reinterpret_cast<PyArrayObject*>(item);
      int code = -1;
      for (int c = 0; c < 256; ++c) {
        if (g_descrs[c] != nullptr &&
            PyArray_EquivTypes(g_descrs[c], PyArray_DESCR(array))) {
          code = c;
          break;
        }
      }
      if (code < 0) return "jaxdecl: unsupported dtype for a C kernel";
      npy_intp* shape = PyArray_SHAPE(array);
      dims.emplace_back(shape, shape + PyArray_NDIM(array));
      described[side].push_back(jaxdecl_buffer{
          PyArray_DATA(array), dims.back().data(), PyArray_NDIM(array), code});
    }
  }
  std::string error;
  Py_BEGIN_ALLOW_THREADS
  error = RunCKernel(function, described[0], described[1]);
  Py_END_ALLOW_THREADS
  return error;
}

}  // namespace jaxdecl

namespace jaxdecl {

int64_t CallSiteCount() { return CallSite::live_call_sites.load(); }

void ReleasePending() { ReleaseGraveyard(nullptr); }

void* CallSiteTypeId() { return &CallSite::id; }

const void* CallSiteTypeInfo() {
  static const TypeInfoV2 info{sizeof(TypeInfoV2), nullptr, &DeleteCallSite};
  return &info;
}

}  // namespace jaxdecl

namespace xla::ffi {

// Decodes `.Ctx<jaxdecl::StateAccess>()`: the API and execution context, for
// the state calls above.
template <>
struct CtxDecoding<jaxdecl::StateAccess> {
  using Type = jaxdecl::StateAccess;

  static std::optional<Type> Decode(const XLA_FFI_Api* api,
                                    XLA_FFI_ExecutionContext* ctx,
                                    DiagnosticEngine&) {
    return jaxdecl::StateAccess{api, ctx};
  }
};

}  // namespace xla::ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxdeclInstantiate, jaxdecl::Instantiate,
    ffi::Ffi::BindInstantiate()
        .Ctx<jaxdecl::StateAccess>()      // to hand XLA the call site
        .Attr<int64_t>("fingerprint_hi")  // which kernel: a stable fingerprint
        .Attr<int64_t>("fingerprint_lo")
        .Attr<std::string_view>("name"));  // Class.method, for messages

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxdeclDispatch, jaxdecl::Execute,
    ffi::Ffi::Bind()
        .Ctx<jaxdecl::StateAccess>()  // the call site, resolved at instantiation
        .Attr<int64_t>("fingerprint_hi")
        .Attr<int64_t>("fingerprint_lo")
        .Attr<std::string_view>("name")
        .RemainingArgs()                        // the rule's operands, in order
        .RemainingRets());                      // the rule's results, in order

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxdeclDispatchSplit, jaxdecl::ExecuteSplit,
    ffi::Ffi::Bind()
        .Ctx<jaxdecl::StateAccess>()
        .Attr<int64_t>("fingerprint_hi")
        .Attr<int64_t>("fingerprint_lo")
        .Attr<std::string_view>("name")
        .RemainingArgs()    // the rule's operands, each with a trailing unit dim
        .RemainingRets());  // the rule's results, likewise

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxdeclDispatchEager, jaxdecl::DispatchEager,
    ffi::Ffi::Bind()
        .Arg<ffi::AnyBuffer>()  // the kernel's slot, an int32 or int64 scalar
        .RemainingArgs()        // the rule's operands, in order
        .RemainingRets());      // the rule's results, in order
