// A tiny C++ kernel library for tutorials/06_cpp_extension.py: out = a*x + y and the pieces
// of its derivative, for float and double. Plain `extern "C"` symbols, loaded with ctypes.
#include <cstddef>

namespace {

template <typename T>
void saxpy(std::size_t n, T a, const T* x, const T* y, T* out) {
  for (std::size_t i = 0; i < n; ++i) out[i] = a * x[i] + y[i];
}

template <typename T>
void scale(std::size_t n, T a, const T* x, T* out) {
  for (std::size_t i = 0; i < n; ++i) out[i] = a * x[i];
}

template <typename T>
double dot(std::size_t n, const T* x, const T* y) {
  // Accumulates in double: the cotangent of `a` sums over the whole array.
  double sum = 0.0;
  for (std::size_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * y[i];
  return sum;
}

}  // namespace

extern "C" {

void saxpy_f32(std::size_t n, float a, const float* x, const float* y, float* out) {
  saxpy(n, a, x, y, out);
}
void saxpy_f64(std::size_t n, double a, const double* x, const double* y, double* out) {
  saxpy(n, a, x, y, out);
}
void scale_f32(std::size_t n, float a, const float* x, float* out) { scale(n, a, x, out); }
void scale_f64(std::size_t n, double a, const double* x, double* out) { scale(n, a, x, out); }
double dot_f32(std::size_t n, const float* x, const float* y) { return dot(n, x, y); }
double dot_f64(std::size_t n, const double* x, const double* y) { return dot(n, x, y); }

}  // extern "C"
