// The activations of kvserve's int8-dot linears (qgemm_int8.h): stores of 16 floats to any
// float type (convert.h has the loads), and QuantRows, x quantized to int8 per block of 32 in the layout the
// tile kernels read.

#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "qgemm.h"

#ifdef KVSERVE_INT8_DOT
namespace kvserve {
namespace qgemm {


// 16 floats stored as T, rounded to nearest even as torch rounds.
inline void store16(float* out, __m512 v) { _mm512_storeu_ps(out, v); }
inline void store16(c10::BFloat16* out, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
inline void store16(c10::Half* out, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// x [M, K] quantized per block of 32, its codes laid out for the passes: rows in groups of
// `P` (a pass's rows; the last group holds the rest), each group's codes as [K / 4][rows] runs
// of 4, so that a pass reads the 4 codes of each of its rows at input k side by side, at
// offsets known when it is compiled (with each row's codes in its own row, the 8 rows' 8
// addresses per block took more registers than x86 has: the 8-row int8 tile spilled them,
// ~13% of its samples). The passes of int8_path start at multiples of P (kChunkRows).
struct QuantRows {
  int64_t M, K, P, blocks, groups;
  // In one buffer, every element written before any read: left uninitialised (zeroing took
  // 9 MB per linear of a 6,000-token prefill, ~2% of a serving run).
  int8_t* q;     // [M, K] in groups of P rows, see above
  float* da;     // [M, blocks] block scales
  float* sums;   // [M, groups] sums of the quantized x per weight group
  float* total;  // [M] sum over blocks of scale x sum of codes

  template <typename T>
  QuantRows(const T* x, int64_t M_, int64_t K_, int64_t per_group, int64_t P_)
      : M(M_), K(K_), P(P_), blocks(K_ / kBlock), groups(K_ / kBlock / per_group) {
    lay_out(claim(bytes(M, K, blocks / groups)));
    // Rows are independent: split them over the threads once there is enough work (a 64-row
    // step quantized serially left a core idle for ~3 ms of SmolLM2's ~48).
    const int64_t grain = std::max<int64_t>(1, 16384 / K);
    at::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) quantize_row(x + r * K, r);
    });
  }
  // The layout of x [M, K] over `buf` (of bytes(M, K, per_group) bytes) without quantizing
  // anything: the threads of a Team each quantize their rows into the same buffer
  // (quantize_row), every one with its own QuantRows of equal pointers.
  QuantRows(char* buf, int64_t M_, int64_t K_, int64_t per_group, int64_t P_)
      : M(M_), K(K_), P(P_), blocks(K_ / kBlock), groups(K_ / kBlock / per_group),
        external_(true) {
    lay_out(buf);
  }
  static size_t bytes(int64_t M, int64_t K, int64_t per_group) {
    const int64_t blocks = K / kBlock;
    return static_cast<size_t>(M * K) +
           4 * static_cast<size_t>(M * (blocks + blocks / per_group + 1));
  }
  ~QuantRows() {
    if (owned_ == nullptr && !external_) kept_busy() = false;
  }
  QuantRows(const QuantRows&) = delete;
  QuantRows& operator=(const QuantRows&) = delete;

