// The vector layer on AVX-512 (F, BW, VL, DQ; VNNI's dpbusd and the BF16 dot product where the
// build has them): every 16-lane type is one 512-bit register.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "types.h"

namespace kvserve {
namespace vec {

#if defined(__AVX512VNNI__)
constexpr const char* kIsa = "avx512+vnni";
#else
constexpr const char* kIsa = "avx512";
#endif
constexpr int kRegisters = 32;   // vector registers
constexpr int kRegsPer16 = 1;    // registers one 16-lane vector takes
// Whether dot4<8> (any byte) costs what dot4<4> does: one dpbusd (VNNI).
#if defined(__AVX512VNNI__)
constexpr bool kFullByteDot = true;
#else
constexpr bool kFullByteDot = false;
#endif

struct F32x16 { __m512 v; };
struct I32x16 { __m512i v; };
struct U8x64 { __m512i v; };

// ---- float --------------------------------------------------------------------------------
inline F32x16 zero() { return {_mm512_setzero_ps()}; }
inline F32x16 set1(float x) { return {_mm512_set1_ps(x)}; }
inline F32x16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline F32x16 load(const bf16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16))};
}
inline F32x16 load(const f16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline void store(float* p, F32x16 a) { _mm512_storeu_ps(p, a.v); }
inline void store(bf16_t* p, F32x16 a) {  // nearest even, NaN to 0x7FC0, as c10 rounds
  const __m512i bits = _mm512_castps_si512(a.v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q),
                            _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
inline void store(f16_t* p, F32x16 a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline F32x16 operator+(F32x16 a, F32x16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F32x16 operator-(F32x16 a, F32x16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F32x16 operator*(F32x16 a, F32x16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F32x16 operator/(F32x16 a, F32x16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline F32x16 fma(F32x16 a, F32x16 b, F32x16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline F32x16 max(F32x16 a, F32x16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline F32x16 abs(F32x16 a) { return {_mm512_abs_ps(a.v)}; }
// num / d where d > 0, else 0 (a block of zeros has no scale)
inline F32x16 div_or_zero(F32x16 num, F32x16 d) {
  return {_mm512_maskz_div_ps(_mm512_cmp_ps_mask(d.v, _mm512_setzero_ps(), _CMP_GT_OQ), num.v,
                              d.v)};
}
// The sum of the 16 lanes: lane i with i + 8, then i + 4, i + 2, i + 1 (every ISA adds in this
// order, so that results agree across builds).
inline float reduce_add(F32x16 a) {
  const __m256 t3 = _mm256_add_ps(_mm512_extractf32x8_ps(a.v, 1), _mm512_castps512_ps256(a.v));
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_permute_ps(t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_movehdup_ps(t8));
}
inline float reduce_max(F32x16 a) { return _mm512_reduce_max_ps(a.v); }
inline bool any_nan(F32x16 a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q) != 0; }
// The first lane equal to x, or -1.
inline int first_equal(F32x16 a, float x) {
  const __mmask16 eq = _mm512_cmp_ps_mask(a.v, _mm512_set1_ps(x), _CMP_EQ_OQ);
  return eq == 0 ? -1 : __builtin_ctz(eq);
}

namespace detail {
// Lane i of the result: op over the 16 lanes of v[i], in reduce_add's order of pairs (v is
// overwritten): four rounds of pairing halves, quarters, pairs and lanes leave vector q + 4 j's
// result in lane 4 q + j; a permute puts vector i's in lane i.
template <typename Op>
inline __m512 transpose_reduce(__m512 (&v)[16], Op op) {
  for (int i = 0; i < 8; ++i) {
    v[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE),
              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44));
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xDD),
              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x88));
  }
  for (int i = 0; i < 2; ++i) {
    const __m512d lo = _mm512_castps_pd(v[2 * i]), hi = _mm512_castps_pd(v[2 * i + 1]);
    v[i] = op(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)),
              _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  const __m512 z = op(_mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                      _mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, z);
}
}  // namespace detail

// Lane r: reduce_add(a[r]) (the same additions in the same order), for 16 vectors at once.
inline F32x16 sum16(const F32x16 (&a)[16]) {
  __m512 v[16];
  for (int i = 0; i < 16; ++i) v[i] = a[i].v;
  return {detail::transpose_reduce(v, [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); })};
}
// Lane r: reduce_max(a[r]).
inline F32x16 max16(const F32x16 (&a)[16]) {
  __m512 v[16];
  for (int i = 0; i < 16; ++i) v[i] = a[i].v;
  return {detail::transpose_reduce(v, [](__m512 x, __m512 y) { return _mm512_max_ps(x, y); })};
}

// ---- int32 --------------------------------------------------------------------------------
inline I32x16 zero_i32() { return {_mm512_setzero_si512()}; }
inline I32x16 operator+(I32x16 a, I32x16 b) { return {_mm512_add_epi32(a.v, b.v)}; }
template <int N>
inline I32x16 shift_left(I32x16 a) { return {_mm512_slli_epi32(a.v, N)}; }
inline F32x16 to_float(I32x16 a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline I32x16 round_to_i32(F32x16 a) { return {_mm512_cvtps_epi32(a.v)}; }  // nearest even
// The 16 lanes saturated to int8, stored to out[0..16).
inline void store_i8(int8_t* out, I32x16 a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(a.v));
}
// Lane r: the sum of a[r]'s lanes (integer: any order is exact).
inline I32x16 sum16(const I32x16 (&a)[16]) {
  __m512 v[16];
  for (int i = 0; i < 16; ++i) v[i] = _mm512_castsi512_ps(a[i].v);
  return {_mm512_castps_si512(detail::transpose_reduce(v, [](__m512 x, __m512 y) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(x), _mm512_castps_si512(y)));
  }))};
}

