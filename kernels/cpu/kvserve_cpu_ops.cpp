// kvserve's CPU ops (loaded by kernels/cpu_ops.py, which builds this file with torch's
// extension tooling at setup):
//
//   decode_attention  one query token per sequence attending over its context, reading K/V
//                     through the block table where they lie in the paged cache (no gather),
//                     with GQA (a KV row is read once for all query heads sharing it), a
//                     sliding window and fp8 caches (e4m3fn / e5m2, read through a table);
//   write_kv          this step's K/V rows into their cache slots (slot -1 skipped), fp8
//                     quantised with saturation as the torch twin does;
//   rms_norm, add_rms_norm_, silu_and_mul, rotary_
//                     the decoder layer's elementwise work, one pass each instead of 4-8
//                     torch ops, rounding where the torch formulation rounds (so bfloat16
//                     results match the eager model's).
//
// Every op is registered for the CPU dispatch key only; the tests hold each one to its torch
// twin (tests/kernels/test_cpu_ops.py).

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

#include "ops.h"

namespace kvserve {
namespace {

inline float to_f(float v) { return v; }
inline float to_f(c10::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_f(c10::Half v) { return static_cast<float>(v); }

template <typename T>
inline T from_f(float v) { return static_cast<T>(v); }  // c10 rounds to nearest even

// The value a float becomes when stored as T and read back (a torch op's output rounding).
template <typename T>
inline float rnd(float v) { return to_f(from_f<T>(v)); }
template <>
inline float rnd<float>(float v) { return v; }

// fp8 bytes -> float, one table per format.
template <typename F8>
const float* fp8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i) {
      t[i] = static_cast<float>(F8(static_cast<uint8_t>(i), F8::from_bits()));
    }
    return t;
  }();
  return table.data();
}

// ---- decode attention ----------------------------------------------------------------------

// Reads one cache row of `dim` elements into float: T the cache element, or uint8_t with a
// table for fp8.
template <typename T>
inline void load_row(const T* src, float* dst, int64_t dim, const float*) {
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) dst[d] = to_f(src[d]);
}
template <>
inline void load_row<uint8_t>(const uint8_t* src, float* dst, int64_t dim, const float* table) {
  for (int64_t d = 0; d < dim; ++d) dst[d] = table[src[d]];
}

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

  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), row(dim), scores, maxes(group),
        sums(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / kv_heads, g = item % kv_heads;
      const int64_t ctx = lens[s];
      const int64_t first = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      const int64_t n = ctx - first;
      for (int64_t h = 0; h < group; ++h) {
        const QT* q = q_ptr + s * q_s0 + (g * group + h) * q_s1;
        for (int64_t d = 0; d < dim; ++d) qf[h * dim + d] = to_f(q[d]) * fscale;
      }
      scores.assign(group * std::max<int64_t>(n, 1), 0.0f);
      std::fill(maxes.begin(), maxes.end(), -std::numeric_limits<float>::infinity());
      const int32_t* table_row = bt + s * bt_s0;
      for (int64_t p = 0; p < n; ++p) {
        const int64_t pos = first + p;
        const int64_t slot = static_cast<int64_t>(table_row[pos / block_size]) * block_size +
                             pos % block_size;
        load_row<KT>(k_ptr + (slot * kv_heads + g) * dim, row.data(), dim, table);
        for (int64_t h = 0; h < group; ++h) {
          const float* qh = qf.data() + h * dim;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += qh[d] * row[d];
          scores[h * n + p] = dot;
          maxes[h] = std::max(maxes[h], dot);
        }
      }
      for (int64_t h = 0; h < group; ++h) {
        float sum = 0.0f;
        float* sc = scores.data() + h * n;
        for (int64_t p = 0; p < n; ++p) {
          sc[p] = std::exp(sc[p] - maxes[h]);
          sum += sc[p];
        }
        sums[h] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t p = 0; p < n; ++p) {
        const int64_t pos = first + p;
        const int64_t slot = static_cast<int64_t>(table_row[pos / block_size]) * block_size +
                             pos % block_size;
        load_row<KT>(v_ptr + (slot * kv_heads + g) * dim, row.data(), dim, table);
        for (int64_t h = 0; h < group; ++h) {
          const float w = scores[h * n + p];
          float* a = acc.data() + h * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += w * row[d];
        }
      }
      for (int64_t h = 0; h < group; ++h) {
        QT* o = o_ptr + s * o_s0 + (g * group + h) * o_s1;
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

// ---- elementwise ---------------------------------------------------------------------------

#define KVSERVE_FLOAT_TYPES(dtype, NAME, ...)                                       \
  switch (dtype) {                                                                  \
    case at::kFloat: { using scalar_t = float; __VA_ARGS__(); break; }              \
    case at::kBFloat16: { using scalar_t = c10::BFloat16; __VA_ARGS__(); break; }   \
    case at::kHalf: { using scalar_t = c10::Half; __VA_ARGS__(); break; }           \
    default: TORCH_CHECK(false, NAME ": unsupported dtype ", dtype);                \
  }

// out = weight * (x / rms(x)) as transformers' LlamaRMSNorm: float math, the normalised value
// rounded to the dtype, then the product with the weight rounded.
template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_f(x[i]);
    ss += v * v;
  }
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = from_f<T>(to_f(w[i]) * rnd<T>(to_f(x[i]) * r));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "rms_norm: x must be contiguous [rows, hidden] with the weight's dtype");
  at::Tensor out = at::empty_like(x);
  const int64_t rows = x.size(0), n = x.size(1);
  KVSERVE_FLOAT_TYPES(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) norm_row(xp + r * n, wp, op + r * n, n, (float)eps);
    });
  });
  return out;
}

