// The weight views of kvserve's quantized linears (qgemm.cpp has the layouts and the paths):
// tile t, block b of an int4 or int8 weight in the tiled layout of engine/quantization/tiles.py.

#pragma once

#include <cstdint>

#include "vec/vec.h"

namespace kvserve {
namespace qgemm {

constexpr int64_t kBlock = 32;
constexpr int64_t kRows = 16;      // output rows per tile
// Register tiles, sized to the ISA's registers (vec::kRegsPer16: registers a 16-lane vector
// takes): with 32 registers of 16 lanes (AVX-512), 8 rows of x per pass over an int8 tile and
// 6 rows over two int4 tiles (12 sums and 12 accumulators); with 16 of 8 lanes (AVX2) or 32 of
// 4 (NEON), 4 rows over an int8 tile and 2 over one int4 tile, which stay in registers.
constexpr bool kWide = vec::kRegsPer16 == 1;
constexpr int kMaxRowsPerPass = kWide ? 8 : 4;  // int8 weights: rows of x per pass over a tile
constexpr int kQ4RowsPerPass = kWide ? 6 : 2;   // int4 weights: rows of x per pass
constexpr int kQ4TilesPerPass = kWide ? 2 : 1;  // int4 weights: tiles per pass
constexpr int kChunkRows = 24;  // row chunks are whole passes of either
enum Path : int64_t { kAuto = 0, kFloat = 1, kInt8Dot = 2 };

// Asymmetric codes per block of 32 inputs, w = s * q + m with a scale s and min m per group of
// `per_group` blocks, of 4, 5 or 8 bits:
//   4: q in 0..15, 256 bytes a tile block: 4 runs of 64, run j holding operand j in its low
//      nibbles and j + 4 in its high ones;
//   5: q in 0..31 (GGUF's Q5 blocks), 320 bytes: the low 4 bits as int4's 256, then 8 words of
//      64 bits, word c the fifth bits of operand c's 64 bytes (bit i of byte i);
//   8: q in 0..255 (GGUF's Q8_0, its signed codes shifted, the shift in the min), 512 bytes:
//      the 8 operands in order.
// Byte 4 l + i of operand c is row l's input 4 c + i of the block.
template <typename S, int Bits>
struct QBlocks {
  static_assert(Bits == 4 || Bits == 5 || Bits == 8, "4-, 5- or 8-bit codes");
  static constexpr int64_t kBlockBytes = kRows * kBlock * Bits / 8;
  const uint8_t* codes;
  const S* sm;
  int64_t K, blocks, groups, per_group;  // per_group: blocks per group

  const uint8_t* block(int64_t t, int64_t b) const {
    return codes + (t * blocks + b) * kBlockBytes;
  }
  const S* scales(int64_t t, int64_t g) const { return sm + (t * groups + g) * 2 * kRows; }

  // Code of row l at input 4 c + i of block p.
  static int code(const uint8_t* p, int l, int c, int i) {
    if constexpr (Bits == 8) {
      return p[64 * c + 4 * l + i];
    } else {
      const uint8_t byte = p[64 * (c % 4) + 4 * l + i];
      const int low = c < 4 ? (byte & 0xF) : (byte >> 4);
      if constexpr (Bits == 4) return low;
      const int bit = 4 * l + i;
      return low | ((p[256 + 8 * c + bit / 8] >> (bit % 8)) & 1) << 4;
    }
  }
  void dequant_tile(int64_t t, float* out) const {  // out [16, K]
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* p = block(t, b);
      const S* s = scales(t, b / per_group);
      for (int l = 0; l < kRows; ++l) {
        const float sl = to_float(s[l]), ml = to_float(s[kRows + l]);
        for (int c = 0; c < 8; ++c)
          for (int i = 0; i < 4; ++i)
            out[l * K + b * kBlock + 4 * c + i] = sl * code(p, l, c, i) + ml;
      }
    }
  }
  float post_scale(int64_t) const { return 1.0f; }
};

template <typename S>
using Q4 = QBlocks<S, 4>;
template <typename S>
using U5 = QBlocks<S, 5>;
template <typename S>
using U8 = QBlocks<S, 8>;

template <typename S>
struct Q8 {
  const int8_t* codes;
  const S* scale;
  int64_t K, blocks;

  const int8_t* block(int64_t t, int64_t b) const { return codes + (t * blocks + b) * 512; }

  // Row l of tile t times `scale` into out[K]: input 32 b + 4 c + i of the row is byte
  // 64 c + 4 l + i of block b (engine/quantization/tiles.py).
  void dequant_row(int64_t t, int64_t l, float scale, float* out) const {
    for (int64_t b = 0; b < blocks; ++b) {
      const int8_t* p = block(t, b) + 4 * l;
      for (int c = 0; c < 8; ++c)
        for (int i = 0; i < 4; ++i)
          out[b * kBlock + 4 * c + i] = static_cast<float>(p[64 * c + i]) * scale;
    }
  }
  void dequant_tile(int64_t t, float* out) const {  // unscaled: post_scale applies it
    for (int64_t l = 0; l < kRows; ++l) dequant_row(t, l, 1.0f, out + l * K);
  }
  float post_scale(int64_t n) const { return to_float(scale[n]); }
};

}  // namespace qgemm
}  // namespace kvserve