// ---- bytes and the int8 dot product ---------------------------------------------------------
inline U8x64 load_u8(const void* p) { return {_mm512_loadu_si512(p)}; }
inline U8x64 and_bytes(U8x64 a, uint8_t m) {
  return {_mm512_and_si512(a.v, _mm512_set1_epi8(static_cast<char>(m)))};
}
inline U8x64 xor_bytes(U8x64 a, uint8_t m) {
  return {_mm512_xor_si512(a.v, _mm512_set1_epi8(static_cast<char>(m)))};
}
inline U8x64 high_nibbles(U8x64 a) {
  return {_mm512_and_si512(_mm512_srli_epi16(a.v, 4), _mm512_set1_epi8(0x0F))};
}
// 16 added to byte i where bit i of `bits` is set (the fifth bit of 5-bit codes).
inline U8x64 add16_where(U8x64 a, uint64_t bits) {
  return {_mm512_mask_add_epi8(a.v, _cvtu64_mask64(bits), a.v, _mm512_set1_epi8(16))};
}
// acc lane i += sum over j < 4 of w byte 4 i + j (unsigned, below 2^Bits) x byte j of x4
// (signed): AVX512-VNNI's dpbusd (exact for any byte); without VNNI, maddubs then madd, with
// the bytes split where they may reach 128 (maddubs saturates its pair sums at 16 bits).
template <int Bits>
inline I32x16 dot4(I32x16 acc, U8x64 w, int32_t x4) {
  const __m512i x = _mm512_set1_epi32(x4);
#if defined(__AVX512VNNI__)
  return {_mm512_dpbusd_epi32(acc.v, w.v, x)};
#else
  const __m512i ones = _mm512_set1_epi16(1);
  if constexpr (Bits <= 7) {
    return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(_mm512_maddubs_epi16(w.v, x), ones))};
  } else {
    const __m512i lo = _mm512_and_si512(w.v, _mm512_set1_epi8(0x7F));
    const __m512i hi = _mm512_and_si512(w.v, _mm512_set1_epi8(static_cast<char>(0x80)));
    const __m512i a = _mm512_madd_epi16(_mm512_maddubs_epi16(lo, x), ones);
    const __m512i b = _mm512_madd_epi16(_mm512_maddubs_epi16(hi, x), ones);
    return {_mm512_add_epi32(acc.v, _mm512_add_epi32(a, b))};
  }
#endif
}

// ---- bfloat16 pairs -----------------------------------------------------------------------
// 32 bfloat16 as 16 pairs (element 2 i in the low half of 32-bit lane i).
#if defined(__AVX512BF16__)
struct BF16x32 { __m512bh v; };
inline BF16x32 pairs_from(__m512i v) { return {reinterpret_cast<__m512bh>(v)}; }
inline BF16x32 load_pairs(const void* p) { return pairs_from(_mm512_loadu_si512(p)); }
inline BF16x32 set1_pair(uint32_t pair) {
  return {reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)))};
}
inline void store_pairs(void* p, BF16x32 a) {
  _mm512_storeu_si512(p, reinterpret_cast<__m512i>(a.v));
}
// acc lane i += a[2i+1] b[2i+1], then += a[2i] b[2i] (vdpbf16ps; the products are exact).
inline F32x16 dot_pairs(F32x16 acc, BF16x32 a, BF16x32 b) {
  return {_mm512_dpbf16_ps(acc.v, a.v, b.v)};
}
#else
struct BF16x32 { __m512i v; };
inline BF16x32 pairs_from(__m512i v) { return {v}; }
inline BF16x32 load_pairs(const void* p) { return {_mm512_loadu_si512(p)}; }
inline BF16x32 set1_pair(uint32_t pair) { return {_mm512_set1_epi32(static_cast<int>(pair))}; }
inline void store_pairs(void* p, BF16x32 a) { _mm512_storeu_si512(p, a.v); }
inline F32x16 dot_pairs(F32x16 acc, BF16x32 a, BF16x32 b) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512 ao = _mm512_castsi512_ps(_mm512_and_si512(a.v, high));
  const __m512 bo = _mm512_castsi512_ps(_mm512_and_si512(b.v, high));
  const __m512 ae = _mm512_castsi512_ps(_mm512_slli_epi32(a.v, 16));
  const __m512 be = _mm512_castsi512_ps(_mm512_slli_epi32(b.v, 16));
  return {_mm512_fmadd_ps(ae, be, _mm512_fmadd_ps(ao, bo, acc.v))};
}
#endif
// Pairs (lo[i], hi[i]) of two rows of 16 bfloat16.
inline BF16x32 interleave_pairs(const bf16_t* lo, const bf16_t* hi) {
  const __m512i l = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo)));
  const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)));
  return pairs_from(_mm512_or_si512(l, _mm512_slli_epi32(h, 16)));
}

}  // namespace vec
}  // namespace kvserve
