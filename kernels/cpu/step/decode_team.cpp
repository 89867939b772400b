// DecoderStack's decode step in one parallel region (team.h): every layer of a pure-decode
// batch of a few rows (up to kTeamRows; past it decode_team_rows.cpp's step) whose linears
// are all kvserve's tiled int4/int8/8-/5-bit ones (kinds 4-7, no bias), with float32 or
// bfloat16 activations and cache, on every ISA of the vector layer. The layer is decoder_layer_'s, on raw buffers:
//
//   each thread, privately:  its own copy of the residual rows, their norms, the SiLU
//                            products (a few KB: recomputing them on every thread costs less
//                            than a barrier, and no thread waits on another for them)
//   split over the threads:  the four linears and the attention, each ending at a barrier
//   thread 0, then barrier:  the rotation of q and k and the cache write
//
// The same kernels and the same rounding (rows.h) as the op-by-op path: the outputs are equal
// bit for bit (tests/kernels/test_cpu_decode_team.py).

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <vector>

#include "sampling/argmax.h"
#include "ops.h"
#include "quant/qgemm_int8.h"
#include "elementwise/rows.h"
#include "step/team.h"
#include "step/team_plan.h"

namespace kvserve {

namespace {

// Whether linear i is an int4/int8/5-/8-bit-code tile weight without bias of shape [N, K]
// (the kernels read the raw buffers unchecked, so the shapes are checked here).
bool linear_fits(int64_t kind, const c10::List<std::optional<at::Tensor>>& linears, int64_t i,
                 int64_t N, int64_t K) {
  const std::optional<at::Tensor> w = linears.get(3 * i), s = linears.get(3 * i + 1);
  if ((kind < 4 || kind > 7) || !w.has_value() || !s.has_value() ||
      linears.get(3 * i + 2).has_value() || !w->is_contiguous() || !s->is_contiguous() ||
      w->dim() != 2 || w->scalar_type() != (kind == 5 ? at::kChar : at::kByte)) {
    return false;
  }
  const at::ScalarType st = s->scalar_type();
  if (st != at::kFloat && st != at::kHalf && st != at::kBFloat16) return false;
  const int64_t block_bytes = TeamLinear::block_bytes(kind), blocks = w->size(1) / block_bytes;
  if (w->size(0) * qgemm::kRows != N || w->size(1) % block_bytes != 0 ||
      blocks * qgemm::kBlock != K) {
    return false;
  }
  if (kind == 5) return s->dim() == 1 && s->size(0) == N;
  return s->dim() == 4 && s->size(0) == w->size(0) && s->size(1) > 0 &&
         blocks % s->size(1) == 0 && s->size(2) == 2 && s->size(3) == qgemm::kRows;
}

}  // namespace

// Whether the team step computes in `dtype`: float32 or bfloat16 (the decode attention reads
// either cache on every ISA).
bool DecoderStack::team_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16;
}

int64_t DecoderStack::team_head_rows(int64_t hidden) const {
  const TeamPlan* plan = team_plan(hidden);
  return plan != nullptr && plan->head.has_value() ? plan->head->N : 0;
}

// The plan of the team step for rows of `hidden`, or null where a layer does not fit it (what
// does not change from step to step: worked out once per hidden size).
const TeamPlan* DecoderStack::team_plan(int64_t hidden) const {
  if (team_checked_hidden_ == hidden) return team_plan_.get();
  team_checked_hidden_ = hidden;
  team_plan_.reset();
  if (layers_.empty() || !team_dtype(layers_[0].norm1.scalar_type())) return nullptr;
  auto plan = std::make_shared<TeamPlan>();
  plan->hidden = hidden;
  plan->dtype = layers_[0].norm1.scalar_type();
  for (const Layer& l : layers_) {
    const int64_t heads = l.heads[0], kv_heads = l.heads[1], dim = l.heads[2];
    if (l.heads != layers_[0].heads || (dim != 64 && dim != 128 && dim != 256) ||
        l.norm1.numel() != hidden || l.norm2.numel() != hidden ||
        l.norm1.scalar_type() != plan->dtype || l.norm2.scalar_type() != plan->dtype ||
        !l.norm1.is_contiguous() || !l.norm2.is_contiguous()) {
      return nullptr;
    }
    const std::optional<at::Tensor> gate_up = l.linears.get(6);
    if (!gate_up.has_value() || gate_up->dim() != 2) return nullptr;
    const int64_t inter = gate_up->size(0) * qgemm::kRows / 2;
    if (!linear_fits(l.kinds[0], l.linears, 0, (heads + 2 * kv_heads) * dim, hidden) ||
        !linear_fits(l.kinds[1], l.linears, 1, hidden, heads * dim) ||
        !linear_fits(l.kinds[2], l.linears, 2, 2 * inter, hidden) ||
        !linear_fits(l.kinds[3], l.linears, 3, hidden, inter)) {
      return nullptr;
    }
    auto make = [&](int64_t j) {
      return TeamLinear(l.kinds[j], *l.linears.get(3 * j), *l.linears.get(3 * j + 1));
    };
    plan->lin.push_back({make(0), make(1), make(2), make(3)});
    plan->qkv_n = std::max(plan->qkv_n, plan->lin.back()[0].N);
    plan->widest = std::max(plan->widest, plan->lin.back()[2].N);
  }
  if (ends_.has_value() && ends_->norm.scalar_type() == plan->dtype &&
      ends_->norm.is_contiguous() && ends_->norm.numel() == hidden &&
      ends_->head_qweight.dim() == 2) {
    const c10::List<std::optional<at::Tensor>> head({ends_->head_qweight, ends_->head_scales,
                                                     std::nullopt});
    if (linear_fits(5, head, 0, ends_->head_qweight.size(0) * qgemm::kRows, hidden)) {
      plan->head.emplace(5, ends_->head_qweight, ends_->head_scales);
    }
  }
  team_plan_ = std::move(plan);
  return team_plan_.get();
}

