// Paged attention for a mixed batch (prefill chunks beside decodes), reading K/V in place
// through the block table: the torch path copied each chunk's whole context out of the blocks
// (index_select) before SDPA, which deep into a long prompt cost more than the attention.
//
// A work item is one sequence's KV head and a tile of its query tokens; the tile's rows (its
// tokens x the query heads sharing the KV head) walk the context in tiles of kKeys keys,
// flash-attention style: scores, the causal (and sliding-window) mask by position, an online
// softmax (running max and sum per row, the accumulators rescaled when the max grows) and the
// values, accumulated in float, each K/V tile converted once for all rows. The loops run across
// 16 query rows per vector; over a bfloat16 cache with AVX512-BF16 the scores and values take
// bf16 dot products (varlen_bf16.h), elsewhere float FMAs. Query token i of a sequence
// with q_len tokens and context ctx sits at position ctx - q_len + i and sees keys at
// positions <= its own (and > position - window with a window).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "convert.h"
#include "ops.h"
#include "paged.h"
#include "varlen_bf16.h"

namespace kvserve {
namespace {

using namespace varlen;  // the tile sizes and the AVX512-BF16 tiles (varlen_bf16.h)

// s[j][l] = k[j] . q[l] for the lanes of one 16-row group; qt holds the rows transposed
// ([dim][lanes], this group's columns at qt), kr the tile's keys as rows ([kKeys][dim]).
inline void tile_scores(const float* qt, int64_t stride, const float* kr, int64_t n,
                        int64_t dim, float* s) {
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    float acc[kBlock][kLanes] = {};
    for (int64_t d = 0; d < dim; ++d) {
      const float* qd = qt + d * stride;
      for (int64_t k = 0; k < kBlock; ++k) {
        const float kv = kr[(j0 + k) * dim + d];
#pragma omp simd
        for (int64_t l = 0; l < kLanes; ++l) acc[k][l] += kv * qd[l];
      }
    }
    for (int64_t k = 0; k < kBlock && j0 + k < n; ++k) {
      std::copy(acc[k], acc[k] + kLanes, s + (j0 + k) * kLanes);
    }
  }
}


// at[d][l] += sum_j p[j][l] v[j][d] for one 16-row group (at: [dim][lanes] at its columns).
inline void tile_values(const float* p, const float* vr, int64_t n, int64_t dim, float* at,
                        int64_t stride) {
  for (int64_t d0 = 0; d0 < dim; d0 += kBlock) {
    float acc[kBlock][kLanes];
    for (int64_t k = 0; k < kBlock; ++k) std::copy(at + (d0 + k) * stride,
                                                  at + (d0 + k) * stride + kLanes, acc[k]);
    for (int64_t j = 0; j < n; ++j) {
      const float* pj = p + j * kLanes;
      for (int64_t k = 0; k < kBlock; ++k) {
        const float vv = vr[j * dim + d0 + k];
#pragma omp simd
        for (int64_t l = 0; l < kLanes; ++l) acc[k][l] += vv * pj[l];
      }
    }
    for (int64_t k = 0; k < kBlock; ++k) std::copy(acc[k], acc[k] + kLanes,
                                                  at + (d0 + k) * stride);
  }
}

struct Item {
  int64_t seq, kv_head, t0, t1;  // query tokens t0..t1-1 of the sequence
  int64_t cost;                  // rows x keys read, for the order items are taken in
};

// Query tokens per item: the most (up to 32) that still make the work at least twice as many
// of the biggest items as there are threads, so that a long chunk beside a few decodes still
// spreads over the threads (fewer tokens per item: each item converts its K/V tiles again).
int64_t tile_tokens(const std::vector<int64_t>& q_lens, const int32_t* lens, int64_t kv_heads,
                    int64_t threads) {
  int64_t total = 0, biggest = 0;
  for (size_t s = 0; s < q_lens.size(); ++s) {
    total += kv_heads * q_lens[s] * lens[s];
    biggest = std::max<int64_t>(biggest, lens[s]);
  }
  int64_t t = 32;
  while (t > 1 && t * biggest * 2 * threads > total) t /= 2;
  return t;
}

// One item: its rows' outputs, by an online softmax over its context's key tiles.
template <typename QT, typename KT, bool kDot>
struct Varlen {
  const QT* q;
  QT* o;
  const KT *k, *v;
  const int32_t *tables, *lens, *starts;
  const float* table;
  int64_t q_s0, q_s1, o_s0, o_s1, bt_s0, block_size, kv_heads, group, dim, window;
  float scale, v_scale;

