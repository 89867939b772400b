// kvserve's vector layer: one small API over 16-lane vectors, implemented once per ISA and
// picked when the file is compiled (as vLLM's cpu_types_*.hpp and ggml's per-ISA dots):
//
//   F32x16   16 floats: loads and stores from/to float, bfloat16 and float16 (rounded as c10
//            rounds), arithmetic, fma, reductions in one fixed order (so every ISA's sums
//            agree), 16 reductions transposed into one vector (sum16, max16)
//   I32x16   16 int32: sums, conversions, int8 saturation
//   U8x64    64 bytes of weight codes: masks, nibbles, the fifth bits of 5-bit codes, and
//            dot4<Bits>, the int8 dot product (VNNI dpbusd on AVX-512, maddubs/madd or AVX-VNNI
//            on AVX2, sdot on NEON with dotprod, plain C++ otherwise)
//   BF16x32  16 pairs of bfloat16: dot_pairs (AVX512-BF16's vdpbf16ps, else two float FMAs)
//
// Implementations: AVX-512 (F/BW/VL/DQ, with VNNI and BF16 where built), AVX2+FMA+F16C, NEON
// and scalar; KVSERVE_VEC_SCALAR forces the scalar one (the harness's reference). Every
// kernel is written once over this API; each ISA's bodies are checked against the scalar
// ones by tests/kernels/harness (aarch64 under qemu).
#pragma once

#if defined(KVSERVE_VEC_SCALAR)
#include "isa_scalar.h"
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#include "isa_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "isa_avx2.h"
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include "isa_neon.h"
#else
#include "isa_scalar.h"
#endif

namespace kvserve {
namespace vec {

// Asks for the cache line at p ahead of its use (every compiler kvserve builds with has it).
inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }
inline void prefetch_lines(const void* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) prefetch(static_cast<const char*>(p) + i);
}

// 16-lane vectors that fit in `registers` registers alongside the rest of a kernel's state:
// how kernels size their register tiles on each ISA.
constexpr int vectors_in(int registers) { return registers / kRegsPer16; }

}  // namespace vec
}  // namespace kvserve
