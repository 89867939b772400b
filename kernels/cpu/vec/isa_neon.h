// The vector layer on aarch64 NEON: each 16-lane type is four 128-bit registers. The int8 dot
// product is `sdot` where the build has the dot-product extension (armv8.2-a+dotprod: Graviton
// 2 and later, Apple M1 and later, Ampere), else widening multiplies and pairwise adds.
#pragma once

#include <arm_neon.h>

#include <algorithm>
#include <cstdint>

#include "types.h"

namespace kvserve {
namespace vec {

#if defined(__ARM_FEATURE_DOTPROD)
constexpr const char* kIsa = "neon+dotprod";
#else
constexpr const char* kIsa = "neon";
#endif
constexpr int kRegisters = 32;
constexpr int kRegsPer16 = 4;
// Whether dot4<8> (any byte) costs what dot4<4> does: one dpbusd (VNNI).
constexpr bool kFullByteDot = false;

struct F32x16 { float32x4_t v[4]; };
struct I32x16 { int32x4_t v[4]; };
struct U8x64 { uint8x16_t v[4]; };

namespace detail {
inline float32x4_t load4(const float* p) { return vld1q_f32(p); }
inline float32x4_t load4(const bf16_t* p) {
  return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
}
inline float32x4_t load4(const f16_t* p) {
  return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))));
}
inline uint16x4_t bf16_bits(float32x4_t a) {  // nearest even, NaN to 0x7FC0, as c10 rounds
  const uint32x4_t bits = vreinterpretq_u32_f32(a);
  const uint32x4_t odd = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
  const uint32x4_t r = vshrq_n_u32(vaddq_u32(bits, vaddq_u32(odd, vdupq_n_u32(0x7FFF))), 16);
  const uint32x4_t ordered = vceqq_f32(a, a);
  return vmovn_u32(vbslq_u32(ordered, r, vdupq_n_u32(0x7FC0)));
}
// Sums of 4 products of w's bytes and x's, per 32-bit lane (w below 128 unless `full`).
inline int32x4_t dot4_quarter(int32x4_t acc, uint8x16_t w, int8x16_t x, bool full) {
#if defined(__ARM_FEATURE_DOTPROD)
  if (!full) return vdotq_s32(acc, vreinterpretq_s8_u8(w), x);
  // bytes of 128 and up: the low 7 bits' sum, minus the top bit's (as int8 it reads -128)
  const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(w, vdupq_n_u8(0x7F)));
  const int8x16_t hi = vreinterpretq_s8_u8(vandq_u8(w, vdupq_n_u8(0x80)));
  return vsubq_s32(vdotq_s32(acc, lo, x), vdotq_s32(vdupq_n_s32(0), hi, x));
#else
  // 16-bit products (u8 x s8 fits once widened), pairwise to 32 bits, then pairs of pairs
  const int16x8_t wl = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(w)));
  const int16x8_t wh = vreinterpretq_s16_u16(vmovl_high_u8(w));
  const int16x8_t xl = vmovl_s8(vget_low_s8(x)), xh = vmovl_high_s8(x);
  const int32x4_t pl = vpaddq_s32(vmull_s16(vget_low_s16(wl), vget_low_s16(xl)),
                                  vmull_high_s16(wl, xl));
  const int32x4_t ph = vpaddq_s32(vmull_s16(vget_low_s16(wh), vget_low_s16(xh)),
                                  vmull_high_s16(wh, xh));
  (void)full;
  return vaddq_s32(acc, vpaddq_s32(pl, ph));
#endif
}
}  // namespace detail

// ---- float --------------------------------------------------------------------------------
inline F32x16 zero() { return {{vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0)}}; }
inline F32x16 set1(float x) { return {{vdupq_n_f32(x), vdupq_n_f32(x), vdupq_n_f32(x), vdupq_n_f32(x)}}; }
template <typename T>
inline F32x16 load(const T* p) {
  return {{detail::load4(p), detail::load4(p + 4), detail::load4(p + 8), detail::load4(p + 12)}};
}
inline void store(float* p, F32x16 a) {
  for (int i = 0; i < 4; ++i) vst1q_f32(p + 4 * i, a.v[i]);
}
inline void store(bf16_t* p, F32x16 a) {
  uint16_t* q = reinterpret_cast<uint16_t*>(p);
  for (int i = 0; i < 4; ++i) vst1_u16(q + 4 * i, detail::bf16_bits(a.v[i]));
}
inline void store(f16_t* p, F32x16 a) {
  uint16_t* q = reinterpret_cast<uint16_t*>(p);
  for (int i = 0; i < 4; ++i) vst1_u16(q + 4 * i, vreinterpret_u16_f16(vcvt_f16_f32(a.v[i])));
}
#define KVSERVE_VEC_MAP2(name, fn)                                   \
  inline F32x16 name(F32x16 a, F32x16 b) {                           \
    return {{fn(a.v[0], b.v[0]), fn(a.v[1], b.v[1]), fn(a.v[2], b.v[2]), fn(a.v[3], b.v[3])}}; \
  }
