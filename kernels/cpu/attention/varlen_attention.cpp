// Paged attention for a mixed batch (prefill chunks beside decodes), reading K/V in place
// through the block table: the torch path copied each chunk's whole context out of the blocks
// (index_select) before SDPA, which deep into a long prompt cost more than the attention.
//
// A work item is one sequence's KV head and a tile of its query tokens; the tile's rows (its
// tokens x the query heads sharing the KV head) walk the context in tiles of kKeys keys,
// flash-attention style: scores, the causal (and sliding-window) mask by position, an online
// softmax (running max and sum per row, the accumulators rescaled when the max grows) and the
// values, accumulated in float, each K/V tile converted once for all rows. The loops run across
// 16 query rows per vector; over a bfloat16 cache the scores and values take bf16 dot
// products (AVX512-BF16's, else emulated in float FMAs), over other caches float FMAs (the
// inner loops: varlen_tiles.h, over the vector layer). Query token i of a sequence with q_len
// tokens and context ctx sits at position ctx - q_len + i and sees keys at positions <= its
// own (and > position - window with a window). Decode rows of the batch go through
// decode_attention.

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
#include <utility>
#include <vector>

#include "convert.h"
#include "ops.h"
#include "attention/paged.h"
#include "attention/varlen_tiles.h"

namespace kvserve {
namespace {

using namespace varlen;  // the tiles' inner loops (varlen_tiles.h)

struct Item {
  int64_t seq, t0, t1;  // query tokens t0..t1-1 of the sequence, with every KV head
  int64_t k0, k1;       // the part of their context this item reads (key positions)
  int64_t cost;         // rows x keys read, for the order items are taken in
  int64_t part;         // -1: writes the output; else KV head 0's slot among the partials
  int64_t parts;        // the parts its tile's context was split into: head g's slot is
                        // part + g x parts
};

constexpr int64_t kTileTokens = 32;     // query tokens per item (at most)
constexpr int64_t kMinSplitKeys = 256;  // the least context a split-off item reads
constexpr int64_t kAheadTiles = 2;      // key tiles between a tile's read and its prefetch
                                        // (TileStream, paged.h; 1, 4 and 8 were no better)

// Keys a tile of query tokens t0..t1-1 reads: its first token's window start to its last
// token's position.
inline std::pair<int64_t, int64_t> key_range(int64_t first_pos, int64_t t0, int64_t t1,
                                             int64_t window) {
  const int64_t first = window > 0 ? std::max<int64_t>(0, first_pos + t0 - window + 1) : 0;
  return {first, first_pos + t1};
}

// One item: its rows' outputs (or, for a part of a split context, its unnormalised partial
// sums with their running max and sum), by an online softmax over its keys' tiles.
template <typename QT, typename KT, bool kDot>
struct Varlen {
  const QT* q;
  QT* o;
  const KT *k, *v;
  const int32_t *tables, *lens, *starts;
  const float* table;
  int64_t q_s0, q_s1, o_s0, o_s1, bt_s0, block_size, kv_heads, group, dim, window;
  float scale, v_scale;

