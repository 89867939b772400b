// The torch-facing declarations of kvserve's C++ CPU ops (registered in kvserve_cpu_ops.cpp;
// bodies by op under attention/, quant/, step/, sampling/ and elementwise/, over vec/).
#pragma once

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <memory>
#include <optional>
#include <vector>

namespace kvserve {

void decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, double scale, int64_t sliding_window,
                      double v_scale);
// The float32- and bfloat16-cache decode attention over the vector layer, on every ISA
// (attention/decode_fast.h); false (nothing done) where it does not apply: another dtype or
// head size.
bool decode_attention_fast(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, double scale, int64_t window,
                             double v_scale);
// Attention for a mixed batch (prefill chunks and decodes) over the paged cache, in place
// (varlen_attention.cpp); query_start_loc [num_seqs + 1] int32 delimits each sequence's rows.
void varlen_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                      double scale, int64_t sliding_window, double v_scale);
void check_cache(const at::Tensor& cache, const at::Tensor& other);  // contiguous, K/V alike
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor k_cache,
              at::Tensor v_cache, const at::Tensor& slot_mapping, double k_scale,
              double v_scale);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm_(at::Tensor h, at::Tensor residual, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor argmax_rows(const at::Tensor& logits);  // torch.argmax(logits, -1), float32 rows
bool int8_dot_available();  // whether q4/q8_linear have the int8-dot path (every ISA now)
const char* vector_isa();   // the vector layer this library was built for (vec::kIsa)
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qweight,
                     const at::Tensor& scale_mins, int64_t path);
at::Tensor u5_linear(const at::Tensor& x, const at::Tensor& qweight,
                     const at::Tensor& scale_mins, int64_t path);
at::Tensor u8_linear(const at::Tensor& x, const at::Tensor& qweight,
                     const at::Tensor& scale_mins, int64_t path);
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                     int64_t path);
// Rows `ids` of a tiled int8 weight, times their scales, as `dtype` [tokens, K]: a tied
// embedding read from the LM head's codes.
at::Tensor q8_embedding(const at::Tensor& ids, const at::Tensor& qweight,
                        const at::Tensor& scales, at::ScalarType dtype);
void decoder_layer_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                    at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                    const at::Tensor& block_tables, const at::Tensor& seq_lens,
                    const at::Tensor& norm1, const at::Tensor& norm2, double eps,
                    at::IntArrayRef kinds, at::IntArrayRef params,
                    const c10::List<std::optional<at::Tensor>>& linears, at::IntArrayRef heads,
                    double scale, int64_t sliding_window, double k_scale, double v_scale,
                    const std::optional<at::Tensor>& query_start_loc);

// Every decoder layer of a model, described once (`add_layer`: decoder_layer_'s per-layer
// arguments) and run in one call per step: 30 calls of decoder_layer_ from Python cost
// ~14 us each in argument conversion and module calls, 0.4 ms of a 5 ms SmolLM2 token.
struct TeamPlan;  // decode_team.cpp

