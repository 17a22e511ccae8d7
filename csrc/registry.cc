// The kernel registry (registry.h): slots, the fingerprint index, and the
// Python references a Kernel owns.  Apart from the handlers because Python
// registers and releases kernels here with the GIL while XLA's threads read
// it without: its locking is its own.

#include "registry.h"

#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace jaxdecl {
namespace {

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

}  // namespace

PyObject* Kernel::Instance() const {
  if (instance_ref == nullptr) return nullptr;
  PyObject* instance = nullptr;
#if PY_VERSION_HEX >= 0x030D0000
  if (PyWeakref_GetRef(instance_ref, &instance) < 0) PyErr_Clear();
#else
  instance = PyWeakref_GetObject(instance_ref);
  if (instance == Py_None) instance = nullptr;
  Py_XINCREF(instance);
#endif
  return instance;
}

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
      instance_ref == nullptr && direct == nullptr && on_failure == nullptr &&
      device_call == nullptr && gpu_keepalive == nullptr) {
    return;
  }
  if (!Py_IsInitialized()) return;  // at exit: nothing left to release
  PyGILState_STATE gil = PyGILState_Ensure();
  eager_views.Clear();
  Py_XDECREF(call);
  Py_XDECREF(on_escape);
  Py_XDECREF(keepalive);
  Py_XDECREF(instance_ref);
  Py_XDECREF(direct);
  Py_XDECREF(on_failure);
  Py_XDECREF(device_call);
  Py_XDECREF(gpu_keepalive);
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

}  // namespace jaxdecl