  void run(const Item& item, int64_t q_len, std::vector<float>& buf) const {
    const int64_t s = item.seq, g = item.kv_head, ctx = lens[s], first_pos = ctx - q_len;
    const int64_t rows = (item.t1 - item.t0) * group;
    const int64_t width = (rows + kLanes - 1) / kLanes * kLanes;  // rows padded to lanes
    buf.assign(2 * dim * width + 2 * kKeys * dim + kKeys * width + 3 * width, 0.0f);
    float *qt = buf.data(), *at = qt + dim * width, *kr = at + dim * width;
    float *vr = kr + kKeys * dim, *sc = vr + kKeys * dim, *m = sc + kKeys * width;
    float *l = m + width, *pos = l + width;
    for (int64_t r = 0; r < width; ++r) {
      m[r] = -INFINITY;
      pos[r] = r < rows ? static_cast<float>(first_pos + item.t0 + r / group) : -1.0f;
    }
    // bf16 dot products: the rows' unscaled (d, d+1) pairs in qt's room, the scale applied
    // to the scores; else the scaled rows in float.
    uint32_t* q2 = reinterpret_cast<uint32_t*>(qt);
    for (int64_t r = 0; r < rows; ++r) {
      const QT* qr = q + (starts[s] + item.t0 + r / group) * q_s0 + (g * group + r % group) * q_s1;
      if constexpr (kDot) {
        for (int64_t i = 0; i < dim / 2; ++i) std::memcpy(q2 + i * width + r, qr + 2 * i, 4);
      } else {
        for (int64_t d = 0; d < dim; ++d) qt[d * width + r] = to_f(qr[d]) * scale;
      }
    }
    const uint32_t* kp[kKeys];
    const KT* vp[kKeys];
    const int64_t key_end = first_pos + item.t1;  // the last token's position + 1
    const int64_t key_first =
        window > 0 ? std::max<int64_t>(0, first_pos + item.t0 - window + 1) : 0;
    const int32_t* table_row = tables + s * bt_s0;
    for (int64_t kb = key_first; kb < key_end; kb += kKeys) {
      const int64_t n = std::min(kKeys, key_end - kb);
      for_each_slot(table_row, block_size, kb, kb + n, [&](int64_t j, int64_t slot) {
        const KT* key = k + (slot * kv_heads + g) * dim;
        if constexpr (kDot) {
          kp[j] = reinterpret_cast<const uint32_t*>(key);
        } else {
          load_row<KT>(key, kr + j * dim, dim, table);
        }
        if constexpr (kDot) {
          vp[j] = v + (slot * kv_heads + g) * dim;
        } else {
          load_row<KT>(v + (slot * kv_heads + g) * dim, vr + j * dim, dim, table);
        }
      });
      if constexpr (kDot) pair_values(vp, n, dim, reinterpret_cast<uint32_t*>(vr));
      for (int64_t c = 0; c < width; c += kLanes) {
        if (kb > pos[std::min(rows, c + kLanes) - 1]) continue;  // the tile is past every row
        if constexpr (kDot) {
          tile_scores_bf16(q2 + c, width, kp, n, dim, sc + c * kKeys);
        } else {
          tile_scores(qt + c, width, kr, n, dim, sc + c * kKeys);
        }
        softmax_tile(sc + c * kKeys, n, kb, kDot ? scale : 1.0f, pos + c, m + c, l + c, at + c,
                     width);
        if constexpr (kDot) {
          tile_values_bf16(sc + c * kKeys, reinterpret_cast<const uint32_t*>(vr), n, dim, at + c,
                           width);
        } else {
          tile_values(sc + c * kKeys, vr, n, dim, at + c, width);
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      QT* out = o + (starts[s] + item.t0 + r / group) * o_s0 + (g * group + r % group) * o_s1;
      const float norm = l[r] > 0.0f ? v_scale / l[r] : 0.0f;
      for (int64_t d = 0; d < dim; ++d) out[d] = from_f<QT>(at[d * width + r] * norm);
    }
  }

  // Masks a group's scores by position, turns them into this tile's probabilities against
  // each row's running max, and rescales its sums and accumulators where the max grew.
  void softmax_tile(float* sc, int64_t n, int64_t kb, float score_scale, const float* pos,
                    float* m, float* l, float* at, int64_t stride) const {
    float mx[kLanes], corr[kLanes], sum[kLanes] = {};
    const float fwin = window > 0 ? static_cast<float>(window) : INFINITY;
    for (int64_t lane = 0; lane < kLanes; ++lane) mx[lane] = m[lane];
    for (int64_t j = 0; j < n; ++j) {
      const float key = static_cast<float>(kb + j);
#pragma omp simd
      for (int64_t lane = 0; lane < kLanes; ++lane) {
        const bool seen = key <= pos[lane] && key > pos[lane] - fwin;
        sc[j * kLanes + lane] = seen ? sc[j * kLanes + lane] * score_scale : -INFINITY;
        mx[lane] = std::max(mx[lane], sc[j * kLanes + lane]);
      }
    }
#pragma omp simd
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      corr[lane] = mx[lane] == -INFINITY ? 1.0f : exp_nonpositive(m[lane] - mx[lane]);
    }
    for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
      for (int64_t lane = 0; lane < kLanes; ++lane) {
        const float x = sc[j * kLanes + lane];
        const float p = x == -INFINITY ? 0.0f : exp_nonpositive(x - mx[lane]);
        sc[j * kLanes + lane] = p;
        sum[lane] += p;
      }
    }
#pragma omp simd
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      l[lane] = l[lane] * corr[lane] + sum[lane];
      m[lane] = mx[lane];
    }
    for (int64_t d = 0; d < dim; ++d) {
#pragma omp simd
      for (int64_t lane = 0; lane < kLanes; ++lane) at[d * stride + lane] *= corr[lane];
    }
  }
};

