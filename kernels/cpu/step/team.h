// One OpenMP parallel region for a whole decode step (decode_team.cpp): a batch-1 SmolLM2 token
// opened ~150 regions (5 per layer: 4 linears and the attention), and each fork and join,
// plus the ATen calls between them, left one of the two threads idle for a quarter of the
// step. Inside a Team the kernels that split work (the quantized linears, the decode
// attention) take their share by thread number and meet at a barrier instead of opening a
// region; outside one, `split_for` is parallel_for (at::parallel_for in the extension).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallel.h"

namespace kvserve {

struct Team {
  std::vector<float> scratch;  // shared_floats' buffer
};

// The Team this thread is working in (set by TeamMember for the region's length), or null.
inline thread_local Team* tl_team = nullptr;

struct TeamMember {
  explicit TeamMember(Team* team) { tl_team = team; }
  ~TeamMember() { tl_team = nullptr; }
  TeamMember(const TeamMember&) = delete;
  TeamMember& operator=(const TeamMember&) = delete;
};

// f(begin, end) over [begin, end): in a Team, this thread's contiguous share (the split
// at::parallel_for makes), then a barrier, so that every thread sees the whole result; every
// thread of the Team must make the call. Elsewhere at::parallel_for.
template <typename F>
void split_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (tl_team == nullptr) {
    parallel_for(begin, end, grain, f);
    return;
  }
  const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
  const int64_t share = (end - begin + threads - 1) / threads;
  const int64_t b = begin + id * share, e = std::min(end, b + share);
  if (b < e) f(b, e);
#pragma omp barrier
}

// A float buffer of n elements every thread of the Team gets the same pointer to (the Team's
// scratch, after a barrier), or `own`, resized, outside a Team.
inline float* shared_floats(std::vector<float>& own, size_t n) {
  if (tl_team == nullptr) {
    own.resize(n);
    return own.data();
  }
  Team* team = tl_team;
#pragma omp single
  {
    if (team->scratch.size() < n) team->scratch.resize(n);
  }  // the single's barrier: the resize is done before anyone reads
  return team->scratch.data();
}

}  // namespace kvserve
