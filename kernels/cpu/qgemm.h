// The weight views of kvserve's quantized linears (qgemm.cpp has the layouts and the paths):
// tile t, block b of an int4 or int8 weight in the tiled layout of engine/quantization/tiles.py.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "convert.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define KVSERVE_INT8_DOT 1
#endif

namespace kvserve {
namespace qgemm {

constexpr int64_t kBlock = 32;
constexpr int64_t kRows = 16;      // output rows per tile
constexpr int kMaxRowsPerPass = 8;  // int8 weights: rows of x per pass over a tile
constexpr int kQ4RowsPerPass = 6;   // int4 weights: rows of x per pass over two tiles
constexpr int kChunkRows = 24;      // row chunks are whole passes of either
enum Path : int64_t { kAuto = 0, kFloat = 1, kInt8Dot = 2 };

template <typename S>
struct Q4 {
  const uint8_t* codes;
  const S* sm;
  int64_t K, blocks, groups, per_group;  // per_group: blocks per group

  const uint8_t* block(int64_t t, int64_t b) const { return codes + (t * blocks + b) * 256; }
  const S* scales(int64_t t, int64_t g) const { return sm + (t * groups + g) * 2 * kRows; }

  void dequant_tile(int64_t t, float* out) const {  // out [16, K]
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* p = block(t, b);
      const S* s = scales(t, b / per_group);
      for (int j = 0; j < 4; ++j) {
        for (int l = 0; l < kRows; ++l) {
          const float sl = to_f(s[l]), ml = to_f(s[kRows + l]);
          for (int i = 0; i < 4; ++i) {
            const uint8_t byte = p[64 * j + 4 * l + i];
            out[l * K + b * kBlock + 4 * j + i] = sl * (byte & 0xF) + ml;
            out[l * K + b * kBlock + 4 * (j + 4) + i] = sl * (byte >> 4) + ml;
          }
        }
      }
    }
  }
  float post_scale(int64_t) const { return 1.0f; }
};

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
  float post_scale(int64_t n) const { return to_f(scale[n]); }
};

}  // namespace qgemm
}  // namespace kvserve
