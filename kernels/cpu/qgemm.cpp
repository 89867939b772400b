// Weight-only quantized linear layers on CPU: y = x W^T with W in int4 or int8 codes, laid out
// for AVX512-VNNI's u8 x s8 dot product (64 products per instruction).
//
// Weights come in tiles of 16 output rows, so that the 16 lanes of a dot product are 16 rows
// and each lane sums 4 consecutive inputs: a block of 32 inputs is 8 such operands, and its
// sums are whole per row, ready for the block's scales without a horizontal reduction.
//
//   q4_linear(x [M, K], qweight [N/16, K/32 * 256] uint8, scale_mins [N/16, groups, 2, 16])
//       w[n, k] = s[n, g] * q[n, k] + m[n, g], q in 0..15, g = k / (K / groups). Block b of
//       tile t is 256 bytes: 4 runs of 64, run j holding operand j in its low nibbles and
//       operand j + 4 in its high ones; byte 4l + i of a run is row l's input 4c + i of the
//       block (c the operand). scale_mins: per tile and group, 16 scales then 16 mins.
//   q8_linear(x [M, K], qweight [N/16, K/32 * 512] int8, scales [N])
//       w[n, k] = scales[n] * q[n, k]; block b of tile t is its 8 operands, 64 bytes each.
//
// engine/quantization/tiles.py packs and unpacks both layouts.
//
// Two ways to compute (`path`: 0 picks, the tests force each):
//   1 float     each tile dequantized to float and dotted with float activations: portable
//               C++, the reference and the fallback without AVX512-VNNI;
//   2 int8-dot  the activations quantized to int8 per block of 32 (scale max|x| / 127, as
//               GGUF's Q8 blocks are), multiplied by the codes in integers, scaled per block in
//               float; the mins of int4 meet the sums of the quantized x.
//
// No ATen op is called inside the parallel regions (a nested region stalls torch's OpenMP
// threads; see attention.cpp).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "convert.h"
#include "ops.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define KVSERVE_INT8_DOT 1
#endif

namespace kvserve {
namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kRows = 16;      // output rows per tile
constexpr int kMaxRowsPerPass = 8;  // rows of x sharing one unpacking of a weight block
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

  void dequant_tile(int64_t t, float* out) const {  // unscaled: post_scale applies it
    for (int64_t b = 0; b < blocks; ++b) {
      const int8_t* p = block(t, b);
      for (int c = 0; c < 8; ++c)
        for (int l = 0; l < kRows; ++l)
          for (int i = 0; i < 4; ++i)
            out[l * K + b * kBlock + 4 * c + i] = static_cast<float>(p[64 * c + 4 * l + i]);
    }
  }
  float post_scale(int64_t n) const { return to_f(scale[n]); }
};

// ---- path 1: float ----------------------------------------------------------------------------

template <typename W>
void float_path(const W& w, const float* x, int64_t M, int64_t N, int64_t K, float* y) {
  at::parallel_for(0, N / kRows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(kRows * K);
    for (int64_t t = begin; t < end; ++t) {
      w.dequant_tile(t, tile.data());
      for (int64_t r = 0; r < M; ++r) {
        const float* xr = x + r * K;
        for (int64_t l = 0; l < kRows; ++l) {
          const float* wl = tile.data() + l * K;
          float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
          for (int64_t k = 0; k < K; ++k) acc += wl[k] * xr[k];
          y[r * N + t * kRows + l] = acc * w.post_scale(t * kRows + l);
        }
      }
    }
  });
}

#ifdef KVSERVE_INT8_DOT
// ---- path 2: int8 dot products ----------------------------------------------------------------

inline __m512 load16(const c10::BFloat16* s) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline __m512 load16(const c10::Half* s) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
}
inline __m512 load16(const float* s) { return _mm512_loadu_ps(s); }

