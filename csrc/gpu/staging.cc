// Staging host rules through pinned host memory (staging.h).

#include "staging.h"

#include <algorithm>
#include <utility>

namespace jaxdecl::gpu {

void Frame::Reset(size_t n_args, size_t n_rets) {
  args_.assign(n_args, XLA_FFI_Buffer{});
  rets_.assign(n_rets, XLA_FFI_Buffer{});
  arg_types_.assign(n_args, XLA_FFI_ArgType_BUFFER);
  ret_types_.assign(n_rets, XLA_FFI_RetType_BUFFER);
  arg_pointers_.resize(n_args);
  ret_pointers_.resize(n_rets);
  for (size_t i = 0; i < n_args; ++i) arg_pointers_[i] = &args_[i];
  for (size_t i = 0; i < n_rets; ++i) ret_pointers_[i] = &rets_[i];
  c_args_ = XLA_FFI_Args{XLA_FFI_Args_STRUCT_SIZE, nullptr, static_cast<int64_t>(n_args),
                         arg_types_.data(), arg_pointers_.data()};
  c_rets_ = XLA_FFI_Rets{XLA_FFI_Rets_STRUCT_SIZE, nullptr, static_cast<int64_t>(n_rets),
                         ret_types_.data(), ret_pointers_.data()};
}

void Describe(const ffi::AnyBuffer& buffer, void* data, XLA_FFI_Buffer* out) {
  auto dims = buffer.dimensions();
  *out = XLA_FFI_Buffer{XLA_FFI_Buffer_STRUCT_SIZE, nullptr,
                        static_cast<XLA_FFI_DataType>(buffer.element_type()), data,
                        static_cast<int64_t>(dims.size()),
                        const_cast<int64_t*>(dims.begin())};
}

PinnedPool::~PinnedPool() {
  if (runtime == nullptr) return;
  // Errors are ignored: at exit the CUDA runtime may already be shutting down.
  if (event != nullptr) {
    if (pending) runtime->EventSynchronize(event);
    runtime->EventDestroy(event);
  }
  for (void* buffer : buffers) {
    if (buffer != nullptr) runtime->FreeHost(buffer);
  }
}

std::string CudaFailure(const CudaRuntime& runtime, const Kernel& kernel, int ordinal,
                        const std::string& what, int code) {
  return "jaxdecl: " + kernel.name + " on GPU " + std::to_string(ordinal) + ": " + what +
         " failed: " + ErrorText(runtime, code);
}

namespace {

// A pool for one run: the device's own pool of `staging` (made at the first
// run), or a temporary one when that is busy.
class Lease {
 public:
  Lease(Staging& staging, const CudaRuntime& runtime, int ordinal) : staging_(staging) {
    std::lock_guard<std::mutex> lock(staging.mutex);
    // Pools of another runtime (tests switch between the fake and the real one)
    // are dropped, each freed by the runtime that allocated it.
    auto& pools = staging.pools;
    pools.erase(std::remove_if(pools.begin(), pools.end(),
                               [&](const std::unique_ptr<PinnedPool>& p) {
                                 return p->runtime != &runtime && !p->busy;
                               }),
                pools.end());
    for (auto& pool : pools) {
      if (pool->ordinal != ordinal || pool->runtime != &runtime) continue;
      if (!pool->busy) {
        pool->busy = true;
        pool_ = pool.get();
        return;
      }
      break;  // busy: a temporary pool for this run
    }
    auto fresh = std::make_unique<PinnedPool>();
    fresh->runtime = &runtime;
    fresh->ordinal = ordinal;
    fresh->busy = true;
    bool keep = std::none_of(pools.begin(), pools.end(), [&](const auto& p) {
      return p->ordinal == ordinal && p->runtime == &runtime;
    });
    pool_ = fresh.get();
    if (keep) {
      pools.push_back(std::move(fresh));
    } else {
      temporary_ = std::move(fresh);
    }
  }

