// DecoderStack's team step (decode_team.cpp) for decode batches past kTeamRows rows: the same
// layer in one parallel region, with the rows' elementwise work split over the threads instead
// of repeated on each (at 64 rows SmolLM2's norms, SiLU products and adds alone would double).
//
//   each thread, its own rows:  the norms, the rotation of q and k and the cache write, the
//                               residual adds, the SiLU products, and quantizing each linear's
//                               input (each linear's input rows are then shared: a barrier)
//   split over the threads:     the linears' tiles and the attention, each ending at a barrier
//
// Op by op, the same step opened ~12 parallel regions a layer, and between them the calling
// thread ran ATen's dispatch, allocations and views alone while the other waited. The same
// kernels and the same rounding (rows.h) as the op-by-op path: the outputs are equal bit for
// bit (tests/kernels/test_cpu_decode_team.py).

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "ops.h"
#include "elementwise/rows.h"
#include "step/team.h"
#include "step/team_plan.h"

namespace kvserve {

template <typename T>
void DecoderStack::team_step_rows(at::Tensor x, const void* const* cos_rows,
                                  const void* const* sin_rows,
                                  const std::vector<at::Tensor>& k_caches,
                                  const std::vector<at::Tensor>& v_caches,
                                  const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, int64_t sliding_window,
                                  void* logits, int64_t* tokens) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const TeamPlan* plan = team_plan(hidden);  // serves_team saw it
  const auto& lin = plan->lin;
  const int64_t qkv_n = plan->qkv_n, widest = plan->widest;
  const Layer& first = layers_[0];
  const int64_t heads = first.heads[0], kv_heads = first.heads[1], dim = first.heads[2];
  const int64_t kv = kv_heads * dim;
  // The shared buffers between the phases; x is the residual stream, each row updated by the
  // thread that owns it.
  at::Tensor h = at::empty({rows, hidden}, x.options());
  at::Tensor qkv = at::empty({rows, qkv_n}, x.options());
  at::Tensor attn = at::empty({rows, heads, dim}, x.options());
  at::Tensor o = at::empty({rows, hidden}, x.options());
  at::Tensor gate_up = at::empty({rows, widest}, x.options());
  at::Tensor act = at::empty({rows, widest / 2}, x.options());
  const at::Tensor q = qkv.narrow(1, 0, heads * dim).view({rows, heads, dim});
  const at::Tensor slots_c = slot_mapping.contiguous();
  const int64_t* slots = slots_c.data_ptr<int64_t>();
  T *x_p = x.data_ptr<T>(), *h_p = h.data_ptr<T>(), *qkv_p = qkv.data_ptr<T>();
  T *attn_p = attn.data_ptr<T>(), *o_p = o.data_ptr<T>(), *gu_p = gate_up.data_ptr<T>();
  T* act_p = act.data_ptr<T>();
  // One buffer for every linear's quantized input: no linear's input is wider than the widest
  // of hidden, the attention's output and the MLP's (and no group is smaller than a block).
  const int64_t widest_in = std::max({hidden, heads * dim, widest / 2});
  const std::unique_ptr<char[]> quantized(new char[qgemm::QuantRows::bytes(rows, widest_in, 1)]);
  char* qbuf = quantized.get();  // every byte a thread reads written first, as QuantRows says
  Team team;
  ++team_steps_;
  const int64_t team_size = at::get_num_threads();
  std::vector<Best> best(tokens != nullptr ? team_size * rows : 0, Best{-INFINITY, -1, false});
#pragma omp parallel num_threads(team_size)
  {
    const TeamMember member(&team);
    const int64_t share = (rows + omp_get_num_threads() - 1) / omp_get_num_threads();
    const int64_t r0 = std::min(rows, omp_get_thread_num() * share);
    const int64_t r1 = std::min(rows, r0 + share);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      const auto& L = lin[i];
      const T *n1 = l.norm1.data_ptr<T>(), *n2 = l.norm2.data_ptr<T>();
      const int64_t inter = L[2].N / 2;
      const auto eps = static_cast<float>(l.eps);
      for (int64_t r = r0; r < r1; ++r) {
        norm_row(x_p + r * hidden, n1, h_p + r * hidden, hidden, eps);
      }
      L[0](h_p, rows, r0, r1, qbuf, qkv_p);
      for (int64_t r = r0; r < r1; ++r) {  // rotate q and k, write k and v to the cache
        T* row = qkv_p + r * qkv_n;
        const T* c = static_cast<const T*>(cos_rows[r]);
        const T* s = static_cast<const T*>(sin_rows[r]);
        for (int64_t hd = 0; hd < heads + kv_heads; ++hd) rope_row(row + hd * dim, c, s, dim / 2);
        if (slots[r] < 0) continue;
        std::memcpy(k_caches[i].data_ptr<T>() + slots[r] * kv, row + heads * dim,
                    sizeof(T) * kv);
        std::memcpy(v_caches[i].data_ptr<T>() + slots[r] * kv, row + heads * dim + kv,
                    sizeof(T) * kv);
      }
#pragma omp barrier
      decode_attention_fast(attn, q, k_caches[i], v_caches[i], block_tables, seq_lens,
                              l.scale * l.k_scale, sliding_window, l.v_scale);
      L[1](attn_p, rows, r0, r1, qbuf, o_p);
      for (int64_t r = r0; r < r1; ++r) {  // x += o (rounded as torch's add), h = norm(x)
        T* xrow = x_p + r * hidden;
        const T* orow = o_p + r * hidden;
        for (int64_t c = 0; c < hidden; ++c) xrow[c] = from_f<T>(to_f(xrow[c]) + to_f(orow[c]));
        norm_row(xrow, n2, h_p + r * hidden, hidden, eps);
      }
      L[2](h_p, rows, r0, r1, qbuf, gu_p);
      for (int64_t r = r0; r < r1; ++r) {
        const T* g = gu_p + r * L[2].N;
        silu_mul_row(g, g + inter, act_p + r * inter, inter);
      }
      L[3](act_p, rows, r0, r1, qbuf, o_p);  // the down projection, into o's buffer
      for (int64_t c = r0 * hidden; c < r1 * hidden; ++c) {
        x_p[c] = from_f<T>(to_f(x_p[c]) + to_f(o_p[c]));
      }
    }
    if (logits != nullptr) {  // the final norm of this thread's rows, then the LM head
      const T* n = ends_->norm.data_ptr<T>();
      const auto eps = static_cast<float>(ends_->eps);
      for (int64_t r = r0; r < r1; ++r) {
        norm_row(x_p + r * hidden, n, h_p + r * hidden, hidden, eps);
      }
      (*plan->head)(h_p, rows, r0, r1, qbuf, static_cast<T*>(logits));
      if (tokens != nullptr) {
        best_of_share(static_cast<const T*>(logits), plan->head->N, rows, best.data());
      }
    }
  }
  if (tokens != nullptr) combine_best(best, team_size, rows, tokens);
}

template void DecoderStack::team_step_rows<float>(
    at::Tensor, const void* const*, const void* const*, const std::vector<at::Tensor>&,
    const std::vector<at::Tensor>&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    int64_t, void*, int64_t*);
template void DecoderStack::team_step_rows<c10::BFloat16>(
    at::Tensor, const void* const*, const void* const*, const std::vector<at::Tensor>&,
    const std::vector<at::Tensor>&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    int64_t, void*, int64_t*);

}  // namespace kvserve
