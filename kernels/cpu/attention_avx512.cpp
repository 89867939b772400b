// Paged decode attention over a bfloat16 or float32 cache with AVX-512 (the common CPU cases):
// the same work split and softmax as attention.cpp's generic kernel, with the two inner loops
// in registers.
//
//   scores  q . k straight from the cache's rows, sixteen keys of a block at a time reduced
//           together (sum16): `vdpbf16ps` on bf16 rows (products of two bf16 are exact in
//           float; sums in float, AVX512-BF16), fused multiply-adds on float rows (AVX512F);
//   values  each V row widened to float (bf16) or loaded (float) once per KV head and
//           accumulated into the output rows of several query heads held in registers.
//
// Head sizes 64, 128 and 256 (two, four or eight 32-wide chunks); anything else, and CPUs
// without the instructions, take the generic kernel. The float32 cache took the generic kernel
// until 2026-12-01: 2.5x (batch 1, 150 keys) to 7x (1000 keys) the bf16 kernel's time.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops.h"
#include "paged.h"
#include "team.h"

namespace kvserve {

#if defined(__AVX512F__) && defined(__AVX512BW__)
namespace {

template <typename T>
struct Call {
  const T *q, *k, *v;
  T* o;
  const int32_t *tables, *lens;
  int64_t q_s0, q_s1, o_s0, o_s1, bt_s0, block_size, kv_heads, group, window;
  float scale, v_scale;
};

// What the kernel needs of an element type, per 32-wide chunk of a row (Q: a query or key
// chunk in registers; dot: acc + q . k) or per 16 elements (load as float, store).
template <typename T>
struct Lanes;

template <>
struct Lanes<float> {
  struct Q { __m512 lo, hi; };
  static Q load_q(const float* p) { return {_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16)}; }
  static __m512 dot(__m512 acc, const Q& q, const Q& k) {
    return _mm512_fmadd_ps(q.hi, k.hi, _mm512_fmadd_ps(q.lo, k.lo, acc));
  }
  static __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
  static void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
};

#if defined(__AVX512BF16__)
template <>
struct Lanes<c10::BFloat16> {
  using Q = __m512bh;
  static Q load_q(const c10::BFloat16* p) {
    return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
  }
  static __m512 dot(__m512 acc, const Q& q, const Q& k) { return _mm512_dpbf16_ps(acc, q, k); }
  static __m512 load16(const c10::BFloat16* p) {  // 16 bf16 -> float
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
  }
  static void store16(c10::BFloat16* p, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  }
};
#endif

// Query heads per pass, so that a pass's vectors stay in registers: QK holds C chunks of each
// head's query, PV 2C float accumulators per head (both halve as the head size doubles).
template <int C>
constexpr int kHeadsPerPass = C <= 2 ? 4 : (C <= 4 ? 2 : 1);

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

// The sum of a's 16 lanes in the order GCC's _mm512_reduce_add_ps adds them (lane i with
// i + 8, then i + 4, then i + 2 and i + 1), written out so that `sum16` can match it.
inline float hsum(__m512 a) {
  const __m256 t3 = _mm256_add_ps(_mm512_extractf32x8_ps(a, 1), _mm512_castps512_ps256(a));
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_permute_ps(t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_movehdup_ps(t8));
}

// Lane r: hsum(a[r]), the same additions in the same order, for 16 vectors at once: 45
// shuffles and adds where 16 hsums take ~130 instructions, each a chain of dependent steps (at
// batch 1 a score's reduction held up its store: half of the scores' time, SmolLM2 on AVX-512).
inline __m512 sum16(const __m512 (&a)[16]) {
  __m512 b[8], c4[4], d[2];
  for (int i = 0; i < 8; ++i) {  // 128-bit lanes: a[2i]'s i and i+8 sums, then a[2i+1]'s
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lane L: vector 4i + L's four partial sums
    c4[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                          _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)));
  }
  for (int i = 0; i < 2; ++i) {  // lane L: two partial sums of vectors 8i + L and 8i + 4 + L
    const __m512d lo = _mm512_castps_pd(c4[2 * i]), hi = _mm512_castps_pd(c4[2 * i + 1]);
    d[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // element 4L + t holds vector 4t + L's sum
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, e);
}

