// One Llama decoder layer as a single op (decode rows, or with `query_start_loc` a mixed batch
// of prefill chunks and decodes): the model's Python forward costs ~25 torch calls and ~10
// module calls per layer, which at batch 1 on a small model took as long as the matmuls. The same kernels and the same torch matmuls run here,
// called from C++. engine/models/llama.py describes each linear layer as (kind, param, up to
// three tensors):
//
//   kind 0  dense weight [out, in] (+ bias)                 at::linear
//   kind 1  oneDNN-packed weight (+ bias)                   mkldnn::_linear_pointwise
//   kind 2  int4 codes in torch's CPU pack, scale/zeros     aten::_weight_int4pack_mm_for_cpu
//           (param: the group size) (+ bias)
//   kind 3  int8 codes, per-channel scales (+ bias)         aten::_weight_int8pack_mm
//   kind 4  int4 tiles, scales and mins (+ bias)            q4_linear (qgemm.cpp)
//   kind 5  int8 tiles, per-channel scales (+ bias)         q8_linear (qgemm.cpp)
//   kind 6  8-bit code tiles, scales and mins (+ bias)      u8_linear (qgemm.cpp)
//   kind 7  5-bit code tiles, scales and mins (+ bias)      u5_linear (qgemm.cpp)
//
// and falls back to its Python forward for anything else (tensor parallel, other formats).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <algorithm>
#include <vector>

#include "ops.h"

namespace kvserve {
namespace {

constexpr int64_t kSlots = 3;  // tensors per linear in `linears`
// Rows per MLP call. A 7,424-token prefill's gate/up output alone is 91 MB: a buffer that large
// is fresh memory from the OS on every call, and its page faults took ~15% of such a step
// (Xeon, SmolLM2 GGUF). Chunks of 512 rows (6 MB) reuse memory the allocator keeps.
constexpr int64_t kMlpRows = 512;

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(weight);
  stack.emplace_back(bias);
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor linear(const at::Tensor& x, int64_t index, at::IntArrayRef kinds,
                  at::IntArrayRef params, const c10::List<std::optional<at::Tensor>>& linears) {
  const std::optional<at::Tensor> a = linears.get(index * kSlots);
  const std::optional<at::Tensor> b = linears.get(index * kSlots + 1);
  const std::optional<at::Tensor> bias = linears.get(index * kSlots + 2);
  TORCH_CHECK(a.has_value(), "decoder_layer_: linear ", index, " has no weight");
  at::Tensor y;
  switch (kinds[index]) {
    case 0:
      return at::linear(x, *a, bias);
    case 1:
      return packed_linear(x, *a, bias);
    case 2:
      y = at::_weight_int4pack_mm_for_cpu(x, *a, params[index], *b);
      break;
    case 3:
      y = at::_weight_int8pack_mm(x, *a, *b);
      break;
    case 4:
      y = q4_linear(x, *a, *b, 0);
      break;
    case 5:
      y = q8_linear(x, *a, *b, 0);
      break;
    case 6:
      y = u8_linear(x, *a, *b, 0);
      break;
    case 7:
      y = u5_linear(x, *a, *b, 0);
      break;
    default:
      TORCH_CHECK(false, "decoder_layer_: unknown linear kind ", kinds[index]);
  }
  if (bias.has_value()) y.add_(*bias);
  return y;
}

}  // namespace

// x [rows, hidden] is the residual stream, updated in place; heads = (heads, kv_heads, dim).
void decoder_layer_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                    at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                    const at::Tensor& block_tables, const at::Tensor& seq_lens,
                    const at::Tensor& norm1, const at::Tensor& norm2, double eps,
                    at::IntArrayRef kinds, at::IntArrayRef params,
                    const c10::List<std::optional<at::Tensor>>& linears, at::IntArrayRef heads,
                    double scale, int64_t sliding_window, double k_scale, double v_scale,
                    const std::optional<at::Tensor>& query_start_loc) {
  TORCH_CHECK(kinds.size() == 4 && params.size() == 4 &&
              linears.size() == static_cast<size_t>(4 * kSlots) && heads.size() == 3,
              "decoder_layer_: 4 linears (qkv, o, gate_up, down) and (heads, kv_heads, dim)");
  const int64_t rows = x.size(0), num_heads = heads[0], kv_heads = heads[1], dim = heads[2];
  const int64_t q_size = num_heads * dim, kv_size = kv_heads * dim;
  at::Tensor h = rms_norm(x, norm1, eps);
  at::Tensor qkv = linear(h, 0, kinds, params, linears);  // [rows, q + 2 kv]
  rotary_(qkv.narrow(1, 0, q_size + kv_size).view({rows, num_heads + kv_heads, dim}), cos, sin);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({rows, num_heads, dim});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({rows, kv_heads, dim});
  at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, kv_heads, dim});
  write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale);
  at::Tensor attn = at::empty({rows, num_heads, dim}, x.options());
  if (query_start_loc.has_value()) {  // a mixed batch: prefill chunks beside decodes
    varlen_attention(attn, q, k_cache, v_cache, block_tables, seq_lens, *query_start_loc,
                     scale * k_scale, sliding_window, v_scale);
  } else {
    decode_attention(attn, q, k_cache, v_cache, block_tables, seq_lens, scale * k_scale,
                     sliding_window, v_scale);
  }
  at::Tensor o = linear(attn.view({rows, q_size}), 1, kinds, params, linears);
  add_rms_norm_(o, x, norm2, eps);  // x += o; o = norm(x)
  if (rows <= kMlpRows) {  // one call, without the views
    at::Tensor act = silu_and_mul(linear(o, 2, kinds, params, linears));
    x.add_(linear(act, 3, kinds, params, linears));
    return;
  }
  // The MLP a chunk of rows at a time (each row's result is the same as in one call).
  for (int64_t r0 = 0; r0 < rows; r0 += kMlpRows) {
    const int64_t n = std::min(kMlpRows, rows - r0);
    at::Tensor act = silu_and_mul(linear(o.narrow(0, r0, n), 2, kinds, params, linears));
    x.narrow(0, r0, n).add_(linear(act, 3, kinds, params, linears));
  }
}

