// Compiled call sites (call_site.h): the FFI instantiate stage that makes
// them, their resolution to a kernel, the `jaxdecl_call_site` FFI type that
// lets XLA destroy them, and the hand-over of their Python references to the
// interpreter when it does.

#include "call_site.h"

#include <cstdio>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace ffi = xla::ffi;

namespace jaxdecl {
namespace {

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

PyObject* resolver = nullptr;  // recipe (bytes) -> (slot, op instance or None)

// A strong reference to the instance `kernel` calls: null for a kernel that
// calls none; false when that instance is gone.
bool PinOf(const Kernel& kernel, PyObject** pin) {
  *pin = nullptr;
  if (kernel.instance_ref == nullptr) return true;
#if PY_VERSION_HEX >= 0x030D0000
  if (PyWeakref_GetRef(kernel.instance_ref, pin) <= 0) {
    PyErr_Clear();
    return false;
  }
#else
  *pin = PyWeakref_GetObject(kernel.instance_ref);
  if (*pin == Py_None) return false;
  Py_INCREF(*pin);
#endif
  return true;
}

// The text of the pending Python exception ("Type: message"); clears it.
std::string TakePythonError() {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  PyErr_NormalizeException(&type, &value, &traceback);
  std::string text = "an unknown error";
  if (value != nullptr) {
    PyObject* name = PyObject_GetAttrString(type, "__name__");
    PyObject* message = PyObject_Str(value);
    if (name != nullptr && message != nullptr) {
      const char* n = PyUnicode_AsUTF8(name);
      const char* m = PyUnicode_AsUTF8(message);
      if (n != nullptr && m != nullptr) text = std::string(n) + ": " + m;
    }
    Py_XDECREF(name);
    Py_XDECREF(message);
  }
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(traceback);
  PyErr_Clear();
  return text;
}

// Rebuilds the site's kernel from its recipe through the Python resolver.
// GIL held.  On failure the site's `failure` says why.
bool RebuildWithGil(CallSite& site, KernelPtr* kernel, PyObject** pin) {
  if (site.recipe.empty() || resolver == nullptr || !site.failure.empty()) return false;
  PyObject* recipe = PyBytes_FromStringAndSize(
      site.recipe.data(), static_cast<Py_ssize_t>(site.recipe.size()));
  PyObject* result =
      recipe == nullptr ? nullptr : PyObject_CallFunctionObjArgs(resolver, recipe, nullptr);
  Py_XDECREF(recipe);
  if (result == nullptr) {
    site.failure = TakePythonError();
    return false;
  }
  long long slot = -1;
  PyObject* instance = nullptr;
  if (!PyArg_ParseTuple(result, "LO", &slot, &instance)) {
    Py_DECREF(result);
    site.failure = TakePythonError();
    return false;
  }
  *kernel = FindBySlot(slot);
  *pin = instance == Py_None ? nullptr : instance;
  Py_XINCREF(*pin);
  Py_DECREF(result);
  if (*kernel == nullptr) {
    Py_XDECREF(*pin);
    *pin = nullptr;
    site.failure = "the rebuilt kernel was released before it was used";
    return false;
  }
  return true;
}

// Finds a live registration for the site's fingerprint and pins its op, or
// rebuilds one from the recipe.  GIL held.  False (site unchanged) when this
// process has neither.
bool ResolveWithGil(CallSite& site) {
  if (site.resolved.load(std::memory_order_acquire)) return true;
  KernelPtr kernel = FindLiveByFingerprint(site.fingerprint);
  PyObject* pin = nullptr;
  if (kernel == nullptr || !PinOf(*kernel, &pin)) {
    if (!RebuildWithGil(site, &kernel, &pin)) return false;
  }
  site.kernel = std::move(kernel);
  site.pin = pin;
  site.resolved.store(true, std::memory_order_release);
  return true;
}

std::string Hex(const Fingerprint& f) {
  char text[33];
  std::snprintf(text, sizeof(text), "%016llx%016llx",
                static_cast<unsigned long long>(f.hi),
                static_cast<unsigned long long>(f.lo));
  return text;
}

void DeleteCallSite(void* site) { delete static_cast<CallSite*>(site); }

}  // namespace

XLA_FFI_TypeId CallSite::id = {0};
std::atomic<int64_t> CallSite::live_call_sites{0};

// XLA destroys the state inside its own destructors (a cache being cleared,
// say), where running Python code (an op's finalizer, JAX's own caches)
// could re-enter what is being destroyed: the Python references are handed
// to the interpreter to drop at its next safe point instead.
CallSite::~CallSite() {
  --live_call_sites;
  if (pin == nullptr && kernel == nullptr && views.inputs == nullptr) return;
  ReleaseLater({views.inputs, views.outputs, pin}, std::move(kernel));
}

bool ResolveNow(CallSite& site) {
  if (!Py_IsInitialized()) return false;
  PyGILState_STATE gil = PyGILState_Ensure();
  bool found = ResolveWithGil(site);
  PyGILState_Release(gil);
  return found;
}

std::string NotAvailable(const CallSite& site) {
  if (!site.failure.empty()) {
    return "jaxdecl: " + site.name + " (kernel " + Hex(site.fingerprint) +
           ") could not be rebuilt in this process: " + site.failure;
  }
  return "jaxdecl: " + site.name + " (kernel " + Hex(site.fingerprint) +
         ") is not available in this process. This executable was compiled, "
         "cached or serialized where the op existed; create an equal op here "
         "and call it once (or trace the function again) before running it";
}

ffi::Error InitCallSite(CallSite& site, int64_t hi, int64_t lo, std::string_view name,
                        std::string_view recipe) {
  site.fingerprint = {static_cast<uint64_t>(hi), static_cast<uint64_t>(lo)};
  site.name = std::string(name);
  site.recipe = std::string(recipe);
  if (!Resolve(site) && !site.failure.empty()) {
    // The recipe names an op this process cannot rebuild: say so now, while
    // XLA loads the program, rather than at its first run.
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, NotAvailable(site));
  }
  return ffi::Error::Success();
}