template <typename QT, typename KT, bool kDot>
void run_items(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
               const at::Tensor& v_cache, const at::Tensor& block_tables,
               const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
               int64_t window, double v_scale, const float* table);

template <typename QT, typename KT>
void varlen_kernel(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                   const at::Tensor& v_cache, const at::Tensor& block_tables,
                   const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                   int64_t window, double v_scale, const float* table) {
  // Scores and values by AVX512-BF16 dot products where the query and cache are bfloat16 and
  // the head size a multiple of 16; float FMAs otherwise.
  if constexpr (kHaveDotBf16 && std::is_same_v<QT, c10::BFloat16> &&
                std::is_same_v<KT, c10::BFloat16>) {
    if (query.size(2) % 16 == 0) {
      return run_items<QT, KT, true>(out, query, k_cache, v_cache, block_tables, seq_lens,
                                     query_start_loc, scale, window, v_scale, table);
    }
  }
  run_items<QT, KT, false>(out, query, k_cache, v_cache, block_tables, seq_lens,
                           query_start_loc, scale, window, v_scale, table);
}

template <typename QT, typename KT, bool kDot>
void run_items(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
               const at::Tensor& v_cache, const at::Tensor& block_tables,
               const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
               int64_t window, double v_scale, const float* table) {
  const int64_t num_seqs = seq_lens.size(0), kv_heads = k_cache.size(2);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const Varlen<QT, KT, kDot> call{
      query.data_ptr<QT>(), out.data_ptr<QT>(),
      reinterpret_cast<const KT*>(k_cache.data_ptr()),
      reinterpret_cast<const KT*>(v_cache.data_ptr()), block_tables.data_ptr<int32_t>(), lens,
      starts, table, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
      block_tables.stride(0), k_cache.size(1), kv_heads, query.size(1) / kv_heads,
      query.size(2), window, static_cast<float>(scale), static_cast<float>(v_scale)};

  std::vector<int64_t> q_lens(num_seqs);
  for (int64_t s = 0; s < num_seqs; ++s) q_lens[s] = starts[s + 1] - starts[s];
  const int64_t threads = at::get_num_threads();
  const int64_t tile = tile_tokens(q_lens, lens, kv_heads, threads);
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int64_t t0 = 0; t0 < q_lens[s]; t0 += tile) {
      const int64_t t1 = std::min(q_lens[s], t0 + tile);
      for (int64_t g = 0; g < kv_heads; ++g) {
        items.push_back({s, g, t0, t1, (t1 - t0) * (lens[s] - q_lens[s] + t1)});
      }
    }
  }
  // Largest first, taken by whichever thread is free: the work balances across the threads.
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t count = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min(threads, count), 1, [&](int64_t, int64_t) {
    std::vector<float> buf;
    for (int64_t i = next++; i < count; i = next++) {
      call.run(items[i], q_lens[items[i].seq], buf);
    }
  });
}

