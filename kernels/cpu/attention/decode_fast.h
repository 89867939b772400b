// The paged decode attention over a bfloat16 or float32 cache, written once over the vector
// layer (vec/vec.h) for every ISA; attention_avx512.cpp calls it from the torch op. Torch-free
// (types.h, parallel.h and team.h stand in under KVSERVE_NO_TORCH), so that the kernel
// harness builds and runs it on every target.
//
//   scores  q . k straight from the cache's rows, sixteen keys of a block at a time reduced
//           together (vec::sum16): vec::dot_pairs on bf16 rows (AVX512-BF16's `vdpbf16ps`,
//           products of two bf16 exact in float, sums in float; two float FMAs per pair
//           elsewhere), fused multiply-adds on float rows;
//   values  each V row widened to float (bf16) or loaded (float) once per KV head and
//           accumulated into the output rows of several query heads held in registers.
//
// Head sizes 64, 128 and 256 (two, four or eight 32-wide chunks, `run_dim`).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention/paged.h"
#include "parallel.h"
#include "step/team.h"
#include "../vec/vec.h"

namespace kvserve {
namespace decode_fast {

using vec::F32x16;

template <typename T>
struct Call {
  const T *q, *k, *v;
  T* o;
  const int32_t *tables, *lens;
  int64_t q_s0, q_s1, o_s0, o_s1, bt_s0, block_size, kv_heads, group, window;
  float scale, v_scale;
};

// What the kernel needs of an element type per 32-wide chunk of a row (Q: a query or key
// chunk in registers; dot: acc + q . k, lane i summing the chunk's elements 2i and 2i + 1 for
// bf16, i and 16 + i for float). Rows of 16 load as float and store with vec::load / store.
template <typename T>
struct Lanes;

template <>
struct Lanes<float> {
  struct Q { F32x16 lo, hi; };
  static Q load_q(const float* p) { return {vec::load(p), vec::load(p + 16)}; }
  static F32x16 dot(F32x16 acc, const Q& q, const Q& k) {
    return vec::fma(q.hi, k.hi, vec::fma(q.lo, k.lo, acc));
  }
};

template <>
struct Lanes<bf16_t> {
  using Q = vec::BF16x32;
  static Q load_q(const bf16_t* p) { return vec::load_pairs(p); }
  static F32x16 dot(F32x16 acc, const Q& q, const Q& k) { return vec::dot_pairs(acc, q, k); }
};

// 16-float vectors the registers hold: 32 on AVX-512, 8 on AVX2 and NEON (two and four
// registers each), 4 in the scalar build.
constexpr int kVectors = vec::vectors_in(vec::kRegisters);

// Query heads per pass, so that a pass's vectors stay in registers: half of them for the
// values' accumulators, 2C per head (on AVX-512: 4, 2, 1 heads for C = 2, 4, 8; the QK pass
// holds C chunks of each head's query). One head elsewhere.
template <int C>
constexpr int kHeadsPerPass = std::max(1, kVectors / 2 / (2 * C));

// 16-wide columns of the head a values pass accumulates: all 2C of them where the pass's heads
// fit (AVX-512), else slices of the head (4 vectors on AVX2 and NEON). A slice reads its own
// cache lines of each V row, so slicing adds passes over the block table, never bytes read.
// A whole 128-dim head's 8 accumulators take every AVX2 register and spill: batch 1, context
// 512, 32/8 heads of 128 took 156 us (bf16) and 174 us (float32) so against 139 and 145 us
// sliced (AMD EPYC Zen 4 built for x86-64-v3, 2 threads).
template <int C>
constexpr int kValueVectors = std::min(2 * C, std::max(1, kVectors / 2 / kHeadsPerPass<C>));
template <int C>
constexpr int kValueSlices = 2 * C / kValueVectors<C>;
static_assert(2 * 8 % kValueVectors<8> == 0 && 2 * 4 % kValueVectors<4> == 0 &&
              2 * 2 % kValueVectors<2> == 0, "value slices must tile the head");

// Blocks ahead whose rows a lead head asks for (for_each_run_ahead), where items read whole
// rows: only in the first item of a thread's run, the later ones finding their rows asked for
// already (RowStream, below). From a cold cache (64 sequences at context 150, 30 layers, 2 threads)
// asking 1 to 8 blocks ahead took 33.5-34.5 ms against 39-41 ms without.
//
// Measured 2026-12-03 (AMD EPYC Zen 4, 2 threads, bf16 cache, 64 sequences at context 64, 30
// layers' caches): 6.9-8.9 ms a step from memory against 2.6-3.7 ms with the caches in L3,
// ~10 GB/s of the 20-30 GB/s a plain read gets. Asking for the next item's whole context at
// once, two items ahead, or more blocks ahead moved it by under 5%: a burst of prefetches
// fills the miss buffers and stalls the dot products. Asking for the next item's rows a few
// lines per inner-loop turn instead (RowStream) took it to 5.0 ms, and the engine's 64-row
// decode step (context 64 to 184) from 44.6 to 40.2 ms (median of 120 steps, interleaved in
// one process). Warming the next layer's rows during the MLP's matmuls gained nothing.
constexpr int64_t kAheadBlocks = 2;

template <typename T>
int64_t block_bytes(const Call<T>& c, int64_t dim) {
  return c.block_size * c.kv_heads * dim * static_cast<int64_t>(sizeof(T));
}

// One sequence's KV head g: scores of its query heads h0..h0+nh (rows of `scores`, n each).
// Sixteen consecutive keys of a block at a time, one query head at a time, their dot products
// reduced together (vec::sum16: lane r is reduce_add of key r's, the same additions in the
// same order, in ~45 shuffles and adds where 16 reduce_adds take ~130 dependent steps; at
// batch 1 a score's reduction held up its store, half of the scores' time on AVX-512); the
// keys left over one by one (reduce_add), all heads of a pass per K row. A lead head (`ahead`,
// kAheadBlocks) asks for the whole K and V rows ahead of its keys; `next` (RowStream) is
// pumped once per 16-key group. Kept out of line: inlined into run's loop (as GCC chose once
// the kernel moved into this header) it took 3-8% more time on AVX-512 and 10-17% on AVX2
// (batch 1 and 64, context 512; the old file's anonymous namespace had kept it apart).
template <int C, typename T>
[[gnu::noinline]] void head_scores(const Call<T>& c, int64_t s, int64_t g, int64_t first,
                                   int64_t ctx, float* scores, int64_t n, bool ahead,
                                   RowStream* next = nullptr) {
  constexpr int H = kHeadsPerPass<C>;
  const int64_t dim = 32 * C, h_base = g * c.group, row = c.kv_heads * dim;
  const F32x16 scale = vec::set1(c.scale);
  for (int64_t h0 = 0; h0 < c.group; h0 += H) {
    const int64_t nh = std::min<int64_t>(H, c.group - h0);
    typename Lanes<T>::Q q[H][C];
    for (int i = 0; i < H; ++i) {
      const T* qh = c.q + s * c.q_s0 + (h_base + h0 + std::min<int64_t>(i, nh - 1)) * c.q_s1;
      for (int j = 0; j < C; ++j) q[i][j] = Lanes<T>::load_q(qh + 32 * j);
    }
    const bool lead = ahead && h0 == 0;
    for_each_run_ahead(c.tables + s * c.bt_s0, c.block_size, first, ctx,
                       lead ? reinterpret_cast<const char*>(c.k) : nullptr,
                       reinterpret_cast<const char*>(c.v), block_bytes(c, dim), kAheadBlocks,
                       [&](int64_t p, int64_t slot, int64_t count) {
      const T* kr = c.k + (slot * c.kv_heads + g) * dim;
      int64_t r0 = 0;
      for (; r0 + 16 <= count; r0 += 16) {
        if (next != nullptr) next->pump();
        for (int i = 0; i < H; ++i) {
          if (i >= nh) break;
          F32x16 dots[16];
          for (int r = 0; r < 16; ++r) {
            const T* kt = kr + (r0 + r) * row;
            F32x16 dot = Lanes<T>::dot(vec::zero(), q[i][0], Lanes<T>::load_q(kt));
            for (int j = 1; j < C; ++j) {
              dot = Lanes<T>::dot(dot, q[i][j], Lanes<T>::load_q(kt + 32 * j));
            }
            dots[r] = dot;
          }
          vec::store(scores + (h0 + i) * n + p + r0, vec::sum16(dots) * scale);
        }
      }
      for (; r0 < count; ++r0) {
        const T* kt = kr + r0 * row;
        typename Lanes<T>::Q k[C];  // the K row once, for every query head of the pass
        for (int j = 0; j < C; ++j) k[j] = Lanes<T>::load_q(kt + 32 * j);
        for (int i = 0; i < H; ++i) {
          if (i >= nh) break;
          F32x16 dot = Lanes<T>::dot(vec::zero(), q[i][0], k[0]);
          for (int j = 1; j < C; ++j) dot = Lanes<T>::dot(dot, q[i][j], k[j]);
          scores[(h0 + i) * n + p + r0] = vec::reduce_add(dot) * c.scale;
        }
      }
    });
  }
}

// The weighted sum of V rows for KV head g's query heads, normalised, into the output: per
// pass of heads, kValueSlices passes over the rows, each accumulating kValueVectors columns.
template <int C, typename T>
void head_values(const Call<T>& c, int64_t s, int64_t g, int64_t first, int64_t ctx,
                 const float* weights, const float* sums, int64_t n, float* raw = nullptr,
                 int64_t raw_stride = 0, RowStream* next = nullptr) {
  constexpr int H = kHeadsPerPass<C>, V = kValueVectors<C>;
  const int64_t dim = 32 * C, h_base = g * c.group;
  for (int64_t h0 = 0; h0 < c.group; h0 += H) {
    const int64_t nh = std::min<int64_t>(H, c.group - h0);
    for (int j0 = 0; j0 < 2 * C; j0 += V) {  // this slice: columns 16 j0 .. 16 (j0 + V)
      F32x16 acc[H][V];
      for (int i = 0; i < H; ++i)
        for (int j = 0; j < V; ++j) acc[i][j] = vec::zero();
      // Each run of slots (a block's) accumulates in a copy of its own: accumulated in place,
      // GCC stored the 16 vectors back every row (RowStream::pump's stores in the loop), 1.5x
      // the bf16 kernel's time at batch 64.
      for_each_run(c.tables + s * c.bt_s0, c.block_size, first, ctx,
                   [&](int64_t p0, int64_t slot0, int64_t count) {
        F32x16 a[H][V];
        for (int i = 0; i < H; ++i)
          for (int j = 0; j < V; ++j) a[i][j] = acc[i][j];
        const T* vr = c.v + (slot0 * c.kv_heads + g) * dim + 16 * j0;
        for (int64_t p = p0; p < p0 + count; ++p, vr += c.kv_heads * dim) {
          if (next != nullptr) next->pump();
          F32x16 w[H];
          for (int i = 0; i < H; ++i) w[i] = vec::set1(i < nh ? weights[(h0 + i) * n + p] : 0.0f);
          for (int j = 0; j < V; ++j) {
            const F32x16 v = vec::load(vr + 16 * j);
            for (int i = 0; i < H; ++i) a[i][j] = vec::fma(w[i], v, a[i][j]);
          }
        }
        for (int i = 0; i < H; ++i)
          for (int j = 0; j < V; ++j) acc[i][j] = a[i][j];
      });
      // a part's unnormalised sums instead, query head h0 + i's at raw + (h0 + i) x raw_stride
      // (loops to the constant H: acc indexed by constants only stays in registers)
      for (int i = 0; i < H; ++i) {
        if (i >= nh) break;
        if (raw != nullptr) {
          for (int j = 0; j < V; ++j) {
            vec::store(raw + (h0 + i) * raw_stride + 16 * (j0 + j), acc[i][j]);
          }
          continue;
        }
        const float sum = sums[h0 + i];
        const F32x16 norm = vec::set1(sum > 0.0f ? c.v_scale / sum : 0.0f);
        T* o = c.o + s * c.o_s0 + (h_base + h0 + i) * c.o_s1 + 16 * j0;
        for (int j = 0; j < V; ++j) vec::store(o + 16 * j, acc[i][j] * norm);
      }
    }
  }
}

// The least context a part of a split sequence reads.
constexpr int64_t kMinPartKeys = 512;

// Parts to split each sequence's keys into: 1 unless the batch has too few (sequence, KV
// heads) items for the threads and a context long enough (a chat at batch 1: SmolLM2's 3 KV
// heads on 2 threads left one thread idle for a third of each step).
template <typename T>
int64_t key_parts(const Call<T>& c, int64_t num_seqs, int64_t items) {
  const int64_t threads = num_threads();
  if (items >= 2 * threads) return 1;
  int64_t longest = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t ctx = c.lens[s];
    longest = std::max(longest, c.window > 0 ? std::min(ctx, c.window) : ctx);
  }
  int64_t parts = (4 * threads + items - 1) / items;
  while ((items * parts) % threads != 0) ++parts;  // every thread the same number of runs
  return std::max<int64_t>(1, std::min(parts, longest / kMinPartKeys));
}

// Flash-decoding: each item's keys in `parts` runs, each run's rows written unnormalised with
// their max and sum, then merged per query head.
template <int C, typename T>
void run_split(const Call<T>& c, int64_t num_seqs, const WorkSplit& split, int64_t parts) {
  constexpr int64_t dim = 32 * C, stride = dim + 2;  // a partial: sums, max, sum
  const int64_t heads = c.kv_heads * c.group;
  std::vector<float> own;
  float* const partials = shared_floats(own, num_seqs * heads * parts * stride);
  split_for(0, num_seqs * split.chunks * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, sums(c.group), maxes(c.group);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t item = work / parts, part = work % parts;
      const int64_t s = item / split.chunks, g0 = (item % split.chunks) * split.per_chunk;
      const int64_t g1 = std::min(c.kv_heads, g0 + split.per_chunk);
      const int64_t ctx = c.lens[s];
      const int64_t first = c.window > 0 ? std::max<int64_t>(0, ctx - c.window) : 0;
      const int64_t per = ((ctx - first + parts - 1) / parts + 15) / 16 * 16;
      const int64_t k0 = std::min(ctx, first + part * per), k1 = std::min(ctx, k0 + per);
      scores.resize(c.group * std::max<int64_t>(k1 - k0, 1));
      for (int64_t g = g0; g < g1; ++g) {
        float* raw = partials + ((s * heads + g * c.group) * parts + part) * stride;
        if (k1 == k0) {  // an empty part (a short sequence): no weight in the merge
          for (int64_t i = 0; i < c.group; ++i) raw[i * parts * stride + dim] = -INFINITY;
          continue;
        }
        const bool ahead = g == g0 && split.per_chunk == c.kv_heads;
        head_scores<C, T>(c, s, g, k0, k1, scores.data(), k1 - k0, ahead);
        softmax_numerators(scores.data(), c.group, k1 - k0, sums.data(), maxes.data());
        head_values<C, T>(c, s, g, k0, k1, scores.data(), sums.data(), k1 - k0, raw,
                       parts * stride);
        for (int64_t i = 0; i < c.group; ++i) {
          float* pr = raw + i * parts * stride;
          pr[dim] = maxes[i];
          pr[dim + 1] = sums[i];
        }
      }
    }
  });
  split_for(0, num_seqs * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* pr = partials + row * parts * stride;
      float mx = -INFINITY, sum = 0.0f;
      for (int64_t p = 0; p < parts; ++p) mx = std::max(mx, pr[p * stride + dim]);
      F32x16 acc[2 * C];
      for (int j = 0; j < 2 * C; ++j) acc[j] = vec::zero();
      for (int64_t p = 0; p < parts && mx != -INFINITY; ++p) {
        const float* part = pr + p * stride;
        if (part[dim] == -INFINITY) continue;
        const float w = exp_nonpositive(part[dim] - mx);
        sum += w * part[dim + 1];
        for (int j = 0; j < 2 * C; ++j) {
          acc[j] = vec::fma(vec::set1(w), vec::load(part + 16 * j), acc[j]);
        }
      }
      const F32x16 norm = vec::set1(sum > 0.0f ? c.v_scale / sum : 0.0f);
      T* o = c.o + (row / heads) * c.o_s0 + (row % heads) * c.o_s1;
      for (int j = 0; j < 2 * C; ++j) vec::store(o + 16 * j, acc[j] * norm);
    }
  });
}

