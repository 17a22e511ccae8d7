// jaxdecl.contrib.finufft._kernels: C kernels (jaxdecl.h) over finufft's C library.
//
// The kernels run finufft's guru interface on XLA's buffers, without Python and
// without the GIL. They do not link against finufft: the finufft Python package
// loads its own library (libfinufft), and Python hands its functions' addresses
// over once (bind()). So this module builds with jaxdecl, needs no finufft
// header, no compiler at run time, and calls exactly the library the user's
// finufft package ships.
//
// Operands of every kernel (see _ops.py, which declares the ops):
//   type 1:  config, x[, y[, z]] (T, M), c (T, B, M)              -> f (T, B, N1[, N2[, N3]])
//   type 2:  config, x[, y[, z]] (T, M), f (T, B, N1[, ...])      -> c (T, B, M)
//   type 3:  config, x[, y[, z]] (T, M), s[, t[, u]] (T, K), c (T, B, M) -> f (T, B, K)
// T point sets, each with B transforms that share them (finufft's n_trans). The
// transposes take the same operands as their forward with the cotangent last.
//
// The masked kernels of types 1 and 2 take a mask (T, M) (bool) after the points: a
// point whose entry is false is padding, which finufft never sees. Its strength is not
// read (type 1) and its value is written as zero (type 2); its coordinates are not read,
// so padding may hold anything, NaN included. Each set's kept points (M' <= M) are
// gathered first: a padded call costs the unpadded call's transform and one pass over the
// padded arrays. (The pool's choice among idle plans fingerprints the whole arrays, the
// plans their gathered points: a masked call's setpts is skipped only when its plan is the
// one its points had last.)
//
// Plans are kept between calls in one pool, per configuration (precision, type,
// modes, n_trans, every option). A call checks a plan out, uses it, and gives it
// back, so no plan is ever used by two threads at once, whichever threads XLA
// runs the kernels on. A plan keeps a copy of the points it was last given:
// when the next call brings the same points (a gradient's forward and
// transpose, an iteration over fixed geometry), finufft's setpts (the sort)
// is skipped.

#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <complex>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <list>
#include <memory>
#include <mutex>
#include <vector>

#include "jaxdecl.h"

namespace py = pybind11;

