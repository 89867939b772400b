// The int8-dot path of kvserve's quantized linears (qgemm.cpp), written once over the vector
// layer (vec/vec.h): the activations quantized to int8 per block of 32 (scale max|x| / 127, as
// GGUF's Q8 blocks are), multiplied by the codes with the ISA's u8 x s8 dot product (VNNI's
// dpbusd, AVX2's maddubs, NEON's sdot), scaled per block in float; int4's mins meet the sums
// of the quantized x.

#pragma once

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "quant/qgemm.h"
#include "quant/quant_rows.h"
#include "step/team.h"

namespace kvserve {
namespace qgemm {

// Calls f(std::integral_constant<int, n>) for a run-time n in 1..Max: the register tiles are
// compiled for each row count.
template <int Max, typename F>
inline void with_rows(int64_t n, F&& f) {
  if constexpr (Max > 0) {
    if (n == Max) {
      f(std::integral_constant<int, Max>{});
    } else {
      with_rows<Max - 1>(n, f);
    }
  }
}

// The 8 operands' sums for the R rows of a pass against one block (xq: the pass's codes at
// the block, see QuantRows::quads): 16 lanes, one per output row. The dot products run as
// independent chains (per row, and split per row when rows are few) so that their latency
// overlaps.
template <int Bits, int R>
inline void block_dots(const vec::U8x64 (&ops)[8], const int32_t* xq, vec::I32x16 (&sums)[R]) {
  constexpr int kChains = R >= 4 ? 1 : (R >= 2 ? 2 : 4);
  vec::I32x16 part[R][kChains];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < kChains; ++h) part[r][h] = vec::zero_i32();
  for (int c = 0; c < 8; ++c)
    for (int r = 0; r < R; ++r)
      part[r][c % kChains] = vec::dot4<Bits>(part[r][c % kChains], ops[c], xq[c * R + r]);
  for (int r = 0; r < R; ++r) {
    sums[r] = part[r][0];
    for (int h = 1; h < kChains; ++h) sums[r] = sums[r] + part[r][h];
  }
}

// The kernels ask for the weights ahead of the pass that reads them: the one-row kernels and
// the int8 tiles kAheadBlocks blocks on, the int4 pairs the next pair's block, each in the
// last pass of x's rows over its tile (the passes before find the tile in L1; a 512-row
// prefill asking in every pass was ~3% slower). The hardware prefetchers start afresh at every
// 4 KiB page, and a few rows of x read each weight byte about once, so those linears are
// streams from memory. Measured 2026-12-02 (Xeon, SmolLM2 GGUF, 2 threads, processes
// interleaved, decode steps in ms): batch 1 5.6-7.6 -> 4.4-5.9 (4 KiB of int4 codes ahead;
// 1 KiB inside noise, 8 and 16 KiB no better), 2: 6.7-7.1 -> 5.2-5.5, 4: 8.1-8.9 -> 6.4-6.5,
// 8: 12.1-14.1 -> 11.4-11.9, 16: 21.7-22.6 -> 19.2-20.3; at 64 no change past noise (60-67
// both), nor in a 512-token prefill (1,780-2,090 tokens/s both).
constexpr int64_t kAheadBlocks = 16;

// Operands j and j + 4 of tile block p (see QBlocks): 4-bit ones from the nibbles of run j,
// 5-bit ones with their fifth bits added from the block's bit words, 8-bit ones as they are.
template <int Bits>
inline void operand_pair(const uint8_t* p, int j, vec::U8x64& lo, vec::U8x64& hi) {
  if constexpr (Bits == 8) {
    lo = vec::load_u8(p + 64 * j);
    hi = vec::load_u8(p + 64 * (j + 4));
  } else {
    const vec::U8x64 v = vec::load_u8(p + 64 * j);
    lo = vec::and_bytes(v, 0x0F);
    hi = vec::high_nibbles(v);
    if constexpr (Bits == 5) {
      uint64_t bits[2];
      std::memcpy(&bits[0], p + 256 + 8 * j, 8);
      std::memcpy(&bits[1], p + 256 + 8 * (j + 4), 8);
      lo = vec::add16_where(lo, bits[0]);
      hi = vec::add16_where(hi, bits[1]);
    }
  }
}

// One row of x against int4 tile t where a dot product of any bytes is one instruction (VNNI):
// the high nibbles enter the dot products masked in place, 16 x their value, and the low ones'
// sums are scaled up to meet them (4 masks instead of 4 masks and 4 shifts). Everything the
// accumulator takes is then 16 x the general tile's, exactly (integer sums below 2^24,
// power-of-two scaling): the mins enter times 16 and the result is divided by 16 at the end,
// so the output equals the general tile's bit for bit. Kept from the AVX-512-only code (5-8%
// faster with the weights in cache, measured 2026-12-01); elsewhere the masked high nibbles
// would need the dearer full-byte product (vec::kFullByteDot).
template <typename S, typename T>
void tile_one_row_masked(const QBlocks<S, 4>& w, const QuantRows& a, int64_t t, int64_t r,
                         int64_t N, T* y) {
  const int64_t scales_ahead =
      kAheadBlocks / w.per_group * 2 * kRows * static_cast<int64_t>(sizeof(S));
  const vec::F32x16 sixteen = vec::set1(16.0f);
  vec::F32x16 acc = vec::zero();
  const int32_t* x = a.quads(r);
  for (int64_t g = 0; g < w.groups; ++g) {
    const S* s = w.scales(t, g);
    vec::prefetch(reinterpret_cast<const char*>(s) + scales_ahead);
    const vec::F32x16 sv = vec::load(s), mv16 = vec::load(s + kRows) * sixteen;
    acc = vec::fma(mv16, vec::set1(a.sums[r * a.groups + g]), acc);
    for (int64_t b = g * w.per_group; b < (g + 1) * w.per_group; ++b) {
      const uint8_t* p = w.block(t, b);
      vec::prefetch_lines(p + kAheadBlocks * 256, 256);
      const int32_t* xq = x + b * kBlock / 4;
      vec::I32x16 lo = vec::zero_i32(), hi = vec::zero_i32();
      for (int j = 0; j < 4; ++j) {
        const vec::U8x64 v = vec::load_u8(p + 64 * j);
        lo = vec::dot4<4>(lo, vec::and_bytes(v, 0x0F), xq[j]);
        hi = vec::dot4<8>(hi, vec::and_bytes(v, 0xF0), xq[j + 4]);
      }
      const vec::F32x16 scale = sv * vec::set1(a.da[r * a.blocks + b]);
      acc = vec::fma(vec::to_float(vec::shift_left<4>(lo) + hi), scale, acc);
    }
  }
  vec::store(y + r * N + t * kRows, acc * vec::set1(1.0f / 16.0f));
}

// One row of x against block tile t (batch-1 decode): each run's two operands into two chains
// of dot products; per group the mins meet the sums of the quantized x, per block the integer
// sums meet the weight's and x's scales. The float operations are q4_tiles' in its order, so
// the output equals the many-row kernel's bit for bit.
template <typename S, int Bits, typename T>
void tile_one_row(const QBlocks<S, Bits>& w, const QuantRows& a, int64_t t, int64_t r,
                  int64_t N, T* y) {
  constexpr int64_t bytes = QBlocks<S, Bits>::kBlockBytes;
  // The scales of the group kAheadBlocks blocks on (a tile's groups are consecutive, and the
  // next tile's follow them), as bytes from this group's.
  const int64_t scales_ahead =
      kAheadBlocks / w.per_group * 2 * kRows * static_cast<int64_t>(sizeof(S));
  vec::F32x16 acc = vec::zero();
  const int32_t* x = a.quads(r);  // one row: its codes in order
  for (int64_t g = 0; g < w.groups; ++g) {
    const S* s = w.scales(t, g);
    vec::prefetch(reinterpret_cast<const char*>(s) + scales_ahead);
    const vec::F32x16 sv = vec::load(s);
    acc = vec::fma(vec::load(s + kRows), vec::set1(a.sums[r * a.groups + g]), acc);
    for (int64_t b = g * w.per_group; b < (g + 1) * w.per_group; ++b) {
      const uint8_t* p = w.block(t, b);
      vec::prefetch_lines(p + kAheadBlocks * bytes, bytes);
      const int32_t* xq = x + b * kBlock / 4;
      vec::I32x16 lo = vec::zero_i32(), hi = vec::zero_i32();
      for (int j = 0; j < 4; ++j) {
        vec::U8x64 op_lo, op_hi;
        operand_pair<Bits>(p, j, op_lo, op_hi);
        lo = vec::dot4<Bits>(lo, op_lo, xq[j]);
        hi = vec::dot4<Bits>(hi, op_hi, xq[j + 4]);
      }
      const vec::F32x16 scale = sv * vec::set1(a.da[r * a.blocks + b]);
      acc = vec::fma(vec::to_float(lo + hi), scale, acc);
    }
  }
  vec::store(y + r * N + t * kRows, acc);
}

// Rows r0..r0+R of x against the T consecutive block tiles t..t+T-1 (T = 1 or 2). Each
// broadcast of x feeds T tiles, and each run of weights is unpacked just before its dot
// products. On AVX-512 all the 512-bit operations here (dot products, unpacking, the float
// work) issue on the same two ports, so what counts is their number: per block, row and
// tile, 8 dot products carry 4 float operations (convert, scale, multiply-add, the mins'
// multiply-add) and a share of the tile's unpacking. Two tiles of 6 rows fill the 32 vector
// registers (12 sums, 12 accumulators, the operands): 20-24% faster than one tile of 8 rows at
// 64 rows of SmolLM2's shapes (Xeon with AVX512-VNNI, one thread, weights in cache;
// 2026-12-01). On Zen 4 (AMD EPYC, 2026-12-03; one thread, weights in L2, 96 rows, K 576, GGUF
// Q4_1's group of one block) the pass runs at 290-320 G ops/s against 458 for dot products
// alone: without the per-block float work it reached 415-440, without the unpacking no
// faster. 1 tile x 12 rows (250-270), 1 x 8, 2 x 4, 3 x 4 and 4 x 3 were no faster. Narrower
// ISAs take 1 tile x 2 rows (qgemm.h: kQ4RowsPerPass), their registers' worth.
template <int T, int R, typename S, int Bits, typename Y>
void q4_tiles(const QBlocks<S, Bits>& w, const QuantRows& a, int64_t t, int64_t r0, int64_t N,
              Y* y, bool ahead) {
  const int32_t* x = a.quads(r0);  // the pass's codes: R per 4 inputs
  vec::F32x16 acc[T][R];
  for (int i = 0; i < T; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = vec::zero();
  for (int64_t b = 0; b < w.blocks; ++b) {
    const int64_t g = b / w.per_group;
    const int32_t* xq = x + b * kBlock / 4 * R;
    vec::I32x16 part[T][R];
    for (int i = 0; i < T; ++i)
      for (int r = 0; r < R; ++r) part[i][r] = vec::zero_i32();
    for (int i = 0; i < T && ahead; ++i) {  // the next pair's block and scales (kAheadBlocks)
      vec::prefetch_lines(w.block(t + T + i, b), QBlocks<S, Bits>::kBlockBytes);
      if (b % w.per_group == 0) {
        vec::prefetch_lines(w.scales(t + T + i, g), 2 * kRows * static_cast<int64_t>(sizeof(S)));
      }
    }
    for (int j = 0; j < 4; ++j) {  // run j: operand j in the low nibbles, j + 4 in the high
      vec::U8x64 lo[T], hi[T];
      for (int i = 0; i < T; ++i) operand_pair<Bits>(w.block(t + i, b), j, lo[i], hi[i]);
      for (int r = 0; r < R; ++r) {
        for (int i = 0; i < T; ++i) {
          part[i][r] = vec::dot4<Bits>(part[i][r], lo[i], xq[j * R + r]);
        }
      }
      for (int r = 0; r < R; ++r) {
        for (int i = 0; i < T; ++i) {
          part[i][r] = vec::dot4<Bits>(part[i][r], hi[i], xq[(j + 4) * R + r]);
        }
      }
    }
    for (int i = 0; i < T; ++i) {
      const S* s = w.scales(t + i, g);
      if (b % w.per_group == 0) {  // the group's mins meet the sums of its quantized x
        const vec::F32x16 mv = vec::load(s + kRows);
        for (int r = 0; r < R; ++r) {
          acc[i][r] = vec::fma(mv, vec::set1(a.sums[(r0 + r) * a.groups + g]), acc[i][r]);
        }
      }
      const vec::F32x16 sv = vec::load(s);
      for (int r = 0; r < R; ++r) {
        const vec::F32x16 scale = sv * vec::set1(a.da[(r0 + r) * a.blocks + b]);
        acc[i][r] = vec::fma(vec::to_float(part[i][r]), scale, acc[i][r]);
      }
    }
  }
  for (int i = 0; i < T; ++i)
    for (int r = 0; r < R; ++r) vec::store(y + (r0 + r) * N + (t + i) * kRows, acc[i][r]);
}

template <int R, typename S, typename T>
void tile(const Q8<S>& w, const QuantRows& a, int64_t t, int64_t r0, int64_t N, T* y,
          bool ahead) {
  const int32_t* x = a.quads(r0);  // the pass's codes: R per 4 inputs
  vec::F32x16 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = vec::zero();
  for (int64_t b = 0; b < w.blocks; ++b) {
    const int8_t* p = w.block(t, b);
    if (ahead) vec::prefetch_lines(p + kAheadBlocks * 512, 512);  // see kAheadBlocks
    // u8 = code + 128: each sum carries 128 x (the block's codes of x), removed at the end.
    vec::U8x64 ops[8];
    for (int c = 0; c < 8; ++c) ops[c] = vec::xor_bytes(vec::load_u8(p + 64 * c), 0x80);
    vec::I32x16 sums[R];
    block_dots<8, R>(ops, x + b * kBlock / 4 * R, sums);
    for (int r = 0; r < R; ++r) {
      acc[r] = vec::fma(vec::to_float(sums[r]), vec::set1(a.da[(r0 + r) * a.blocks + b]), acc[r]);
    }
  }
  const vec::F32x16 scale = vec::load(w.scale + t * kRows);
  for (int r = 0; r < R; ++r) {
    const vec::F32x16 v = acc[r] - vec::set1(128.0f * a.total[r0 + r]);
    vec::store(y + (r0 + r) * N + t * kRows, v * scale);
  }
}

// Rows r0..r1 of x against int8 tile t, kMaxRowsPerPass rows per pass; returns the tiles done.
template <typename S, typename T>
int64_t passes(const Q8<S>& w, const QuantRows& a, int64_t t, int64_t, int64_t r0, int64_t r1,
               int64_t N, T* y) {
  int64_t r = r0;
  for (; r + kMaxRowsPerPass <= r1; r += kMaxRowsPerPass) {
    tile<kMaxRowsPerPass>(w, a, t, r, N, y, r + kMaxRowsPerPass == r1);
  }
  with_rows<kMaxRowsPerPass - 1>(r1 - r, [&](auto rows) {
    tile<decltype(rows)::value>(w, a, t, r, N, y, true);
  });
  return 1;
}

template <int T, typename S, int Bits, typename Y>
void q4_passes(const QBlocks<S, Bits>& w, const QuantRows& a, int64_t t, int64_t r0, int64_t r1,
               int64_t N, Y* y) {
  int64_t r = r0;
  for (; r + kQ4RowsPerPass <= r1; r += kQ4RowsPerPass) {
    q4_tiles<T, kQ4RowsPerPass>(w, a, t, r, N, y, r + kQ4RowsPerPass == r1);
  }
  with_rows<kQ4RowsPerPass - 1>(r1 - r, [&](auto rows) {
    q4_tiles<T, decltype(rows)::value>(w, a, t, r, N, y, true);
  });
}

// Rows r0..r1 of x against int4 (or 5- or 8-bit block) tile t, and tile t + 1 too where the
// ISA pairs tiles and it is below t_end (this thread's tiles end there); returns the tiles
// done. One row of x (batch-1 decode) takes tile_one_row, tile by tile.
template <typename S, int Bits, typename T>
int64_t passes(const QBlocks<S, Bits>& w, const QuantRows& a, int64_t t, int64_t t_end,
               int64_t r0, int64_t r1, int64_t N, T* y) {
  if (r1 - r0 == 1) {
    if constexpr (Bits == 4 && vec::kFullByteDot) {
      tile_one_row_masked(w, a, t, r0, N, y);
    } else {
      tile_one_row(w, a, t, r0, N, y);
    }
    return 1;
  }
  if (kQ4TilesPerPass == 2 && t + 1 < t_end) {
    q4_passes<kQ4TilesPerPass>(w, a, t, r0, r1, N, y);
    return kQ4TilesPerPass;
  }
  q4_passes<1>(w, a, t, r0, r1, N, y);
  return 1;
}

template <typename S, int Bits>
int64_t blocks_per_group(const QBlocks<S, Bits>& w) { return w.per_group; }
template <typename S>
int64_t blocks_per_group(const Q8<S>& w) { return w.blocks; }
template <typename S, int Bits>
int64_t rows_per_pass(const QBlocks<S, Bits>&) { return kQ4RowsPerPass; }
template <typename S>
int64_t rows_per_pass(const Q8<S>&) { return kMaxRowsPerPass; }

// x's quantized rows against every tile of w: y [M, N] = x W^T.
template <typename W, typename T>
void int8_passes(const W& w, const QuantRows& a, int64_t M, int64_t N, int64_t K, T* y) {
  // Rows in chunks whose quantized x stays in L2 while the thread's tiles pass over it (a
  // 4096-row prefill streamed all of it from L3 once per tile: ~15% slower at K 576). Each
  // thread takes one contiguous run of tiles: its weight reads are one stream the hardware
  // prefetchers follow (work items from a shared counter, interleaving the threads' tiles,
  // cost batch-1 decode ~15% and offline throughput ~5%).
  const int64_t chunk = std::max<int64_t>(kChunkRows, (1 << 18) / K / kChunkRows * kChunkRows);
  split_for(0, N / kRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c0 = 0; c0 < M; c0 += chunk) {
      const int64_t c1 = std::min(M, c0 + chunk);
      for (int64_t t = begin; t < end;) t += passes(w, a, t, end, c0, c1, N, y);
    }
  });
}

template <typename W, typename T>
void int8_path(const W& w, const T* x, int64_t M, int64_t N, int64_t K, T* y) {
  const QuantRows a(x, M, K, blocks_per_group(w), rows_per_pass(w));
  int8_passes(w, a, M, N, K, y);
}

// int8_path in a Team whose threads split x's rows: this thread quantizes rows [r0, r1) into
// `buf` (the same for every thread, of at least QuantRows::bytes), and after a barrier every thread's
// tiles read all of them (ends at a barrier).
template <typename W, typename T>
void int8_path_rows(const W& w, const T* x, int64_t M, int64_t N, int64_t K, int64_t r0,
                    int64_t r1, char* buf, T* y) {
  QuantRows a(buf, M, K, blocks_per_group(w), rows_per_pass(w));
  for (int64_t r = r0; r < r1; ++r) a.quantize_row(x + r * K, r);
#pragma omp barrier
  int8_passes(w, a, M, N, K, y);
}

}  // namespace qgemm
}  // namespace kvserve
