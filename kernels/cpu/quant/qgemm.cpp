// Weight-only quantized linear layers on CPU: y = x W^T with W in int4 or int8 codes, laid out
// for the u8 x s8 dot product of the vector layer (vec::dot4: VNNI's dpbusd, 64 products per
// instruction; AVX2's maddubs; NEON's sdot).
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
//   u5_linear(x [M, K], qweight [N/16, K/32 * 320] uint8, scale_mins [N/16, groups, 2, 16])
//       as q4_linear with 5-bit codes q in 0..31 (GGUF's Q5 blocks): the low 4 bits as
//       q4_linear's 256 bytes, then 8 words of 64 bits, word c the fifth bits of operand c.
//   u8_linear(x [M, K], qweight [N/16, K/32 * 512] uint8, scale_mins [N/16, groups, 2, 16])
//       as q4_linear with 8-bit codes q in 0..255 (GGUF's Q8_0 and Q6_K blocks): block b of
//       tile t is its 8 operands of 64 bytes, byte 4l + i of operand c row l's input 4c + i.
//   q8_linear(x [M, K], qweight [N/16, K/32 * 512] int8, scales [N])
//       w[n, k] = scales[n] * q[n, k]; block b of tile t is its 8 operands, 64 bytes each.
//
// engine/quantization/tiles.py packs and unpacks both layouts.
//
// Two ways to compute (`path`: 0 picks, the tests force each):
//   1 float     each tile dequantized to float and dotted with float activations: portable
//               C++, the reference the tests hold the int8-dot path to;
//   2 int8-dot  the activations quantized to int8 per block of 32 (scale max|x| / 127, as
//               GGUF's Q8 blocks are), multiplied by the codes in integers, scaled per block in
//               float; the mins of int4 meet the sums of the quantized x.
//
// No ATen op is called inside the parallel regions (a nested region stalls torch's OpenMP
// threads; see attention.cpp).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

#include "ops.h"
#include "quant/qgemm_int8.h"

namespace kvserve {
namespace {

using namespace qgemm;  // NOLINT: this file is the ops of qgemm.h's views

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

template <typename W>
at::Tensor run(const W& w, const at::Tensor& x, int64_t N, int64_t path) {
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(path >= kAuto && path <= kInt8Dot, "quantized linear: unknown path ", path);
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

bool int8_dot_available() { return true; }  // every ISA's vector layer has the int8 dot

const char* vector_isa() { return vec::kIsa; }

namespace {

// q4_linear, u5_linear and u8_linear: asymmetric codes of `Bits` in tiles, a scale and min per group.
template <int Bits>
at::Tensor blocks_linear(const at::Tensor& x, const at::Tensor& qweight,
                         const at::Tensor& scale_mins, int64_t path, const char* op) {
  constexpr int64_t bytes = QBlocks<float, Bits>::kBlockBytes;
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte &&
                  qweight.is_contiguous() && qweight.size(1) % bytes == 0,
              op, ": qweight must be contiguous uint8 [N/16, K/32 * ", bytes, "]");
  TORCH_CHECK(scale_mins.dim() == 4 && scale_mins.size(0) == qweight.size(0) &&
                  scale_mins.size(2) == 2 && scale_mins.size(3) == kRows &&
                  scale_mins.is_contiguous(),
              op, ": scale_mins must be contiguous [N/16, groups, 2, 16]");
  const int64_t N = qweight.size(0) * kRows, blocks = qweight.size(1) / bytes;
  const int64_t K = blocks * kBlock, groups = scale_mins.size(1);
  check_x(x, K, op);
  TORCH_CHECK(groups > 0 && blocks % groups == 0, op, ": ", groups,
              " groups do not split ", blocks, " blocks of 32");
  const uint8_t* codes = qweight.data_ptr<uint8_t>();
  const int64_t per_group = blocks / groups;
  switch (scale_mins.scalar_type()) {
    case at::kBFloat16:
      return run(QBlocks<c10::BFloat16, Bits>{codes, scale_mins.data_ptr<c10::BFloat16>(), K,
                                              blocks, groups, per_group}, x, N, path);
    case at::kHalf:
      return run(QBlocks<c10::Half, Bits>{codes, scale_mins.data_ptr<c10::Half>(), K, blocks,
                                          groups, per_group}, x, N, path);
    case at::kFloat:
      return run(QBlocks<float, Bits>{codes, scale_mins.data_ptr<float>(), K, blocks, groups,
                                      per_group}, x, N, path);
    default:
      TORCH_CHECK(false, op, ": scales must be float, bfloat16 or half");
  }
}

}  // namespace

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qweight,
                     const at::Tensor& scale_mins, int64_t path) {
  return blocks_linear<4>(x, qweight, scale_mins, path, "q4_linear");
}

at::Tensor u5_linear(const at::Tensor& x, const at::Tensor& qweight,
                     const at::Tensor& scale_mins, int64_t path) {
  return blocks_linear<5>(x, qweight, scale_mins, path, "u5_linear");
}

at::Tensor u8_linear(const at::Tensor& x, const at::Tensor& qweight,
                     const at::Tensor& scale_mins, int64_t path) {
  return blocks_linear<8>(x, qweight, scale_mins, path, "u8_linear");
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

at::Tensor q8_embedding(const at::Tensor& ids, const at::Tensor& qweight,
                        const at::Tensor& scales, at::ScalarType dtype) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar &&
                  qweight.is_contiguous() && qweight.size(1) % 512 == 0,
              "q8_embedding: qweight must be contiguous int8 [N/16, K/32 * 512]");
  const int64_t N = qweight.size(0) * kRows, K = qweight.size(1) / 512 * kBlock;
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == N, "q8_embedding: scales must be [N]");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong,
              "q8_embedding: ids must be int64 [tokens]");
  const at::Tensor idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  const int64_t n = idc.size(0);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < N, "q8_embedding: token id ", id[i],
                " is out of range for a vocabulary of ", N);
  }
  const at::Tensor scale = scales.index_select(0, idc).to(at::kFloat).contiguous();  // [n]
  at::Tensor out = at::empty({n, K}, qweight.options().dtype(at::kFloat));
  const Q8<float> w{qweight.data_ptr<int8_t>(), nullptr, K, K / kBlock};
  const float* sc = scale.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) w.dequant_row(id[i] / kRows, id[i] % kRows, sc[i], o + i * K);
  return dtype == at::kFloat ? out : out.to(dtype);
}

}  // namespace kvserve
