// The CUDA runtime table (cuda_runtime.h): finding libcudart, and the fake.

#include "cuda_runtime.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

namespace jaxdecl::gpu {
namespace {

// The sonames of the runtimes JAX's CUDA plugins load (CUDA 13, then 12).
constexpr const char* kLoadedSonames[] = {"libcudart.so.13", "libcudart.so.12"};

std::mutex g_mutex;
std::vector<std::string> g_candidates;  // from Python (SetCandidates)
CudaRuntime* g_real = nullptr;          // loaded once, never unloaded
std::string g_real_error;               // why loading failed (retried on next use)
std::atomic<const CudaRuntime*> g_active{nullptr};  // the fake, or null: the real one

template <typename F>
bool Bind(void* library, const char* symbol, F* slot, std::string* missing) {
  *slot = reinterpret_cast<F>(dlsym(library, symbol));
  if (*slot == nullptr && missing->empty()) *missing = symbol;
  return *slot != nullptr;
}

// The table of `library`, or null with `missing` naming a symbol it lacks.
CudaRuntime* TableOf(void* library, const std::string& origin, std::string* missing) {
  auto runtime = std::make_unique<CudaRuntime>();
  runtime->origin = origin;
  Bind(library, "cudaSetDevice", &runtime->SetDevice, missing);
  Bind(library, "cudaMemcpyAsync", &runtime->MemcpyAsync, missing);
  Bind(library, "cudaMemsetAsync", &runtime->MemsetAsync, missing);
  Bind(library, "cudaStreamSynchronize", &runtime->StreamSynchronize, missing);
  Bind(library, "cudaHostAlloc", &runtime->HostAlloc, missing);
  Bind(library, "cudaFreeHost", &runtime->FreeHost, missing);
  Bind(library, "cudaEventCreateWithFlags", &runtime->EventCreateWithFlags, missing);
  Bind(library, "cudaEventRecord", &runtime->EventRecord, missing);
  Bind(library, "cudaEventSynchronize", &runtime->EventSynchronize, missing);
  Bind(library, "cudaEventDestroy", &runtime->EventDestroy, missing);
  Bind(library, "cudaStreamWaitEvent", &runtime->StreamWaitEvent, missing);
  Bind(library, "cudaGetErrorName", &runtime->GetErrorName, missing);
  Bind(library, "cudaGetErrorString", &runtime->GetErrorString, missing);
  return missing->empty() ? runtime.release() : nullptr;
}

// Loads the real runtime: the libcudart already in the process (the one
// JAX's plugin loaded: RTLD_NOLOAD finds it by soname and loads nothing),
// else the first candidate path that loads.  Caller holds g_mutex.
CudaRuntime* LoadReal(std::string* error) {
  std::string tried;
  for (const char* soname : kLoadedSonames) {
    void* library = dlopen(soname, RTLD_NOW | RTLD_NOLOAD);
    if (library == nullptr) continue;
    std::string missing;
    CudaRuntime* table = TableOf(library, std::string(soname) + " (loaded by JAX)", &missing);
    if (table != nullptr) return table;
    tried += std::string(" ") + soname + " lacks " + missing + ";";
  }
  for (const std::string& path : g_candidates) {
    void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      const char* why = dlerror();
      tried += " " + path + ": " + (why ? why : "does not load") + ";";
      continue;
    }
    std::string missing;
    CudaRuntime* table = TableOf(library, path, &missing);
    if (table != nullptr) return table;
    tried += " " + path + " lacks " + missing + ";";
  }
  *error = "jaxdecl found no CUDA runtime (libcudart.so.13 or .12) in this process" +
           (tried.empty() ? std::string() : " (" + tried.substr(1, tried.size() - 2) + ")") +
           ". It uses the one JAX's CUDA plugin loads: install JAX with its CUDA plugin "
           "(`pip install -U \"jax[cuda13]\"` or `\"jax[cuda12]\"`), whose nvidia "
           "packages bring it";
  return nullptr;
}

// --- the fake: host memory as the device ----------------------------------------------

struct Fake {
  std::mutex mutex;
  std::string fail_function;
  int fail_on = 0;
  int fail_code = 0;
  bool sticky = false;
  std::map<std::string, int> calls;
  std::vector<std::tuple<std::string, std::vector<int64_t>>> log;
  int64_t live_allocations = 0;
  int64_t live_events = 0;
};

Fake& fake() {
  static Fake* instance = new Fake();  // outlives every pool that used it
  return *instance;
}

int64_t AsInt(const void* pointer) {
  return static_cast<int64_t>(reinterpret_cast<intptr_t>(pointer));
}

// Records a call; its error code (0: it succeeds).  The log is the tests'
// view of the copy order.
int Enter(const char* function, std::vector<int64_t> arguments) {
  Fake& f = fake();
  std::lock_guard<std::mutex> lock(f.mutex);
  int count = ++f.calls[function];
  f.log.emplace_back(function, std::move(arguments));
  if (f.fail_function == function &&
      (count == f.fail_on || (f.sticky && count > f.fail_on))) {
    return f.fail_code;
  }
  return 0;
}

int FakeSetDevice(int device) { return Enter("SetDevice", {device}); }

int FakeMemcpyAsync(void* dst, const void* src, size_t bytes, int kind, void* stream) {
  int code = Enter("MemcpyAsync", {AsInt(dst), AsInt(src), static_cast<int64_t>(bytes), kind,
                                   AsInt(stream)});
  if (code == 0 && bytes > 0) std::memcpy(dst, src, bytes);
  return code;
}

int FakeMemsetAsync(void* dst, int value, size_t bytes, void* stream) {
  int code = Enter("MemsetAsync", {AsInt(dst), value, static_cast<int64_t>(bytes), AsInt(stream)});
  if (code == 0 && bytes > 0) std::memset(dst, value, bytes);
  return code;
}

int FakeStreamSynchronize(void* stream) { return Enter("StreamSynchronize", {AsInt(stream)}); }

int FakeHostAlloc(void** pointer, size_t bytes, unsigned flags) {
  *pointer = nullptr;
  int code = Enter("HostAlloc", {static_cast<int64_t>(bytes), flags});
  if (code != 0) return code;
  // 64-byte aligned, as XLA's buffers are (and cudaHostAlloc's pages).
  if (posix_memalign(pointer, 64, bytes) != 0) {
    *pointer = nullptr;
    return 2;  // cudaErrorMemoryAllocation
  }
  std::lock_guard<std::mutex> lock(fake().mutex);
  ++fake().live_allocations;
  std::get<1>(fake().log.back()).push_back(AsInt(*pointer));
  return 0;
}

int FakeFreeHost(void* pointer) {
  int code = Enter("FreeHost", {AsInt(pointer)});
  if (code != 0) return code;
  std::free(pointer);
  std::lock_guard<std::mutex> lock(fake().mutex);
  --fake().live_allocations;
  return 0;
}

int FakeEventCreateWithFlags(void** event, unsigned flags) {
  *event = nullptr;
  int code = Enter("EventCreateWithFlags", {flags});
  if (code != 0) return code;
  *event = new int(0);
  std::lock_guard<std::mutex> lock(fake().mutex);
  ++fake().live_events;
  return 0;
}

int FakeEventRecord(void* event, void* stream) {
  return Enter("EventRecord", {AsInt(event), AsInt(stream)});
}

int FakeEventSynchronize(void* event) { return Enter("EventSynchronize", {AsInt(event)}); }

int FakeEventDestroy(void* event) {
  int code = Enter("EventDestroy", {AsInt(event)});
  if (code != 0) return code;
  delete static_cast<int*>(event);
  std::lock_guard<std::mutex> lock(fake().mutex);
  --fake().live_events;
  return 0;
}

int FakeStreamWaitEvent(void* stream, void* event, unsigned flags) {
  return Enter("StreamWaitEvent", {AsInt(stream), AsInt(event), flags});
}

// The names and texts of the CUDA runtime, for the codes tests inject.
const char* FakeErrorName(int code) {
  switch (code) {
    case 0: return "cudaSuccess";
    case 1: return "cudaErrorInvalidValue";
    case 2: return "cudaErrorMemoryAllocation";
    case 400: return "cudaErrorInvalidResourceHandle";
    case 700: return "cudaErrorIllegalAddress";
    default: return "cudaErrorUnknown";
  }
}

const char* FakeErrorString(int code) {
  switch (code) {
    case 0: return "no error";
    case 1: return "invalid argument";
    case 2: return "out of memory";
    case 400: return "invalid resource handle";
    case 700: return "an illegal memory access was encountered";
    default: return "unknown error";
  }
}

const CudaRuntime* FakeTable() {
  static const CudaRuntime* table = new CudaRuntime{
      "the fake CUDA runtime (host memory)", FakeSetDevice, FakeMemcpyAsync, FakeMemsetAsync,
      FakeStreamSynchronize, FakeHostAlloc, FakeFreeHost, FakeEventCreateWithFlags,
      FakeEventRecord, FakeEventSynchronize, FakeEventDestroy, FakeStreamWaitEvent,
      FakeErrorName, FakeErrorString};
  return table;
}

}  // namespace