// One sequence's KV head g: scores of its query heads h0..h0+nh (rows of `scores`, n each).
// Sixteen consecutive keys of a block at a time, one query head at a time, their dot products
// reduced together (sum16); the keys left over one by one, all heads of a pass per K row.
// A lead head (`ahead`, kAheadBlocks) asks for the whole K and V rows ahead of its keys; `next`
// (RowStream) is pumped once per 16-key group.
template <int C, typename T>
void head_scores(const Call<T>& c, int64_t s, int64_t g, int64_t first, int64_t ctx,
                 float* scores, int64_t n, bool ahead, RowStream* next = nullptr) {
  constexpr int H = kHeadsPerPass<C>;
  const int64_t dim = 32 * C, h_base = g * c.group, row = c.kv_heads * dim;
  const __m512 scale = _mm512_set1_ps(c.scale);
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
          __m512 dots[16];
          for (int r = 0; r < 16; ++r) {
            const T* kt = kr + (r0 + r) * row;
            __m512 dot = Lanes<T>::dot(_mm512_setzero_ps(), q[i][0], Lanes<T>::load_q(kt));
            for (int j = 1; j < C; ++j) {
              dot = Lanes<T>::dot(dot, q[i][j], Lanes<T>::load_q(kt + 32 * j));
            }
            dots[r] = dot;
          }
          _mm512_storeu_ps(scores + (h0 + i) * n + p + r0, _mm512_mul_ps(sum16(dots), scale));
        }
      }
      for (; r0 < count; ++r0) {
        const T* kt = kr + r0 * row;
        typename Lanes<T>::Q k[C];  // the K row once, for every query head of the pass
        for (int j = 0; j < C; ++j) k[j] = Lanes<T>::load_q(kt + 32 * j);
        for (int i = 0; i < H; ++i) {
          if (i >= nh) break;
          __m512 dot = Lanes<T>::dot(_mm512_setzero_ps(), q[i][0], k[0]);
          for (int j = 1; j < C; ++j) dot = Lanes<T>::dot(dot, q[i][j], k[j]);
          scores[(h0 + i) * n + p + r0] = hsum(dot) * c.scale;
        }
      }
    });
  }
}

