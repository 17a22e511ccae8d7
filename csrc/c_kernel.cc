// C kernels (kernels.h, jaxdecl.h): a rule compiled to a C function, run on
// descriptions of XLA's buffers without the GIL: once, or once per row of a
// looped batch (rows.h), the rows of a large call on XLA's intra-op pool;
// given only the operands it takes; conjugated around the call where the rule
// is an adjoint.  (From Python, jaxdecl/_cfunction.py
// calls a kernel through ctypes.)
//
// Kept apart because it is the one path that touches no Python object per
// call: the buffer descriptions and the error message buffer are all it needs.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fp_env.h"
#include "kernels.h"
#include "rows.h"
#include "views.h"

namespace jaxdecl {
namespace {

// jaxdecl.h's element type codes are XLA's, so a buffer's code passes through.
static_assert(JAXDECL_BOOL == static_cast<int>(ffi::DataType::PRED));
static_assert(JAXDECL_INT8 == static_cast<int>(ffi::DataType::S8));
static_assert(JAXDECL_UINT64 == static_cast<int>(ffi::DataType::U64));
static_assert(JAXDECL_FLOAT16 == static_cast<int>(ffi::DataType::F16));
static_assert(JAXDECL_FLOAT64 == static_cast<int>(ffi::DataType::F64));
static_assert(JAXDECL_COMPLEX64 == static_cast<int>(ffi::DataType::C64));
static_assert(JAXDECL_BFLOAT16 == static_cast<int>(ffi::DataType::BF16));
static_assert(JAXDECL_COMPLEX128 == static_cast<int>(ffi::DataType::C128));

// Room for a C kernel's error message; the buffer is per thread, allocated
// once, and only its first byte is cleared per call.
constexpr int64_t kMessageSize = 64 * 1024;

std::string RunCFunction(jaxdecl_kernel function,
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

// Complex elements are (real, imaginary) pairs: negating every second value
// conjugates them in place.
template <typename Real>
void Conjugate(void* data, int64_t count) {
  Real* values = static_cast<Real*>(data);
  for (int64_t i = 1; i < 2 * count; i += 2) values[i] = -values[i];
}

int64_t ElementCount(const jaxdecl_buffer& buffer) {
  int64_t count = 1;
  for (int64_t d = 0; d < buffer.rank; ++d) count *= buffer.dims[d];
  return count;
}

bool ConjugateIfComplex(const jaxdecl_buffer& buffer) {
  int64_t count = ElementCount(buffer);
  if (buffer.dtype == JAXDECL_COMPLEX64) {
    Conjugate<float>(buffer.data, count);
  } else if (buffer.dtype == JAXDECL_COMPLEX128) {
    Conjugate<double>(buffer.data, count);
  } else {
    return false;
  }
  return true;
}

size_t ElementBytes(int32_t dtype) {
  return ffi::ByteWidth(static_cast<ffi::DataType>(dtype));
}

// One call of the kernel's function on `inputs` (all of the rule's operands)
// and `outputs`, as the kernel's record says: only the operands it takes,
// and around an adjoint the conjugations that make it the transpose (the
// conjugated operands are copies: XLA's input buffers are not ours to write).
std::string CallFunction(const Kernel& kernel, std::vector<jaxdecl_buffer> inputs,
                         const std::vector<jaxdecl_buffer>& outputs) {
  thread_local std::vector<std::vector<char>> copies;
  if (kernel.c_conj_from >= 0) {
    if (copies.size() < inputs.size()) copies.resize(inputs.size());
    for (size_t i = kernel.c_conj_from; i < inputs.size(); ++i) {
      jaxdecl_buffer& buffer = inputs[i];
      if (buffer.dtype != JAXDECL_COMPLEX64 && buffer.dtype != JAXDECL_COMPLEX128) continue;
      size_t bytes = static_cast<size_t>(ElementCount(buffer)) * ElementBytes(buffer.dtype);
      copies[i].resize(bytes);
      std::memcpy(copies[i].data(), buffer.data, bytes);
      buffer.data = copies[i].data();
      ConjugateIfComplex(buffer);
    }
  }
  std::string error;
  if (kernel.c_operands.empty()) {
    error = RunCFunction(kernel.c_function, inputs, outputs);
  } else {
    std::vector<jaxdecl_buffer> taken;
    taken.reserve(kernel.c_operands.size());
    for (int index : kernel.c_operands) taken.push_back(inputs[index]);
    error = RunCFunction(kernel.c_function, taken, outputs);
  }
  if (error.empty() && kernel.c_conj_from >= 0) {
    for (const jaxdecl_buffer& buffer : outputs) ConjugateIfComplex(buffer);
  }
  return error;
}

// " (row r of n)": where a looped call failed, its rows counted row-major.
std::string InRow(const std::string& error, int64_t row, int64_t rows) {
  return error + " (row " + std::to_string(row) + " of " + std::to_string(rows) + ")";
}

// Rows run on XLA's intra-op pool once a call moves at least this many bytes
// (operands and results together), in tasks of at least kTaskBytes each:
// below, scheduling (microseconds per task) costs more than the rows gain.
constexpr int64_t kParallelBytes = 256 * 1024;
constexpr int64_t kTaskBytes = 64 * 1024;

// A looped call's rows, shared by the caller and the pool's tasks: each takes
// the next row until none is left.  Heap-held, because a task may start after
// the call has returned; such a task finds `closed` and touches nothing else.
struct RowJob {
  const Kernel* kernel;
  RowCursor cursor;  // each worker seeks its own copy
  std::vector<jaxdecl_buffer> inputs, outputs;  // batch dims dropped
  std::vector<void*> starts;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> failed{INT64_MAX};  // the first failing row so far
  std::atomic<int> active{0};  // tasks inside Work
  std::atomic<bool> closed{false};
  std::mutex mutex;
  std::condition_variable idle;
  std::string error;  // row `failed`'s, under `mutex`

  RowJob(const Kernel& k, const RowCursor& c) : kernel(&k), cursor(c) {}

  // Rows, taken one by one in row order, until none is left or one before
  // the next has failed (rows are taken in order, so no later one matters).
  void Work() {
    RuleFpEnvironment environment;  // per thread: the caller's usual one (fp_env.h)
    RowCursor mine = cursor;
    std::vector<jaxdecl_buffer> in = inputs, out = outputs;
    for (int64_t row; (row = next.fetch_add(1)) < cursor.rows();) {
      if (row > failed.load()) break;
      mine.Seek(row);
      size_t k = 0;
      for (auto* side : {&in, &out}) {
        for (jaxdecl_buffer& buffer : *side) {
          buffer.data = static_cast<char*>(starts[k]) + mine.offset(k);
          ++k;
        }
      }
      std::string row_error = CallFunction(*kernel, in, out);
      if (!row_error.empty()) {
        std::lock_guard<std::mutex> lock(mutex);
        if (row < failed.load()) {
          failed.store(row);
          error = std::move(row_error);
        }
      }
    }
  }
};

int64_t RowThreadsAtStart() {
  const char* text = std::getenv("JAXDECL_ROW_THREADS");
  if (text == nullptr || *text == '\0') return 0;
  char* end = nullptr;
  long long value = std::strtoll(text, &end, 10);
  return (*end == '\0' && value > 0) ? value : 0;  // (anything else: no cap)
}

std::atomic<int64_t>& RowThreadsCap() {
  static std::atomic<int64_t> cap{RowThreadsAtStart()};
  return cap;
}

// How many workers a call's rows get: 1 (the caller alone) unless the call
// moves enough bytes and the pool has threads to spare; at most RowThreads().
int64_t WorkersFor(ffi::ThreadPool* pool, int64_t rows, int64_t bytes) {
  int64_t cap = RowThreadsCap().load(std::memory_order_relaxed);
  if (pool == nullptr || rows < 2 || bytes < kParallelBytes || cap == 1) return 1;
  // (the caller is one of them: as many as the pool has threads, no more)
  int64_t workers = std::min({pool->num_threads(), rows, bytes / kTaskBytes});
  if (cap > 0) workers = std::min(workers, cap);
  return std::max<int64_t>(1, workers);
}

// The rows on `workers` threads: the caller and workers - 1 pool tasks.  The
// caller waits only for tasks that have started taking rows, never for one
// still queued (the pool may be busy with calls like this one).
std::string RunRowsOnPool(std::shared_ptr<RowJob> job, ffi::ThreadPool& pool,
                          int64_t workers) {
  for (int64_t t = 1; t < workers; ++t) {
    pool.Schedule([job] {
      job->active.fetch_add(1);
      if (!job->closed.load()) job->Work();
      if (job->active.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> lock(job->mutex);
        job->idle.notify_all();
      }
    });
  }
  job->Work();
  job->closed.store(true);  // (seq_cst with `active`: a later task sees it)
  std::unique_lock<std::mutex> lock(job->mutex);
  job->idle.wait(lock, [&] { return job->active.load() == 0; });
  int64_t failed = job->failed.load();
  return failed == INT64_MAX ? std::string() : InRow(job->error, failed, job->cursor.rows());
}

// batch="loop": the function once per row, on descriptions of each row (the
// batch dimensions dropped) moved along the buffers.  No Python, no GIL.  On
// XLA's intra-op pool where the call is large enough (a C kernel is
// thread-safe by contract, jaxdecl.h); the first failing row in row order
// fails the call, as in sequence.
std::string RunRowsOf(const Kernel& kernel, std::vector<jaxdecl_buffer> inputs,
                      std::vector<jaxdecl_buffer> outputs, ffi::ThreadPool* pool) {
  RowCursor cursor(kernel.row_dims);
  std::vector<void*> starts;
  int64_t bytes = 0;
  for (auto* side : {&inputs, &outputs}) {
    for (jaxdecl_buffer& buffer : *side) {
      if (!cursor.Add(buffer.dims, buffer.rank, ElementBytes(buffer.dtype))) {
        return "jaxdecl: the call's buffers do not fit its batch";
      }
      bytes += ElementCount(buffer) * static_cast<int64_t>(ElementBytes(buffer.dtype));
      starts.push_back(buffer.data);
      buffer.dims += cursor.rank();
      buffer.rank -= cursor.rank();
    }
  }
  int64_t workers = WorkersFor(pool, cursor.rows(), bytes);
  if (workers > 1) {
    auto job = std::make_shared<RowJob>(kernel, cursor);
    job->inputs = std::move(inputs);
    job->outputs = std::move(outputs);
    job->starts = std::move(starts);
    return RunRowsOnPool(std::move(job), *pool, workers);
  }
  for (int64_t row = 0; row < cursor.rows(); ++row) {
    if (row > 0) cursor.Next();
    size_t k = 0;
    for (auto* side : {&inputs, &outputs}) {
      for (jaxdecl_buffer& buffer : *side) {
        buffer.data = static_cast<char*>(starts[k]) + cursor.offset(k);
        ++k;
      }
    }
    std::string error = CallFunction(kernel, inputs, outputs);
    if (!error.empty()) return InRow(error, row, cursor.rows());
  }
  return {};
}

}  // namespace

int64_t RowThreads() { return RowThreadsCap().load(); }

void SetRowThreads(int64_t threads) { RowThreadsCap().store(threads > 0 ? threads : 0); }

std::string RunCKernel(const Kernel& kernel, const Call& call) {
  std::vector<jaxdecl_buffer> inputs, outputs;
  if (!DescribeForC(call.args, call.drop, &inputs) ||
      !DescribeForC(call.rets, call.drop, &outputs)) {
    return "jaxdecl: an operand is not a buffer";
  }
  std::string error;
  {
    RuleFpEnvironment environment;  // the caller's usual one, not XLA's (fp_env.h)
    error = kernel.row_dims.empty()  // (each pool task sets its own environment)
                ? CallFunction(kernel, std::move(inputs), outputs)
                : RunRowsOf(kernel, std::move(inputs), std::move(outputs), call.pool);
  }
  return error.empty() ? error : kernel.name + ": " + error;
}

}  // namespace jaxdecl
