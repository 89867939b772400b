// Helpers shared by the paged attention kernels (attention.cpp, attention_avx512.cpp,
// varlen_attention.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvserve {

// exp(x) for x <= 0 (scores minus their maximum), in a form the compiler vectorises:
// x = k ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial, times 2^k built in
// the exponent bits; relative error under 4e-6 over [-87, 0] (measured). Below -87 it returns
// e^-87, a weight no softmax sum notices.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float k = std::nearbyint(x * 1.44269504f);
  const float r = x - k * 0.693145752f - k * 1.42860677e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Calls fn(index from `first`, first cache slot, count) for each run of positions first..end-1
// of a sequence whose blocks `table_row` lists that share a block (their slots consecutive);
// on_block(b) runs before block b's run.
struct NoBlockHook {
  void operator()(int64_t) const {}
};
template <typename Fn, typename OnBlock = NoBlockHook>
inline void for_each_run(const int32_t* table_row, int64_t block_size, int64_t first,
                         int64_t end, Fn&& fn, OnBlock&& on_block = {}) {
  for (int64_t b = first / block_size; b * block_size < end; ++b) {
    on_block(b);
    const int64_t start = b * block_size, pos = std::max(first, start);
    fn(pos - first, static_cast<int64_t>(table_row[b]) * block_size + pos - start,
       std::min(end, start + block_size) - pos);
  }
}

// fn(index from `first`, cache slot) for each of those positions, block by block (no division
// per position).
template <typename Fn, typename OnBlock = NoBlockHook>
inline void for_each_slot(const int32_t* table_row, int64_t block_size, int64_t first,
                          int64_t end, Fn&& fn, OnBlock&& on_block = {}) {
  for_each_run(table_row, block_size, first, end, [&](int64_t p, int64_t slot, int64_t count) {
    for (int64_t i = 0; i < count; ++i) fn(p + i, slot + i);
  }, on_block);
}

// Asks for block `block`'s rows (its `block_bytes` in `cache` and in `cache2`) into L2.
inline void prefetch_block(const char* cache, const char* cache2, int64_t block,
                           int64_t block_bytes) {
  const int64_t at = block * block_bytes;
  for (int64_t off = 0; off < block_bytes; off += 64) {
    __builtin_prefetch(cache + at + off, 0, 2);
    __builtin_prefetch(cache2 + at + off, 0, 2);
  }
}

// for_each_run that also asks for the cache rows of the block `ahead` blocks on (all of its
// `block_bytes` from `cache` and from `cache2`, into L2) before each block's run, when `cache`
// is given (the first block asks for the blocks up to `ahead`). A decode item reads its heads'
// part of each row, a few lines of every row; from a cold cache those reads waited on memory
// one by one (64 sequences at context 150 over 30 layers: 35-40 ms cold against 18 ms warm).
template <typename Fn>
inline void for_each_run_ahead(const int32_t* table_row, int64_t block_size, int64_t first,
                               int64_t end, const char* cache, const char* cache2,
                               int64_t block_bytes, int64_t ahead, Fn&& fn) {
  if (cache == nullptr) return for_each_run(table_row, block_size, first, end, fn);
  const int64_t first_block = first / block_size, last_block = (end - 1) / block_size;
  for_each_run(table_row, block_size, first, end, fn, [&](int64_t b) {
    for (int64_t n = b == first_block ? b + 1 : b + ahead; n <= std::min(last_block, b + ahead);
         ++n) {
      prefetch_block(cache, cache2, table_row[n], block_bytes);
    }
  });
}

// The cache rows (K and V) of the next work item's sequence, asked for a few lines at a time
// while this item computes (`pump` from its inner loops), so that memory works while the
// dot products do; asking for a whole block at once filled the miss buffers and stalled them.
struct RowStream {
  const char *k = nullptr, *v = nullptr;
  const int32_t* table = nullptr;
  int64_t block_bytes = 0, block = 0, end = 0, offset = 0, per_pump = 0;