bool DecoderStack::serves_team(const at::Tensor& x, const std::vector<at::Tensor>& k_caches,
                               const std::vector<at::Tensor>& v_caches,
                               const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens) const {
  if (!team_ || !x.is_contiguous() || x.dim() != 2 || x.size(0) < 1 ||
      x.size(0) > kTeamMaxRows) {
    return false;
  }
  const TeamPlan* plan = team_plan(x.size(1));
  if (plan == nullptr || x.scalar_type() != plan->dtype) return false;
  const int64_t rows = x.size(0);
  const at::Tensor &tables = block_tables, &lens = seq_lens;
  if (tables.scalar_type() != at::kInt || tables.dim() != 2 || tables.stride(1) != 1 ||
      lens.scalar_type() != at::kInt || !lens.is_contiguous() ||
      slot_mapping.scalar_type() != at::kLong || slot_mapping.numel() != rows ||
      lens.numel() != rows || tables.size(0) != rows) {
    return false;
  }
  for (size_t i = 0; i < layers_.size(); ++i) {
    const at::Tensor &k = k_caches[i], &v = v_caches[i];
    const std::vector<int64_t>& heads = layers_[i].heads;
    if (k.scalar_type() != plan->dtype || v.scalar_type() != plan->dtype ||
        !k.is_contiguous() || !v.is_contiguous() || k.dim() != 4 || k.sizes() != v.sizes() ||
        k.size(2) != heads[1] || k.size(3) != heads[2]) {
      return false;
    }
  }
  return true;
}

void DecoderStack::forward_team(at::Tensor x, const void* const* cos_rows,
                                const void* const* sin_rows,
                                const std::vector<at::Tensor>& k_caches,
                                const std::vector<at::Tensor>& v_caches,
                                const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, int64_t sliding_window,
                                void* logits, int64_t* tokens) {
  const bool split = x.size(0) > kTeamRows;
  if (x.scalar_type() == at::kBFloat16) {
    const auto step = split ? &DecoderStack::team_step_rows<c10::BFloat16>
                            : &DecoderStack::team_step<c10::BFloat16>;
    (this->*step)(x, cos_rows, sin_rows, k_caches, v_caches, slot_mapping, block_tables,
                  seq_lens, sliding_window, logits, tokens);
  } else {
    const auto step =
        split ? &DecoderStack::team_step_rows<float> : &DecoderStack::team_step<float>;
    (this->*step)(x, cos_rows, sin_rows, k_caches, v_caches, slot_mapping, block_tables,
                  seq_lens, sliding_window, logits, tokens);
  }
}

