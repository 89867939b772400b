// The vector layer on AVX2 with FMA and F16C (x86-64-v3: Intel since Haswell, AMD since
// Excavator and every Zen): each 16-lane type is two 256-bit registers, lanes 0-7 in `lo`.
// The int8 dot product is AVX-VNNI's dpbusd where the build has it (Alder Lake, Zen 5), else
// maddubs then madd.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "types.h"

namespace kvserve {
namespace vec {

#if defined(__AVXVNNI__)
constexpr const char* kIsa = "avx2+avxvnni";
#else
constexpr const char* kIsa = "avx2";
#endif
constexpr int kRegisters = 16;
constexpr int kRegsPer16 = 2;
// Whether dot4<8> (any byte) costs what dot4<4> does: one dpbusd (VNNI).
#if defined(__AVXVNNI__)
constexpr bool kFullByteDot = true;
#else
constexpr bool kFullByteDot = false;
#endif

struct F32x16 { __m256 lo, hi; };
struct I32x16 { __m256i lo, hi; };
struct U8x64 { __m256i lo, hi; };

namespace detail {
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
inline __m256 load8(const f16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// 8 floats -> 8 bfloat16 bits in the low halves of 32-bit lanes, as c10 rounds
inline __m256i bf16_bits(__m256 a) {
  const __m256i bits = _mm256_castps_si256(a);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}
// two vectors of 8 lanes holding 16-bit values -> 16 x 16 bits in lane order
inline __m256i pack16(__m256i lo, __m256i hi) {
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
}
inline float hsum8(__m256 t3) {  // lanes i + 4, then i + 2, i + 1
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_permute_ps(t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_movehdup_ps(t8));
}
inline __m256i dot4_half(__m256i acc, __m256i w, __m256i x, bool full_bytes) {
#if defined(__AVXVNNI__)
  (void)full_bytes;
  return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if (!full_bytes) return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
  // maddubs saturates its pair sums at 16 bits: bytes of 128 and up in a second product
  const __m256i lo = _mm256_and_si256(w, _mm256_set1_epi8(0x7F));
  const __m256i hi = _mm256_and_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
  const __m256i a = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x), ones);
  const __m256i b = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x), ones);
  return _mm256_add_epi32(acc, _mm256_add_epi32(a, b));
#endif
}
// 32 bits -> 32 bytes, 0xFF where the bit is set
inline __m256i bits_to_bytes(uint32_t bits) {
  const __m256i v = _mm256_set1_epi32(static_cast<int>(bits));
  const __m256i spread = _mm256_shuffle_epi8(
      v, _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                          3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
}
}  // namespace detail

// ---- float --------------------------------------------------------------------------------
inline F32x16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F32x16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
template <typename T>
inline F32x16 load(const T* p) { return {detail::load8(p), detail::load8(p + 8)}; }
inline void store(float* p, F32x16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline void store(bf16_t* p, F32x16 a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      detail::pack16(detail::bf16_bits(a.lo), detail::bf16_bits(a.hi)));
}
inline void store(f16_t* p, F32x16 a) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(a.lo, kRound));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(a.hi, kRound));
}
#define KVSERVE_VEC_BINARY(op, fn) \
  inline F32x16 operator op(F32x16 a, F32x16 b) { return {fn(a.lo, b.lo), fn(a.hi, b.hi)}; }
