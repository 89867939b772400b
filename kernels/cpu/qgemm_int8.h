// The int8-dot path of kvserve's quantized linears (qgemm.cpp): the activations quantized to
// int8 per block of 32 (scale max|x| / 127, as GGUF's Q8 blocks are), multiplied by the codes
// with AVX512-VNNI's u8 x s8 dot product, scaled per block in float; int4's mins meet the sums
// of the quantized x.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "qgemm.h"
#include "quant_rows.h"
#include "team.h"

#ifdef KVSERVE_INT8_DOT
namespace kvserve {
namespace qgemm {

// ---- path 2: int8 dot products ----------------------------------------------------------------

inline __m512i broadcast(const int32_t* p) { return _mm512_set1_epi32(*p); }

// The 8 operands' sums for the R rows of a pass against one block (xq: the pass's codes at
// the block, see QuantRows::quads): 16 lanes, one per output row. The dot products run as
// independent chains (per row, and split per row when rows are few) so that their latency
// overlaps.
template <int R>
inline void block_dots(const __m512i (&ops)[8], const int32_t* xq,
                       __m512i (&sums)[R]) {
  constexpr int kChains = R >= 4 ? 1 : (R >= 2 ? 2 : 4);
  __m512i part[R][kChains];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < kChains; ++h) part[r][h] = _mm512_setzero_si512();
  for (int c = 0; c < 8; ++c)
    for (int r = 0; r < R; ++r)
      part[r][c % kChains] = _mm512_dpbusd_epi32(part[r][c % kChains], ops[c],
                                                 broadcast(xq + c * R + r));
  for (int r = 0; r < R; ++r) {
    sums[r] = part[r][0];
    for (int h = 1; h < kChains; ++h) sums[r] = _mm512_add_epi32(sums[r], part[r][h]);
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

inline void prefetch_lines(const void* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) {
    _mm_prefetch(static_cast<const char*>(p) + i, _MM_HINT_T0);
  }
}

// One row of x against int4 tile t (batch-1 decode; fewer instructions per weight byte: 5-8%
// faster with the weights in cache, inside noise when they stream from memory, measured
// 2026-12-01 on SmolLM2's shapes): the high nibbles enter the dot products
// masked in place, 16 x their value, and the low ones' sums are scaled up to meet them
// (4 masks instead of 4 masks and 4 shifts, 2 sum chains instead of 4). Everything the
// accumulator takes is then 16 x the general tile's, exactly (integer sums below 2^24,
// power-of-two scaling): the mins enter times 16 and the result is divided by 16 at the end,
// so the output equals the general tile's bit for bit.
template <typename S, typename T>
void tile_one_row(const Q4<S>& w, const QuantRows& a, int64_t t, int64_t r, int64_t N, T* y) {
  // The scales of the group kAheadBlocks blocks on (a tile's groups are consecutive, and the
  // next tile's follow them), as bytes from this group's.
  const int64_t scales_ahead =
      kAheadBlocks / w.per_group * 2 * kRows * static_cast<int64_t>(sizeof(S));
  const __m512i low4 = _mm512_set1_epi8(0x0F), high4 = _mm512_set1_epi8(static_cast<char>(0xF0));
  const __m512 sixteen = _mm512_set1_ps(16.0f);
  __m512 acc = _mm512_setzero_ps();
  const int32_t* x = a.quads(r);  // one row: its codes in order
  for (int64_t g = 0; g < w.groups; ++g) {
    const S* s = w.scales(t, g);
    prefetch_lines(reinterpret_cast<const char*>(s) + scales_ahead, 64);
    const __m512 sv = load16(s), mv16 = _mm512_mul_ps(load16(s + kRows), sixteen);
    acc = _mm512_fmadd_ps(mv16, _mm512_set1_ps(a.sums[r * a.groups + g]), acc);
    for (int64_t b = g * w.per_group; b < (g + 1) * w.per_group; ++b) {
      const uint8_t* p = w.block(t, b);
      prefetch_lines(p + kAheadBlocks * 256, 256);
      const int32_t* xq = x + b * kBlock / 4;
      __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(p + 64 * j);
        lo = _mm512_dpbusd_epi32(lo, _mm512_and_si512(v, low4), broadcast(xq + j));
        hi = _mm512_dpbusd_epi32(hi, _mm512_and_si512(v, high4), broadcast(xq + j + 4));
      }
      const __m512i sum16 = _mm512_add_epi32(_mm512_slli_epi32(lo, 4), hi);
      const __m512 scale = _mm512_mul_ps(sv, _mm512_set1_ps(a.da[r * a.blocks + b]));
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum16), scale, acc);
    }
  }
  store16(y + r * N + t * kRows, _mm512_mul_ps(acc, _mm512_set1_ps(1.0f / 16.0f)));
}

