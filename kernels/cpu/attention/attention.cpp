// Paged decode attention read in place and the KV cache write (see kvserve_cpu_ops.cpp).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "convert.h"
#include "ops.h"
#include "attention/paged.h"

namespace kvserve {
namespace {

// ---- decode attention ----------------------------------------------------------------------

template <typename QT, typename KT>
void decode_attention_kernel(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, double scale, int64_t window,
                             double v_scale, const float* table) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), dim = query.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = num_heads / kv_heads;
  const int64_t q_s0 = query.stride(0), q_s1 = query.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int64_t bt_s0 = block_tables.stride(0);
  const QT* q_ptr = query.data_ptr<QT>();
  QT* o_ptr = out.data_ptr<QT>();
  const KT* k_ptr = reinterpret_cast<const KT*>(k_cache.data_ptr());
  const KT* v_ptr = reinterpret_cast<const KT*>(v_cache.data_ptr());
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale), fv_scale = static_cast<float>(v_scale);

  const WorkSplit split(num_seqs, kv_heads, at::get_num_threads());
  const int64_t chunks = split.chunks, per_chunk = split.per_chunk;

  at::parallel_for(0, num_seqs * chunks, 1, [&](int64_t begin, int64_t end) {
    const int64_t width = per_chunk * dim, rows_q = per_chunk * group;
    std::vector<float> qf(rows_q * dim), acc(rows_q * dim), row(width), scores, sums(rows_q);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / chunks, g0 = (item % chunks) * per_chunk;
      const int64_t g1 = std::min(kv_heads, g0 + per_chunk);
      if (g0 >= g1) continue;
      const int64_t nq = (g1 - g0) * group;  // query heads g0 * group .. g1 * group
      const int64_t ctx = lens[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      const int64_t n = ctx - first;
      for (int64_t h = 0; h < nq; ++h) {
        const QT* q = q_ptr + s * q_s0 + (g0 * group + h) * q_s1;
        for (int64_t d = 0; d < dim; ++d) qf[h * dim + d] = to_f(q[d]) * fscale;
      }
      scores.assign(nq * std::max<int64_t>(n, 1), 0.0f);
      const int32_t* table_row = bt + s * bt_s0;
      for_each_slot(table_row, block_size, first, ctx, [&](int64_t p, int64_t slot) {
        load_row<KT>(k_ptr + (slot * kv_heads + g0) * dim, row.data(), (g1 - g0) * dim, table);
        for (int64_t h = 0; h < nq; ++h) {
          const float* qh = qf.data() + h * dim;
          const float* kh = row.data() + (h / group) * dim;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += qh[d] * kh[d];
          scores[h * n + p] = dot;
        }
      });
      softmax_numerators(scores.data(), nq, n, sums.data());
      std::fill(acc.begin(), acc.end(), 0.0f);
      for_each_slot(table_row, block_size, first, ctx, [&](int64_t p, int64_t slot) {
        load_row<KT>(v_ptr + (slot * kv_heads + g0) * dim, row.data(), (g1 - g0) * dim, table);
        for (int64_t h = 0; h < nq; ++h) {
          const float w = scores[h * n + p];
          const float* vh = row.data() + (h / group) * dim;
          float* a = acc.data() + h * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += w * vh[d];
        }
      });
      for (int64_t h = 0; h < nq; ++h) {
        QT* o = o_ptr + s * o_s0 + (g0 * group + h) * o_s1;
        const float norm = sums[h] > 0.0f ? fv_scale / sums[h] : 0.0f;
        for (int64_t d = 0; d < dim; ++d) o[d] = from_f<QT>(acc[h * dim + d] * norm);
      }
    }
  });
}

template <typename QT>
void decode_attention_for(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens, double scale, int64_t window,
                          double v_scale) {
  const auto kind = k_cache.scalar_type();
  if (kind == at::ScalarType::Float8_e4m3fn) {
    decode_attention_kernel<QT, uint8_t>(out, query, k_cache, v_cache, block_tables, seq_lens,
                                         scale, window, v_scale, fp8_table<c10::Float8_e4m3fn>());
  } else if (kind == at::ScalarType::Float8_e5m2) {
    decode_attention_kernel<QT, uint8_t>(out, query, k_cache, v_cache, block_tables, seq_lens,
                                         scale, window, v_scale, fp8_table<c10::Float8_e5m2>());
  } else {
    TORCH_CHECK(kind == query.scalar_type(), "decode_attention: a non-fp8 cache must have the "
                "query's dtype");
    if (decode_attention_fast(out, query, k_cache, v_cache, block_tables, seq_lens, scale,
                                window, v_scale)) {
      return;
    }
    decode_attention_kernel<QT, QT>(out, query, k_cache, v_cache, block_tables, seq_lens, scale,
                                    window, v_scale, nullptr);
  }
}

}  // namespace


