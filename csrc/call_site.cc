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
  return "jaxdecl: " + site.name + " (kernel " + Hex(site.fingerprint) +
         ") is not available in this process. This executable was compiled, "
         "cached or serialized where the op existed; create an equal op here "
         "and call it once (or trace the function again) before running it";
}

namespace {

// Instantiation: once per call site when XLA builds or loads an executable.
// A kernel this process does not have yet is looked up again when the site
// first runs (see Resolve).
ffi::Error JaxdeclInstantiateImpl(StateAccess access, int64_t hi, int64_t lo,
                                  std::string_view name) {
  auto site = std::make_unique<CallSite>();
  ++CallSite::live_call_sites;
  site->fingerprint = {static_cast<uint64_t>(hi), static_cast<uint64_t>(lo)};
  site->name = std::string(name);
  Resolve(*site);
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