KVSERVE_VEC_BINARY(+, _mm256_add_ps)
KVSERVE_VEC_BINARY(-, _mm256_sub_ps)
KVSERVE_VEC_BINARY(*, _mm256_mul_ps)
KVSERVE_VEC_BINARY(/, _mm256_div_ps)
#undef KVSERVE_VEC_BINARY
inline F32x16 fma(F32x16 a, F32x16 b, F32x16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline F32x16 max(F32x16 a, F32x16 b) {
  return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)};
}
inline F32x16 abs(F32x16 a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
inline F32x16 div_or_zero(F32x16 num, F32x16 d) {
  const __m256 z = _mm256_setzero_ps();
  return {_mm256_and_ps(_mm256_div_ps(num.lo, d.lo), _mm256_cmp_ps(d.lo, z, _CMP_GT_OQ)),
          _mm256_and_ps(_mm256_div_ps(num.hi, d.hi), _mm256_cmp_ps(d.hi, z, _CMP_GT_OQ))};
}
inline float reduce_add(F32x16 a) { return detail::hsum8(_mm256_add_ps(a.hi, a.lo)); }
inline float reduce_max(F32x16 a) {
  const __m256 m8 = _mm256_max_ps(a.lo, a.hi);
  __m128 m = _mm_max_ps(_mm256_extractf128_ps(m8, 1), _mm256_castps256_ps128(m8));
  m = _mm_max_ps(m, _mm_permute_ps(m, _MM_SHUFFLE(1, 0, 3, 2)));
  return std::max(_mm_cvtss_f32(m), _mm_cvtss_f32(_mm_movehdup_ps(m)));
}
inline bool any_nan(F32x16 a) {
  return _mm256_movemask_ps(_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q)) != 0 ||
         _mm256_movemask_ps(_mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q)) != 0;
}
inline int first_equal(F32x16 a, float x) {
  const __m256 v = _mm256_set1_ps(x);
  const unsigned eq = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, v, _CMP_EQ_OQ))) |
                      static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(a.hi, v, _CMP_EQ_OQ))) << 8;
  return eq == 0 ? -1 : __builtin_ctz(eq);
}
// Lane r: reduce_add(a[r]) in its order: the 8-lane halves added, then 8 such vectors'
// reductions transposed together (pairs of lanes i and i + 4, then i + 2, then i + 1).
inline __m256 transpose_sum8(const __m256 (&t)[8]) {
  __m256 u[4], w[2];
  for (int i = 0; i < 4; ++i) {  // 128-bit halves: vector 2i's lanes i and i + 4 summed, 2i + 1's
    u[i] = _mm256_add_ps(_mm256_permute2f128_ps(t[2 * i], t[2 * i + 1], 0x31),
                         _mm256_permute2f128_ps(t[2 * i], t[2 * i + 1], 0x20));
  }
  for (int i = 0; i < 2; ++i) {  // lanes j and j + 2 of each quarter
    const __m256d lo = _mm256_castps_pd(u[2 * i]), hi = _mm256_castps_pd(u[2 * i + 1]);
    w[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpackhi_pd(lo, hi)),
                         _mm256_castpd_ps(_mm256_unpacklo_pd(lo, hi)));
  }
  const __m256 z = _mm256_add_ps(_mm256_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // lanes 0-3 hold vectors 0, 2, 4, 6 and lanes 4-7 vectors 1, 3, 5, 7: vector i to lane i
  return _mm256_permutevar8x32_ps(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
inline F32x16 sum16(const F32x16 (&a)[16]) {
  __m256 t0[8], t1[8];
  for (int i = 0; i < 8; ++i) {
    t0[i] = _mm256_add_ps(a[i].hi, a[i].lo);
    t1[i] = _mm256_add_ps(a[8 + i].hi, a[8 + i].lo);
  }
  return {transpose_sum8(t0), transpose_sum8(t1)};
}
inline F32x16 max16(const F32x16 (&a)[16]) {
  alignas(32) float out[16];
  for (int i = 0; i < 16; ++i) out[i] = reduce_max(a[i]);
  return load(out);
}

// ---- int32 --------------------------------------------------------------------------------
inline I32x16 zero_i32() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I32x16 operator+(I32x16 a, I32x16 b) {
  return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)};
}
template <int N>
inline I32x16 shift_left(I32x16 a) {
  return {_mm256_slli_epi32(a.lo, N), _mm256_slli_epi32(a.hi, N)};
}
inline F32x16 to_float(I32x16 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline I32x16 round_to_i32(F32x16 a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
inline void store_i8(int8_t* out, I32x16 a) {
  const __m256i s16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(a.lo, a.hi), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                   _mm_packs_epi16(_mm256_castsi256_si128(s16), _mm256_extracti128_si256(s16, 1)));
}
inline I32x16 sum16(const I32x16 (&a)[16]) {
  alignas(32) int32_t lanes[16], out[16];
  for (int i = 0; i < 16; ++i) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi32(a[i].lo, a[i].hi));
    int32_t s = 0;
    for (int j = 0; j < 8; ++j) s += lanes[j];
    out[i] = s;
  }
  return {_mm256_load_si256(reinterpret_cast<const __m256i*>(out)),
          _mm256_load_si256(reinterpret_cast<const __m256i*>(out + 8))};
}

