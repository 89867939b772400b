// Greedy sampling's argmax over a span of logits (float32, bfloat16 or float16), vectorised:
// two AVX-512 passes (the max, then its first index). The answer is torch.argmax's: the first
// index of the largest value, NaN counted as larger than anything (the first NaN wins), -0.0
// equal to +0.0. Spans combine in order (`earlier_best`), so a row split over threads gets the
// same answer.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "convert.h"

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
  float m = -INFINITY;
  bool nan = false;
#if defined(__AVX512F__)
  __m512 mx = _mm512_set1_ps(-INFINITY);
  __mmask16 unordered = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16(x + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mx = _mm512_max_ps(mx, v);
  }
  m = _mm512_reduce_max_ps(mx);
  nan = unordered != 0;
#endif
  for (; i < n; ++i) {
    const float v = to_f(x[i]);
    nan = nan || std::isnan(v);
    m = v > m ? v : m;
  }
  if (nan) {
    for (i = 0; i < n; ++i) {
      if (std::isnan(to_f(x[i]))) return {to_f(x[i]), i, true};
    }
  }
  i = 0;
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(load16(x + i), mv, _CMP_EQ_OQ);
    if (eq != 0) return {m, i + __builtin_ctz(eq), false};
  }
#endif
  for (; i < n; ++i) {
    if (to_f(x[i]) == m) return {m, i, false};
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