namespace {

// ---------------------------------------------------------------------------
// finufft's C API (finufft.h, 2.x), reached through the addresses bind() sets.
// ---------------------------------------------------------------------------

using Plan = void*;
template <typename Real>
struct Api {
  void (*default_opts)(void*) = nullptr;
  int (*makeplan)(int, int, const int64_t*, int, int, Real, Plan*, const void*) = nullptr;
  int (*setpts)(Plan, int64_t, const Real*, const Real*, const Real*, int64_t, const Real*,
                const Real*, const Real*) = nullptr;
  int (*execute)(Plan, void*, void*) = nullptr;
  int (*destroy)(Plan) = nullptr;
};
Api<double> api64;
Api<float> api32;
std::atomic<bool> bound{false};

// finufft_opts begins with these fields (the same offsets in every 2.x release); the
// union leaves room for the fields a release adds after them, which
// finufft_default_opts fills.
union alignas(16) Options {
  struct {
    int modeord, spreadinterponly, debug, spread_debug, showwarn, nthreads, fftw,
        spread_sort, spread_kerevalmeth, spread_kerpad;
    double upsampfac;
    int spread_thread, maxbatchsize, spread_nthr_atomic, spread_max_sp_size;
  } head;
  char room[1024];
};

// One direction's settings, packed by _options.py (CONFIG_DTYPE there): little
// endian doubles and int32s at fixed offsets.
struct Settings {
  double eps, upsampfac;
  int32_t iflag, modeord, debug, spread_debug, showwarn, nthreads, fftw, spread_sort,
      spread_kerevalmeth, spread_kerpad, spread_thread, maxbatchsize, spread_nthr_atomic,
      spread_max_sp_size;
};
constexpr uint32_t kMagic = 0x4a444655;  // "UFDJ": a config packed by _options.py
struct Config {
  uint32_t magic, size;
  Settings forward, transpose;  // the forward's settings, its transpose's
};
static_assert(sizeof(Settings) == 72, "CONFIG_DTYPE in _options.py");
static_assert(sizeof(Config) == 152, "CONFIG_DTYPE in _options.py");

// ---------------------------------------------------------------------------
// Counters, read by the tests (which transforms ran, which setpts were skipped).
// ---------------------------------------------------------------------------

std::atomic<int64_t> plans_made{0}, setpts_run{0}, setpts_skipped{0};
std::atomic<int64_t> points_set{0};  // points given to setpts, summed (padding never is)
std::atomic<int64_t> executed[4] = {{0}, {0}, {0}, {0}};     // calls of execute, by type
std::atomic<int64_t> transforms[4] = {{0}, {0}, {0}, {0}};   // n_trans summed, by type

// ---------------------------------------------------------------------------
// The plan pool
// ---------------------------------------------------------------------------

struct Key {
  int32_t precision, type, dim, ntrans;
  int64_t modes[3];
  Settings settings;
  bool operator==(const Key& other) const { return std::memcmp(this, &other, sizeof(Key)) == 0; }
};

struct Entry {
  Key key;
  Plan plan = nullptr;
  std::vector<unsigned char> points;  // the coordinates setpts was last given (owned)
  int64_t m = -1, k = -1;             // their counts; -1: no setpts yet
  uint64_t sample = 0;                // a fingerprint of them (sampled: see fingerprint())
  uint64_t used = 0;
};

constexpr size_t kIdlePlans = 8;  // plans kept while no call uses them
std::mutex pool_mutex;
std::list<std::unique_ptr<Entry>>* idle = new std::list<std::unique_ptr<Entry>>();  // never freed:
uint64_t clock_ticks = 0;  // finufft may be gone when static destructors run at exit
std::mutex planner_mutex;  // makeplan and destroy plan FFTs: one thread at a time

void destroy(Entry& entry) {
  if (entry.plan == nullptr) return;
  std::lock_guard<std::mutex> planner(planner_mutex);
  if (entry.key.precision == 64) api64.destroy(entry.plan);
  else api32.destroy(entry.plan);
  entry.plan = nullptr;
}

// An idle plan for `key`: preferably one last given points whose fingerprint is `sample`
// (several devices or threads each keep their own points), else the most recent one.
std::unique_ptr<Entry> check_out(const Key& key, uint64_t sample) {
  std::lock_guard<std::mutex> lock(pool_mutex);
  auto chosen = idle->end();
  for (auto it = idle->begin(); it != idle->end(); ++it) {
    if (!((*it)->key == key)) continue;
    if ((*it)->sample == sample) {
      chosen = it;
      break;
    }
    if (chosen == idle->end()) chosen = it;
  }
  if (chosen == idle->end()) return nullptr;
  auto entry = std::move(*chosen);
  idle->erase(chosen);
  return entry;
}

void give_back(std::unique_ptr<Entry> entry) {
  std::unique_ptr<Entry> evicted;
  {
    std::lock_guard<std::mutex> lock(pool_mutex);
    entry->used = ++clock_ticks;
    idle->push_front(std::move(entry));
    if (idle->size() > kIdlePlans) {
      auto oldest = std::min_element(idle->begin(), idle->end(),
                                     [](const auto& a, const auto& b) { return a->used < b->used; });
      evicted = std::move(*oldest);
      idle->erase(oldest);
    }
  }
  if (evicted) destroy(*evicted);
}

size_t clear_pool() {
  std::list<std::unique_ptr<Entry>> gone;
  {
    std::lock_guard<std::mutex> lock(pool_mutex);
    gone.swap(*idle);
  }
  for (auto& entry : gone) destroy(*entry);
  return gone.size();
}

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

const char* finufft_error(int code) {
  switch (code) {
    case 2: return "FINUFFT_ERR_MAXNALLOC: the fine grid would be too large";
    case 3: return "FINUFFT_ERR_SPREAD_BOX_SMALL: the fine grid is smaller than the kernel";
    case 7: return "FINUFFT_ERR_UPSAMPFAC_TOO_SMALL: upsampfac must exceed 1";
    case 9: return "FINUFFT_ERR_NTRANS_NOTVALID";
    case 11: return "FINUFFT_ERR_ALLOC: out of memory";
    case 13: return "FINUFFT_ERR_SPREAD_THREAD_NOTVALID: spread_thread must be 0, 1 or 2";
    case 14: return "FINUFFT_ERR_NDATA_NOTVALID";
    case 20: return "FINUFFT_ERR_NUM_NU_PTS_INVALID";
    case 21: return "FINUFFT_ERR_INVALID_ARGUMENT";
    case 23: return "FINUFFT_ERR_NTHREADS_NOTVALID: nthreads must be >= 0";
    default: return "see finufft's documentation of error codes";
  }
}

struct Failure {
  char* message;
  int64_t size;
  int operator()(const char* what, int code = 0) const {
    if (code != 0) {
      std::snprintf(message, size, "finufft: %s failed with code %d (%s)", what, code,
                    finufft_error(code));
    } else {
      std::snprintf(message, size, "finufft kernel: %s", what);
    }
    return 1;
  }
};

// ---------------------------------------------------------------------------
// One kernel call
// ---------------------------------------------------------------------------

int64_t volume(const jaxdecl_buffer& b, int64_t from) {
  int64_t n = 1;
  for (int64_t i = from; i < b.rank; ++i) n *= b.dims[i];
  return n;
}

enum class Role { kType1, kType2, kType3, kType3Swapped };

struct Call {
  int type;             // finufft's type of the transform this call runs
  int dim;
  const jaxdecl_buffer* from[3];    // the points setpts gets first (x, y, z), row-major (T, M)
  const jaxdecl_buffer* to[3];      // type 3: the targets (s, t, u) (T, K)
  const jaxdecl_buffer* input;      // (T, B, ...)
  const jaxdecl_buffer* output;     // (T, B, ...)
  const jaxdecl_buffer* mask;       // masked kernels: (T, M), false for padding; else null
  int64_t sets, batch, m, k;        // T, B, points, targets (type 3)
  int64_t modes[3];                 // types 1, 2: finufft's order (fastest first)
};

// FNV-1a over the counts and 16 evenly spaced coordinates of every array of point set t:
// cheap, and different for the point sets of different devices in practice (a match is
// confirmed by same_points before setpts is skipped).
uint64_t fingerprint(const Call& call, int64_t t, size_t real_size) {
  uint64_t hash = 1469598103934665603ull;
  auto mix = [&](const void* data, size_t size) {
    for (size_t i = 0; i < size; ++i) {
      hash ^= static_cast<const unsigned char*>(data)[i];
      hash *= 1099511628211ull;
    }
  };
  mix(&call.m, sizeof(call.m));
  mix(&call.k, sizeof(call.k));
  auto sample = [&](const jaxdecl_buffer* array, int64_t count) {
    const unsigned char* row = static_cast<const unsigned char*>(array->data) +
                               t * count * real_size;
    for (int64_t j = 0; j < 16 && count > 0; ++j) mix(row + (j * (count - 1) / 15) * real_size,
                                                     real_size);
  };
  for (int i = 0; i < call.dim; ++i) {
    sample(call.from[i], call.m);
    if (call.type == 3) sample(call.to[i], call.k);
  }
  return hash;
}

bool same_points(const Entry& entry, const Call& call, int64_t t, size_t real_size) {
  if (entry.m != call.m || entry.k != call.k) return false;
  const unsigned char* copy = entry.points.data();
  size_t row = static_cast<size_t>(call.m) * real_size;
  for (int i = 0; i < call.dim; ++i, copy += row) {
    if (std::memcmp(copy, static_cast<const unsigned char*>(call.from[i]->data) + t * row, row))
      return false;
  }
  size_t target_row = static_cast<size_t>(call.k) * real_size;
  if (call.type == 3) {
    for (int i = 0; i < call.dim; ++i, copy += target_row) {
      if (std::memcmp(copy, static_cast<const unsigned char*>(call.to[i]->data) + t * target_row,
                      target_row))
        return false;
    }
  }
  return true;
}

template <typename Real>
int set_points(Entry& entry, const Call& call, int64_t t, const Api<Real>& api) {
  size_t row = static_cast<size_t>(call.m) * sizeof(Real);
  size_t target_row = call.type == 3 ? static_cast<size_t>(call.k) * sizeof(Real) : 0;
  entry.points.resize(call.dim * (row + target_row));
  entry.m = entry.k = -1;  // invalid until setpts succeeds
  unsigned char* copy = entry.points.data();
  const Real* first[3] = {nullptr, nullptr, nullptr};
  const Real* targets[3] = {nullptr, nullptr, nullptr};
  for (int i = 0; i < call.dim; ++i, copy += row) {
    std::memcpy(copy, static_cast<const unsigned char*>(call.from[i]->data) + t * row, row);
    first[i] = reinterpret_cast<const Real*>(copy);
  }
  for (int i = 0; call.type == 3 && i < call.dim; ++i, copy += target_row) {
    std::memcpy(copy, static_cast<const unsigned char*>(call.to[i]->data) + t * target_row,
                target_row);
    targets[i] = reinterpret_cast<const Real*>(copy);
  }
  ++setpts_run;
  points_set += call.m;
  int code = api.setpts(entry.plan, call.m, first[0], first[1], first[2],
                        call.type == 3 ? call.k : 0, targets[0], targets[1], targets[2]);
  if (code > 1) return code;
  entry.m = call.m;
  entry.k = call.k;
  entry.sample = fingerprint(call, t, sizeof(Real));
  return 0;
}

// Set t of a masked call (types 1 and 2): its kept points gathered into a one-set call of
// M' points, run by `transform`; type 1's strengths are gathered the same way, type 2's
// values scattered back with zeros at the padding. A set without points transforms
// nothing: type 1's modes and type 2's values are zeros.
template <typename Real, typename Transform>
void masked_set(const Call& call, int64_t t, Transform& transform) {
  using Complex = std::complex<Real>;
  const unsigned char* keep = static_cast<const unsigned char*>(call.mask->data) + t * call.m;
  std::vector<int64_t> kept;
  kept.reserve(static_cast<size_t>(call.m));
  for (int64_t j = 0; j < call.m; ++j)
    if (keep[j]) kept.push_back(j);
  const int64_t m = static_cast<int64_t>(kept.size()), batch = call.batch;
  const bool scatter = call.type == 2;  // the nonuniform values are the output
  const jaxdecl_buffer& modes = scatter ? *call.input : *call.output;
  const int64_t mode_size = volume(modes, 1);
  Complex* values = static_cast<Complex*>((scatter ? call.output : call.input)->data) +
                    t * batch * call.m;
  if (m == 0) {
    Complex* zeros = scatter ? values : static_cast<Complex*>(call.output->data) + t * mode_size;
    std::fill(zeros, zeros + (scatter ? batch * call.m : mode_size), Complex(0));
    return;
  }
  // The gathered set: coordinates (d, M'), values (1, B, M'), the modes' row t in place.
  std::vector<Real> coords(static_cast<size_t>(call.dim * m));
  std::vector<Complex> gathered(static_cast<size_t>(batch * m));
  const int64_t one_set[2] = {1, m}, gathered_dims[3] = {1, batch, m};
  jaxdecl_buffer points[3], nonuniform, uniform;
  Call g = call;
  g.sets = 1;
  g.m = m;
  g.mask = nullptr;
  for (int i = 0; i < call.dim; ++i) {
    const Real* row = static_cast<const Real*>(call.from[i]->data) + t * call.m;
    Real* dst = coords.data() + i * m;
    for (int64_t j = 0; j < m; ++j) dst[j] = row[kept[j]];
    points[i] = {dst, one_set, 2, call.from[i]->dtype};
    g.from[i] = &points[i];
  }
  if (!scatter) {
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t j = 0; j < m; ++j) gathered[b * m + j] = values[b * call.m + kept[j]];
  }
  nonuniform = {gathered.data(), gathered_dims, 3, call.input->dtype};
  uniform = modes;  // row t of the modes, as a set of its own
  uniform.data = static_cast<Complex*>(modes.data) + t * mode_size;
  (scatter ? g.output : g.input) = &nonuniform;
  (scatter ? g.input : g.output) = &uniform;
  transform(g, 0);  // (a failure is the caller's `code`: the values are then not read)
  if (scatter) {
    std::fill(values, values + batch * call.m, Complex(0));
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t j = 0; j < m; ++j) values[b * call.m + kept[j]] = gathered[b * m + j];
  }
}

