// The activations of kvserve's int8-dot linears (qgemm_int8.h): QuantRows, x quantized to int8
// per block of 32 in the layout the tile kernels read, written over the vector layer.

#pragma once

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>

#include "parallel.h"
#include "quant/qgemm.h"

namespace kvserve {
namespace qgemm {

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
    parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
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
    // together (vec::max16, vec::sum16), where one block at a time took two chains of shuffles per block
    // (~65 instructions a block, most of a quantization's time).
    for (int64_t b0 = 0; b0 < blocks; b0 += 16) {
      const int nb = static_cast<int>(std::min<int64_t>(16, blocks - b0));
      vec::F32x16 v[16];
      for (int i = 0; i < 16; ++i) {
        v[i] = vec::zero();
        if (i < nb) {
          const T* xb = xr + (b0 + i) * kBlock;
          v[i] = vec::max(vec::abs(vec::load(xb)), vec::abs(vec::load(xb + 16)));
        }
      }
      const vec::F32x16 amax = vec::max16(v);
      alignas(64) float inv[16], scales16[16], sums16[16];
      vec::store(inv, vec::div_or_zero(vec::set1(127.0f), amax));
      const vec::F32x16 scale = amax / vec::set1(127.0f);
      vec::store(scales16, scale);
      std::memcpy(da + r * blocks + b0, scales16, sizeof(float) * nb);
      vec::I32x16 code_sums[16];
      for (int i = 0; i < 16; ++i) {
        code_sums[i] = vec::zero_i32();
        if (i >= nb) continue;
        const int64_t b = b0 + i;
        const T* xb = xr + b * kBlock;
        // 127 / max|x| overflows for blocks below ~3.7e-37: those quantize to zeros (x inf
        // would give inf and NaN codes, converted differently by each architecture)
        const vec::F32x16 s =
            vec::set1(inv[i] <= std::numeric_limits<float>::max() ? inv[i] : 0.0f);
        const vec::I32x16 qlo = vec::round_to_i32(vec::load(xb) * s);  // nearest even
        const vec::I32x16 qhi = vec::round_to_i32(vec::load(xb + 16) * s);
        if (rows == 1) {  // one row in its group: its codes in order
          vec::store_i8(group + b * kBlock, qlo);
          vec::store_i8(group + b * kBlock + 16, qhi);
        } else {
          alignas(16) int8_t codes[kBlock];
          vec::store_i8(codes, qlo);
          vec::store_i8(codes + 16, qhi);
          for (int64_t c = 0; c < kBlock / 4; ++c) {
            std::memcpy(group + (b * kBlock / 4 + c) * rows * 4, codes + 4 * c, 4);
          }
        }
        code_sums[i] = qlo + qhi;
      }
      // The sums are of the quantized x, so that int4's mins and codes meet the same x: the
      // result is then exactly w . x' (x' the quantized x). Exact float sums instead leave
      // sum(q x') - sum(q x), with q up to 15, uncancelled (+3% perplexity on SmolLM2).
      vec::store(sums16, scale * vec::to_float(vec::sum16(code_sums)));
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
