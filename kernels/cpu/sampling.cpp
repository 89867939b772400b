// Greedy sampling's argmax over float32 logits rows, vectorised: torch's argmax along the
// vocabulary ran one row at a time at ~2.3 G elements/s here (1.3 ms of a 64-row SmolLM2
// step, its 49,152-entry rows); two AVX-512 passes per row (the max, then its first index),
// rows split over the threads, take a tenth of that.
//
// Same answer as torch.argmax(x, -1): the first index of the row's maximum, with NaN counted
// as larger than anything (the first NaN wins) and -0.0 equal to +0.0.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "ops.h"

namespace kvserve {
namespace {

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
  }
  return -1;
}

int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0;
  float m = -INFINITY;
  bool nan = false;
#if defined(__AVX512F__)
  __m512 mx = _mm512_set1_ps(-INFINITY);
  __mmask16 unordered = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mx = _mm512_max_ps(mx, v);
  }
  m = _mm512_reduce_max_ps(mx);
  nan = unordered != 0;
#endif
  for (; i < n; ++i) {
    nan = nan || std::isnan(x[i]);
    m = x[i] > m ? x[i] : m;
  }
  if (nan) return first_nan(x, n);
  i = 0;
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), mv, _CMP_EQ_OQ);
    if (eq != 0) return i + __builtin_ctz(eq);
  }
#endif
  for (; i < n; ++i) {
    if (x[i] == m) return i;
  }
  return 0;  // n == 0 is refused by the caller; an all -inf row ends above
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  logits.stride(1) == 1 && logits.size(1) > 0,
              "argmax_rows: logits must be float32 [rows, vocab > 0] with unit stride along "
              "the vocabulary, got ", logits.sizes(), " ", logits.scalar_type());
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 2, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) o[r] = argmax_row(x + r * stride, n);
  });
  return out;
}

}  // namespace kvserve