  ~Lease() {
    if (temporary_ != nullptr) return;  // freed with the lease (after its stream sync)
    std::lock_guard<std::mutex> lock(staging_.mutex);
    if (discard_) {
      auto& pools = staging_.pools;
      pools.erase(std::remove_if(pools.begin(), pools.end(),
                                 [&](const auto& p) { return p.get() == pool_; }),
                  pools.end());
      return;
    }
    pool_->busy = false;
  }

  PinnedPool& pool() { return *pool_; }
  bool temporary() const { return temporary_ != nullptr; }
  // After a failure that may leave copies in flight: never reuse the pool.
  void Discard() { discard_ = true; }

 private:
  Staging& staging_;
  PinnedPool* pool_ = nullptr;
  std::unique_ptr<PinnedPool> temporary_;
  bool discard_ = false;
};

// Makes every buffer of `pool` hold at least `bytes[i]`: allocated at the
// first run, re-allocated only when a run needs more.  0, or the CUDA error.
int Reserve(const CudaRuntime& runtime, PinnedPool& pool, const std::vector<size_t>& bytes,
            size_t* failed) {
  if (pool.buffers.size() < bytes.size()) {
    pool.buffers.resize(bytes.size(), nullptr);
    pool.capacities.resize(bytes.size(), 0);
  }
  for (size_t i = 0; i < bytes.size(); ++i) {
    // At least one byte: a zero-size buffer still gets a real address to view.
    size_t need = std::max<size_t>(bytes[i], 1);
    if (pool.buffers[i] != nullptr && pool.capacities[i] >= need) continue;
    if (pool.buffers[i] != nullptr) {
      runtime.FreeHost(pool.buffers[i]);
      pool.buffers[i] = nullptr;
      pool.capacities[i] = 0;
    }
    void* buffer = nullptr;
    int code = runtime.HostAlloc(&buffer, need, kHostAllocPortable);
    if (code != 0) {
      *failed = i;
      return code;
    }
    pool.buffers[i] = buffer;
    pool.capacities[i] = need;
  }
  return 0;
}

// The bytes of every operand and result of `call`; false if one is not a buffer.
bool SizesOf(const DeviceCall& call, std::vector<size_t>* bytes) {
  bytes->clear();
  for (size_t i = 0; i < call.args.size(); ++i) {
    auto buffer = BufferAt(call.args, i);
    if (!buffer.has_value()) return false;
    bytes->push_back(buffer->size_bytes());
  }
  for (size_t i = 0; i < call.rets.size(); ++i) {
    auto buffer = BufferAt(call.rets, i);
    if (!buffer.has_value()) return false;
    bytes->push_back(buffer->size_bytes());
  }
  return true;
}

std::string Operand(const char* side, size_t index) {
  return std::string(side) + " " + std::to_string(index);
}

}  // namespace

std::string RunStaged(const CudaRuntime& rt, const Kernel& kernel, const DeviceCall& call,
                      Staging& staging) {
  auto fail = [&](const std::string& what, int code) {
    return CudaFailure(rt, kernel, call.ordinal, what, code);
  };
  std::vector<size_t> bytes;
  if (!SizesOf(call, &bytes)) return "jaxdecl: " + kernel.name + ": an operand is not a buffer";
  size_t n_args = call.args.size();
  size_t n_rets = call.rets.size();

  Lease lease(staging, rt, call.ordinal);
  PinnedPool& pool = lease.pool();
  int code = 0;
  if (pool.pending) {
    // The last run's copies back read these buffers: wait for them.
    if ((code = rt.EventSynchronize(pool.event)) != 0) {
      lease.Discard();
      return fail("waiting for the previous run's copies (cudaEventSynchronize)", code);
    }
    pool.pending = false;
  }
  size_t failed = 0;
  if ((code = Reserve(rt, pool, bytes, &failed)) != 0) {
    return fail("allocating " + std::to_string(bytes[failed]) + " bytes of pinned host memory "
                "for " + (failed < n_args ? Operand("operand", failed)
                                           : Operand("result", failed - n_args)) +
                " (cudaHostAlloc)", code);
  }
  if (pool.event == nullptr &&
      (code = rt.EventCreateWithFlags(&pool.event, kEventDisableTiming)) != 0) {
    pool.event = nullptr;
    return fail("creating an event (cudaEventCreateWithFlags)", code);
  }

  // Operands device -> host, then one synchronisation (the GIL is not held).
  Frame& frame = pool.frame;
  frame.Reset(n_args, n_rets);
  bool in_flight = false;
  auto abandon = [&](const std::string& what, int error) {
    // Copies already queued still touch the pool: let them finish, or never
    // reuse it if the stream is broken.
    if (in_flight && rt.StreamSynchronize(call.stream) != 0) lease.Discard();
    return fail(what, error);
  };
  for (size_t i = 0; i < n_args; ++i) {
    auto buffer = *BufferAt(call.args, i);
    Describe(buffer, pool.buffers[i], &frame.arg(i));
    if (bytes[i] == 0) continue;
    code = rt.MemcpyAsync(pool.buffers[i], buffer.untyped_data(), bytes[i], kDeviceToHost,
                          call.stream);
    if (code != 0) {
      return abandon("copying " + Operand("operand", i) + " to the host (cudaMemcpyAsync)",
                     code);
    }
    in_flight = true;
  }
  for (size_t j = 0; j < n_rets; ++j) {
    Describe(*BufferAt(call.rets, j), pool.buffers[n_args + j], &frame.ret(j));
  }
  if ((code = rt.StreamSynchronize(call.stream)) != 0) {
    lease.Discard();
    return fail("waiting for the operands (cudaStreamSynchronize)", code);
  }
  in_flight = false;

  // The kernel, exactly as on the CPU, on the pinned copies.
  Call host{frame.Args(), frame.Rets(), call.eager, call.cache, call.drop};
  std::string error = kernel.c_function == nullptr ? RunPythonKernel(kernel, host)
                                                   : RunCKernel(kernel, host);
  if (!error.empty()) return error;

  // Results host -> device on the same stream; the next run waits for the event.
  for (size_t j = 0; j < n_rets; ++j) {
    size_t k = n_args + j;
    if (bytes[k] == 0) continue;
    code = rt.MemcpyAsync(BufferAt(call.rets, j)->untyped_data(), pool.buffers[k], bytes[k],
                          kHostToDevice, call.stream);
    if (code != 0) {
      return abandon("copying " + Operand("result", j) + " to the device (cudaMemcpyAsync)",
                     code);
    }
    in_flight = true;
  }
  if (lease.temporary()) {
    // A temporary pool is freed with the lease: its copies must be done first.
    if ((code = rt.StreamSynchronize(call.stream)) != 0) {
      return fail("waiting for the results (cudaStreamSynchronize)", code);
    }
    return {};
  }
  if ((code = rt.EventRecord(pool.event, call.stream)) != 0) {
    return abandon("recording an event after the results (cudaEventRecord)", code);
  }
  pool.pending = true;
  return {};
}

std::string RunOnDevice(const Kernel& kernel, const DeviceCall& call, Staging& staging) {
  std::string error;
  const CudaRuntime* rt = Runtime(&error);
  if (rt == nullptr) return "jaxdecl: " + kernel.name + ": " + error;
  // The call's own device: without this a multi-GPU call would run on device 0.
  int code = rt->SetDevice(call.ordinal);
  if (code != 0) return CudaFailure(*rt, kernel, call.ordinal, "cudaSetDevice", code);
  if (kernel.device_call != nullptr || kernel.gpu_function != nullptr) {
    return RunDeviceRule(*rt, kernel, call);
  }
  return RunStaged(*rt, kernel, call, staging);
}

}  // namespace jaxdecl::gpu
