// Shared between the FFI handlers and the Python module (module.cc): the
// kernel registry (registry.cc) and what Python configures in the handlers.
//
// A kernel is registered by Python for as long as an op of its configuration
// (or a Python executable that lowered it) lives, and released when that owner
// goes.  XLA finds it either by its fingerprint (what compiled HLO carries:
// stable across processes, never an address or a process-local counter),
// once per call site when an executable is instantiated, or by its slot (what
// the eager path passes at run time, so that one compiled executable serves
// every op of one signature).  Kernels are shared pointers: an instantiated
// call site keeps its kernel after the registration is released.

#ifndef JAXDECL_CSRC_REGISTRY_H_
#define JAXDECL_CSRC_REGISTRY_H_

#include <Python.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "jaxdecl.h"

namespace jaxdecl {

namespace gpu {
struct Staging;  // csrc/gpu/staging.h
}  // namespace gpu

// 128 bits of a SHA-256 over the op's class, configuration, rule and shapes.
struct Fingerprint {
  uint64_t hi = 0;
  uint64_t lo = 0;
  bool operator==(const Fingerprint& other) const {
    return hi == other.hi && lo == other.lo;
  }
};

// Hashes a fingerprint for unordered maps (its bits are already uniform).
struct FingerprintHash {
  size_t operator()(const Fingerprint& f) const {
    return static_cast<size_t>(f.hi ^ (f.lo * 0x9E3779B97F4A7C15ull));
  }
};

// The views a kernel handed to its rule last time (at one compiled call site,
// or on the eager path), kept for the next run: XLA's buffers move between runs but keep their shapes and types,
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

// What XLA runs: a Python host kernel, or a C kernel that runs without the
// GIL.  Owns references to its Python objects; releasing them takes the GIL.
struct Kernel {
  Fingerprint fingerprint;
  std::string name;                // Class.method (@kind), for messages
  PyObject* call = nullptr;        // kernel(inputs, outputs, eager) -> None | str
  PyObject* on_escape = nullptr;   // on_escape(is_output, index, error, eager) -> str
  jaxdecl_kernel c_function = nullptr;
  PyObject* keepalive = nullptr;   // owner of c_function's code (capsule, ctypes)
  PyObject* instance_ref = nullptr;  // weakref to the op the kernel calls, or null
  // The hot path of a zero-copy rule with one result, or null: the dispatcher
  // calls direct([instance,] *inputs, out=output) itself, one Python frame
  // fewer, and on_failure(exc, returned, inputs, outputs, eager) -> message
  // when it raises or returns something.
  PyObject* direct = nullptr;
  PyObject* on_failure = nullptr;
  // batch="loop": the leading dimensions whose rows the kernel runs on one at
  // a time, in the dispatcher (rows.h), for every kind of kernel; empty: it
  // sees the whole call.
  std::vector<int64_t> row_dims;
  // C kernels: the operands the function takes, by index (empty: all, in
  // order), so that a derivative rule is not handed extras it does not take.
  std::vector<int> c_operands;
  // C kernels given as an adjoint A^H: the operands from this index on are
  // conjugated before the call and the results after it, which makes the
  // transpose conj(A^H conj(ct)); -1: not an adjoint.
  int c_conj_from = -1;
  // The views of the eager path and of CUDA's compiled calls (their shapes
  // are the kernel's own).  GIL held.
  mutable ViewCache eager_views;
  // A device rule (platform="gpu"), which the CUDA handlers run on the
  // device buffers instead of staging them through the host rule above:
  // a Python kernel device_call(inputs, outputs, stream, ordinal, eager) ->
  // None | message, each input and output an (address, shape, type code);
  // or a C function that takes XLA's stream (jaxdecl.h), its code owned by
  // gpu_keepalive.  Null: the host rule runs on GPUs too (csrc/gpu/).
  PyObject* device_call = nullptr;
  jaxdecl_gpu_kernel gpu_function = nullptr;
  PyObject* gpu_keepalive = nullptr;
  // The pinned host buffers of the kernel's GPU runs (compiled and eager),
  // made at its first GPU run.
  mutable std::mutex gpu_mutex;
  mutable std::shared_ptr<gpu::Staging> eager_staging;
  // False once the op the kernel calls is gone.  GIL held.
  bool Alive() const;
  // The op the kernel calls (a new reference); null when it has none or it is
  // gone.  GIL held.
  PyObject* Instance() const;
  ~Kernel();
};

using KernelPtr = std::shared_ptr<const Kernel>;

// Looks up what the handler needs from Python (gc.collect); false with a
// Python error set on failure.  Called once, when the module is imported.
bool Initialize();

// Registers a kernel; returns its slot (>= 1).  Several registrations may
// share one fingerprint (equal configurations); lookups by fingerprint find
// the most recent live one.  GIL held.
int64_t RegisterKernel(std::unique_ptr<Kernel> kernel);

// Drops a registration; false if the slot is not registered.  The kernel is
// destroyed once no running call holds it.  GIL held.
bool ReleaseKernel(int64_t slot);

// Safe without the GIL; nullptr when nothing is registered there.
KernelPtr FindBySlot(int64_t slot);

// The most recent registration under `fingerprint` whose op is alive.  GIL held.
KernelPtr FindLiveByFingerprint(const Fingerprint& fingerprint);

// How many registrations are live.
int64_t KernelCount();

// How many compiled call sites (instantiated `jaxdecl_dispatch` calls of live
// executables) exist; each holds its kernel and op until XLA drops it.
int64_t CallSiteCount();

// Drops now what destroyed call sites left for Python to drop at its next
// safe point (their op instances and views).  GIL held.
void ReleasePending();

// The Python callable that rebuilds a call site's kernel from its recipe:
// resolver(recipe: bytes) -> (slot, op instance or None).  Null: none.
void SetResolver(PyObject* function);

// The FFI type of the call-site state (its TypeId, filled in when the type
// is registered with XLA, and its XLA_FFI_TypeInfo), for jax.ffi.
void* CallSiteTypeId();
const void* CallSiteTypeInfo();

// NumPy dtype for an XLA element type code (a new reference), or nullptr.
void SetDescr(int code, PyObject* descr);

// Replaces the garbage collection run before an escape is reported (default:
// gc.collect) with a callable that may also release stale references.
void SetCollect(PyObject* collect);

// What a kernel on one of XLA's worker threads runs under: attribute `name`
// of the thread's `state()` object set to `value` for the call (JAX's
// transfer guard: a rule calling JAX there would deadlock, so it fails).
void SetWorkerGuard(PyObject* state, PyObject* name, PyObject* value);

}  // namespace jaxdecl

#endif  // JAXDECL_CSRC_REGISTRY_H_