namespace {

// Instantiation: once per call site when XLA builds or loads an executable.
// A kernel this process does not have yet is looked up again when the site
// first runs (see Resolve).
ffi::Error JaxdeclInstantiateImpl(StateAccess access, int64_t hi, int64_t lo,
                                  std::string_view name, std::string_view recipe) {
  auto site = std::make_unique<CallSite>();
  ffi::Error failed = InitCallSite(*site, hi, lo, name, recipe);
  if (failed.failure()) return failed;
  XLA_FFI_Error* error = SetState(access, &CallSite::id, site.get(), &DeleteCallSite);
  if (error != nullptr) {
    DestroyError(access.api, error);
    return ffi::Error(ffi::ErrorCode::kInternal,
                      "jaxdecl: XLA refused the call site's state (" + site->name + ")");
  }
  site.release();  // XLA owns it now
  return ffi::Error::Success();
}

}  // namespace

// registry.h's view of call sites, for the Python module.

int64_t CallSiteCount() { return CallSite::live_call_sites.load(); }

void ReleasePending() { ReleaseGraveyard(nullptr); }

void SetResolver(PyObject* function) {
  Py_XINCREF(function);
  PyObject* old = resolver;
  resolver = function;
  Py_XDECREF(old);
}

void* CallSiteTypeId() { return &CallSite::id; }

const void* CallSiteTypeInfo() {
  static const TypeInfoV2 info{sizeof(TypeInfoV2), nullptr, &DeleteCallSite};
  return &info;
}

}  // namespace jaxdecl

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxdeclInstantiate, jaxdecl::JaxdeclInstantiateImpl,
    // the call site's context and attributes, as its execute stages bind them
    jaxdecl::BindCallSite<ffi::ExecutionStage::kInstantiate>());
