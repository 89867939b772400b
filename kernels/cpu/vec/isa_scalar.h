// The vector layer in plain C++: 16-lane arrays, the reference every other ISA's bodies are
// checked against (the kernel harness), and the build for CPUs with none of the others.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "types.h"

namespace kvserve {
namespace vec {

constexpr const char* kIsa = "scalar";
constexpr int kRegisters = 16;
constexpr int kRegsPer16 = 4;  // no registers hold 16 lanes: tile the kernels small
// Whether dot4<8> (any byte) costs what dot4<4> does: one dpbusd (VNNI).
constexpr bool kFullByteDot = false;

struct F32x16 { float v[16]; };
struct I32x16 { int32_t v[16]; };
struct U8x64 { uint8_t v[64]; };

// ---- float --------------------------------------------------------------------------------
inline F32x16 zero() { return F32x16{}; }
inline F32x16 set1(float x) {
  F32x16 r;
  for (float& e : r.v) e = x;
  return r;
}
template <typename T>
inline F32x16 load(const T* p) {
  F32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = to_float(p[i]);
  return r;
}
inline void store(float* p, F32x16 a) { std::memcpy(p, a.v, sizeof(a.v)); }
inline void store(bf16_t* p, F32x16 a) {
  for (int i = 0; i < 16; ++i) p[i].x = float_to_bf16_bits(a.v[i]);
}
inline void store(f16_t* p, F32x16 a) {
  for (int i = 0; i < 16; ++i) p[i].x = float_to_f16_bits(a.v[i]);
}
#define KVSERVE_VEC_MAP2(name, expr)              \
  inline F32x16 name(F32x16 a, F32x16 b) {        \
    F32x16 r;                                     \
    for (int i = 0; i < 16; ++i) {                \
      const float x = a.v[i], y = b.v[i];         \
      r.v[i] = (expr);                            \
    }                                             \
    return r;                                     \
  }
KVSERVE_VEC_MAP2(operator+, x + y)
KVSERVE_VEC_MAP2(operator-, x - y)
KVSERVE_VEC_MAP2(operator*, x * y)
KVSERVE_VEC_MAP2(operator/, x / y)
// the x86 max: the second operand where either is NaN or both are zeros
KVSERVE_VEC_MAP2(max, x > y ? x : y)
KVSERVE_VEC_MAP2(div_or_zero, y > 0.0f ? x / y : 0.0f)
#undef KVSERVE_VEC_MAP2
inline F32x16 fma(F32x16 a, F32x16 b, F32x16 c) {
  F32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return r;
}
inline F32x16 abs(F32x16 a) {
  F32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = std::fabs(a.v[i]);
  return r;
}
// lane i with i + 8, then i + 4, i + 2, i + 1 (every ISA adds in this order)
inline float reduce_add(F32x16 a) {
  float t[8];
  for (int i = 0; i < 8; ++i) t[i] = a.v[i + 8] + a.v[i];
  for (int i = 0; i < 4; ++i) t[i] = t[i + 4] + t[i];
  for (int i = 0; i < 2; ++i) t[i] = t[i] + t[i + 2];
  return t[0] + t[1];
}
inline float reduce_max(F32x16 a) {
  float m = a.v[0];
  for (int i = 1; i < 16; ++i) m = a.v[i] > m ? a.v[i] : m;
  return m;
}
inline bool any_nan(F32x16 a) {
  for (float e : a.v) {
    if (e != e) return true;
  }
  return false;
}
inline int first_equal(F32x16 a, float x) {
  for (int i = 0; i < 16; ++i) {
    if (a.v[i] == x) return i;
  }
  return -1;
}
inline F32x16 sum16(const F32x16 (&a)[16]) {
  F32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = reduce_add(a[i]);
  return r;
}
inline F32x16 max16(const F32x16 (&a)[16]) {
  F32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = reduce_max(a[i]);
  return r;
}

// ---- int32 --------------------------------------------------------------------------------
inline I32x16 zero_i32() { return I32x16{}; }
inline I32x16 operator+(I32x16 a, I32x16 b) {
  I32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] + b.v[i];
  return r;
}
template <int N>
inline I32x16 shift_left(I32x16 a) {
  I32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = static_cast<int32_t>(static_cast<uint32_t>(a.v[i]) << N);
  return r;
}
inline F32x16 to_float(I32x16 a) {
  F32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(a.v[i]);
  return r;
}
inline I32x16 round_to_i32(F32x16 a) {  // nearest even, as the vector conversions round
  I32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = static_cast<int32_t>(std::nearbyint(a.v[i]));
  return r;
}
inline void store_i8(int8_t* out, I32x16 a) {
  for (int i = 0; i < 16; ++i) out[i] = static_cast<int8_t>(std::clamp(a.v[i], -128, 127));
}
inline I32x16 sum16(const I32x16 (&a)[16]) {
  I32x16 r;
  for (int i = 0; i < 16; ++i) {
    int32_t s = 0;
    for (int32_t e : a[i].v) s += e;
    r.v[i] = s;
  }
  return r;
}

// ---- bytes and the int8 dot product ---------------------------------------------------------
inline U8x64 load_u8(const void* p) {
  U8x64 r;
  std::memcpy(r.v, p, 64);
  return r;
}
inline U8x64 and_bytes(U8x64 a, uint8_t m) {
  for (uint8_t& e : a.v) e &= m;
  return a;
}
inline U8x64 xor_bytes(U8x64 a, uint8_t m) {
  for (uint8_t& e : a.v) e ^= m;
  return a;
}
inline U8x64 high_nibbles(U8x64 a) {
  for (uint8_t& e : a.v) e >>= 4;
  return a;
}
inline U8x64 add16_where(U8x64 a, uint64_t bits) {
  for (int i = 0; i < 64; ++i) a.v[i] = static_cast<uint8_t>(a.v[i] + (((bits >> i) & 1u) << 4));
  return a;
}
template <int Bits>
inline I32x16 dot4(I32x16 acc, U8x64 w, int32_t x4) {
  int8_t x[4];
  std::memcpy(x, &x4, 4);
  for (int i = 0; i < 16; ++i) {
    int32_t s = 0;
    for (int j = 0; j < 4; ++j) s += static_cast<int32_t>(w.v[4 * i + j]) * x[j];
    acc.v[i] += s;
  }
  return acc;
}

// ---- bfloat16 pairs -----------------------------------------------------------------------
struct BF16x32 { uint32_t v[16]; };
inline BF16x32 load_pairs(const void* p) {
  BF16x32 r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline BF16x32 set1_pair(uint32_t pair) {
  BF16x32 r;
  for (uint32_t& e : r.v) e = pair;
  return r;
}
inline void store_pairs(void* p, BF16x32 a) { std::memcpy(p, a.v, sizeof(a.v)); }
// acc lane i += a[2i+1] b[2i+1], then += a[2i] b[2i] (each product exact in float)
inline F32x16 dot_pairs(F32x16 acc, BF16x32 a, BF16x32 b) {
  for (int i = 0; i < 16; ++i) {
    const float odd = bits_to_float(a.v[i] & 0xFFFF0000u) * bits_to_float(b.v[i] & 0xFFFF0000u);
    const float even = bits_to_float(a.v[i] << 16) * bits_to_float(b.v[i] << 16);
    acc.v[i] = (acc.v[i] + odd) + even;
  }
  return acc;
}
inline BF16x32 interleave_pairs(const bf16_t* lo, const bf16_t* hi) {
  BF16x32 r;
  for (int i = 0; i < 16; ++i) r.v[i] = bits16(lo[i]) | static_cast<uint32_t>(bits16(hi[i])) << 16;
  return r;
}

}  // namespace vec
}  // namespace kvserve