KVSERVE_VEC_MAP2(operator+, vaddq_f32)
KVSERVE_VEC_MAP2(operator-, vsubq_f32)
KVSERVE_VEC_MAP2(operator*, vmulq_f32)
KVSERVE_VEC_MAP2(operator/, vdivq_f32)
#undef KVSERVE_VEC_MAP2
// the x86 max: the second operand where either is NaN or both are zeros (vmaxq_f32 gives NaN)
inline F32x16 max(F32x16 a, F32x16 b) {
  F32x16 r;
  for (int i = 0; i < 4; ++i) r.v[i] = vbslq_f32(vcgtq_f32(a.v[i], b.v[i]), a.v[i], b.v[i]);
  return r;
}
inline F32x16 fma(F32x16 a, F32x16 b, F32x16 c) {
  F32x16 r;
  for (int i = 0; i < 4; ++i) r.v[i] = vfmaq_f32(c.v[i], a.v[i], b.v[i]);
  return r;
}
inline F32x16 abs(F32x16 a) {
  F32x16 r;
  for (int i = 0; i < 4; ++i) r.v[i] = vabsq_f32(a.v[i]);
  return r;
}
inline F32x16 div_or_zero(F32x16 num, F32x16 d) {
  F32x16 r;
  for (int i = 0; i < 4; ++i) {
    const uint32x4_t positive = vcgtq_f32(d.v[i], vdupq_n_f32(0));
    r.v[i] = vreinterpretq_f32_u32(
        vandq_u32(vreinterpretq_u32_f32(vdivq_f32(num.v[i], d.v[i])), positive));
  }
  return r;
}
// lane i with i + 8, then i + 4, i + 2, i + 1 (every ISA adds in this order)
inline float reduce_add(F32x16 a) {
  const float32x4_t u = vaddq_f32(vaddq_f32(a.v[2], a.v[0]), vaddq_f32(a.v[3], a.v[1]));
  const float32x4_t w = vaddq_f32(u, vextq_f32(u, u, 2));
  return vgetq_lane_f32(w, 0) + vgetq_lane_f32(w, 1);
}
inline float reduce_max(F32x16 a) {
  return vmaxvq_f32(vmaxq_f32(vmaxq_f32(a.v[0], a.v[1]), vmaxq_f32(a.v[2], a.v[3])));
}
inline bool any_nan(F32x16 a) {
  uint32x4_t ordered = vceqq_f32(a.v[0], a.v[0]);
  for (int i = 1; i < 4; ++i) ordered = vandq_u32(ordered, vceqq_f32(a.v[i], a.v[i]));
  return vminvq_u32(ordered) == 0;
}
inline int first_equal(F32x16 a, float x) {
  alignas(16) uint32_t eq[16];
  for (int i = 0; i < 4; ++i) vst1q_u32(eq + 4 * i, vceqq_f32(a.v[i], vdupq_n_f32(x)));
  for (int i = 0; i < 16; ++i) {
    if (eq[i] != 0) return i;
  }
  return -1;
}
inline F32x16 sum16(const F32x16 (&a)[16]) {
  alignas(16) float out[16];
  for (int i = 0; i < 16; ++i) out[i] = reduce_add(a[i]);
  return load(out);
}
inline F32x16 max16(const F32x16 (&a)[16]) {
  alignas(16) float out[16];
  for (int i = 0; i < 16; ++i) out[i] = reduce_max(a[i]);
  return load(out);
}

// ---- int32 --------------------------------------------------------------------------------
inline I32x16 zero_i32() { return {{vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)}}; }
inline I32x16 operator+(I32x16 a, I32x16 b) {
  I32x16 r;
  for (int i = 0; i < 4; ++i) r.v[i] = vaddq_s32(a.v[i], b.v[i]);
  return r;
}
template <int N>
inline I32x16 shift_left(I32x16 a) {
  I32x16 r;
  for (int i = 0; i < 4; ++i) r.v[i] = vshlq_n_s32(a.v[i], N);
  return r;
}
inline F32x16 to_float(I32x16 a) {
  F32x16 r;
  for (int i = 0; i < 4; ++i) r.v[i] = vcvtq_f32_s32(a.v[i]);
  return r;
}
inline I32x16 round_to_i32(F32x16 a) {  // nearest even
  I32x16 r;
  for (int i = 0; i < 4; ++i) r.v[i] = vcvtnq_s32_f32(a.v[i]);
  return r;
}
inline void store_i8(int8_t* out, I32x16 a) {
  const int16x8_t lo = vcombine_s16(vqmovn_s32(a.v[0]), vqmovn_s32(a.v[1]));
  const int16x8_t hi = vcombine_s16(vqmovn_s32(a.v[2]), vqmovn_s32(a.v[3]));
  vst1q_s8(out, vcombine_s8(vqmovn_s16(lo), vqmovn_s16(hi)));
}
inline I32x16 sum16(const I32x16 (&a)[16]) {
  alignas(16) int32_t out[16];
  for (int i = 0; i < 16; ++i) {
    out[i] = vaddvq_s32(vaddq_s32(vaddq_s32(a[i].v[0], a[i].v[1]), vaddq_s32(a[i].v[2], a[i].v[3])));
  }
  return {{vld1q_s32(out), vld1q_s32(out + 4), vld1q_s32(out + 8), vld1q_s32(out + 12)}};
}