// 16 floats stored as T, rounded to nearest even as torch rounds.
inline void store16(float* out, __m512 v) { _mm512_storeu_ps(out, v); }
inline void store16(c10::BFloat16* out, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
inline void store16(c10::Half* out, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// x [M, K] quantized per block of 32.
struct QuantRows {
  int64_t K, blocks, groups;
  std::vector<int8_t> q;      // [M, K]
  std::vector<float> da;      // [M, blocks] block scales
  std::vector<float> sums;    // [M, groups] sums of the quantized x per weight group
  std::vector<float> total;   // [M] sum over blocks of scale x sum of codes

  template <typename T>
  QuantRows(const T* x, int64_t M, int64_t K_, int64_t per_group)
      : K(K_), blocks(K_ / kBlock), groups(K_ / kBlock / per_group), q(M * K_),
        da(M * (K_ / kBlock)), sums(M * groups, 0.0f), total(M, 0.0f) {
    for (int64_t r = 0; r < M; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        const T* xb = x + r * K + b * kBlock;
        const __m512 lo = load16(xb), hi = load16(xb + 16);
        const float amax = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));  // nearest even
        const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
        int8_t* qb = q.data() + r * K + b * kBlock;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtsepi32_epi8(qlo));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtsepi32_epi8(qhi));
        // The sums are of the quantized x, so that int4's mins and codes meet the same x:
        // the result is then exactly w . x' (x' the quantized x). Exact float sums instead
        // leave sum(q x') - sum(q x), with q up to 15, uncancelled (+3% perplexity on SmolLM2).
        const float block_sum = amax / 127.0f * static_cast<float>(_mm512_reduce_add_epi32(
                                                     _mm512_add_epi32(qlo, qhi)));
        da[r * blocks + b] = amax / 127.0f;
        sums[r * groups + b / per_group] += block_sum;
        total[r] += block_sum;
      }
    }
  }
  // Row r's 4 codes starting at input k, broadcast to every lane.
  __m512i quad(int64_t r, int64_t k) const {
    int32_t v;
    std::memcpy(&v, q.data() + r * K + k, sizeof(v));
    return _mm512_set1_epi32(v);
  }
};


// The 8 operands' sums for rows r0..r0+R of x against one block: 16 lanes, one per output
// row. The dot products run as independent chains (per row, and split per row when rows are
// few) so that their latency overlaps.
template <int R>
inline void block_dots(const __m512i (&ops)[8], const QuantRows& a, int64_t r0, int64_t k,
                       __m512i (&sums)[R]) {
  constexpr int kChains = R >= 4 ? 1 : (R >= 2 ? 2 : 4);
  __m512i part[R][kChains];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < kChains; ++h) part[r][h] = _mm512_setzero_si512();
  for (int c = 0; c < 8; ++c)
    for (int r = 0; r < R; ++r)
      part[r][c % kChains] = _mm512_dpbusd_epi32(part[r][c % kChains], ops[c],
                                                 a.quad(r0 + r, k + 4 * c));
  for (int r = 0; r < R; ++r) {
    sums[r] = part[r][0];
    for (int h = 1; h < kChains; ++h) sums[r] = _mm512_add_epi32(sums[r], part[r][h]);
  }
}

template <int R, typename S, typename T>
void tile(const Q4<S>& w, const QuantRows& a, int64_t t, int64_t r0, int64_t N, T* y) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    const S* s = w.scales(t, g);
    const __m512 sv = load16(s), mv = load16(s + kRows);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.sums[(r0 + r) * a.groups + g]), acc[r]);
    }
    for (int64_t b = g * w.per_group; b < (g + 1) * w.per_group; ++b) {
      const uint8_t* p = w.block(t, b);
      __m512i ops[8];
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(p + 64 * j);
        ops[j] = _mm512_and_si512(v, low4);
        ops[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      __m512i sums[R];
      block_dots<R>(ops, a, r0, b * kBlock, sums);
      for (int r = 0; r < R; ++r) {
        const __m512i sum = sums[r];
        const __m512 scale = _mm512_mul_ps(sv, _mm512_set1_ps(a.da[(r0 + r) * a.blocks + b]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) store16(y + (r0 + r) * N + t * kRows, acc[r]);
}

template <int R, typename S, typename T>
void tile(const Q8<S>& w, const QuantRows& a, int64_t t, int64_t r0, int64_t N, T* y) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.blocks; ++b) {
    const int8_t* p = w.block(t, b);
    // u8 = code + 128: each sum carries 128 x (the block's codes of x), removed at the end.
    __m512i ops[8];
    for (int c = 0; c < 8; ++c) ops[c] = _mm512_xor_si512(_mm512_loadu_si512(p + 64 * c), flip);
    __m512i sums[R];
    block_dots<R>(ops, a, r0, b * kBlock, sums);
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

template <typename S>
int64_t blocks_per_group(const Q4<S>& w) { return w.per_group; }
template <typename S>
int64_t blocks_per_group(const Q8<S>& w) { return w.blocks; }
template <typename W, typename T>
void int8_path(const W& w, const T* x, int64_t M, int64_t N, int64_t K, T* y) {
  const QuantRows a(x, M, K, blocks_per_group(w));
  at::parallel_for(0, N / kRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t r = 0;
      for (; r + kMaxRowsPerPass <= M; r += kMaxRowsPerPass) {
        tile<kMaxRowsPerPass>(w, a, t, r, N, y);
      }
      switch (M - r) {
        case 7: tile<7>(w, a, t, r, N, y); break;
        case 6: tile<6>(w, a, t, r, N, y); break;
        case 5: tile<5>(w, a, t, r, N, y); break;
        case 4: tile<4>(w, a, t, r, N, y); break;
        case 3: tile<3>(w, a, t, r, N, y); break;
        case 2: tile<2>(w, a, t, r, N, y); break;
        case 1: tile<1>(w, a, t, r, N, y); break;
        default: break;
      }
    }
  });
}
#endif  // KVSERVE_INT8_DOT

template <typename W>
at::Tensor run(const W& w, const at::Tensor& x, int64_t N, int64_t path) {
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(path >= kAuto && path <= kInt8Dot, "quantized linear: unknown path ", path);
  TORCH_CHECK(path != kInt8Dot || int8_dot_available(),
              "quantized linear: the int8-dot path needs AVX512-VNNI in this build");
#ifdef KVSERVE_INT8_DOT
  if (path != kFloat) {
    const at::Tensor xc = x.contiguous();
    at::Tensor y = at::empty({M, N}, x.options());
    if (M == 0) return y;
    switch (x.scalar_type()) {
      case at::kBFloat16:
        int8_path(w, xc.data_ptr<c10::BFloat16>(), M, N, K, y.data_ptr<c10::BFloat16>());
        return y;
      case at::kHalf:
        int8_path(w, xc.data_ptr<c10::Half>(), M, N, K, y.data_ptr<c10::Half>());
        return y;
      case at::kFloat:
        int8_path(w, xc.data_ptr<float>(), M, N, K, y.data_ptr<float>());
        return y;
      default:
        break;  // other float types: the float path
    }
  }
#endif
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M > 0) {
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    float_path(w, xf.data_ptr<float>(), M, N, K, y.data_ptr<float>());
  }
  return y.to(x.scalar_type());
}