  // The codes of the pass whose first row is r0 (a group's first) in runs of 4: row i's
  // codes at inputs 4 c..4 c + 3 are element c x R + i, R the group's rows.
  const int32_t* quads(int64_t r0) const {
    return reinterpret_cast<const int32_t*>(q + r0 * K);
  }
  template <typename T>
  void quantize_row(const T* xr, int64_t r) {
    const int64_t first = r / P * P, rows = std::min(P, M - first);
    int8_t* group = q + first * K + (r - first) * 4;
    const int64_t per_group = blocks / groups;
    int64_t g = 0, in_group = 0;
    float row_total = 0.0f, group_sum = 0.0f;
    // 16 blocks at a time: their max |x| and their code sums each reduced across lanes
    // together (reduce16), where one block at a time took two chains of shuffles per block
    // (~65 instructions a block, most of a quantization's time).
    for (int64_t b0 = 0; b0 < blocks; b0 += 16) {
      const int nb = static_cast<int>(std::min<int64_t>(16, blocks - b0));
      const __mmask16 used = static_cast<__mmask16>((1u << nb) - 1u);
      __m512 v[16];
      for (int i = 0; i < 16; ++i) {
        v[i] = _mm512_setzero_ps();
        if (i < nb) {
          const T* xb = xr + (b0 + i) * kBlock;
          v[i] = _mm512_max_ps(_mm512_abs_ps(load16(xb)), _mm512_abs_ps(load16(xb + 16)));
        }
      }
      const __m512 amax = reduce16(v, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); });
      alignas(64) float inv[16], sums16[16];
      _mm512_store_ps(inv, _mm512_maskz_div_ps(
                               _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ),
                               _mm512_set1_ps(127.0f), amax));
      const __m512 scale = _mm512_div_ps(amax, _mm512_set1_ps(127.0f));
      _mm512_mask_storeu_ps(da + r * blocks + b0, used, scale);
      for (int i = 0; i < 16; ++i) {
        v[i] = _mm512_setzero_ps();
        if (i >= nb) continue;
        const int64_t b = b0 + i;
        const T* xb = xr + b * kBlock;
        const __m512 s = _mm512_set1_ps(inv[i]);
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(load16(xb), s));  // nearest even
        const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(load16(xb + 16), s));
        const __m128i clo = _mm512_cvtsepi32_epi8(qlo), chi = _mm512_cvtsepi32_epi8(qhi);
        if (rows == 1) {  // one row in its group: its codes in order
          _mm_storeu_si128(reinterpret_cast<__m128i*>(group + b * kBlock), clo);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(group + b * kBlock + 16), chi);
        } else {
          alignas(16) int8_t codes[kBlock];
          _mm_store_si128(reinterpret_cast<__m128i*>(codes), clo);
          _mm_store_si128(reinterpret_cast<__m128i*>(codes + 16), chi);
          for (int64_t c = 0; c < kBlock / 4; ++c) {
            std::memcpy(group + (b * kBlock / 4 + c) * rows * 4, codes + 4 * c, 4);
          }
        }
        v[i] = _mm512_castsi512_ps(_mm512_add_epi32(qlo, qhi));
      }
      // The sums are of the quantized x, so that int4's mins and codes meet the same x: the
      // result is then exactly w . x' (x' the quantized x). Exact float sums instead leave
      // sum(q x') - sum(q x), with q up to 15, uncancelled (+3% perplexity on SmolLM2).
      const __m512 code_sums = reduce16(v, [](__m512 a, __m512 b) {
        return _mm512_castsi512_ps(
            _mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
      });
      _mm512_store_ps(sums16,
                      _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_castps_si512(code_sums))));
      for (int i = 0; i < nb; ++i) {  // in block order, as one block at a time added them
        group_sum += sums16[i];
        row_total += sums16[i];
        if (++in_group == per_group) {
          sums[r * groups + g++] = group_sum;
          group_sum = 0.0f;
          in_group = 0;
        }
      }
    }
    total[r] = row_total;
  }

  // Lane i of the result: op over the 16 lanes of v[i] (v is overwritten). Four rounds of
  // pairing halves, quarters, pairs and lanes leave block q + 4 j in lane 4 q + j; a permute
  // puts block i in lane i. The ops are max (exact in any order) and integer adds.
  template <typename Op>
  static __m512 reduce16(__m512 (&v)[16], Op op) {
    for (int i = 0; i < 8; ++i) {  // lanes 0-7: v[2i]'s partial, 8-15: v[2i + 1]'s
      v[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    }
    for (int i = 0; i < 4; ++i) {  // quarter q: v[4i + q]'s partial
      v[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x88),
                _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xDD));
    }
    for (int i = 0; i < 2; ++i) {  // quarter q: v[8i + q]'s two lanes, then v[8i + 4 + q]'s
      v[i] = op(_mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0x44),
                _mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0xEE));
    }
    const __m512 z = op(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, z);
  }

 private:
  void lay_out(char* buf) {
    q = reinterpret_cast<int8_t*>(buf);  // M K is a multiple of 32: the floats stay aligned
    da = reinterpret_cast<float*>(buf + M * K);
    sums = da + M * blocks;
    total = sums + M * groups;
  }
  // Decode steps quantize a few rows per linear, 121 times a SmolLM2 token: the calling thread
  // keeps one buffer of up to kKeptBytes for them (malloc, free and malloc_consolidate were ~3%
  // of a batch-1 step's worker samples; with the attention's kept scores the 30 layers went
  // from 2.35-2.40 to 2.29-2.33 ms). Larger x, or a second live QuantRows, get their own.
  static constexpr size_t kKeptBytes = size_t{1} << 20;
  static bool& kept_busy() {
    thread_local bool busy = false;
    return busy;
  }
  char* claim(size_t bytes) {
    if (bytes > kKeptBytes || kept_busy()) {
      owned_.reset(new char[bytes]);
      return owned_.get();
    }
    thread_local std::unique_ptr<char[]> kept(new char[kKeptBytes]);
    kept_busy() = true;
    return kept.get();
  }
  std::unique_ptr<char[]> owned_;
  bool external_ = false;  // laid out over a buffer the caller owns
};

}  // namespace qgemm
}  // namespace kvserve
#endif  // KVSERVE_INT8_DOT