class DecoderStack : public torch::CustomClassHolder {
 public:
  void add_layer(at::Tensor norm1, at::Tensor norm2, double eps, std::vector<int64_t> kinds,
                 std::vector<int64_t> params, c10::List<std::optional<at::Tensor>> linears,
                 std::vector<int64_t> heads, double scale, double k_scale, double v_scale);
  void forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
               const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
               const at::Tensor& slot_mapping, const at::Tensor& block_tables,
               const at::Tensor& seq_lens, int64_t sliding_window,
               const std::optional<at::Tensor>& query_start_loc);
  int64_t size() const { return static_cast<int64_t>(layers_.size()); }
  // Whether forward runs a pure-decode step in one parallel region (decode_team.cpp) where it
  // can; on by default, off to run the op-by-op path (the tests compare the two).
  void set_team(bool on) { team_ = on; }
  int64_t team_steps() const { return team_steps_; }  // steps the team path ran
  // The model's two ends, for forward_logits: the rotary tables [positions, head_dim], the
  // final norm, and an LM head of int8 tiles without bias whose rows are also the embedding
  // (a tied one, read as q8_embedding reads it).
  void set_ends(at::Tensor cos_table, at::Tensor sin_table, at::Tensor norm, double eps,
                at::Tensor head_qweight, at::Tensor head_scales);
  // A decode step from token ids to float32 logits [rows, vocab]: the embedding, every layer,
  // the final norm and the LM head in one parallel region; None where the team step does not
  // take the step (nothing has run then: the caller runs forward instead). The rows come as
  // the model runner's plain lists: each row's token id, position (its sequence's length is
  // the position + 1) and cache slot, and the block tables' rows one after another, padded to
  // one width. Building tensors of them in Python cost ~0.1 ms a step (batch 1, SmolLM2: the
  // first torch calls after a step run on caches the step swept).
  std::optional<at::Tensor> forward_logits(const std::vector<int64_t>& ids,
                                           const std::vector<int64_t>& positions,
                                           const std::vector<at::Tensor>& k_caches,
                                           const std::vector<at::Tensor>& v_caches,
                                           const std::vector<int64_t>& slots,
                                           const std::vector<int64_t>& tables,
                                           int64_t sliding_window);
  // The same step ending in each row's greedy token instead (int64 [rows]: torch.argmax of its
  // logits, each thread scanning the columns of the head it computed): the logits never leave
  // the threads' caches, nor are they widened to float32.
  std::optional<at::Tensor> forward_argmax(const std::vector<int64_t>& ids,
                                           const std::vector<int64_t>& positions,
                                           const std::vector<at::Tensor>& k_caches,
                                           const std::vector<at::Tensor>& v_caches,
                                           const std::vector<int64_t>& slots,
                                           const std::vector<int64_t>& tables,
                                           int64_t sliding_window);

 private:
  const TeamPlan* team_plan(int64_t hidden) const;
  bool serves_team(const at::Tensor& x, const std::vector<at::Tensor>& k_caches,
                   const std::vector<at::Tensor>& v_caches, const at::Tensor& slot_mapping,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens) const;
  // Rows up to which each thread of the team step keeps its own copy of the rows and repeats
  // their elementwise work (team_step); past it they are split over the threads
  // (team_step_rows), and past kTeamMaxRows the op-by-op path runs.
  static constexpr int64_t kTeamRows = 8;
  static constexpr int64_t kTeamMaxRows = 256;
  static bool team_dtype(at::ScalarType dtype);
  // The LM head's rows (the vocabulary) where the team step for rows of `hidden` can end in
  // the head, else 0.
  int64_t team_head_rows(int64_t hidden) const;
  std::optional<at::Tensor> logits_step(const std::vector<int64_t>& ids,
                                        const std::vector<int64_t>& positions,
                                        const std::vector<at::Tensor>& k_caches,
                                        const std::vector<at::Tensor>& v_caches,
                                        const std::vector<int64_t>& slots,
                                        const std::vector<int64_t>& tables,
                                        int64_t sliding_window, bool argmax);
  // The team step on x; each row's rotary angles from cos_rows/sin_rows; with `logits` also
  // the final norm and the LM head into it (x then keeps its input), and with `tokens` each
  // row's argmax of them.
  // cos_rows/sin_rows and logits are in x's dtype (float32 or bfloat16: team_step's T).
  void forward_team(at::Tensor x, const void* const* cos_rows, const void* const* sin_rows,
                    const std::vector<at::Tensor>& k_caches,
                    const std::vector<at::Tensor>& v_caches, const at::Tensor& slot_mapping,
                    const at::Tensor& block_tables, const at::Tensor& seq_lens,
                    int64_t sliding_window, void* logits, int64_t* tokens);
  template <typename T>
  void team_step(at::Tensor x, const void* const* cos_rows, const void* const* sin_rows,
                 const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                 const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                 const at::Tensor& seq_lens, int64_t sliding_window, void* logits,
                 int64_t* tokens);
  template <typename T>  // decode_team_rows.cpp
  void team_step_rows(at::Tensor x, const void* const* cos_rows, const void* const* sin_rows,
                      const std::vector<at::Tensor>& k_caches,
                      const std::vector<at::Tensor>& v_caches, const at::Tensor& slot_mapping,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens,
                      int64_t sliding_window, void* logits, int64_t* tokens);

  struct Ends {
    at::Tensor cos_table, sin_table, norm;
    double eps;
    at::Tensor head_qweight, head_scales;
  };
  std::optional<Ends> ends_;

  struct Layer {
    at::Tensor norm1, norm2;
    double eps;
    std::vector<int64_t> kinds, params;
    c10::List<std::optional<at::Tensor>> linears;
    std::vector<int64_t> heads;
    double scale, k_scale, v_scale;
  };
  std::vector<Layer> layers_;
  bool team_ = true;
  int64_t team_steps_ = 0;
  mutable int64_t team_checked_hidden_ = -1;  // the hidden size team_plan_ was worked out for
  mutable std::shared_ptr<const TeamPlan> team_plan_;  // null: the layers do not fit
};

}  // namespace kvserve