void check_x(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.is_floating_point(), op,
              ": x must be a float tensor [rows, ", K, "], got ", x.sizes());
}

}  // namespace

bool int8_dot_available() {
#ifdef KVSERVE_INT8_DOT
  return true;
#else
  return false;
#endif
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qweight,
                     const at::Tensor& scale_mins, int64_t path) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte &&
                  qweight.is_contiguous() && qweight.size(1) % 256 == 0,
              "q4_linear: qweight must be contiguous uint8 [N/16, K/32 * 256]");
  TORCH_CHECK(scale_mins.dim() == 4 && scale_mins.size(0) == qweight.size(0) &&
                  scale_mins.size(2) == 2 && scale_mins.size(3) == kRows &&
                  scale_mins.is_contiguous(),
              "q4_linear: scale_mins must be contiguous [N/16, groups, 2, 16]");
  const int64_t N = qweight.size(0) * kRows, blocks = qweight.size(1) / 256;
  const int64_t K = blocks * kBlock, groups = scale_mins.size(1);
  check_x(x, K, "q4_linear");
  TORCH_CHECK(groups > 0 && blocks % groups == 0, "q4_linear: ", groups,
              " groups do not split ", blocks, " blocks of 32");
  const uint8_t* codes = qweight.data_ptr<uint8_t>();
  const int64_t per_group = blocks / groups;
  switch (scale_mins.scalar_type()) {
    case at::kBFloat16:
      return run(Q4<c10::BFloat16>{codes, scale_mins.data_ptr<c10::BFloat16>(), K, blocks,
                                   groups, per_group}, x, N, path);
    case at::kHalf:
      return run(Q4<c10::Half>{codes, scale_mins.data_ptr<c10::Half>(), K, blocks, groups,
                               per_group}, x, N, path);
    case at::kFloat:
      return run(Q4<float>{codes, scale_mins.data_ptr<float>(), K, blocks, groups, per_group},
                 x, N, path);
    default:
      TORCH_CHECK(false, "q4_linear: scales must be float, bfloat16 or half");
  }
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                     int64_t path) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar &&
                  qweight.is_contiguous() && qweight.size(1) % 512 == 0,
              "q8_linear: qweight must be contiguous int8 [N/16, K/32 * 512]");
  const int64_t N = qweight.size(0) * kRows, blocks = qweight.size(1) / 512;
  const int64_t K = blocks * kBlock;
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == N && scales.is_contiguous(),
              "q8_linear: scales must be contiguous [N]");
  check_x(x, K, "q8_linear");
  const int8_t* codes = qweight.data_ptr<int8_t>();
  switch (scales.scalar_type()) {
    case at::kBFloat16:
      return run(Q8<c10::BFloat16>{codes, scales.data_ptr<c10::BFloat16>(), K, blocks}, x, N,
                 path);
    case at::kHalf:
      return run(Q8<c10::Half>{codes, scales.data_ptr<c10::Half>(), K, blocks}, x, N, path);
    case at::kFloat:
      return run(Q8<float>{codes, scales.data_ptr<float>(), K, blocks}, x, N, path);
    default:
      TORCH_CHECK(false, "q8_linear: scales must be float, bfloat16 or half");
  }
}

}  // namespace kvserve