template <typename Real>
int run(const Call& call, const Settings& settings, const Api<Real>& api, Failure fail) {
  using Complex = std::complex<Real>;
  Key key;
  std::memset(&key, 0, sizeof(Key));  // the padding too: keys compare with memcmp
  key.precision = sizeof(Real) == 8 ? 64 : 32;
  key.type = call.type;
  key.dim = call.dim;
  key.ntrans = static_cast<int32_t>(call.batch);
  for (int i = 0; i < 3; ++i) key.modes[i] = call.type == 3 ? 1 : call.modes[i];
  key.settings = settings;

  std::unique_ptr<Entry> entry = check_out(key, fingerprint(call, 0, sizeof(Real)));
  if (!entry) {
    entry = std::make_unique<Entry>();
    entry->key = key;
    Options options;
    api.default_opts(&options);
    auto& o = options.head;
    o.modeord = settings.modeord;
    o.debug = settings.debug;
    o.spread_debug = settings.spread_debug;
    o.showwarn = settings.showwarn;
    o.nthreads = settings.nthreads;
    o.fftw = settings.fftw;
    o.spread_sort = settings.spread_sort;
    o.spread_kerevalmeth = settings.spread_kerevalmeth;
    o.spread_kerpad = settings.spread_kerpad;
    o.upsampfac = settings.upsampfac;
    o.spread_thread = settings.spread_thread;
    o.maxbatchsize = settings.maxbatchsize;
    o.spread_nthr_atomic = settings.spread_nthr_atomic;
    o.spread_max_sp_size = settings.spread_max_sp_size;
    int code;
    {
      std::lock_guard<std::mutex> planner(planner_mutex);
      code = api.makeplan(call.type, call.dim, key.modes, settings.iflag,
                          static_cast<int>(call.batch), static_cast<Real>(settings.eps),
                          &entry->plan, &options);
    }
    if (code > 1) {
      entry->plan = nullptr;  // finufft frees what it made when makeplan fails
      return fail("finufft_makeplan", code);
    }
    ++plans_made;
  }

  int code = 0;
  const char* step = "finufft_setpts";
  // Set t of `c`: setpts unless the plan has these points already, then execute.
  auto transform = [&](const Call& c, int64_t t) {
    const int64_t in_size = volume(*c.input, 1), out_size = volume(*c.output, 1);
    step = "finufft_setpts";
    if (same_points(*entry, c, t, sizeof(Real))) {
      ++setpts_skipped;
    } else {
      code = set_points(*entry, c, t, api);
      if (code != 0) return;
    }
    Complex* in = static_cast<Complex*>(c.input->data) + t * in_size;
    Complex* out = static_cast<Complex*>(c.output->data) + t * out_size;
    // execute(plan, nonuniform values, uniform values): which is read depends on the type.
    step = "finufft_execute";
    code = c.type == 2 ? api.execute(entry->plan, out, in) : api.execute(entry->plan, in, out);
    if (code == 1) code = 0;  // a warning (eps below what the precision reaches)
    ++executed[c.type];
    transforms[c.type] += c.batch;
  };
  if (call.mask == nullptr) {
    for (int64_t t = 0; t < call.sets && code == 0; ++t) transform(call, t);
  } else {
    for (int64_t t = 0; t < call.sets && code == 0; ++t) masked_set<Real>(call, t, transform);
  }
  if (code != 0) {
    destroy(*entry);
    return fail(step, code);
  }
  give_back(std::move(entry));
  return 0;
}