void DecoderStack::add_layer(at::Tensor norm1, at::Tensor norm2, double eps,
                             std::vector<int64_t> kinds, std::vector<int64_t> params,
                             c10::List<std::optional<at::Tensor>> linears,
                             std::vector<int64_t> heads, double scale, double k_scale,
                             double v_scale) {
  team_checked_hidden_ = -1;  // team_plan works it out again
  layers_.push_back(Layer{std::move(norm1), std::move(norm2), eps, std::move(kinds),
                          std::move(params), std::move(linears), std::move(heads), scale,
                          k_scale, v_scale});
}

void DecoderStack::forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                           const std::vector<at::Tensor>& k_caches,
                           const std::vector<at::Tensor>& v_caches,
                           const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, int64_t sliding_window,
                           const std::optional<at::Tensor>& query_start_loc) {
  TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
              "DecoderStack.forward: ", layers_.size(), " layers, ", k_caches.size(),
              " K and ", v_caches.size(), " V caches");
  if (!query_start_loc.has_value() &&
      serves_team(x, k_caches, v_caches, slot_mapping, block_tables, seq_lens)) {
    const int64_t rows = x.size(0);  // at most a few, as serves_team saw
    const bool rope_fits = cos.scalar_type() == x.scalar_type() &&
                           sin.scalar_type() == x.scalar_type() && cos.size(0) == rows &&
                           sin.size(0) == rows && cos.stride(-1) == 1 && sin.stride(-1) == 1 &&
                           cos.size(-1) == layers_[0].heads[2] &&
                           sin.size(-1) == layers_[0].heads[2];
    if (rope_fits) {  // each row's angles, in x's dtype
      const auto* c = static_cast<const char*>(cos.data_ptr());
      const auto* s = static_cast<const char*>(sin.data_ptr());
      std::vector<const void*> cos_rows, sin_rows;
      for (int64_t r = 0; r < rows; ++r) {
        cos_rows.push_back(c + r * cos.stride(0) * cos.element_size());
        sin_rows.push_back(s + r * sin.stride(0) * sin.element_size());
      }
      return forward_team(x, cos_rows.data(), sin_rows.data(), k_caches, v_caches,
                          slot_mapping, block_tables, seq_lens, sliding_window, nullptr,
                          nullptr);
    }
  }
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& l = layers_[i];
    decoder_layer_(x, cos, sin, k_caches[i], v_caches[i], slot_mapping, block_tables, seq_lens,
                   l.norm1, l.norm2, l.eps, l.kinds, l.params, l.linears, l.heads, l.scale,
                   sliding_window, l.k_scale, l.v_scale, query_start_loc);
  }
}

}  // namespace kvserve
