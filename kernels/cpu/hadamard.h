// fwht(x, n): a head's query or key into an 8-bit K/V cache's rotated basis (kv_rotation.py says
// why), bitwise kv_rotation.rotate.
#ifndef DEEPINFER_KERNELS_CPU_HADAMARD_H
#define DEEPINFER_KERNELS_CPU_HADAMARD_H

#include <cmath>
#include <cstdint>

// a head's n values times the orthonormal Hadamard matrix of each block of n & -n values, in
// place: kv_rotation.rotate's butterflies in its order, then its fp32 scale
inline void fwht(float* x, int64_t n) {
  const int64_t m = n & -n;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(m)));
  for (int64_t b = 0; b < n; b += m) {
    float* y = x + b;
    for (int64_t s = 1; s < m; s *= 2) {
      for (int64_t j = 0; j < m; j += 2 * s) {
        for (int64_t i = j; i < j + s; ++i) {
          const float a = y[i], c = y[i + s];
          y[i] = a + c;
          y[i + s] = a - c;
        }
      }
    }
    for (int64_t i = 0; i < m; ++i) y[i] *= scale;
  }
}

#endif  // DEEPINFER_KERNELS_CPU_HADAMARD_H