// ---- bytes and the int8 dot product ---------------------------------------------------------
inline U8x64 load_u8(const void* p) {
  const uint8_t* q = static_cast<const uint8_t*>(p);
  return {{vld1q_u8(q), vld1q_u8(q + 16), vld1q_u8(q + 32), vld1q_u8(q + 48)}};
}
inline U8x64 and_bytes(U8x64 a, uint8_t m) {
  U8x64 r;
  for (int i = 0; i < 4; ++i) r.v[i] = vandq_u8(a.v[i], vdupq_n_u8(m));
  return r;
}
inline U8x64 xor_bytes(U8x64 a, uint8_t m) {
  U8x64 r;
  for (int i = 0; i < 4; ++i) r.v[i] = veorq_u8(a.v[i], vdupq_n_u8(m));
  return r;
}
inline U8x64 high_nibbles(U8x64 a) {
  U8x64 r;
  for (int i = 0; i < 4; ++i) r.v[i] = vshrq_n_u8(a.v[i], 4);
  return r;
}
inline U8x64 add16_where(U8x64 a, uint64_t bits) {
  static const uint8_t kSelect[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  const uint8x16_t select = vld1q_u8(kSelect);
  U8x64 r;
  for (int i = 0; i < 4; ++i) {
    const uint8x16_t b = vcombine_u8(vdup_n_u8(static_cast<uint8_t>(bits >> (16 * i))),
                                     vdup_n_u8(static_cast<uint8_t>(bits >> (16 * i + 8))));
    r.v[i] = vaddq_u8(a.v[i], vandq_u8(vtstq_u8(b, select), vdupq_n_u8(16)));
  }
  return r;
}
template <int Bits>
inline I32x16 dot4(I32x16 acc, U8x64 w, int32_t x4) {
  const int8x16_t x = vreinterpretq_s8_s32(vdupq_n_s32(x4));
  I32x16 r;
  for (int i = 0; i < 4; ++i) r.v[i] = detail::dot4_quarter(acc.v[i], w.v[i], x, Bits > 7);
  return r;
}

// ---- bfloat16 pairs (the two products of a pair in float FMAs, the odd one first) ----------
struct BF16x32 { uint32x4_t v[4]; };
inline BF16x32 load_pairs(const void* p) {
  const uint32_t* q = static_cast<const uint32_t*>(p);
  return {{vld1q_u32(q), vld1q_u32(q + 4), vld1q_u32(q + 8), vld1q_u32(q + 12)}};
}
inline BF16x32 set1_pair(uint32_t pair) {
  const uint32x4_t v = vdupq_n_u32(pair);
  return {{v, v, v, v}};
}
inline void store_pairs(void* p, BF16x32 a) {
  uint32_t* q = static_cast<uint32_t*>(p);
  for (int i = 0; i < 4; ++i) vst1q_u32(q + 4 * i, a.v[i]);
}
inline F32x16 dot_pairs(F32x16 acc, BF16x32 a, BF16x32 b) {
  const uint32x4_t high = vdupq_n_u32(0xFFFF0000u);
  F32x16 r;
  for (int i = 0; i < 4; ++i) {
    const float32x4_t ao = vreinterpretq_f32_u32(vandq_u32(a.v[i], high));
    const float32x4_t bo = vreinterpretq_f32_u32(vandq_u32(b.v[i], high));
    const float32x4_t ae = vreinterpretq_f32_u32(vshlq_n_u32(a.v[i], 16));
    const float32x4_t be = vreinterpretq_f32_u32(vshlq_n_u32(b.v[i], 16));
    r.v[i] = vfmaq_f32(vfmaq_f32(acc.v[i], ao, bo), ae, be);
  }
  return r;
}
inline BF16x32 interleave_pairs(const bf16_t* lo, const bf16_t* hi) {
  const uint16_t* l = reinterpret_cast<const uint16_t*>(lo);
  const uint16_t* h = reinterpret_cast<const uint16_t*>(hi);
  BF16x32 r;
  for (int i = 0; i < 4; ++i) {
    r.v[i] = vorrq_u32(vmovl_u16(vld1_u16(l + 4 * i)), vshll_n_u16(vld1_u16(h + 4 * i), 16));
  }
  return r;
}

}  // namespace vec
}  // namespace kvserve