template <int C, typename T>
void run(const Call<T>& c, int64_t num_seqs) {
  const WorkSplit split(num_seqs, c.kv_heads, num_threads());
  const int64_t parts = key_parts(c, num_seqs, num_seqs * split.chunks);
  if (parts > 1) return run_split<C, T>(c, num_seqs, split, parts);
  split_for(0, num_seqs * split.chunks, 1, [&](int64_t begin, int64_t end) {
    // each thread's scores kept from call to call: no allocation per thread and layer
    thread_local std::vector<float> scores, sums;
    sums.resize(c.group);
    RowStream stream;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / split.chunks, g0 = (item % split.chunks) * split.per_chunk;
      const int64_t g1 = std::min(c.kv_heads, g0 + split.per_chunk);
      const int64_t ctx = c.lens[s];
      const int64_t first = c.window > 0 ? std::max<int64_t>(0, ctx - c.window) : 0;
      const int64_t n = ctx - first;
      scores.resize(c.group * std::max<int64_t>(n, 1));
      const bool whole = split.per_chunk == c.kv_heads;  // the item reads whole rows
      RowStream* next = nullptr;
      if (whole && item + 1 < end) {
        const int64_t ns = s + 1, nctx = c.lens[ns];
        const int64_t nfirst = c.window > 0 ? std::max<int64_t>(0, nctx - c.window) : 0;
        // pumps: per KV head and pass of kHeadsPerPass query heads, one per 16-key group and
        // one per value row and slice
        const int64_t passes = (c.group + kHeadsPerPass<C> - 1) / kHeadsPerPass<C>;
        stream.aim(reinterpret_cast<const char*>(c.k), reinterpret_cast<const char*>(c.v),
                   c.tables + ns * c.bt_s0, c.block_size, nfirst, nctx, block_bytes(c, 32 * C),
                   (g1 - g0) * passes * (n / 16 + kValueSlices<C> * n));
        next = &stream;
      }
      for (int64_t g = g0; g < g1; ++g) {
        const bool ahead = g == g0 && whole && item == begin;
        head_scores<C, T>(c, s, g, first, ctx, scores.data(), n, ahead, next);
        softmax_numerators(scores.data(), c.group, n, sums.data());
        head_values<C, T>(c, s, g, first, ctx, scores.data(), sums.data(), n, nullptr, 0, next);
      }
    }
  });
}

// The call for head size dim (64, 128 or 256: whether the kernel applies is the caller's test).
template <typename T>
void run_dim(const Call<T>& c, int64_t num_seqs, int64_t dim) {
  if (dim == 64) run<2, T>(c, num_seqs);
  else if (dim == 128) run<4, T>(c, num_seqs);
  else run<8, T>(c, num_seqs);
}

}  // namespace decode_fast
}  // namespace kvserve