// Checks the operands against the layout above and runs the transform.
int kernel(Role role, bool transposed, bool masked, const jaxdecl_buffer* in, int64_t n_in,
           const jaxdecl_buffer* out, int64_t n_out, char* message, int64_t size) {
  Failure fail{message, size};
  if (!bound.load()) return fail("finufft's library is not bound (import jaxdecl.contrib.finufft)");
  const bool three = role == Role::kType3 || role == Role::kType3Swapped;
  const int64_t n_points = n_in - (masked ? 3 : 2);
  if (n_out != 1 || n_points < 1 || (three && n_points % 2 != 0))
    return fail("wrong number of operands");
  const int dim = static_cast<int>(three ? n_points / 2 : n_points);
  if (dim > 3) return fail("finufft transforms 1, 2 or 3 dimensions");
  if (in[0].dtype != JAXDECL_UINT8 || volume(in[0], 0) != static_cast<int64_t>(sizeof(Config)))
    return fail("the first operand is not a configuration packed by jaxdecl.contrib.finufft");
  Config config;
  std::memcpy(&config, in[0].data, sizeof(Config));
  if (config.magic != kMagic || config.size != sizeof(Config))
    return fail("the first operand is not a configuration packed by jaxdecl.contrib.finufft");
  const Settings& settings = transposed ? config.transpose : config.forward;

  const jaxdecl_buffer& data = in[n_in - 1];
  const jaxdecl_buffer& result = out[0];
  const bool single = data.dtype == JAXDECL_COMPLEX64;
  const int32_t real = single ? JAXDECL_FLOAT32 : JAXDECL_FLOAT64;
  if ((data.dtype != JAXDECL_COMPLEX64 && data.dtype != JAXDECL_COMPLEX128) ||
      result.dtype != data.dtype)
    return fail("values must be complex64 or complex128, the same in and out");

  Call call;
  std::memset(&call, 0, sizeof(Call));
  call.dim = dim;
  call.input = &data;
  call.output = &result;
  call.mask = masked ? &in[n_in - 2] : nullptr;
  // The points arrive x, y, z: finufft's first (fastest) dimension is the last
  // mode axis, so the kernel gives setpts the last coordinate first.
  const jaxdecl_buffer* first = in + 1;
  const jaxdecl_buffer* second = in + 1 + dim;
  if (role == Role::kType3Swapped) std::swap(first, second);
  for (int i = 0; i < dim; ++i) {
    call.from[i] = three ? first + i : first + (dim - 1 - i);
    call.to[i] = three ? second + i : nullptr;
  }
  for (int i = 0; i < (three ? 2 * dim : dim); ++i) {
    const jaxdecl_buffer& p = in[1 + i];
    if (p.dtype != real || p.rank != 2)
      return fail("points must be (T, M) arrays of the values' real precision");
  }
  call.sets = call.from[0]->dims[0];
  call.m = call.from[0]->dims[1];
  call.k = three ? call.to[0]->dims[1] : 0;
  if (masked && (call.mask->dtype != JAXDECL_BOOL || call.mask->rank != 2 ||
                 call.mask->dims[0] != call.sets || call.mask->dims[1] != call.m))
    return fail("the mask must be a bool array (T, M) of the points' shape");
  for (int i = 0; i < dim; ++i) {
    if (call.from[i]->dims[0] != call.sets || call.from[i]->dims[1] != call.m ||
        (three && (call.to[i]->dims[0] != call.sets || call.to[i]->dims[1] != call.k)))
      return fail("the coordinate arrays differ in shape");
  }
  // Which of data/result holds the nonuniform values, which the modes.
  int type;
  switch (role) {
    case Role::kType1: type = transposed ? 2 : 1; break;
    case Role::kType2: type = transposed ? 1 : 2; break;
    default: type = 3;
  }
  call.type = type;
  const jaxdecl_buffer& modes = type == 1 ? result : data;
  const jaxdecl_buffer& values = type == 1 ? data : result;
  const int64_t mode_rank = three ? 1 : dim;
  if (data.rank != 2 + (type == 2 ? mode_rank : 1) || result.rank != 2 + (type == 1 ? mode_rank : 1))
    return fail("values must be (T, B, M) and modes (T, B, N1, ..., Nd)");
  if (data.dims[0] != call.sets || result.dims[0] != call.sets || data.dims[1] != result.dims[1])
    return fail("values and modes must share their leading (T, B) dims with the points");
  call.batch = data.dims[1];
  if (three) {
    // (The transpose's points are the targets: from, to, m and k are swapped already.)
    if (data.dims[2] != call.m || result.dims[2] != call.k)
      return fail("type 3 maps (T, B, M) values at the points to (T, B, K) at the targets");
  } else {
    if (values.dims[2] != call.m) return fail("values must be (T, B, M) for M points");
    for (int i = 0; i < dim; ++i) call.modes[i] = modes.dims[2 + dim - 1 - i];
  }
  if (call.batch > 0x7fffffff) return fail("more than 2^31 - 1 transforms share one set of points");

  const size_t out_bytes = static_cast<size_t>(volume(result, 0)) * (single ? 8 : 16);
  if (volume(result, 0) == 0) return 0;
  if (call.m == 0 || volume(data, 0) == 0 || call.batch == 0) {
    std::memset(result.data, 0, out_bytes);  // a sum over nothing
    return 0;
  }
  return single ? run<float>(call, settings, api32, fail) : run<double>(call, settings, api64, fail);
}