  // Every KV head of the item walks the same key tiles, one head after the other per tile:
  // a cache row holds all KV heads of its slot side by side, so a tile's rows are read whole.
  // (Items of one head each read a third of every row, SmolLM2's 128 bytes of 384: from a
  // cold cache that read was 3.4x slower than whole rows, and a 4-token chunk at context
  // 7,800 took 36 ms of attention per step cold against 15 ms warm.)
  void run(const Item& item, int64_t q_len, std::vector<float>& buf, float* partial,
           int64_t partial_stride) const {
    const int64_t s = item.seq, ctx = lens[s], first_pos = ctx - q_len;
    const int64_t rows = (item.t1 - item.t0) * group;
    const int64_t width = (rows + kLanes - 1) / kLanes * kLanes;  // rows padded to lanes
    const int64_t per_head = 2 * dim * width + 2 * width;  // q rows, accumulators, max, sum
    buf.assign(kv_heads * per_head + 2 * kKeys * dim + kKeys * width + 2 * width, 0.0f);
    float *kr = buf.data() + kv_heads * per_head, *vr = kr + kKeys * dim;
    float *sc = vr + kKeys * dim, *pos = sc + kKeys * width, *corr = pos + width;
    const auto head = [&](int64_t g) { return buf.data() + g * per_head; };  // its q rows
    for (int64_t r = 0; r < width; ++r) {
      pos[r] = r < rows ? static_cast<float>(first_pos + item.t0 + r / group) : -1.0f;
    }
    for (int64_t g = 0; g < kv_heads; ++g) {
      float *qt = head(g), *m = qt + 2 * dim * width;
      for (int64_t r = 0; r < width; ++r) m[r] = -INFINITY;
      // bf16 dot products: the rows' unscaled (d, d+1) pairs in qt's room, the scale applied
      // to the scores; else the scaled rows in float.
      uint32_t* q2 = reinterpret_cast<uint32_t*>(qt);
      for (int64_t r = 0; r < rows; ++r) {
        const QT* qr =
            q + (starts[s] + item.t0 + r / group) * q_s0 + (g * group + r % group) * q_s1;
        if constexpr (kDot) {
          for (int64_t i = 0; i < dim / 2; ++i) std::memcpy(q2 + i * width + r, qr + 2 * i, 4);
        } else {
          for (int64_t d = 0; d < dim; ++d) qt[d * width + r] = to_f(qr[d]) * scale;
        }
      }
    }
    const uint32_t* kp[kKeys];
    const KT* vp[kKeys];
    const int32_t* table_row = tables + s * bt_s0;
    TileStream ahead;
    for (int64_t kb = item.k0; kb < item.k1; kb += kKeys) {
      const int64_t n = std::min(kKeys, item.k1 - kb);
      ahead.aim(table_row, block_size, kb + kAheadTiles * kKeys,
                std::min(item.k1, kb + (kAheadTiles + 1) * kKeys), kv_heads * dim * sizeof(KT),
                kv_heads);
      for (int64_t g = 0; g < kv_heads; ++g) {
        float *qt = head(g), *at = qt + dim * width, *m = at + dim * width, *l = m + width;
        ahead.pump(reinterpret_cast<const char*>(k), reinterpret_cast<const char*>(v));
        for_each_slot(table_row, block_size, kb, kb + n, [&](int64_t j, int64_t slot) {
          const KT* key = k + (slot * kv_heads + g) * dim;
          const KT* value = v + (slot * kv_heads + g) * dim;
          if constexpr (kDot) {
            kp[j] = reinterpret_cast<const uint32_t*>(key);
            vp[j] = value;
          } else {  // copied even from a float cache: from a cold cache the copy's streaming
                    // reads beat the loops reading rows in place (measured: 64-68 against
                    // 78-85 ms for a 16-token chunk at context 7,800 over 30 layers)
            load_row<KT>(key, kr + j * dim, dim, table);
            load_row<KT>(value, vr + j * dim, dim, table);
          }
        });
        if constexpr (kDot) pair_values(vp, n, dim, reinterpret_cast<uint32_t*>(vr));
        for (int64_t c = 0; c < width;) {
          if (kb > pos[std::min(rows, c + kLanes) - 1]) {  // the tile is past every row
            c += kLanes;
            continue;
          }
          // Later groups hold later positions: a group that sees this tile is followed by
          // groups that see it too, and two go through the float loops together.
          const int64_t groups = !kDot && c + 2 * kLanes <= width ? 2 : 1;
          const int64_t ld = groups * kLanes;
          float* s_c = sc + c * kKeys;  // [kKeys][ld]
          if constexpr (kDot) {
            tile_scores_bf16(reinterpret_cast<const uint32_t*>(qt) + c, width, kp, n, dim, s_c);
          } else if (groups == 2) {
            tile_scores<2>(qt + c, width, kr, n, dim, s_c);
          } else {
            tile_scores<1>(qt + c, width, kr, n, dim, s_c);
          }
          for (int64_t h = 0; h < groups; ++h) {
            const int64_t r = c + h * kLanes;
            softmax_tile(s_c + h * kLanes, ld, n, kb, kDot ? scale : 1.0f, pos + r, m + r,
                         l + r, corr + r, window);
          }
          if constexpr (kDot) {
            tile_values_bf16(s_c, reinterpret_cast<const uint32_t*>(vr), n, dim, corr + c,
                             at + c, width);
          } else if (groups == 2) {
            tile_values<2>(s_c, vr, n, dim, corr + c, at + c, width);
          } else {
            tile_values<1>(s_c, vr, n, dim, corr + c, at + c, width);
          }
          c += ld;
        }
      }
    }
    for (int64_t g = 0; g < kv_heads; ++g) {
      const float *at = head(g) + dim * width, *m = at + dim * width, *l = m + width;
      for (int64_t r = 0; r < rows; ++r) {
        if (partial != nullptr) {  // per head: rows x (dim sums, max, sum)
          float* pr = partial + g * partial_stride + r * (dim + 2);
          for (int64_t d = 0; d < dim; ++d) pr[d] = at[d * width + r];
          pr[dim] = m[r];
          pr[dim + 1] = l[r];
          continue;
        }
        QT* out =
            o + (starts[s] + item.t0 + r / group) * o_s0 + (g * group + r % group) * o_s1;
        const float norm = l[r] > 0.0f ? v_scale / l[r] : 0.0f;
        for (int64_t d = 0; d < dim; ++d) out[d] = from_f<QT>(at[d * width + r] * norm);
      }
    }
  }

