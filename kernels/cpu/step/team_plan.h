// The team decode steps' description of a model (decode_team.cpp builds it once, the steps of
// decode_team.cpp and decode_team_rows.cpp read it): each layer's four linears as tile weight
// views, and the widths of the buffers between them.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <vector>

#include "sampling/argmax.h"
#include "quant/qgemm_int8.h"

namespace kvserve {

// One linear of kind 4 (int4 tiles), 5 (int8 tiles), 6 (8-bit code tiles) or 7 (5-bit code
// tiles): its weight views, built once.
struct TeamLinear {
  int64_t kind, N, K, blocks, groups;
  const void *codes, *scales;
  at::ScalarType scale_type;

  static int64_t block_bytes(int64_t kind) { return kind == 4 ? 256 : kind == 7 ? 320 : 512; }
  TeamLinear(int64_t kind_, const at::Tensor& qweight, const at::Tensor& s)
      : kind(kind_), N(qweight.size(0) * qgemm::kRows),
        blocks(qweight.size(1) / block_bytes(kind_)),
        groups(kind_ == 5 ? 1 : s.size(1)), codes(qweight.data_ptr()), scales(s.data_ptr()),
        scale_type(s.scalar_type()) {
    K = blocks * qgemm::kBlock;
  }

  // f(the weight view): Q4, U8, U5 or Q8 over the scales' type S
  template <typename S, typename F>
  void visit_as(F&& f) const {
    const S* sp = static_cast<const S*>(scales);
    const auto* u = static_cast<const uint8_t*>(codes);
    if (kind == 4) {
      f(qgemm::Q4<S>{u, sp, K, blocks, groups, blocks / groups});
    } else if (kind == 6) {
      f(qgemm::U8<S>{u, sp, K, blocks, groups, blocks / groups});
    } else if (kind == 7) {
      f(qgemm::U5<S>{u, sp, K, blocks, groups, blocks / groups});
    } else {
      f(qgemm::Q8<S>{static_cast<const int8_t*>(codes), sp, K, blocks});
    }
  }
  template <typename F>
  void visit(F&& f) const {
    if (scale_type == at::kHalf) visit_as<c10::Half>(f);
    else if (scale_type == at::kBFloat16) visit_as<c10::BFloat16>(f);
    else visit_as<float>(f);
  }
  // y [M, N] = x [M, K] W^T, split over the team (ends at a barrier); every thread
  // quantizes all of x for itself (few rows: cheaper than a barrier)
  template <typename T>
  void operator()(const T* x, int64_t M, T* y) const {
    visit([&](const auto& w) { qgemm::int8_path(w, x, M, N, K, y); });
  }
  // The same with x's rows split over the team: this thread quantizes rows [r0, r1) into
  // `buf` (the same buffer for every thread, of qgemm::QuantRows::bytes for x), then all
  // threads' tiles read every row.
  template <typename T>
  void operator()(const T* x, int64_t M, int64_t r0, int64_t r1, char* buf, T* y) const {
    visit([&](const auto& w) { qgemm::int8_path_rows(w, x, M, N, K, r0, r1, buf, y); });
  }
};

// After a team's LM head over logits [rows, vocab]: this thread's best column of each row
// among those split_for gave it (still in its cache), into best[thread * rows + row].
template <typename T>
void best_of_share(const T* logits, int64_t vocab, int64_t rows, Best* best) {
  const int64_t tiles = vocab / qgemm::kRows, id = omp_get_thread_num();
  const int64_t share = (tiles + omp_get_num_threads() - 1) / omp_get_num_threads();
  const int64_t c0 = std::min(tiles, id * share) * qgemm::kRows;
  const int64_t c1 = std::min(tiles, (id + 1) * share) * qgemm::kRows;
  for (int64_t r = 0; r < rows; ++r) {
    Best b = best_of(logits + r * vocab + c0, c1 - c0);
    if (b.index >= 0) b.index += c0;
    best[id * rows + r] = b;
  }
}

// Each row's token from the threads' bests, combined in column order (torch.argmax's ties).
inline void combine_best(const std::vector<Best>& best, int64_t team_size, int64_t rows,
                         int64_t* tokens) {
  for (int64_t r = 0; r < rows; ++r) {
    Best row{-INFINITY, -1, false};
    for (int64_t t = 0; t < team_size; ++t) row = earlier_best(row, best[t * rows + r]);
    tokens[r] = row.index;
  }
}

// Each layer's four linears (qkv, o, gate_up, down) and the widest qkv and gate_up outputs, for
// rows of `hidden`: what team_plan works out once.
// With the model's ends set (set_ends) and fitting, also the LM head.
struct TeamPlan {
  int64_t hidden, qkv_n = 0, widest = 0;
  at::ScalarType dtype;  // the activations', the norms' and the caches'
  std::vector<std::array<TeamLinear, 4>> lin;
  std::optional<TeamLinear> head;
};

}  // namespace kvserve