void check_cache(const at::Tensor& cache, const at::Tensor& other) {
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous(), "KV cache must be a contiguous "
              "[num_blocks, block_size, kv_heads, head_dim] tensor");
  TORCH_CHECK(cache.sizes() == other.sizes() && cache.scalar_type() == other.scalar_type(),
              "K and V caches must match");
}

void decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, double scale, int64_t sliding_window,
                      double v_scale) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && out.stride(2) == 1,
              "query/out must be [num_seqs, heads, head_dim] with contiguous head_dim");
  TORCH_CHECK(query.size(2) == k_cache.size(3) && query.size(1) % k_cache.size(2) == 0,
              "query heads must be a multiple of the KV heads, head dims equal");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
              seq_lens.is_contiguous() && block_tables.stride(1) == 1,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
              "out must match query");
  switch (query.scalar_type()) {
    case at::kFloat:
      return decode_attention_for<float>(out, query, k_cache, v_cache, block_tables, seq_lens,
                                         scale, sliding_window, v_scale);
    case at::kBFloat16:
      return decode_attention_for<c10::BFloat16>(out, query, k_cache, v_cache, block_tables,
                                                 seq_lens, scale, sliding_window, v_scale);
    case at::kHalf:
      return decode_attention_for<c10::Half>(out, query, k_cache, v_cache, block_tables,
                                             seq_lens, scale, sliding_window, v_scale);
    default:
      TORCH_CHECK(false, "decode_attention: unsupported query dtype ", query.scalar_type());
  }
}

// ---- KV cache write --------------------------------------------------------------------------

template <typename T, typename CT>
void write_rows(const at::Tensor& rows, at::Tensor& cache, const int64_t* slots, int64_t count,
                double scale) {
  const int64_t heads = rows.size(1), dim = rows.size(2);
  const int64_t r_s0 = rows.stride(0), r_s1 = rows.stride(1);
  const T* src = rows.data_ptr<T>();
  CT* dst = reinterpret_cast<CT*>(cache.data_ptr());
  const bool fp8 = cache.element_size() == 1;
  const float fscale = static_cast<float>(scale);
  const float limit = fp8 ? static_cast<float>(std::numeric_limits<CT>::max()) : 0.0f;
  for (int64_t t = 0; t < count; ++t) {
    if (slots[t] < 0) continue;
    for (int64_t h = 0; h < heads; ++h) {
      const T* s = src + t * r_s0 + h * r_s1;
      CT* d = dst + (slots[t] * heads + h) * dim;
      for (int64_t i = 0; i < dim; ++i) {
        if (fp8) {
          d[i] = CT(std::clamp(to_f(s[i]) / fscale, -limit, limit));
        } else {
          d[i] = static_cast<CT>(to_f(s[i]));
        }
      }
    }
  }
}

template <typename T>
void write_kv_for(const at::Tensor& rows, at::Tensor& cache, const int64_t* slots, int64_t count,
                  double scale) {
  switch (cache.scalar_type()) {
    case at::ScalarType::Float8_e4m3fn:
      return write_rows<T, c10::Float8_e4m3fn>(rows, cache, slots, count, scale);
    case at::ScalarType::Float8_e5m2:
      return write_rows<T, c10::Float8_e5m2>(rows, cache, slots, count, scale);
    default:
      TORCH_CHECK(cache.scalar_type() == rows.scalar_type(), "write_kv: a non-fp8 cache must "
                  "have the rows' dtype");
      return write_rows<T, T>(rows, cache, slots, count, scale);
  }
}

void write_one(const at::Tensor& rows, at::Tensor& cache, const at::Tensor& slot_mapping,
               double scale) {
  TORCH_CHECK(rows.dim() == 3 && rows.stride(2) == 1 && rows.size(1) == cache.size(2) &&
              rows.size(2) == cache.size(3), "write_kv: rows must be [tokens, kv_heads, dim]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t count = rows.size(0);
  switch (rows.scalar_type()) {
    case at::kFloat: return write_kv_for<float>(rows, cache, slots, count, scale);
    case at::kBFloat16: return write_kv_for<c10::BFloat16>(rows, cache, slots, count, scale);
    case at::kHalf: return write_kv_for<c10::Half>(rows, cache, slots, count, scale);
    default: TORCH_CHECK(false, "write_kv: unsupported dtype ", rows.scalar_type());
  }
}

void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache,
              at::Tensor v_cache, const at::Tensor& slot_mapping, double k_scale,
              double v_scale) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.size(0) == key.size(0), "write_kv: slot_mapping must be int64");
  write_one(key, k_cache, slot_mapping, k_scale);
  write_one(value, v_cache, slot_mapping, v_scale);
}

}  // namespace kvserve