// residual += h (rounded to the dtype, as `residual + h`), then h = rms_norm(residual).
void add_rms_norm_(at::Tensor h, at::Tensor residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && residual.is_contiguous() &&
              h.sizes() == residual.sizes() && h.scalar_type() == residual.scalar_type() &&
              weight.scalar_type() == h.scalar_type(), "add_rms_norm_: shapes/dtypes differ");
  const int64_t rows = h.size(0), n = h.size(1);
  KVSERVE_FLOAT_TYPES(h.scalar_type(), "add_rms_norm_", [&] {
    scalar_t* hp = h.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        scalar_t* hr = hp + r * n;
        scalar_t* rr = rp + r * n;
        for (int64_t i = 0; i < n; ++i) rr[i] = from_f<scalar_t>(to_f(rr[i]) + to_f(hr[i]));
        norm_row(rr, wp, hr, n, (float)eps);
      }
    });
  });
}

// [rows, 2I] -> [rows, I]: silu(gate) * up, each rounded to the dtype as torch's two ops do.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_and_mul: gate_up must be contiguous [rows, 2 * intermediate]");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  KVSERVE_FLOAT_TYPES(gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows * inter, 4096, [&](int64_t b, int64_t e) {
      for (int64_t k = b; k < e; ++k) {
        const int64_t r = k / inter, i = k % inter;
        const float g = to_f(gp[r * 2 * inter + i]), u = to_f(gp[r * 2 * inter + inter + i]);
        op[k] = from_f<scalar_t>(rnd<scalar_t>(g / (1.0f + std::exp(-g))) * u);
      }
    });
  });
  return out;
}

// In place on x [tokens, heads, dim] (a strided view of the fused qkv rows): the half-split
// rotation x * cos + rotate_half(x) * sin, with cos/sin [tokens, 1 or heads, dim] in x's dtype,
// each product and the sum rounded as the three torch ops round them.
void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && cos.scalar_type() == x.scalar_type() &&
              sin.scalar_type() == x.scalar_type() && cos.stride(2) == 1 &&
              sin.stride(2) == 1 && cos.size(0) == x.size(0),
              "rotary_: x [tokens, heads, dim], cos/sin [tokens, 1, dim] in x's dtype");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t x_s0 = x.stride(0), x_s1 = x.stride(1), c_s0 = cos.stride(0),
                s_s0 = sin.stride(0);
  KVSERVE_FLOAT_TYPES(x.scalar_type(), "rotary_", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 16, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const scalar_t* c = cp + t * c_s0;
        const scalar_t* s = sp + t * s_s0;
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t* v = xp + t * x_s0 + h * x_s1;
          for (int64_t i = 0; i < half; ++i) {
            const float a = to_f(v[i]), b2 = to_f(v[i + half]);
            const float lo = rnd<scalar_t>(a * to_f(c[i])) + rnd<scalar_t>(-b2 * to_f(s[i]));
            const float hi = rnd<scalar_t>(b2 * to_f(c[i + half])) +
                             rnd<scalar_t>(a * to_f(s[i + half]));
            v[i] = from_f<scalar_t>(lo);
            v[i + half] = from_f<scalar_t>(hi);
          }
        }
      }
    });
  });
}

}  // namespace kvserve

TORCH_LIBRARY(kvserve_cpu, m) {
  m.def("decode_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, int sliding_window, "
        "float v_scale) -> ()");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, float k_scale, float v_scale) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) h, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("decoder_layer_(Tensor(a!) x, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
        "Tensor norm1, Tensor norm2, float eps, int[] kinds, int[] params, Tensor?[] linears, "
        "int[] heads, float scale, int sliding_window, float k_scale, float v_scale) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("decode_attention", &kvserve::decode_attention);
  m.impl("write_kv", &kvserve::write_kv);
  m.impl("rms_norm", &kvserve::rms_norm);
  m.impl("add_rms_norm_", &kvserve::add_rms_norm_);
  m.impl("silu_and_mul", &kvserve::silu_and_mul);
  m.impl("rotary_", &kvserve::rotary_);
  m.impl("decoder_layer_", &kvserve::decoder_layer_);
}

// A layer whose weights oneDNN packed holds MkldnnCPU tensors: the call dispatches there.
TORCH_LIBRARY_IMPL(kvserve_cpu, MkldnnCPU, m) {
  m.impl("decoder_layer_", &kvserve::decoder_layer_);
}
