// The 16-bit float element types the vector layer loads and stores: c10's BFloat16 and Half
// in the torch extension, layout-equal stand-ins in the torch-free kernel harness
// (KVSERVE_NO_TORCH), so that kernel bodies compile and run without torch on any target.
#pragma once

#include <cstdint>
#include <cstring>

#ifndef KVSERVE_NO_TORCH
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#endif

namespace kvserve {

#ifndef KVSERVE_NO_TORCH
using bf16_t = c10::BFloat16;
using f16_t = c10::Half;
#else
struct bf16_t {
  uint16_t x;
};
struct f16_t {
  uint16_t x;
};
#endif

// The raw bits of a 16-bit element (both types keep them in their public member `x`).
template <typename T>
inline uint16_t bits16(T v) {
  return v.x;
}

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// bfloat16 bits -> float (exact) and float -> bfloat16 bits rounded to nearest even as c10
// rounds (NaN to the quiet 0x7FC0), written without branches so that loops over it vectorise.
inline float bf16_bits_to_float(uint16_t b) { return bits_to_float(static_cast<uint32_t>(b) << 16); }
inline uint16_t float_to_bf16_bits(float v) {
  const uint32_t u = float_to_bits(v);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(v != v ? 0x7FC0u : rounded);
}

// IEEE half bits <-> float, exact for every half (denormals included), rounding to nearest
// even on the way down, as c10::Half and the F16C/NEON conversions do.
inline float f16_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0x1F) {  // inf, or NaN made quiet as F16C and NEON make it
    return bits_to_float(sign | 0x7F800000u | (man << 13) | (man != 0 ? 0x00400000u : 0u));
  }
  if (exp != 0) return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
  const float denormal = static_cast<float>(man) * 5.9604644775390625e-08f;  // man x 2^-24
  return sign ? -denormal : denormal;
}
inline uint16_t float_to_f16_bits(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u | ((a >> 13) & 0x3FFu);  // NaN, payload kept
  if (a == 0x7F800000u) return sign | 0x7C00u;
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // rounds past 65504: inf
  if (a < 0x38800000u) {  // below the smallest normal half: a denormal (or zero)
    // adding 0.5 moves the value's bits so that float addition rounds them (nearest even)
    const float shifted = bits_to_float(a) + 0.5f;
    return sign | static_cast<uint16_t>(float_to_bits(shifted) - 0x3F000000u);
  }
  const uint32_t odd = (a >> 13) & 1u;
  return sign | static_cast<uint16_t>((a - 0x38000000u + 0xFFFu + odd) >> 13);
}

inline float to_float(float v) { return v; }
inline float to_float(bf16_t v) { return bf16_bits_to_float(bits16(v)); }
inline float to_float(f16_t v) { return f16_bits_to_float(bits16(v)); }

}  // namespace kvserve