#define KERNEL(NAME, ROLE, TRANSPOSED, MASKED)                                          \
  extern "C" int NAME(const jaxdecl_buffer* in, int64_t n_in, const jaxdecl_buffer* out, \
                      int64_t n_out, char* message, int64_t size) {                      \
    return kernel(ROLE, TRANSPOSED, MASKED, in, n_in, out, n_out, message, size);         \
  }
KERNEL(nufft_type1, Role::kType1, false, false)
KERNEL(nufft_type1_transpose, Role::kType1, true, false)
KERNEL(nufft_type2, Role::kType2, false, false)
KERNEL(nufft_type2_transpose, Role::kType2, true, false)
KERNEL(nufft_type3, Role::kType3, false, false)
KERNEL(nufft_type3_transpose, Role::kType3Swapped, true, false)
KERNEL(nufft_type1_masked, Role::kType1, false, true)
KERNEL(nufft_type1_masked_transpose, Role::kType1, true, true)
KERNEL(nufft_type2_masked, Role::kType2, false, true)
KERNEL(nufft_type2_masked_transpose, Role::kType2, true, true)
#undef KERNEL

template <typename Real>
void bind_api(Api<Real>& api, const py::dict& a, const char* prefix) {
  auto get = [&](const char* name) -> uintptr_t {
    std::string key = std::string(prefix) + name;
    if (!a.contains(key.c_str())) throw py::key_error(key);
    uintptr_t address = a[key.c_str()].cast<uintptr_t>();
    if (address == 0) throw py::value_error(key + " is NULL");
    return address;
  };
  api.default_opts = reinterpret_cast<decltype(api.default_opts)>(get("_default_opts"));
  api.makeplan = reinterpret_cast<decltype(api.makeplan)>(get("_makeplan"));
  api.setpts = reinterpret_cast<decltype(api.setpts)>(get("_setpts"));
  api.execute = reinterpret_cast<decltype(api.execute)>(get("_execute"));
  api.destroy = reinterpret_cast<decltype(api.destroy)>(get("_destroy"));
}

}  // namespace

