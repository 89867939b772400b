// Element conversions shared by kvserve's CPU kernels: float <-> the model dtypes with the
// rounding torch uses, and fp8 bytes read through a table.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace kvserve {

inline float to_f(float v) { return v; }
inline float to_f(c10::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_f(c10::Half v) { return static_cast<float>(v); }

template <typename T>
inline T from_f(float v) { return static_cast<T>(v); }  // c10 rounds to nearest even
// float -> bfloat16 exactly as c10 rounds it (nearest even, NaN to the quiet 0x7FC0), written
// without c10's branch so that loops over it vectorise.
template <>
inline c10::BFloat16 from_f<c10::BFloat16>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(v != v ? 0x7FC0u : rounded),
                       c10::BFloat16::from_bits());
}

// The value a float becomes when stored as T and read back (a torch op's output rounding).
template <typename T>
inline float rnd(float v) { return to_f(from_f<T>(v)); }
template <>
inline float rnd<float>(float v) { return v; }

// fp8 bytes -> float, one table per format.
template <typename F8>
const float* fp8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i) {
      t[i] = static_cast<float>(F8(static_cast<uint8_t>(i), F8::from_bits()));
    }
    return t;
  }();
  return table.data();
}

// Reads one cache row of `dim` elements into float: T the cache element, or uint8_t with a
// table for fp8.
template <typename T>
inline void load_row(const T* src, float* dst, int64_t dim, const float*) {
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) dst[d] = to_f(src[d]);
}
template <>
inline void load_row<uint8_t>(const uint8_t* src, float* dst, int64_t dim, const float* table) {
  for (int64_t d = 0; d < dim; ++d) dst[d] = table[src[d]];
}

}  // namespace kvserve