template <typename T>
void DecoderStack::team_step(at::Tensor x, const void* const* cos_rows,
                             const void* const* sin_rows,
                             const std::vector<at::Tensor>& k_caches,
                             const std::vector<at::Tensor>& v_caches,
                             const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, int64_t sliding_window, void* logits,
                             int64_t* tokens) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const TeamPlan* plan = team_plan(hidden);  // serves_team saw it
  const auto& lin = plan->lin;
  const int64_t qkv_n = plan->qkv_n, widest = plan->widest;
  // The shared outputs, one per linear (its readers are done before its next writer starts:
  // a barrier always lies between), and the attention's.
  const Layer& first = layers_[0];
  const int64_t heads = first.heads[0], kv_heads = first.heads[1], dim = first.heads[2];
  at::Tensor qkv = at::empty({rows, qkv_n}, x.options());
  at::Tensor attn = at::empty({rows, heads, dim}, x.options());
  at::Tensor o = at::empty({rows, hidden}, x.options());
  at::Tensor gate_up = at::empty({rows, widest}, x.options());
  at::Tensor down = at::empty({rows, hidden}, x.options());
  const at::Tensor q = qkv.narrow(1, 0, heads * dim).view({rows, heads, dim});
  const at::Tensor slots_c = slot_mapping.contiguous();
  const int64_t* slots = slots_c.data_ptr<int64_t>();
  T *qkv_p = qkv.data_ptr<T>(), *attn_p = attn.data_ptr<T>();
  T *o_p = o.data_ptr<T>(), *gu_p = gate_up.data_ptr<T>();
  T *down_p = down.data_ptr<T>(), *x_p = x.data_ptr<T>();
  Team team;
  ++team_steps_;
  // Greedy tokens: each thread's best over its share of the head's columns, combined below.
  const int64_t team_size = at::get_num_threads();
  std::vector<Best> best(tokens != nullptr ? team_size * rows : 0, Best{-INFINITY, -1, false});
#pragma omp parallel num_threads(team_size)
  {
    const TeamMember member(&team);
    thread_local std::vector<T> own;  // residual [rows, hidden], h [rows, hidden], act
    own.resize(2 * rows * hidden + rows * widest / 2);
    T *xr = own.data(), *h = xr + rows * hidden, *act = h + rows * hidden;
    std::memcpy(xr, x_p, sizeof(T) * rows * hidden);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      const auto& L = lin[i];
      const T *n1 = l.norm1.data_ptr<T>(), *n2 = l.norm2.data_ptr<T>();
      const int64_t kv = kv_heads * dim, inter = L[2].N / 2;
      for (int64_t r = 0; r < rows; ++r) {
        norm_row(xr + r * hidden, n1, h + r * hidden, hidden, static_cast<float>(l.eps));
      }
      L[0](h, rows, qkv_p);
      if (omp_get_thread_num() == 0) {
        for (int64_t r = 0; r < rows; ++r) {
          T* row = qkv_p + r * qkv_n;
          const T* c = static_cast<const T*>(cos_rows[r]);
          const T* s = static_cast<const T*>(sin_rows[r]);
          for (int64_t hd = 0; hd < heads + kv_heads; ++hd) {
            rope_row(row + hd * dim, c, s, dim / 2);
          }
          if (slots[r] < 0) continue;
          T* kc = k_caches[i].data_ptr<T>() + slots[r] * kv;
          T* vc = v_caches[i].data_ptr<T>() + slots[r] * kv;
          std::memcpy(kc, row + heads * dim, sizeof(T) * kv);
          std::memcpy(vc, row + heads * dim + kv, sizeof(T) * kv);
        }
      }
#pragma omp barrier
      decode_attention_fast(attn, q, k_caches[i], v_caches[i], block_tables, seq_lens,
                              l.scale * l.k_scale, sliding_window, l.v_scale);
      L[1](attn_p, rows, o_p);
      for (int64_t r = 0; r < rows; ++r) {  // x += o (rounded as torch's add), h = norm(x)
        T* xrow = xr + r * hidden;
        const T* orow = o_p + r * hidden;
        for (int64_t c = 0; c < hidden; ++c) {
          xrow[c] = from_f<T>(to_f(xrow[c]) + to_f(orow[c]));
        }
        norm_row(xrow, n2, h + r * hidden, hidden, static_cast<float>(l.eps));
      }
      L[2](h, rows, gu_p);
      for (int64_t r = 0; r < rows; ++r) {
        const T* g = gu_p + r * L[2].N;
        silu_mul_row(g, g + inter, act + r * inter, inter);
      }
      L[3](act, rows, down_p);
      for (int64_t c = 0; c < rows * hidden; ++c) {
        xr[c] = from_f<T>(to_f(xr[c]) + to_f(down_p[c]));
      }
    }
    if (logits != nullptr) {  // the final norm (each thread its own copy) and the LM head
      const T* n = ends_->norm.data_ptr<T>();
      for (int64_t r = 0; r < rows; ++r) {
        norm_row(xr + r * hidden, n, h + r * hidden, hidden, static_cast<float>(ends_->eps));
      }
      (*plan->head)(h, rows, static_cast<T*>(logits));
      if (tokens != nullptr) {
        best_of_share(static_cast<const T*>(logits), plan->head->N, rows, best.data());
      }
    } else if (omp_get_thread_num() == 0) {
      std::memcpy(x_p, xr, sizeof(T) * rows * hidden);
    }
  }
  if (tokens != nullptr) combine_best(best, team_size, rows, tokens);
}

}  // namespace kvserve
