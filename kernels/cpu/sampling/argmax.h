// Greedy sampling's argmax over a span of logits (float32, bfloat16 or float16), vectorised
// over the vector layer: two passes (the max, then its first index). The answer is
// torch.argmax's: the first index of the largest value, NaN counted as larger than anything
// (the first NaN wins), -0.0 equal to +0.0. Spans combine in order (`earlier_best`), so a row
// split over threads gets the same answer.
#pragma once

#include <cmath>
#include <cstdint>

#include "vec/vec.h"

namespace kvserve {

struct Best {
  float value;
  int64_t index;  // -1: an empty span
  bool nan;       // index is then the span's first NaN
};

template <typename T>
Best best_of(const T* x, int64_t n) {
  if (n <= 0) return {-INFINITY, -1, false};
  int64_t i = 0;
  // NaN is tracked on the side (any_nan): where there is one, it alone decides.
  vec::F32x16 mx = vec::set1(-INFINITY);
  bool nan = false;
  for (; i + 16 <= n; i += 16) {
    const vec::F32x16 v = vec::load(x + i);
    nan = nan || vec::any_nan(v);
    mx = vec::max(mx, v);
  }
  float m = vec::reduce_max(mx);
  for (; i < n; ++i) {
    const float v = to_float(x[i]);
    nan = nan || std::isnan(v);
    m = v > m ? v : m;
  }
  if (nan) {
    for (i = 0; i < n; ++i) {
      if (std::isnan(to_float(x[i]))) return {to_float(x[i]), i, true};
    }
  }
  for (i = 0; i + 16 <= n; i += 16) {
    const int lane = vec::first_equal(vec::load(x + i), m);
    if (lane >= 0) return {m, i + lane, false};
  }
  for (; i < n; ++i) {
    if (to_float(x[i]) == m) return {m, i, false};
  }
  return {m, 0, false};  // not reached: m is one of the values (all -inf: the first)
}

// The Best of span a followed by span b (b's index already offset past a's).
inline Best earlier_best(const Best& a, const Best& b) {
  if (a.index < 0) return b;
  if (b.index < 0 || a.nan) return a;
  if (b.nan) return b;
  return b.value > a.value ? b : a;
}

}  // namespace kvserve