// Operands j and j + 4 of tile block p (see QBlocks): 4-bit ones from the nibbles of run j,
// 5-bit ones with their fifth bits added from the block's bit words, 8-bit ones as they are.
template <int Bits>
inline void operand_pair(const uint8_t* p, int j, __m512i& lo, __m512i& hi) {
  if constexpr (Bits == 8) {
    lo = _mm512_loadu_si512(p + 64 * j);
    hi = _mm512_loadu_si512(p + 64 * (j + 4));
  } else {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i v = _mm512_loadu_si512(p + 64 * j);
    lo = _mm512_and_si512(v, low4);
    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    if constexpr (Bits == 5) {
      const __m512i sixteen = _mm512_set1_epi8(16);
      uint64_t bits[2];
      std::memcpy(&bits[0], p + 256 + 8 * j, 8);
      std::memcpy(&bits[1], p + 256 + 8 * (j + 4), 8);
      lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(bits[0]), lo, sixteen);
      hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(bits[1]), hi, sixteen);
    }
  }
}

// One row of x against 5- or 8-bit block tile t (batch-1 decode): each run's two operands
// into two chains of dot products; the group's scale and min as in the int4 tiles.
template <typename S, int Bits, typename T>
void tile_one_row(const QBlocks<S, Bits>& w, const QuantRows& a, int64_t t, int64_t r,
                  int64_t N, T* y) {
  constexpr int64_t bytes = QBlocks<S, Bits>::kBlockBytes;
  const int64_t scales_ahead =
      kAheadBlocks / w.per_group * 2 * kRows * static_cast<int64_t>(sizeof(S));
  __m512 acc = _mm512_setzero_ps();
  const int32_t* x = a.quads(r);
  for (int64_t g = 0; g < w.groups; ++g) {
    const S* s = w.scales(t, g);
    prefetch_lines(reinterpret_cast<const char*>(s) + scales_ahead, 64);
    const __m512 sv = load16(s);
    acc = _mm512_fmadd_ps(load16(s + kRows), _mm512_set1_ps(a.sums[r * a.groups + g]), acc);
    for (int64_t b = g * w.per_group; b < (g + 1) * w.per_group; ++b) {
      const uint8_t* p = w.block(t, b);
      prefetch_lines(p + kAheadBlocks * bytes, bytes);
      const int32_t* xq = x + b * kBlock / 4;
      __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        __m512i op_lo, op_hi;
        operand_pair<Bits>(p, j, op_lo, op_hi);
        lo = _mm512_dpbusd_epi32(lo, op_lo, broadcast(xq + j));
        hi = _mm512_dpbusd_epi32(hi, op_hi, broadcast(xq + j + 4));
      }
      const __m512 scale = _mm512_mul_ps(sv, _mm512_set1_ps(a.da[r * a.blocks + b]));
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)), scale, acc);
    }
  }
  store16(y + r * N + t * kRows, acc);
}

// Rows r0..r0+R of x against the T consecutive int4 tiles t..t+T-1 (T = 1 or 2). Each
// broadcast of x feeds T tiles, and each run of weights is unpacked just before its dot
// products. All the 512-bit operations here (dot products, unpacking, the float work) issue on
// the same two ports, so what counts is their number: per block, row and tile, 8 dot products
// carry 4 float operations (convert, scale, multiply-add, the mins' multiply-add) and a share
// of the tile's unpacking. Two tiles of 6 rows fill the 32 vector registers (12 sums, 12
// accumulators, the operands): 20-24% faster than one tile of 8 rows at 64 rows of SmolLM2's
// shapes (Xeon with AVX512-VNNI, one thread, weights in cache; 2026-12-01). The output is the
// one-tile kernel's bit for bit: the same integer sums, the same float operations in order.
// On Zen 4 (AMD EPYC, 2026-12-03; one thread, weights in L2, 96 rows, K 576, GGUF Q4_1's
// group of one block) the pass runs at 290-320 G ops/s against 458 for dot products alone:
// without the per-block float work it reached 415-440, without the unpacking no faster. The
// float work (per block, row and tile: convert, scale product, two multiply-adds against 8 dot
// products) is what is left: with scales per block on both sides, each (block, row, tile)
// needs its own scale product, so none of it can be shared. 1 tile x 12 rows (250-270), 1 x 8, 2 x 4, 3 x 4 and 4 x 3 were no faster.
template <int T, int R, typename S, int Bits, typename Y>
void q4_tiles(const QBlocks<S, Bits>& w, const QuantRows& a, int64_t t, int64_t r0, int64_t N,
              Y* y, bool ahead) {
  const int32_t* x = a.quads(r0);  // the pass's codes: R per 4 inputs
  __m512 acc[T][R];
  for (int i = 0; i < T; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.blocks; ++b) {
    const int64_t g = b / w.per_group;
    const int32_t* xq = x + b * kBlock / 4 * R;
    __m512i part[T][R];
    for (int i = 0; i < T; ++i)
      for (int r = 0; r < R; ++r) part[i][r] = _mm512_setzero_si512();
    for (int i = 0; i < T && ahead; ++i) {  // the next pair's block and scales (kAheadBlocks)
      prefetch_lines(w.block(t + T + i, b), QBlocks<S, Bits>::kBlockBytes);
      if (b % w.per_group == 0) {
        prefetch_lines(w.scales(t + T + i, g), 2 * kRows * static_cast<int64_t>(sizeof(S)));
      }
    }
    for (int j = 0; j < 4; ++j) {  // run j: operand j in the low nibbles, j + 4 in the high
      __m512i lo[T], hi[T];
      for (int i = 0; i < T; ++i) operand_pair<Bits>(w.block(t + i, b), j, lo[i], hi[i]);
      for (int r = 0; r < R; ++r) {
        const __m512i xr = broadcast(xq + j * R + r);
        for (int i = 0; i < T; ++i) part[i][r] = _mm512_dpbusd_epi32(part[i][r], lo[i], xr);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i xr = broadcast(xq + (j + 4) * R + r);
        for (int i = 0; i < T; ++i) part[i][r] = _mm512_dpbusd_epi32(part[i][r], hi[i], xr);
      }
    }
    for (int i = 0; i < T; ++i) {
      const S* s = w.scales(t + i, g);
      if (b % w.per_group == 0) {  // the group's mins meet the sums of its quantized x
        const __m512 mv = load16(s + kRows);
        for (int r = 0; r < R; ++r) {
          acc[i][r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.sums[(r0 + r) * a.groups + g]),
                                      acc[i][r]);
        }
      }
      const __m512 sv = load16(s);
      for (int r = 0; r < R; ++r) {
        const __m512 scale = _mm512_mul_ps(sv, _mm512_set1_ps(a.da[(r0 + r) * a.blocks + b]));
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part[i][r]), scale, acc[i][r]);
      }
    }
  }
  for (int i = 0; i < T; ++i)
    for (int r = 0; r < R; ++r) store16(y + (r0 + r) * N + (t + i) * kRows, acc[i][r]);
}

