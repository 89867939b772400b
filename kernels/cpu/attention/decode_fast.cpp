// Paged decode attention over a bfloat16 or float32 cache (the common CPU cases) on every ISA:
// the torch op's entry to attention/decode_fast.h, the kernel written once over the vector
// layer. Head sizes other than 64, 128 and 256, and other dtypes, take attention.cpp's generic
// kernel. The float32 cache took the generic kernel until 2026-12-01: 2.5x (batch 1, 150 keys)
// to 7x (1000 keys) the bf16 kernel's time. Until issue 49 this file was AVX-512 only
// (AVX512-BF16 for the bf16 cache): other CPUs took the generic kernel for both.

#include <ATen/ATen.h>

#include "attention/decode_fast.h"
#include "ops.h"

namespace kvserve {
namespace {

template <typename T>
void run_for(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
             const at::Tensor& v_cache, const at::Tensor& block_tables,
             const at::Tensor& seq_lens, double scale, int64_t window, double v_scale) {
  const decode_fast::Call<T> c{
      query.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), out.data_ptr<T>(),
      block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), query.stride(0),
      query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), k_cache.size(1),
      k_cache.size(2), query.size(1) / k_cache.size(2), window, static_cast<float>(scale),
      static_cast<float>(v_scale)};
  decode_fast::run_dim<T>(c, query.size(0), query.size(2));
}

}  // namespace

bool decode_attention_fast(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
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
  if (dtype == at::kBFloat16) {
    run_for<bf16_t>(out, query, k_cache, v_cache, block_tables, seq_lens, scale, window,
                    v_scale);
    return true;
  }
  return false;
}

}  // namespace kvserve