template <typename QT>
void varlen_for(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                const at::Tensor& v_cache, const at::Tensor& block_tables,
                const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                int64_t window, double v_scale) {
  const auto kind = k_cache.scalar_type();
  if (kind == at::ScalarType::Float8_e4m3fn) {
    varlen_kernel<QT, uint8_t>(out, query, k_cache, v_cache, block_tables, seq_lens,
                               query_start_loc, scale, window, v_scale,
                               fp8_table<c10::Float8_e4m3fn>());
  } else if (kind == at::ScalarType::Float8_e5m2) {
    varlen_kernel<QT, uint8_t>(out, query, k_cache, v_cache, block_tables, seq_lens,
                               query_start_loc, scale, window, v_scale,
                               fp8_table<c10::Float8_e5m2>());
  } else {
    TORCH_CHECK(kind == query.scalar_type(), "varlen_attention: a non-fp8 cache must have the "
                "query's dtype");
    varlen_kernel<QT, QT>(out, query, k_cache, v_cache, block_tables, seq_lens,
                          query_start_loc, scale, window, v_scale, nullptr);
  }
}

}  // namespace

void varlen_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                      double scale, int64_t sliding_window, double v_scale) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && out.stride(2) == 1,
              "query/out must be [tokens, heads, head_dim] with contiguous head_dim");
  TORCH_CHECK(query.size(2) == k_cache.size(3) && query.size(1) % k_cache.size(2) == 0,
              "query heads must be a multiple of the KV heads, head dims equal");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
              query_start_loc.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
              query_start_loc.is_contiguous() && block_tables.stride(1) == 1,
              "block_tables, seq_lens and query_start_loc must be int32");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_tables.size(0) >= num_seqs &&
              query_start_loc.data_ptr<int32_t>()[num_seqs] == query.size(0),
              "query_start_loc must have num_seqs + 1 entries ending at the token count");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
              "out must match query");
  switch (query.scalar_type()) {
    case at::kFloat:
      return varlen_for<float>(out, query, k_cache, v_cache, block_tables, seq_lens,
                               query_start_loc, scale, sliding_window, v_scale);
    case at::kBFloat16:
      return varlen_for<c10::BFloat16>(out, query, k_cache, v_cache, block_tables, seq_lens,
                                       query_start_loc, scale, sliding_window, v_scale);
    case at::kHalf:
      return varlen_for<c10::Half>(out, query, k_cache, v_cache, block_tables, seq_lens,
                                   query_start_loc, scale, sliding_window, v_scale);
    default:
      TORCH_CHECK(false, "varlen_attention: unsupported query dtype ", query.scalar_type());
  }
}

}  // namespace kvserve
