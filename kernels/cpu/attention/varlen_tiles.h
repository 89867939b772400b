// The inner loops of varlen_attention.cpp: a tile's scores and values for 16 or 32 query rows
// at a time (the rows are the vector lanes), in float FMAs, and over a bfloat16 cache in bf16
// dot products (vec::dot_pairs; AVX512-BF16's `vdpbf16ps`: two bf16 products, exact in float,
// added to a float lane per instruction, twice the float FMA's rate): scores straight from the
// cache rows, values paired along the keys; and the online softmax between them.
//
// Two 16-row groups side by side (G = 2) share each key's broadcast between two vectors: 16
// FMAs per 10 loads instead of 8 per 9. The accumulators' rescale when a row's max grows is
// folded into the values' load of them (it was a pass of its own over every head dim, ~9% of
// a deep chunk's time).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "attention/paged.h"
#include "vec/vec.h"

namespace kvserve {
namespace varlen {

constexpr int64_t kKeys = 16;   // keys per tile
constexpr int64_t kLanes = 16;  // query rows per vector: the loops run across rows
constexpr int64_t kBlock = 8;   // keys (scores) or head dims (values) per register block

// s[j][l] = k[j] . q[l] for G 16-row groups side by side (s: [kKeys][G x 16]); qt holds the
// rows transposed ([dim][stride], these groups' columns at qt), kr the tile's keys as rows
// ([kKeys][dim]).
template <int64_t G>
inline void tile_scores(const float* qt, int64_t stride, const float* kr, int64_t n,
                        int64_t dim, float* s) {
  constexpr int64_t L = G * kLanes;
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const float* key[kBlock];
    for (int64_t k = 0; k < kBlock; ++k) key[k] = kr + std::min(j0 + k, n - 1) * dim;
    float acc[kBlock][L] = {};
    for (int64_t d = 0; d < dim; ++d) {
      const float* qd = qt + d * stride;
      for (int64_t k = 0; k < kBlock; ++k) {
        const float kv = key[k][d];
#pragma omp simd
        for (int64_t l = 0; l < L; ++l) acc[k][l] += kv * qd[l];
      }
    }
    for (int64_t k = 0; k < kBlock && j0 + k < n; ++k) {
      std::copy(acc[k], acc[k] + L, s + (j0 + k) * L);
    }
  }
}

// at[d][l] = at[d][l] x corr[l] + sum_j p[j][l] v[j][d] for G 16-row groups side by side
// (p: [kKeys][G x 16]; at: [dim][stride] at these groups' columns; vr the tile's values as
// rows, [kKeys][dim]).
template <int64_t G>
inline void tile_values(const float* p, const float* vr, int64_t n, int64_t dim,
                        const float* corr, float* at, int64_t stride) {
  constexpr int64_t L = G * kLanes;
  for (int64_t d0 = 0; d0 + kBlock <= dim; d0 += kBlock) {
    float acc[kBlock][L];
    for (int64_t k = 0; k < kBlock; ++k) {
      const float* ad = at + (d0 + k) * stride;
#pragma omp simd
      for (int64_t l = 0; l < L; ++l) acc[k][l] = ad[l] * corr[l];
    }
    for (int64_t j = 0; j < n; ++j) {
      const float* pj = p + j * L;
      const float* vj = vr + j * dim + d0;
      for (int64_t k = 0; k < kBlock; ++k) {
        const float vv = vj[k];
#pragma omp simd
        for (int64_t l = 0; l < L; ++l) acc[k][l] += vv * pj[l];
      }
    }
    for (int64_t k = 0; k < kBlock; ++k) std::copy(acc[k], acc[k] + L,
                                                  at + (d0 + k) * stride);
  }
  for (int64_t d = dim - dim % kBlock; d < dim; ++d) {  // a head size not a multiple of 8
    float* ad = at + d * stride;
#pragma omp simd
    for (int64_t l = 0; l < L; ++l) ad[l] *= corr[l];
    for (int64_t j = 0; j < n; ++j) {
      const float vv = vr[j * dim + d];
#pragma omp simd
      for (int64_t l = 0; l < L; ++l) ad[l] += vv * p[j * L + l];
    }
  }
}

// Masks one 16-row group's scores (key j's at sc[j x ld]) by position, turns them into this
// tile's probabilities against each row's running max, updates the rows' max and sum, and
// leaves in corr the factor the rows' accumulators must be rescaled by (the values apply it).
inline void softmax_tile(float* sc, int64_t ld, int64_t n, int64_t kb, float score_scale,
                         const float* pos, float* m, float* l, float* corr, int64_t window) {
  float mx[kLanes], sum[kLanes] = {};
  const float fwin = window > 0 ? static_cast<float>(window) : INFINITY;
  for (int64_t lane = 0; lane < kLanes; ++lane) mx[lane] = m[lane];
  for (int64_t j = 0; j < n; ++j) {
    const float key = static_cast<float>(kb + j);
    float* sj = sc + j * ld;
#pragma omp simd
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      const bool seen = key <= pos[lane] && key > pos[lane] - fwin;
      sj[lane] = seen ? sj[lane] * score_scale : -INFINITY;
      mx[lane] = std::max(mx[lane], sj[lane]);
    }
  }
#pragma omp simd
  for (int64_t lane = 0; lane < kLanes; ++lane) {
    corr[lane] = mx[lane] == -INFINITY ? 1.0f : exp_nonpositive(m[lane] - mx[lane]);
  }
  for (int64_t j = 0; j < n; ++j) {
    float* sj = sc + j * ld;
#pragma omp simd
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      const float x = sj[lane];
      const float p = x == -INFINITY ? 0.0f : exp_nonpositive(x - mx[lane]);
      sj[lane] = p;
      sum[lane] += p;
    }
  }
