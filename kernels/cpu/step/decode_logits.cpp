// The decode step's two ends around DecoderStack's team step (decode_team.cpp): from token ids
// (the tied int8 embedding) to the float32 logits of the final norm and the LM head, or to each
// row's greedy token, in one call.

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <vector>

#include "ops.h"

namespace kvserve {

void DecoderStack::set_ends(at::Tensor cos_table, at::Tensor sin_table, at::Tensor norm,
                            double eps, at::Tensor head_qweight, at::Tensor head_scales) {
  team_checked_hidden_ = -1;  // team_plan works it out again
  ends_ = Ends{std::move(cos_table), std::move(sin_table), std::move(norm), eps,
               std::move(head_qweight), std::move(head_scales)};
}

std::optional<at::Tensor> DecoderStack::forward_logits(
    const std::vector<int64_t>& ids, const std::vector<int64_t>& positions,
    const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
    const std::vector<int64_t>& slots, const std::vector<int64_t>& tables,
    int64_t sliding_window) {
  return logits_step(ids, positions, k_caches, v_caches, slots, tables, sliding_window, false);
}

std::optional<at::Tensor> DecoderStack::forward_argmax(
    const std::vector<int64_t>& ids, const std::vector<int64_t>& positions,
    const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
    const std::vector<int64_t>& slots, const std::vector<int64_t>& tables,
    int64_t sliding_window) {
  return logits_step(ids, positions, k_caches, v_caches, slots, tables, sliding_window, true);
}

std::optional<at::Tensor> DecoderStack::logits_step(
    const std::vector<int64_t>& ids, const std::vector<int64_t>& positions,
    const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
    const std::vector<int64_t>& slots, const std::vector<int64_t>& tables,
    int64_t sliding_window, bool argmax) {
  TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
              "DecoderStack.forward_logits: ", layers_.size(), " layers, ", k_caches.size(),
              " K and ", v_caches.size(), " V caches");
  const int64_t rows = static_cast<int64_t>(ids.size());
  TORCH_CHECK(static_cast<int64_t>(positions.size()) == rows &&
                  static_cast<int64_t>(slots.size()) == rows && rows > 0 && !tables.empty() &&
                  static_cast<int64_t>(tables.size()) % rows == 0,
              "DecoderStack.forward_logits: ", rows, " ids, ", positions.size(), " positions, ",
              slots.size(), " slots and ", tables.size(), " block table entries");
  if (!ends_.has_value() || layers_.empty() || rows > kTeamMaxRows ||
      !team_dtype(layers_[0].norm1.scalar_type())) {
    return std::nullopt;
  }
  // The head's rows: 0 where the team step does not end in it (or, in a build without
  // AVX512-VNNI, does not exist).
  const int64_t vocab = team_head_rows(layers_[0].norm1.numel());
  if (vocab == 0) return std::nullopt;
  const Ends& e = ends_.value();
  const at::ScalarType dtype = layers_[0].norm1.scalar_type();
  const int64_t dim = layers_[0].heads[2], width = static_cast<int64_t>(tables.size()) / rows;
  const at::Tensor& ct = e.cos_table;
  const at::Tensor& st = e.sin_table;
  if (ct.scalar_type() != at::kFloat || ct.dim() != 2 || !ct.is_contiguous() ||
      ct.size(1) != dim || st.sizes() != ct.sizes() || st.scalar_type() != at::kFloat ||
      !st.is_contiguous()) {
    return std::nullopt;
  }
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(positions[r] >= 0 && positions[r] < ct.size(0),
                "DecoderStack.forward_logits: position ", positions[r],
                " is past the rotary table's ", ct.size(0), " positions");
  }
  const auto longs = at::TensorOptions().dtype(at::kLong);
  const at::Tensor pos = at::tensor(positions, longs);
  const at::Tensor slot_mapping = at::tensor(slots, longs);
  at::Tensor block_tables = at::empty({rows, width}, longs.dtype(at::kInt));
  at::Tensor seq_lens = at::empty({rows}, longs.dtype(at::kInt));
  int32_t *bt = block_tables.data_ptr<int32_t>(), *lens = seq_lens.data_ptr<int32_t>();
  for (int64_t i = 0; i < rows * width; ++i) bt[i] = static_cast<int32_t>(tables[i]);
  for (int64_t r = 0; r < rows; ++r) lens[r] = static_cast<int32_t>(positions[r] + 1);
  // The embedding as LlamaForCausalLM's Int8Embedding computes it (the ids are checked there).
  at::Tensor x = q8_embedding(at::tensor(ids, longs), e.head_qweight, e.head_scales, dtype);
  if (!serves_team(x, k_caches, v_caches, slot_mapping, block_tables, seq_lens)) {
    return std::nullopt;
  }
  // Each row's angles in the model's dtype, as RotaryEmbedding.cos_sin rounds them.
  const at::Tensor cos = ct.index_select(0, pos).to(dtype);
  const at::Tensor sin = st.index_select(0, pos).to(dtype);
  const int64_t row_bytes = dim * cos.element_size();
  std::vector<const void*> cos_rows(rows), sin_rows(rows);
  for (int64_t r = 0; r < rows; ++r) {
    cos_rows[r] = static_cast<const char*>(cos.data_ptr()) + r * row_bytes;
    sin_rows[r] = static_cast<const char*>(sin.data_ptr()) + r * row_bytes;
  }
  at::Tensor logits = at::empty({rows, vocab}, x.options());
  if (argmax) {  // the greedy tokens, found where each thread's share of the head left them
    at::Tensor tokens = at::empty({rows}, longs);
    forward_team(x, cos_rows.data(), sin_rows.data(), k_caches, v_caches, slot_mapping,
                 block_tables, seq_lens, sliding_window, logits.data_ptr(),
                 tokens.data_ptr<int64_t>());
    return tokens;
  }
  forward_team(x, cos_rows.data(), sin_rows.data(), k_caches, v_caches, slot_mapping,
               block_tables, seq_lens, sliding_window, logits.data_ptr(), nullptr);
  // compute_logits widens the head's output to float32
  return dtype == at::kFloat ? logits : logits.to(at::kFloat);
}

}  // namespace kvserve
