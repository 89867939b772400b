// One row's elementwise math, shared by the ops of elementwise.cpp and the team decode step
// (decode_team.cpp), so that both round alike.
#pragma once

#include <cmath>
#include <cstdint>

#include "convert.h"
#include "attention/paged.h"

namespace kvserve {

// out = weight * (x / rms(x)) as transformers' LlamaRMSNorm: float math, the normalised value
// rounded to the dtype, then the product with the weight rounded.
template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_f(x[i]);
    ss += v * v;
  }
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = from_f<T>(to_f(w[i]) * rnd<T>(to_f(x[i]) * r));
}

// o[i] = silu(g[i]) * u[i] for i < n, rounded as torch's silu then mul round. silu(g) =
// g / (1 + e^-g) takes e^-|g| from exp_nonpositive (relative error under 4e-6).
template <typename T>
inline void silu_mul_row(const T* g, const T* u, T* o, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float x = to_f(g[i]), a = std::fabs(x);
    // e^-|x|, past exp_nonpositive's clamp at -87 as e^-(|x| - 87) e^-87
    const float ex = exp_nonpositive(a > 87.0f ? 87.0f - a : -a) *
                     (a > 87.0f ? 1.64581143e-38f : 1.0f);
    // torch's x / (1 + e^-x) is -0 once e^-x overflows float
    const float silu = x < -88.7228394f ? -0.0f : (x >= 0.0f ? x : x * ex) / (1.0f + ex);
    o[i] = from_f<T>(rnd<T>(silu) * to_f(u[i]));
  }
}

// One head v[2 half] rotated in place: v * cos + rotate_half(v) * sin, each product and the
// sum rounded as the three torch ops round them.
template <typename T>
inline void rope_row(T* v, const T* c, const T* s, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = to_f(v[i]), b2 = to_f(v[i + half]);
    const float lo = rnd<T>(a * to_f(c[i])) + rnd<T>(-b2 * to_f(s[i]));
    const float hi = rnd<T>(b2 * to_f(c[i + half])) + rnd<T>(a * to_f(s[i + half]));
    v[i] = from_f<T>(lo);
    v[i + half] = from_f<T>(hi);
  }
}

}  // namespace kvserve