const CudaRuntime* Runtime(std::string* error) {
  const CudaRuntime* active = g_active.load(std::memory_order_acquire);
  if (active != nullptr) return active;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_real == nullptr) g_real = LoadReal(&g_real_error);
  if (g_real == nullptr) {
    *error = g_real_error;
    return nullptr;
  }
  const CudaRuntime* expected = nullptr;
  g_active.compare_exchange_strong(expected, g_real);
  return g_active.load(std::memory_order_acquire);
}

std::string ErrorText(const CudaRuntime& runtime, int code) {
  const char* name = runtime.GetErrorName(code);
  const char* text = runtime.GetErrorString(code);
  return std::string(name ? name : "cudaError") + " (" + std::to_string(code) + "): " +
         (text ? text : "no description");
}

void SetCandidates(std::vector<std::string> paths) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_candidates = std::move(paths);
}

void UseFake(const std::string& fail_function, int fail_on, int fail_code, bool sticky) {
  {
    Fake& f = fake();
    std::lock_guard<std::mutex> lock(f.mutex);
    f.fail_function = fail_function;
    f.fail_on = fail_on;
    f.fail_code = fail_code;
    f.sticky = sticky;
    f.calls.clear();
    f.log.clear();
  }
  g_active.store(FakeTable(), std::memory_order_release);
}

void UseReal() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_active.store(g_real, std::memory_order_release);  // null: loaded on next use
}

std::vector<std::tuple<std::string, std::vector<int64_t>>> TakeFakeLog() {
  Fake& f = fake();
  std::lock_guard<std::mutex> lock(f.mutex);
  std::vector<std::tuple<std::string, std::vector<int64_t>>> log;
  log.swap(f.log);
  return log;
}

int64_t FakeLiveAllocations() {
  std::lock_guard<std::mutex> lock(fake().mutex);
  return fake().live_allocations;
}

int64_t FakeLiveEvents() {
  std::lock_guard<std::mutex> lock(fake().mutex);
  return fake().live_events;
}

}  // namespace jaxdecl::gpu