PYBIND11_MODULE(_kernels, m, py::mod_gil_not_used()) {
  m.doc() = "C kernels over finufft's C library (jaxdecl.contrib.finufft).";
  m.def("bind", [](py::dict addresses) {
    if (bound.load()) return;
    bind_api(api64, addresses, "finufft");
    bind_api(api32, addresses, "finufftf");
    bound.store(true);
  }, "Takes finufft's functions: {'finufft_makeplan': address, ...} for both precisions.");
  m.def("kernels", []() {
    py::dict found;
    auto put = [&](const char* name, jaxdecl_kernel f) {
      found[name] = reinterpret_cast<uintptr_t>(f);
    };
    put("type1", &nufft_type1);
    put("type1_transpose", &nufft_type1_transpose);
    put("type2", &nufft_type2);
    put("type2_transpose", &nufft_type2_transpose);
    put("type3", &nufft_type3);
    put("type3_transpose", &nufft_type3_transpose);
    put("type1_masked", &nufft_type1_masked);
    put("type1_masked_transpose", &nufft_type1_masked_transpose);
    put("type2_masked", &nufft_type2_masked);
    put("type2_masked_transpose", &nufft_type2_masked_transpose);
    return found;
  }, "The kernels' addresses, for jd.cfunction.");
  m.def("clear", []() { return clear_pool(); }, "Destroys the plans no call uses; their count.");
  m.def("counters", []() {
    py::dict c;
    c["plans_made"] = plans_made.load();
    c["setpts_run"] = setpts_run.load();
    c["setpts_skipped"] = setpts_skipped.load();
    c["points_set"] = points_set.load();
    for (int t = 1; t <= 3; ++t) {
      c[("executed_type" + std::to_string(t)).c_str()] = executed[t].load();
      c[("transforms_type" + std::to_string(t)).c_str()] = transforms[t].load();
    }
    {
      std::lock_guard<std::mutex> lock(pool_mutex);
      c["idle_plans"] = static_cast<int64_t>(idle->size());
    }
    return c;
  }, "What the kernels did so far (plans made, setpts run and skipped, executes by type).");
  m.attr("CONFIG_SIZE") = sizeof(Config);
  m.attr("CONFIG_MAGIC") = kMagic;
}