// ---- bytes and the int8 dot product ---------------------------------------------------------
inline U8x64 load_u8(const void* p) {
  const __m256i* q = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
inline U8x64 and_bytes(U8x64 a, uint8_t m) {
  const __m256i v = _mm256_set1_epi8(static_cast<char>(m));
  return {_mm256_and_si256(a.lo, v), _mm256_and_si256(a.hi, v)};
}
inline U8x64 xor_bytes(U8x64 a, uint8_t m) {
  const __m256i v = _mm256_set1_epi8(static_cast<char>(m));
  return {_mm256_xor_si256(a.lo, v), _mm256_xor_si256(a.hi, v)};
}
inline U8x64 high_nibbles(U8x64 a) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(_mm256_srli_epi16(a.lo, 4), m),
          _mm256_and_si256(_mm256_srli_epi16(a.hi, 4), m)};
}
inline U8x64 add16_where(U8x64 a, uint64_t bits) {
  const __m256i sixteen = _mm256_set1_epi8(16);
  return {_mm256_add_epi8(a.lo, _mm256_and_si256(detail::bits_to_bytes(static_cast<uint32_t>(bits)), sixteen)),
          _mm256_add_epi8(a.hi, _mm256_and_si256(detail::bits_to_bytes(static_cast<uint32_t>(bits >> 32)), sixteen))};
}
template <int Bits>
inline I32x16 dot4(I32x16 acc, U8x64 w, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4);
  return {detail::dot4_half(acc.lo, w.lo, x, Bits > 7), detail::dot4_half(acc.hi, w.hi, x, Bits > 7)};
}

// ---- bfloat16 pairs (emulated: the two products of a pair in float FMAs, odd one first) ---
struct BF16x32 { __m256i lo, hi; };
inline BF16x32 load_pairs(const void* p) {
  const __m256i* q = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
inline BF16x32 set1_pair(uint32_t pair) {
  const __m256i v = _mm256_set1_epi32(static_cast<int>(pair));
  return {v, v};
}
inline void store_pairs(void* p, BF16x32 a) {
  __m256i* q = static_cast<__m256i*>(p);
  _mm256_storeu_si256(q, a.lo);
  _mm256_storeu_si256(q + 1, a.hi);
}
namespace detail {
inline __m256 dot_pairs8(__m256 acc, __m256i a, __m256i b) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256 ao = _mm256_castsi256_ps(_mm256_and_si256(a, high));
  const __m256 bo = _mm256_castsi256_ps(_mm256_and_si256(b, high));
  const __m256 ae = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
  const __m256 be = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
  return _mm256_fmadd_ps(ae, be, _mm256_fmadd_ps(ao, bo, acc));
}
}  // namespace detail
inline F32x16 dot_pairs(F32x16 acc, BF16x32 a, BF16x32 b) {
  return {detail::dot_pairs8(acc.lo, a.lo, b.lo), detail::dot_pairs8(acc.hi, a.hi, b.hi)};
}
inline BF16x32 interleave_pairs(const bf16_t* lo, const bf16_t* hi) {
  const __m128i* l = reinterpret_cast<const __m128i*>(lo);
  const __m128i* h = reinterpret_cast<const __m128i*>(hi);
  auto pairs = [](__m128i a, __m128i b) {
    return _mm256_or_si256(_mm256_cvtepu16_epi32(a), _mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
  };
  return {pairs(_mm_loadu_si128(l), _mm_loadu_si128(h)),
          pairs(_mm_loadu_si128(l + 1), _mm_loadu_si128(h + 1))};
}

}  // namespace vec
}  // namespace kvserve