// The weighted sum of V rows for KV head g's query heads, normalised, into the output.
template <int C, typename T>
void head_values(const Call<T>& c, int64_t s, int64_t g, int64_t first, int64_t ctx,
                 const float* weights, const float* sums, int64_t n, float* raw = nullptr,
                 int64_t raw_stride = 0, RowStream* next = nullptr) {
  constexpr int H = kHeadsPerPass<C>;
  const int64_t dim = 32 * C, h_base = g * c.group;
  for (int64_t h0 = 0; h0 < c.group; h0 += H) {
    const int64_t nh = std::min<int64_t>(H, c.group - h0);
    __m512 acc[H][2 * C];
    for (int i = 0; i < H; ++i)
      for (int j = 0; j < 2 * C; ++j) acc[i][j] = _mm512_setzero_ps();
    for_each_slot(c.tables + s * c.bt_s0, c.block_size, first, ctx, [&](int64_t p, int64_t slot) {
      const T* vr = c.v + (slot * c.kv_heads + g) * dim;
      if (next != nullptr) next->pump();
      __m512 w[H];
      for (int i = 0; i < H; ++i) w[i] = _mm512_set1_ps(i < nh ? weights[(h0 + i) * n + p] : 0.0f);
      for (int j = 0; j < 2 * C; ++j) {
        const __m512 v = Lanes<T>::load16(vr + 16 * j);
        for (int i = 0; i < H; ++i) acc[i][j] = _mm512_fmadd_ps(w[i], v, acc[i][j]);
      }
    });
    // a part's unnormalised sums instead, query head h0 + i's at raw + (h0 + i) x raw_stride
    for (int64_t i = 0; i < nh && raw != nullptr; ++i) {
      for (int j = 0; j < 2 * C; ++j) {
        _mm512_storeu_ps(raw + (h0 + i) * raw_stride + 16 * j, acc[i][j]);
      }
    }
    for (int64_t i = 0; i < nh && raw == nullptr; ++i) {
      const float sum = sums[h0 + i];
      const __m512 norm = _mm512_set1_ps(sum > 0.0f ? c.v_scale / sum : 0.0f);
      T* o = c.o + s * c.o_s0 + (h_base + h0 + i) * c.o_s1;
      for (int j = 0; j < 2 * C; ++j) Lanes<T>::store16(o + 16 * j, _mm512_mul_ps(acc[i][j], norm));
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
  const int64_t threads = at::get_num_threads();
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
      __m512 acc[2 * C];
      for (int j = 0; j < 2 * C; ++j) acc[j] = _mm512_setzero_ps();
      for (int64_t p = 0; p < parts && mx != -INFINITY; ++p) {
        const float* part = pr + p * stride;
        if (part[dim] == -INFINITY) continue;
        const float w = exp_nonpositive(part[dim] - mx);
        sum += w * part[dim + 1];
        for (int j = 0; j < 2 * C; ++j) {
          acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(w), _mm512_loadu_ps(part + 16 * j), acc[j]);
        }
      }
      const __m512 norm = _mm512_set1_ps(sum > 0.0f ? c.v_scale / sum : 0.0f);
      T* o = c.o + (row / heads) * c.o_s0 + (row % heads) * c.o_s1;
      for (int j = 0; j < 2 * C; ++j) Lanes<T>::store16(o + 16 * j, _mm512_mul_ps(acc[j], norm));
    }
  });
}

template <int C, typename T>
void run(const Call<T>& c, int64_t num_seqs) {
  const WorkSplit split(num_seqs, c.kv_heads, at::get_num_threads());
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
        // one per value row
        const int64_t passes = (c.group + kHeadsPerPass<C> - 1) / kHeadsPerPass<C>;
        stream.aim(reinterpret_cast<const char*>(c.k), reinterpret_cast<const char*>(c.v),
                   c.tables + ns * c.bt_s0, c.block_size, nfirst, nctx, block_bytes(c, 32 * C),
                   (g1 - g0) * passes * (n / 16 + n));
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

template <typename T>
void run_for(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
             const at::Tensor& v_cache, const at::Tensor& block_tables,
             const at::Tensor& seq_lens, double scale, int64_t window, double v_scale) {
  const Call<T> c{query.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                  out.data_ptr<T>(), block_tables.data_ptr<int32_t>(),
                  seq_lens.data_ptr<int32_t>(), query.stride(0), query.stride(1),
                  out.stride(0), out.stride(1), block_tables.stride(0), k_cache.size(1),
                  k_cache.size(2), query.size(1) / k_cache.size(2), window,
                  static_cast<float>(scale), static_cast<float>(v_scale)};
  const int64_t num_seqs = query.size(0), dim = query.size(2);
  if (dim == 64) run<2, T>(c, num_seqs);
  else if (dim == 128) run<4, T>(c, num_seqs);
  else run<8, T>(c, num_seqs);
}

}  // namespace

bool decode_attention_avx512(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, double scale, int64_t window,
                             double v_scale) {
  const int64_t dim = query.size(2);
  const auto dtype = query.scalar_type();
  if (k_cache.scalar_type() != dtype || (dim != 64 && dim != 128 && dim != 256)) return false;
  if (dtype == at::kFloat) {
    run_for<float>(out, query, k_cache, v_cache, block_tables, seq_lens, scale, window, v_scale);
    return true;
  }
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) {
    run_for<c10::BFloat16>(out, query, k_cache, v_cache, block_tables, seq_lens, scale, window,
                           v_scale);
    return true;
  }
#endif
  return false;
}

#else

bool decode_attention_avx512(at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                             int64_t, double) {
  return false;
}

#endif

}  // namespace kvserve
