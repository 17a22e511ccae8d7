// The FFI state calls in each API version's layout (ffi_state.h).

#include "ffi_state.h"

namespace jaxdecl {
namespace {

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

int ApiMinor(const XLA_FFI_Api* api) { return api->api_version.minor_version; }

using StateCall = XLA_FFI_Error* (*)(void* args);

}  // namespace

XLA_FFI_Error* SetState(const StateAccess& access, XLA_FFI_TypeId* type,
                        void* state, void (*deleter)(void*)) {
  auto set = reinterpret_cast<StateCall>(access.api->XLA_FFI_State_Set);
  int minor = ApiMinor(access.api);
  if (minor <= 1) {
    StateArgsV1 args{sizeof(StateArgsV1), nullptr, access.ctx, type, state, deleter};
    return set(&args);
  }
  if (minor == 2) {
    StateArgsV2 args{sizeof(StateArgsV2), nullptr, access.ctx, type, state};
    return set(&args);
  }
  StateArgsV3 args{sizeof(StateArgsV3), nullptr, access.ctx, 0, type, state};
  return set(&args);
}

void* GetState(const StateAccess& access, XLA_FFI_TypeId* type) {
  auto get = reinterpret_cast<StateCall>(access.api->XLA_FFI_State_Get);
  XLA_FFI_Error* error = nullptr;
  void* state = nullptr;
  if (ApiMinor(access.api) <= 2) {
    StateArgsV2 args{sizeof(StateArgsV2), nullptr, access.ctx, type, nullptr};
    error = get(&args);
    state = args.state;
  } else {
    StateArgsV3 args{sizeof(StateArgsV3), nullptr, access.ctx, 0, type, nullptr};
    error = get(&args);
    state = args.state;
  }
  if (error != nullptr) {
    DestroyError(access.api, error);
    return nullptr;
  }
  return state;
}

void DestroyError(const XLA_FFI_Api* api, XLA_FFI_Error* error) {
  XLA_FFI_Error_Destroy_Args destroy{XLA_FFI_Error_Destroy_Args_STRUCT_SIZE, nullptr,
                                     error};
  api->XLA_FFI_Error_Destroy(&destroy);
}

}  // namespace jaxdecl