#pragma omp simd
  for (int64_t lane = 0; lane < kLanes; ++lane) {
    l[lane] = l[lane] * corr[lane] + sum[lane];
    m[lane] = mx[lane];
  }
}

// The bf16 tiles below serve a bfloat16 query and cache on every ISA, not only with
// AVX512-BF16's native `vdpbf16ps`: where vec::dot_pairs is emulated (two float FMAs and four
// bit operations a pair) they still beat the float tiles, which copy each K/V tile to float
// first. A 3-sequence batch of 32/16/64-token chunks at context 512, 2 threads, AMD EPYC Zen 4:
// built for x86-64-v3 (AVX2) 1.77 ms against 2.30 ms (9/3 heads of 64) and 10.2 against
// 14.7 ms (32/8 heads of 128); for x86-64-v4 (AVX-512 without BF16) 0.91 against 0.96 ms and
// 6.4 against 7.2 ms. (Not measured on NEON, whose emulation costs the same per pair.)

// Keys per register block of the bf16 scores: a block's accumulators take half the registers
// (8 on AVX-512, 4 on AVX2 and NEON, whose vectors take two and four registers; on AVX2 blocks
// of 4 and 8 keys measured the same, and NEON's 8 would take all 32 of its registers).
constexpr int64_t kDotBlock = std::min<int64_t>(kBlock, vec::vectors_in(vec::kRegisters) / 2);

// tile_scores for a bfloat16 query and cache: q2 holds the rows' (d, d+1) pairs ([dim / 2]
// [lanes] of 32 bits), each key's pair is broadcast straight from its cache row and
// vec::dot_pairs adds both products (exact in float) to the row's score.
inline void tile_scores_bf16(const uint32_t* q2, int64_t stride, const uint32_t* const* kp,
                             int64_t n, int64_t dim, float* s) {
  for (int64_t j0 = 0; j0 < n; j0 += kDotBlock) {
    const uint32_t* key[kDotBlock];
    for (int64_t k = 0; k < kDotBlock; ++k) key[k] = kp[std::min(j0 + k, n - 1)];
    vec::F32x16 acc[kDotBlock];
    for (int64_t k = 0; k < kDotBlock; ++k) acc[k] = vec::zero();
    for (int64_t i = 0; i < dim / 2; ++i) {
      const vec::BF16x32 qv = vec::load_pairs(q2 + i * stride);
      for (int64_t k = 0; k < kDotBlock; ++k) {
        acc[k] = vec::dot_pairs(acc[k], qv, vec::set1_pair(key[k][i]));
      }
    }
    for (int64_t k = 0; k < kDotBlock && j0 + k < n; ++k) {
      vec::store(s + (j0 + k) * kLanes, acc[k]);
    }
  }
}

// The tile's values as (key j, key j + 1) pairs per head dim ([kKeys / 2][dim] of 32 bits,
// an odd last key paired with zeros), read straight from the bfloat16 cache rows.
inline void pair_values(const bf16_t* const* vp, int64_t n, int64_t dim, uint32_t* v2) {
  static const bf16_t zeros[16] = {};
  for (int64_t jp = 0; jp < (n + 1) / 2; ++jp) {
    const bf16_t *a = vp[2 * jp], *b = 2 * jp + 1 < n ? vp[2 * jp + 1] : nullptr;
    for (int64_t d = 0; d < dim; d += 16) {
      vec::store_pairs(v2 + jp * dim + d, vec::interleave_pairs(a + d, b ? b + d : zeros));
    }
  }
}

// tile_values for bfloat16 values: the group's probabilities rounded to bfloat16 (as c10
// rounds) and paired along the keys like the values, so that vec::dot_pairs adds two keys'
// products per instruction.
inline void tile_values_bf16(const float* p, const uint32_t* v2, int64_t n, int64_t dim,
                             const float* corr, float* at, int64_t stride) {
  const vec::F32x16 cv = vec::load(corr);
  vec::BF16x32 p2[kKeys / 2];
  const int64_t pairs = (n + 1) / 2;
  for (int64_t jp = 0; jp < pairs; ++jp) {
    bf16_t lo[kLanes], hi[kLanes];
    vec::store(lo, vec::load(p + 2 * jp * kLanes));
    vec::store(hi, 2 * jp + 1 < n ? vec::load(p + (2 * jp + 1) * kLanes) : vec::zero());
    p2[jp] = vec::interleave_pairs(lo, hi);
  }
  for (int64_t d0 = 0; d0 < dim; d0 += kBlock) {
    vec::F32x16 acc[kBlock];
    for (int64_t k = 0; k < kBlock; ++k) acc[k] = vec::load(at + (d0 + k) * stride) * cv;
    for (int64_t jp = 0; jp < pairs; ++jp) {
      for (int64_t k = 0; k < kBlock; ++k) {
        acc[k] = vec::dot_pairs(acc[k], p2[jp], vec::set1_pair(v2[jp * dim + d0 + k]));
      }
    }
    for (int64_t k = 0; k < kBlock; ++k) vec::store(at + (d0 + k) * stride, acc[k]);
  }
}

}  // namespace varlen
}  // namespace kvserve