  // The output rows of a tile of query tokens whose context was split over `item.parts`
  // items (a KV head's partials `stride` apart, the heads item.parts x stride apart): each
  // part's sums rescaled to the common max, over the parts' total sum.
  void merge(const Item& item, const float* partials, int64_t stride) const {
    const int64_t rows = (item.t1 - item.t0) * group, parts = item.parts;
    std::vector<float> acc(dim);
    for (int64_t g = 0; g < kv_heads; ++g) {
      const float* head_partials = partials + g * parts * stride;
      for (int64_t r = 0; r < rows; ++r) {
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t p = 0; p < parts; ++p) {
          mx = std::max(mx, head_partials[p * stride + r * (dim + 2) + dim]);
        }
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t p = 0; p < parts && mx != -INFINITY; ++p) {
          const float* pr = head_partials + p * stride + r * (dim + 2);
          if (pr[dim] == -INFINITY) continue;
          const float w = exp_nonpositive(pr[dim] - mx);
          sum += w * pr[dim + 1];
          for (int64_t d = 0; d < dim; ++d) acc[d] += w * pr[d];
        }
        const int64_t t = item.t0 + r / group, h = g * group + r % group;
        QT* out = o + (starts[item.seq] + t) * o_s0 + h * o_s1;
        const float norm = sum > 0.0f ? v_scale / sum : 0.0f;
        for (int64_t d = 0; d < dim; ++d) out[d] = from_f<QT>(acc[d] * norm);
      }
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
  // Scores and values by bf16 dot products (vec::dot_pairs, on every ISA: varlen_tiles.h)
  // where the query and cache are bfloat16 and the head size a multiple of 16; float FMAs
  // otherwise.
  if constexpr (std::is_same_v<QT, c10::BFloat16> && std::is_same_v<KT, c10::BFloat16>) {
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
  // Tiles of up to kTileTokens query tokens, with every KV head; a tile whose context is a
  // large share of the work (a short chunk deep into a long prompt) is split along its keys
  // into parts of at least kMinSplitKeys, so the threads share it without cutting its rows
  // (fewer rows per item would fill fewer vector lanes and read the context again per item).
  std::vector<Item> whole;
  int64_t total = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (q_lens[s] == 1) continue;  // decode rows: decode_attention (varlen_attention below)
    for (int64_t t0 = 0; t0 < q_lens[s]; t0 += kTileTokens) {
      const int64_t t1 = std::min(q_lens[s], t0 + kTileTokens);
      const auto [k0, k1] = key_range(lens[s] - q_lens[s], t0, t1, window);
      whole.push_back({s, t0, t1, k0, k1, (t1 - t0) * (k1 - k0) * kv_heads, -1, 1});
      total += whole.back().cost;
    }
  }
  const int64_t share = std::max<int64_t>(1, total / (4 * threads));
  std::vector<Item> items, merges;  // merges: each split tile, its partials from `part`
  int64_t num_partials = 0;
  for (const Item& item : whole) {
    const int64_t keys = item.k1 - item.k0;
    const int64_t split = std::min((item.cost + share - 1) / share, keys / kMinSplitKeys);
    if (split <= 1) {
      items.push_back(item);
      continue;
    }
    const int64_t per = (keys / split + kKeys - 1) / kKeys * kKeys;
    const int64_t parts = (keys + per - 1) / per;
    merges.push_back({item.seq, item.t0, item.t1, item.k0, item.k1, item.cost, num_partials,
                      parts});
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t k0 = item.k0 + p * per, k1 = std::min(item.k1, k0 + per);
      items.push_back({item.seq, item.t0, item.t1, k0, k1,
                       (item.t1 - item.t0) * (k1 - k0) * kv_heads, num_partials + p, parts});
    }
    num_partials += parts * kv_heads;
  }
  const int64_t stride = kTileTokens * call.group * (call.dim + 2);  // floats per partial
  std::vector<float> partials(num_partials * stride);
  // Largest first, taken by whichever thread is free: the work balances across the threads.
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t count = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min(threads, count), 1, [&](int64_t, int64_t) {
    std::vector<float> buf;
    for (int64_t i = next++; i < count; i = next++) {
      const Item& item = items[i];
      call.run(item, q_lens[item.seq], buf,
               item.part < 0 ? nullptr : partials.data() + item.part * stride,
               item.parts * stride);
    }
  });
  std::atomic<int64_t> next_merge{0};
  const int64_t num_merges = static_cast<int64_t>(merges.size());
  at::parallel_for(0, std::min(threads, num_merges), 1, [&](int64_t, int64_t) {
    for (int64_t i = next_merge++; i < num_merges; i = next_merge++) {
      call.merge(merges[i], partials.data() + merges[i].part * stride, stride);
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
  // The decode rows (one query token) go through decode_attention, whose kernels hold a
  // sequence's query heads in registers (a decode's 1 x group rows would fill a few of the
  // tiles' 16 lanes: 2.5x slower for 64 decodes beside a chunk); the tiles take the rest.
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  std::vector<int64_t> decode_seqs, decode_rows;
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (starts[s + 1] - starts[s] == 1) {
      decode_seqs.push_back(s);
      decode_rows.push_back(starts[s]);
    }
  }
  if (!decode_seqs.empty()) {
    const auto as_index = [](const std::vector<int64_t>& v) {
      return at::tensor(v, at::TensorOptions().dtype(at::kLong));
    };
    const at::Tensor seqs = as_index(decode_seqs), rows = as_index(decode_rows);
    const at::Tensor q = query.index_select(0, rows);
    at::Tensor o = at::empty_like(q);
    decode_attention(o, q, k_cache, v_cache, block_tables.index_select(0, seqs),
                     seq_lens.index_select(0, seqs), scale, sliding_window, v_scale);
    out.index_copy_(0, rows, o);
  }
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