  // The blocks of [first, ctx) of the sequence whose table row is `table_row`, spread over
  // `pumps` calls of pump.
  void aim(const char* k_, const char* v_, const int32_t* table_row, int64_t block_size,
           int64_t first, int64_t ctx, int64_t block_bytes_, int64_t pumps) {
    k = k_;
    v = v_;
    table = table_row;
    block_bytes = block_bytes_;
    block = first / block_size;
    end = ctx > first ? (ctx - 1) / block_size + 1 : block;
    offset = 0;
    const int64_t lines = (end - block) * (block_bytes / 64);
    per_pump = pumps > 0 ? (lines + pumps - 1) / pumps : lines;
  }
  void pump() {
    for (int64_t i = 0; i < per_pump && block < end; ++i) {
      const int64_t at = table[block] * block_bytes + offset;
      __builtin_prefetch(k + at, 0, 2);
      __builtin_prefetch(v + at, 0, 2);
      offset += 64;
      if (offset >= block_bytes) {
        offset = 0;
        ++block;
      }
    }
  }
};

// The K and V cache rows of one key tile ahead of a varlen_attention item's reads (positions
// [first, end) of its sequence), asked for into L2 a share per KV head's pass over the current
// tile (`pump`), so memory streams the context while the tiles compute. Without it a short
// chunk deep into a long prompt read its context from memory at ~5 GB/s (SmolLM2, bf16 cache,
// 4 tokens at context 7,800: 34 ms of attention a step over 30 layers cold, 16 ms warm; with
// it 18 ms cold; AMD EPYC Zen 4, 2 threads).
struct TileStream {
  int64_t runs = 0, lines = 0, per_pump = 0, done = 0;
  int64_t first_slot[2] = {}, count[2] = {};  // its first two slot runs (all, for blocks >= 16)
  int64_t row_bytes = 0;

  void aim(const int32_t* table_row, int64_t block_size, int64_t first, int64_t end,
           int64_t row_bytes_, int64_t pumps) {
    runs = lines = done = 0;
    row_bytes = row_bytes_;
    if (first >= end) return;
    for_each_run(table_row, block_size, first, end, [&](int64_t, int64_t slot, int64_t n) {
      if (runs < 2) {
        first_slot[runs] = slot;
        count[runs++] = n;
        lines += (n * row_bytes + 63) / 64;
      }
    });
    per_pump = (lines + pumps - 1) / pumps;
  }
  void pump(const char* k, const char* v) {
    for (int64_t i = 0; i < per_pump && done < lines; ++i, ++done) {
      int64_t line = done, r = 0;
      const int64_t first_lines = (count[0] * row_bytes + 63) / 64;
      if (line >= first_lines) {
        line -= first_lines;
        r = 1;
      }
      const int64_t at = first_slot[r] * row_bytes + line * 64;
      __builtin_prefetch(k + at, 0, 2);
      __builtin_prefetch(v + at, 0, 2);
    }
  }
};

// Work items of a decode attention call: a sequence's KV heads in `chunks` runs of
// `per_chunk`, each item reading its heads' part of every cache row once (one contiguous run
// per token). One run per sequence when there are enough sequences to keep the threads busy;
// at batch 1 the heads split over the threads.
struct WorkSplit {
  int64_t chunks, per_chunk;
  WorkSplit(int64_t num_seqs, int64_t kv_heads, int64_t threads)
      : chunks(std::min<int64_t>(kv_heads, std::max<int64_t>(1, (2 * threads + num_seqs - 1) /
                                                                    num_seqs))),
        per_chunk((kv_heads + chunks - 1) / chunks) {}
};

// Each of `heads` rows of n scores becomes exp(score - the row's max), in place; sums[h] gets
// row h's sum (the softmax's denominator) and, given, maxes[h] that max.
inline void softmax_numerators(float* scores, int64_t heads, int64_t n, float* sums,
                               float* maxes = nullptr) {
  for (int64_t h = 0; h < heads; ++h) {
    float* sc = scores + h * n;
    float m = -INFINITY;
    // std::max's loop stayed scalar: a 4-cycle vmaxss chain, ~15% of a batch-1 decode
    // attention call at 150 keys (SmolLM2, AVX-512)
#pragma omp simd reduction(max : m)
    for (int64_t p = 0; p < n; ++p) m = sc[p] > m ? sc[p] : m;
    float sum = 0.0f;
    // a scalar std::exp per score was a third of the kernel's time (and ATen's exp_ may not be
    // called here: a nested parallel region stalls every OpenMP team)
#pragma omp simd reduction(+ : sum)
    for (int64_t p = 0; p < n; ++p) {
      sc[p] = exp_nonpositive(sc[p] - m);
      sum += sc[p];
    }
    sums[h] = sum;
    if (maxes != nullptr) maxes[h] = m;
  }
}

}  // namespace kvserve