template <int R, typename S, typename T>
void tile(const Q8<S>& w, const QuantRows& a, int64_t t, int64_t r0, int64_t N, T* y,
          bool ahead) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int32_t* x = a.quads(r0);  // the pass's codes: R per 4 inputs
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.blocks; ++b) {
    const int8_t* p = w.block(t, b);
    if (ahead) prefetch_lines(p + kAheadBlocks * 512, 512);  // see kAheadBlocks
    // u8 = code + 128: each sum carries 128 x (the block's codes of x), removed at the end.
    __m512i ops[8];
    for (int c = 0; c < 8; ++c) ops[c] = _mm512_xor_si512(_mm512_loadu_si512(p + 64 * c), flip);
    __m512i sums[R];
    block_dots<R>(ops, x + b * kBlock / 4 * R, sums);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]),
                               _mm512_set1_ps(a.da[(r0 + r) * a.blocks + b]), acc[r]);
    }
  }
  const __m512 scale = load16(w.scale + t * kRows);
  for (int r = 0; r < R; ++r) {
    const __m512 v = _mm512_sub_ps(acc[r], _mm512_set1_ps(128.0f * a.total[r0 + r]));
    store16(y + (r0 + r) * N + t * kRows, _mm512_mul_ps(v, scale));
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
  switch (r1 - r) {
    case 7: tile<7>(w, a, t, r, N, y, true); break;
    case 6: tile<6>(w, a, t, r, N, y, true); break;
    case 5: tile<5>(w, a, t, r, N, y, true); break;
    case 4: tile<4>(w, a, t, r, N, y, true); break;
    case 3: tile<3>(w, a, t, r, N, y, true); break;
    case 2: tile<2>(w, a, t, r, N, y, true); break;
    case 1: tile<1>(w, a, t, r, N, y, true); break;
    default: break;
  }
  return 1;
}

template <int T, typename S, int Bits, typename Y>
void q4_passes(const QBlocks<S, Bits>& w, const QuantRows& a, int64_t t, int64_t r0, int64_t r1,
               int64_t N, Y* y) {
  int64_t r = r0;
  for (; r + kQ4RowsPerPass <= r1; r += kQ4RowsPerPass) {
    q4_tiles<T, kQ4RowsPerPass>(w, a, t, r, N, y, r + kQ4RowsPerPass == r1);
  }
  switch (r1 - r) {
    case 5: q4_tiles<T, 5>(w, a, t, r, N, y, true); break;
    case 4: q4_tiles<T, 4>(w, a, t, r, N, y, true); break;
    case 3: q4_tiles<T, 3>(w, a, t, r, N, y, true); break;
    case 2: q4_tiles<T, 2>(w, a, t, r, N, y, true); break;
    case 1: q4_tiles<T, 1>(w, a, t, r, N, y, true); break;
    default: break;
  }
}

// Rows r0..r1 of x against int4 (or 5- or 8-bit block) tile t, and tile t + 1 too where it is below
// t_end (this thread's tiles end there); returns the tiles done. One row of x (batch-1
// decode) takes tile_one_row, tile by tile.
template <typename S, int Bits, typename T>
int64_t passes(const QBlocks<S, Bits>& w, const QuantRows& a, int64_t t, int64_t t_end,
               int64_t r0, int64_t r1, int64_t N, T* y) {
  if (r1 - r0 == 1) {
    tile_one_row(w, a, t, r0, N, y);
    return 1;
  }
  if (t + 1 < t_end) {
    q4_passes<2>(w, a, t, r0, r1, N, y);
    return 2;
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
#endif  // KVSERVE_INT8_DOT
