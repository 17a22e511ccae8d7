// Compiled call sites: the state XLA keeps for each `jaxdecl_dispatch` (and
// `jaxdecl_dispatch_split`) custom call of an instantiated executable.
//
// When XLA instantiates an executable (after compiling it, or loading it
// from a cache) each call site resolves its fingerprint once into a
// `CallSite`: the kernel and a strong reference to the op instance it calls.
// XLA owns that state (the FFI type `jaxdecl_call_site`) and destroys it with
// the executable, after its last run has finished, so a program that is
// queued or running always finds its kernel, whoever dropped the Python
// objects that built it (async dispatch of a temporary `jax.jit`), and no
// lookup runs per call.  Apart from the execute handlers (handler.cc)
// because this is about lifetimes, not about running: who owns what, and
// when Python may drop it.

#ifndef JAXDECL_CSRC_CALL_SITE_H_
#define JAXDECL_CSRC_CALL_SITE_H_

#include <Python.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>

#include "ffi_state.h"
#include "registry.h"
#include "views.h"
#include "xla/ffi/api/ffi.h"

namespace jaxdecl {

// One call site of one instantiated executable: the kernel it runs and the
// op instance that kernel calls, held strongly.  Ownership: XLA's executable
// -> CallSite -> (Kernel, op instance).  The registry's own reference to the
// kernel may go first (the op's handle and the Python executable dropped);
// this one keeps the kernel runnable until XLA destroys the executable,
// which it does only after the executable's last run.
struct CallSite {
  static XLA_FFI_TypeId id;  // assigned when the type is registered with XLA
  Fingerprint fingerprint;
  std::string name;
  // What any process needs to rebuild the kernel (jaxdecl/_recipes.py), or
  // empty for an op that cannot be rebuilt elsewhere.
  std::string recipe;
  // Why rebuilding from the recipe failed (set once, under the GIL).
  std::string failure;
  // Set once, under the GIL; read without it once `resolved` is true.
  std::atomic<bool> resolved{false};
  KernelPtr kernel;
  PyObject* pin = nullptr;  // a strong reference to the op instance, or null
  ViewCache views;          // GIL held

  CallSite() { ++live_call_sites; }
  ~CallSite();

  static std::atomic<int64_t> live_call_sites;
};

// Looks the site's kernel up now, taking the GIL: a live registration of its
// fingerprint, else one rebuilt from its recipe.  False (the site's
// `failure` says why, when a rebuild failed) when neither is possible.
bool ResolveNow(CallSite& site);

// True once the site has its kernel.  A kernel this process did not have at
// instantiation (an executable deserialized before its ops were created) is
// looked up again when the site runs; only that first run pays for it.
inline bool Resolve(CallSite& site) {
  return site.resolved.load(std::memory_order_acquire) || ResolveNow(site);
}

// The message of a site whose kernel this process does not have.
std::string NotAvailable(const CallSite& site);

// The instantiate stage's work, for every platform: fills `site` from the
// call's attributes and resolves its kernel.  Fails when the recipe names an
// op this process cannot rebuild (said while XLA loads the program, not at
// its first run).
ffi::Error InitCallSite(CallSite& site, int64_t hi, int64_t lo, std::string_view name,
                        std::string_view recipe);

// The call site XLA keeps for this custom call, or null.
inline CallSite* GetCallSite(const StateAccess& access) {
  return static_cast<CallSite*>(GetState(access, &CallSite::id));
}

// What every stage of a call site binds.  The instantiate stage reads the
// attributes; the execute stages decode them too (older APIs make every
// stage decode them all), though the site already holds what they say.
template <ffi::ExecutionStage stage>
auto BindCallSite() {
  return ffi::Ffi::Bind<stage>()
      .template Ctx<StateAccess>()               // the call site's state
      .template Attr<int64_t>("fingerprint_hi")  // which kernel: a stable fingerprint
      .template Attr<int64_t>("fingerprint_lo")
      .template Attr<std::string_view>("name")   // Class.method, for messages
      .template Attr<std::string_view>("recipe");  // how to rebuild it anywhere
}

}  // namespace jaxdecl

#endif  // JAXDECL_CSRC_CALL_SITE_H_
