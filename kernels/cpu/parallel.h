// Splitting a loop over threads: torch's at::parallel_for in the extension, a plain loop in the
// torch-free kernel harness (KVSERVE_NO_TORCH), so that kernel bodies build without torch.
#pragma once

#include <cstdint>

#ifndef KVSERVE_NO_TORCH
#include <ATen/Parallel.h>
#endif

namespace kvserve {

template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
#ifndef KVSERVE_NO_TORCH
  at::parallel_for(begin, end, grain, f);
#else
  (void)grain;
  if (begin < end) f(begin, end);
#endif
}

inline int64_t num_threads() {
#ifndef KVSERVE_NO_TORCH
  return at::get_num_threads();
#else
  return 1;
#endif
}

}  // namespace kvserve
