// Per-executable handler state across XLA FFI API versions.
//
// jaxdecl is built against the oldest FFI API it supports (0.1, see
// csrc/third_party), so that one build loads next to every jaxlib.  Handlers
// built so run on newer jaxlibs, but the arguments of the two calls that set
// and read a handler's state changed layout after 0.1, so those two are made
// here in the layout of the API version XLA reports at run time.  Kept apart
// so that this is the only C++ that knows FFI API versions; it knows nothing
// of what the state is (call_site.h).

#ifndef JAXDECL_CSRC_FFI_STATE_H_
#define JAXDECL_CSRC_FFI_STATE_H_

#include <cstddef>
#include <optional>

#include "xla/ffi/api/ffi.h"

namespace jaxdecl {

// The execution context as a handler argument: `.Ctx<StateAccess>()`.
struct StateAccess {
  const XLA_FFI_Api* api;
  XLA_FFI_ExecutionContext* ctx;
};

// What registering a state type with API >= 0.2 takes (XLA_FFI_TypeInfo).
struct TypeInfoV2 {
  size_t struct_size;
  XLA_FFI_Extension_Base* extension_start;
  void (*deleter)(void* object);
};

// Hands XLA `state` of type `type` for the instantiate stage; XLA destroys it
// with `deleter` (API 0.1) or the type's registered deleter.  Null, or the
// error XLA returned (to pass to DestroyError).
XLA_FFI_Error* SetState(const StateAccess& access, XLA_FFI_TypeId* type,
                        void* state, void (*deleter)(void*));

// The state SetState handed XLA for this call site, or null.
void* GetState(const StateAccess& access, XLA_FFI_TypeId* type);

void DestroyError(const XLA_FFI_Api* api, XLA_FFI_Error* error);

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

#endif  // JAXDECL_CSRC_FFI_STATE_H_
