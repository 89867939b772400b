// The torch-free kernel harness: runs kvserve's vector layer (kernels/cpu/vec) and the int8-dot
// linear bodies built on it (quant_rows.h, qgemm_int8.h) on inputs drawn from a fixed seed and
// prints every result as hex, one labelled line per check. tests/kernels/test_kernel_harness.py
// builds it once per ISA (-DKVSERVE_VEC_SCALAR for the reference) and compares the outputs line
// by line: every ISA's bodies must give the scalar ones' bits (a NaN matching any NaN in floats
// and float16: which NaN arithmetic returns is not part of the layer's contract), aarch64 ones
// those of an aarch64 scalar build (conversions of NaN and of floats past int32 differ by
// architecture).
//
// Output lines: `<label> <kind> <hex> <hex> ...`, kind one of f32 (float bits), i32, u32, bf16,
// f16 (16-bit bits), u8, i8, u64; a label `<case>/in.<name>` is an input of the checks under
// <case>/ (the test shows them with a mismatch). Lines starting with '#' are informative only
// (the ISA's name and tile sizes differ by design).
//
// Build: g++ -O2 -std=c++17 -fopenmp -ffp-contract=off -DKVSERVE_NO_TORCH -I kernels/cpu
//        [-DKVSERVE_VEC_SCALAR | -march=...] tests/kernels/harness/harness.cpp

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "quant/qgemm_int8.h"  // the linears; pulls in quant_rows.h, qgemm.h, team.h and vec/vec.h

namespace {

using kvserve::bf16_t;
using kvserve::f16_t;
namespace vec = kvserve::vec;
namespace qg = kvserve::qgemm;

// ---- deterministic inputs ------------------------------------------------------------------
// splitmix64; floats are drawn through exact integer scaling only, so every build (whatever
// its ISA) draws the same inputs.
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  uint32_t u32() { return static_cast<uint32_t>(next() >> 32); }
  int below(int n) { return static_cast<int>((next() >> 33) % static_cast<uint64_t>(n)); }
  float sym() {  // uniform in [-1, 1), a multiple of 2^-23
    return static_cast<float>(static_cast<int32_t>(u32() >> 8) - (1 << 23)) * 0x1p-23f;
  }
  // sym() x 2^e, e uniform in [lo, lo + span): the draws in sequence (the operands of one
  // expression are evaluated in an order that differs between compilers and targets)
  float scaled(int lo, int span) {
    const float m = sym();
    return std::ldexp(m, lo + below(span));
  }
};

float from_bits(uint32_t u) { return kvserve::bits_to_float(u); }
uint16_t bf16_bits(float f) { return kvserve::float_to_bf16_bits(f); }
uint16_t f16_bits(float f) { return kvserve::float_to_f16_bits(f); }
float bf16_to_f32(uint16_t b) { return kvserve::bf16_bits_to_float(b); }

// Floats the vector layer must treat exactly: NaNs (quiet, negative, with payloads,
// signalling), infinities, signed zeros, denormals, the extremes, rounding ties of
// round_to_i32, of bfloat16 and of float16 (denormal halves' and the overflow to inf
// included), int8 saturation and int32's range.
const uint32_t kSpecialBits[] = {
    0x7FC00000u, 0xFFC00000u, 0x7FA00001u, 0x7F800001u, 0xFFF00010u,  // NaNs
    0x7F800000u, 0xFF800000u, 0x00000000u, 0x80000000u,                // inf, 0
    0x00000001u, 0x80000001u, 0x007FFFFFu, 0x00800000u, 0x80400000u,  // denormals, FLT_MIN
    0x7F7FFFFFu, 0xFF7FFFFFu,                                          // FLT_MAX
    0x3F800000u, 0xBF800000u, 0x3F000000u, 0xBF000000u, 0x3FC00000u,  // 1 -1 .5 -.5 1.5
    0x40200000u, 0xC0200000u, 0x42FF0000u, 0xC3008000u, 0x43000000u,  // 2.5 -2.5 127.5 -128.5 128
    0x3F808000u, 0x3F818000u, 0xBF808001u,                             // bf16 ties, past a tie
    0x477FE000u, 0x477FF000u, 0x477FEFFFu, 0x47800000u,                // 65504, 65520 (tie), ...
    0x33800000u, 0x33000000u, 0x33C00000u, 0xB3400000u, 0x387FE000u,  // 2^-24, f16 denormal ties
    0x3A801000u, 0x3A803000u,                                          // f16 normal ties
    0x501502F9u, 0xD01502F9u, 0x4EFFFFFFu, 0x4F000000u, 0xCF000000u,  // 1e10, int32 range
    0x4B000001u, 0x4B7FFFFFu, 0x3EFFFFFFu,                             // 2^23+1, 0.49999997
};
constexpr int kSpecials = sizeof(kSpecialBits) / sizeof(kSpecialBits[0]);

// One float of a random kind: moderate, special, any bits, a bf16 tie, a float16 tie, a
// round_to_i32 tie (up to int8 saturation and past it), a denormal, an integer.
float random_float(Rng& g) {
  switch (g.below(9)) {
    case 0: return g.scaled(-8, 17);
    case 1: return from_bits(kSpecialBits[g.below(kSpecials)]);
    case 2: return from_bits(g.u32());
    case 3: return from_bits((g.u32() & 0xFFFF0000u) | 0x8000u);  // exactly between two bf16
    case 4: {  // exactly between two float16 values (normal or denormal halves)
      const uint16_t h = static_cast<uint16_t>(g.u32() % 0x7BFFu);  // finite, below 65504
      const float lo = kvserve::f16_bits_to_float(h);
      const float tie = (h >> 10) == 0 ? std::ldexp(2.0f * (h & 0x3FF) + 1.0f, -25)
                                       : from_bits(kvserve::float_to_bits(lo) + (1u << 12));
      return g.below(2) ? -tie : tie;
    }
    case 5: return static_cast<float>(g.below(601) - 300) + 0.5f;
    case 6: return from_bits(g.u32() & 0x807FFFFFu);
    case 7: return static_cast<float>(g.below(2001) - 1000);
    default: return g.scaled(-30, 60);
  }
}

// ---- output --------------------------------------------------------------------------------
// One line: the label, the kind and the n elements' bits in hex (bytes as one run of hex digits,
// wider elements space-separated, each as its value's bits, not its bytes' order in memory).
template <typename E>
void emit(const std::string& label, const char* kind, const E* p, size_t n) {
  std::string s = label + " " + kind + " ";
  char buf[24];
  for (size_t i = 0; i < n; ++i) {
    uint64_t u = 0;
    std::memcpy(&u, p + i, sizeof(E));  // little-endian on every target the harness runs on
    const int width = static_cast<int>(2 * sizeof(E));
    std::snprintf(buf, sizeof(buf), "%s%0*" PRIx64, sizeof(E) > 1 && i > 0 ? " " : "", width, u);
    s += buf;
  }
  std::puts(s.c_str());
}
void emit_f32(const std::string& l, const float* p, size_t n) { emit(l, "f32", p, n); }
void emit_f32(const std::string& l, vec::F32x16 a) {
  float o[16];
  vec::store(o, a);
  emit_f32(l, o, 16);
}
void emit_i32(const std::string& l, const int32_t* p, size_t n) { emit(l, "i32", p, n); }

// I32x16 and U8x64 have no stores (no kernel needs one): their lanes are read back through
// exact conversions. Lane v = hi 2^24 + lo24: shift_left<8> leaves lo24 x 2^8 (exact as a
// float); adding -lo24 (made by round_to_i32, exact below 2^24) leaves hi x 2^24 (exact too).
void lanes(vec::I32x16 a, int32_t* out) {
  float lo[16], neg[16], hi[16];
  uint32_t lo24[16];
  vec::store(lo, vec::to_float(vec::shift_left<8>(a)));
  for (int i = 0; i < 16; ++i) {
    lo24[i] = static_cast<uint32_t>(static_cast<int32_t>(lo[i])) >> 8;
    neg[i] = -static_cast<float>(lo24[i]);
  }
  vec::store(hi, vec::to_float(a + vec::round_to_i32(vec::load(neg))));
  for (int i = 0; i < 16; ++i) {
    out[i] = static_cast<int32_t>(static_cast<uint32_t>(static_cast<int32_t>(hi[i])) | lo24[i]);
  }
}
void emit_i32(const std::string& l, vec::I32x16 a) {
  int32_t o[16];
  lanes(a, o);
  emit_i32(l, o, 16);
}
// Any int32 lanes as an I32x16: hi 2^16 and lo16 are exact floats, and so is their sum's
// conversion (round_to_i32 of each, then the integer add).
vec::I32x16 make_i32(const int32_t* v) {
  float hi[16], lo[16];
  for (int i = 0; i < 16; ++i) {
    hi[i] = static_cast<float>(v[i] >> 16) * 65536.0f;
    lo[i] = static_cast<float>(v[i] & 0xFFFF);
  }
  return vec::round_to_i32(vec::load(hi)) + vec::round_to_i32(vec::load(lo));
}
// Byte 4 i + j of w is lane i of w's dot product with byte j set to 1 (dot4<8> is exact).
void emit_u8(const std::string& l, vec::U8x64 w) {
  uint8_t out[64];
  for (int j = 0; j < 4; ++j) {
    int32_t v[16];
    lanes(vec::dot4<8>(vec::zero_i32(), w, 1 << (8 * j)), v);
    for (int i = 0; i < 16; ++i) out[4 * i + j] = static_cast<uint8_t>(v[i]);
  }
  emit(l, "u8", out, 64);
}
std::string hex_id(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%" PRIx64, v);
  return buf;
}
uint64_t fnv1a(const void* p, size_t n, uint64_t h = 0xCBF29CE484222325ull) {
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const uint8_t*>(p)[i]) * 0x100000001B3ull;
  return h;
}

// ---- a. the vector layer, op by op ----------------------------------------------------------

// reduce_max and max16 are checked on lanes without NaN, their zeros printed as +0: which of
// the lanes a NaN or a zero of either sign comes from follows each ISA's order of pairs (the
// scalar build's is sequential), and nothing depends on it (quant_rows takes the max of |x|).
bool has_nan(const float* v, int n = 16) {
  for (int i = 0; i < n; ++i) {
    if (v[i] != v[i]) return true;
  }
  return false;
}
float max_of(float m) { return m == 0.0f ? 0.0f : m; }

// The float ops on one case: a, b, c of 16 lanes each.
void float_ops(const std::string& id, const float* a, const float* b, const float* c, Rng& g) {
  emit_f32(id + "/in.a", a, 16);
  emit_f32(id + "/in.b", b, 16);
  emit_f32(id + "/in.c", c, 16);
  const vec::F32x16 va = vec::load(a), vb = vec::load(b), vc = vec::load(c);
  emit_f32(id + "/load", va);
  emit_f32(id + "/set1", vec::set1(b[3]));
  emit_f32(id + "/add", va + vb);
  emit_f32(id + "/sub", va - vb);
  emit_f32(id + "/mul", va * vb);
  emit_f32(id + "/div", va / vb);
  emit_f32(id + "/fma", vec::fma(va, vb, vc));
  emit_f32(id + "/max", vec::max(va, vb));
  emit_f32(id + "/abs", vec::abs(va));
  emit_f32(id + "/div_or_zero", vec::div_or_zero(va, vb));
  const float sums[2] = {vec::reduce_add(va), vec::reduce_add(vb)};
  emit_f32(id + "/reduce_add", sums, 2);
  if (!has_nan(a) && !has_nan(b)) {  // see max_of
    const float maxes[2] = {max_of(vec::reduce_max(va)), max_of(vec::reduce_max(vb))};
    emit_f32(id + "/reduce_max", maxes, 2);
  }
  const int k = g.below(16);
  const int32_t found[7] = {vec::any_nan(va),
                            vec::any_nan(vb),
                            vec::first_equal(va, a[k]),
                            vec::first_equal(va, b[k]),
                            vec::first_equal(va, 0.0f),
                            vec::first_equal(va, -0.0f),
                            vec::first_equal(va, std::numeric_limits<float>::quiet_NaN())};
  emit_i32(id + "/any_nan,first_equal", found, 7);
  emit_i32(id + "/round_to_i32", vec::round_to_i32(va));
  int8_t i8[16];
  vec::store_i8(i8, vec::round_to_i32(va));
  emit(id + "/store_i8(round_to_i32)", "i8", i8, 16);
  bf16_t h[16];
  vec::store(h, va);
  emit(id + "/store_bf16", "bf16", h, 16);
  f16_t f[16];
  vec::store(f, va);
  emit(id + "/store_f16", "f16", f, 16);
}

void vec_float_checks() {
  Rng g{1};
  // every pair of specials, lane by lane, then random lanes of every kind
  constexpr int kPairs = kSpecials * kSpecials;
  for (int p0 = 0, n = 0; p0 < kPairs; p0 += 16, ++n) {
    float a[16], b[16], c[16];
    for (int i = 0; i < 16; ++i) {
      const int p = (p0 + i) % kPairs;
      a[i] = from_bits(kSpecialBits[p / kSpecials]);
      b[i] = from_bits(kSpecialBits[p % kSpecials]);
      c[i] = from_bits(kSpecialBits[g.below(kSpecials)]);
    }
    float_ops("vec/special" + std::to_string(n), a, b, c, g);
  }
  for (int n = 0; n < 256; ++n) {
    float a[16], b[16], c[16];
    for (int i = 0; i < 16; ++i) {
      a[i] = random_float(g);
      b[i] = random_float(g);
      c[i] = random_float(g);
    }
    float_ops("vec/random" + std::to_string(n), a, b, c, g);
  }
  // sum16 and max16: 16 vectors at once, of moderate values (the order of the additions
  // shows), of every kind, of zeros of both signs, and of |x| (what quant_rows takes the max of)
  for (int n = 0; n < 64; ++n) {
    const std::string id = "vec/sum16,max16." + std::to_string(n);
    float in[16][16];
    vec::F32x16 v[16];
    bool nan = false;
    for (int r = 0; r < 16; ++r) {
      for (int i = 0; i < 16; ++i) {
        const int kind = n % 4;
        float x = kind == 0 || kind == 2 ? g.scaled(-20, 41) : random_float(g);
        if (kind == 2 && g.below(4) != 0) x = g.below(2) ? 0.0f : -0.0f;
        // kind 3: |x| as quant_rows meets it, NaNs as infinities
        if (kind == 3) x = x != x ? std::numeric_limits<float>::infinity() : std::fabs(x);
        in[r][i] = x;
      }
      emit_f32(id + "/in." + std::to_string(r), in[r], 16);
      v[r] = vec::load(in[r]);
      nan = nan || has_nan(in[r]);
    }
    emit_f32(id + "/sum16", vec::sum16(v));
    if (!nan) {
      float m[16];
      vec::store(m, vec::max16(v));
      for (float& e : m) e = max_of(e);
      emit_f32(id + "/max16", m, 16);
    }
  }
}

// Loads of every bfloat16 and float16, stores of random floats of every kind, and float16's
// round trip.
void vec_load_store_checks() {
  for (uint32_t base = 0; base < 65536; base += 256) {
    uint16_t src[256];
    for (uint32_t i = 0; i < 256; ++i) src[i] = static_cast<uint16_t>(base + i);
    float fb[256], fh[256];
    f16_t back[256];
    for (int v = 0; v < 16; ++v) {
      vec::store(fb + 16 * v, vec::load(reinterpret_cast<const bf16_t*>(src) + 16 * v));
      const vec::F32x16 h = vec::load(reinterpret_cast<const f16_t*>(src) + 16 * v);
      vec::store(fh + 16 * v, h);
      vec::store(back + 16 * v, h);
    }
    emit_f32("load_bf16/" + hex_id(base), fb, 256);
    emit_f32("load_f16/" + hex_id(base), fh, 256);
    emit("load_f16,store_f16/" + hex_id(base), "f16", back, 256);
  }
  Rng g{2};
  for (int n = 0; n < 64; ++n) {
    float x[256];
    for (float& e : x) e = random_float(g);
    bf16_t b[256];
    f16_t h[256];
    for (int v = 0; v < 16; ++v) {
      vec::store(b + 16 * v, vec::load(x + 16 * v));
      vec::store(h + 16 * v, vec::load(x + 16 * v));
    }
    const std::string id = "store/" + std::to_string(n);
    emit_f32(id + "/in.x", x, 256);
    emit(id + "/bf16", "bf16", b, 256);
    emit(id + "/f16", "f16", h, 256);
  }
}

int32_t random_int(Rng& g) {
  switch (g.below(6)) {
    case 0: return g.below(256) - 128;
    case 1: return g.below(1025) - 512;  // past int8 both ways
    case 2: return g.below(1 << 25) - (1 << 24);
    case 3: return static_cast<int32_t>(g.u32());
    case 4: {
      const int32_t edge[] = {std::numeric_limits<int32_t>::min(),
                              std::numeric_limits<int32_t>::max(),
                              (1 << 24) + 1, -(1 << 24) - 3, 0x7FFFFFC0, 127, 128, -128, -129};
      return edge[g.below(9)];
    }
    default: return 0;
  }
}

void vec_int_checks() {
  Rng g{3};
  for (int n = 0; n < 64; ++n) {
    const std::string id = "i32/" + std::to_string(n);
    int32_t a[16], b[16], c[16];
    for (int i = 0; i < 16; ++i) {
      a[i] = random_int(g);
      b[i] = g.below(1 << 30) - (1 << 29);  // sums within int32
      c[i] = g.below(1 << 30) - (1 << 29);
    }
    emit_i32(id + "/in.a", a, 16);
    emit_i32(id + "/in.b", b, 16);
    emit_i32(id + "/in.c", c, 16);
    const vec::I32x16 va = make_i32(a), vb = make_i32(b), vc = make_i32(c);
    emit_i32(id + "/lanes", va);
    emit_i32(id + "/add", vb + vc);
    emit_i32(id + "/zero_i32+", vec::zero_i32() + vb);
    emit_i32(id + "/shift_left<1>", vec::shift_left<1>(va));
    emit_i32(id + "/shift_left<4>", vec::shift_left<4>(va));
    emit_i32(id + "/shift_left<16>", vec::shift_left<16>(va));
    emit_f32(id + "/to_float", vec::to_float(va));
    int8_t i8[16];
    vec::store_i8(i8, va);
    emit(id + "/store_i8", "i8", i8, 16);
  }
  for (int n = 0; n < 16; ++n) {  // sum16: 16 vectors' lane sums, transposed
    const std::string id = "i32/sum16." + std::to_string(n);
    vec::I32x16 v[16];
    for (int r = 0; r < 16; ++r) {
      int32_t a[16];
      for (int32_t& e : a) e = g.below(1 << 27) - (1 << 26);
      emit_i32(id + "/in." + std::to_string(r), a, 16);
      v[r] = make_i32(a);
    }
    emit_i32(id + "/sum16", vec::sum16(v));
  }
}

void vec_byte_checks() {
  Rng g{4};
  const uint8_t edge[] = {0, 1, 15, 16, 17, 31, 32, 127, 128, 129, 240, 255};
  for (int n = 0; n < 96; ++n) {
    const std::string id = "u8/" + std::to_string(n);
    uint8_t w[64];
    for (uint8_t& e : w) e = n % 3 == 0 ? edge[g.below(12)] : static_cast<uint8_t>(g.u32());
    int8_t x[4];
    for (int8_t& e : x) {
      e = static_cast<int8_t>(n % 2 ? g.u32() : (g.below(2) ? -128 : 127));
    }
    int32_t x4, acc[16];
    std::memcpy(&x4, x, 4);
    for (int32_t& e : acc) e = g.below(1 << 25) - (1 << 24);
    const uint64_t bits = n == 1 ? ~0ull : n == 2 ? 0x5555AAAA0F0FF0F0ull : g.next();
    const uint8_t m = static_cast<uint8_t>(g.u32());
    emit(id + "/in.w", "u8", w, 64);
    emit_i32(id + "/in.x4", &x4, 1);
    emit_i32(id + "/in.acc", acc, 16);
    emit(id + "/in.bits", "u64", &bits, 1);
    emit(id + "/in.m", "u8", &m, 1);
    const vec::U8x64 vw = vec::load_u8(w);
    const vec::I32x16 va = make_i32(acc);
    emit_u8(id + "/load_u8", vw);
    emit_u8(id + "/and_bytes.0f", vec::and_bytes(vw, 0x0F));
    emit_u8(id + "/and_bytes.m", vec::and_bytes(vw, m));
    emit_u8(id + "/xor_bytes.80", vec::xor_bytes(vw, 0x80));
    emit_u8(id + "/xor_bytes.m", vec::xor_bytes(vw, m));
    emit_u8(id + "/high_nibbles", vec::high_nibbles(vw));
    const vec::U8x64 five = vec::add16_where(vec::and_bytes(vw, 0x0F), bits);  // 5-bit codes
    emit_u8(id + "/add16_where(low nibbles)", five);
    emit_u8(id + "/add16_where(high nibbles)", vec::add16_where(vec::high_nibbles(vw), ~bits));
    emit_u8(id + "/add16_where(bytes)", vec::add16_where(vw, bits));  // wraps past 255
    emit_i32(id + "/dot4<4>", vec::dot4<4>(va, vec::and_bytes(vw, 0x0F), x4));
    emit_i32(id + "/dot4<4>.high", vec::dot4<4>(va, vec::high_nibbles(vw), x4));
    emit_i32(id + "/dot4<5>", vec::dot4<5>(va, five, x4));
    emit_i32(id + "/dot4<5>.and", vec::dot4<5>(va, vec::and_bytes(vw, 0x1F), x4));
    emit_i32(id + "/dot4<8>", vec::dot4<8>(va, vw, x4));
    emit_i32(id + "/dot4<8>.xor", vec::dot4<8>(va, vec::xor_bytes(vw, 0x80), x4));
  }
}

// A bfloat16 of moderate size or, with `edge`, NaN, inf, a zero or a normal of any size whose
// products with another are normal floats. dot_pairs' contract holds where each product is
// exact in float: no denormal operands (AVX512-BF16's vdpbf16ps reads them as zeros and
// flushes denormal results) and no products that overflow or underflow (the FMAs of the other
// ISAs round only the sums, the scalar build rounds the products too).
uint16_t random_bf16(Rng& g, bool edge) {
  if (edge && g.below(4) == 0) {
    const uint16_t special[] = {0x7FC0, 0xFFC0, 0x7F80, 0xFF80, 0x0000, 0x8000};
    return special[g.below(6)];
  }
  if (edge) {
    const uint32_t sign_mantissa = g.u32() & 0x807Fu;
    return static_cast<uint16_t>(sign_mantissa | static_cast<uint32_t>(67 + g.below(121)) << 7);
  }
  const uint32_t sign_mantissa = g.u32() & 0x807Fu;
  return static_cast<uint16_t>(sign_mantissa | static_cast<uint32_t>(107 + g.below(41)) << 7);
}

void vec_pair_checks() {
  Rng g{5};
  for (int n = 0; n < 64; ++n) {
    const bool edge = n >= 48;
    const std::string id = std::string(edge ? "pairs.edge/" : "pairs/") + std::to_string(n);
    uint16_t a[8][32], b[8][32];
    float acc[16];
    for (int k = 0; k < 8; ++k) {
      for (int i = 0; i < 32; ++i) {
        a[k][i] = random_bf16(g, edge);
        b[k][i] = random_bf16(g, edge);
      }
      emit(id + "/in.a" + std::to_string(k), "bf16", a[k], 32);
      emit(id + "/in.b" + std::to_string(k), "bf16", b[k], 32);
    }
    for (float& e : acc) e = edge ? bf16_to_f32(random_bf16(g, true)) : g.scaled(-10, 21);
    emit_f32(id + "/in.acc", acc, 16);
    uint32_t out[16];
    vec::store_pairs(out, vec::load_pairs(a[0]));
    emit(id + "/load_pairs,store_pairs", "u32", out, 16);
    uint32_t pair;
    std::memcpy(&pair, b[0], 4);
    vec::store_pairs(out, vec::set1_pair(pair));
    emit(id + "/set1_pair", "u32", out, 16);
    vec::store_pairs(out, vec::interleave_pairs(reinterpret_cast<const bf16_t*>(a[1]),
                                                reinterpret_cast<const bf16_t*>(b[1])));
    emit(id + "/interleave_pairs", "u32", out, 16);
    const vec::F32x16 va = vec::load(acc);
    emit_f32(id + "/dot_pairs", vec::dot_pairs(va, vec::load_pairs(a[0]), vec::load_pairs(b[0])));
    vec::F32x16 chain = va;  // as the attention's dot products accumulate
    for (int k = 0; k < 8; ++k) {
      chain = vec::dot_pairs(chain, vec::load_pairs(a[k]), vec::load_pairs(b[k]));
    }
    emit_f32(id + "/dot_pairs.chain8", chain);
  }
}

// ---- b. QuantRows ----------------------------------------------------------------------------

template <typename T>
T from_float(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, bf16_t>) {
    return T{bf16_bits(v)};
  } else {
    return T{f16_bits(v)};
  }
}
template <typename T>
const char* type_name() {
  return std::is_same_v<T, float> ? "f32" : std::is_same_v<T, bf16_t> ? "bf16" : "f16";
}

// x [M, K] as the linears meet it, block by block: mostly moderate values of any scale, and
// blocks of zeros (no scale), of rounding ties (max 127: every x / scale is exactly k + 1/2),
// with one value, of tiny values (denormals in the element type) or a wide range.
template <typename T>
std::vector<T> make_x(Rng& g, int64_t M, int64_t K) {
  std::vector<T> x(M * K);
  const bool half = std::is_same_v<T, f16_t>;  // float16 ends at 65504
  const int tiny = half ? -20 : -130;
  for (int64_t b = 0; b < M * K / 32; ++b) {
    const int kind = g.below(12);
    const int e = g.below(13) - 6;
    for (int i = 0; i < 32; ++i) {
      float v = std::ldexp(g.sym(), e);
      if (kind == 1) v = 0.0f;
      if (kind == 2 && i == 5) v = g.below(2) ? 127.0f : -127.0f;
      if (kind == 2 && i != 5) v = static_cast<float>(g.below(254) - 127) + 0.5f;
      if (kind == 3) v = i == 17 ? v : (i % 2 ? -0.0f : 0.0f);
      if (kind == 4) v = std::ldexp(g.sym(), tiny);
      if (kind == 5) v = g.scaled(-20, half ? 34 : 40);
      x[b * 32 + i] = from_float<T>(v);
    }
  }
  return x;
}

// QuantRows of x for every P any ISA's passes use: the codes in x's order (the layout read
// back as QuantRows documents it), the block scales, the groups' sums and the totals; for P
// past 1, whether all of that equals P = 1's, and a hash of the whole buffer as laid out.
template <typename T>
void quant_case(const std::string& id, const std::vector<T>& x, int64_t M, int64_t K,
                int64_t per_group) {
  std::vector<int8_t> codes1;
  std::vector<float> floats1;
  for (const int64_t P : {1, 2, 4, 6, 8}) {
    const qg::QuantRows a(x.data(), M, K, per_group, P);
    std::vector<int8_t> codes(M * K);
    for (int64_t r = 0; r < M; ++r) {
      const int64_t first = r / P * P, rows = std::min(P, M - first);
      for (int64_t k = 0; k < K; ++k) {
        codes[r * K + k] = a.q[first * K + ((k / 4) * rows + (r - first)) * 4 + k % 4];
      }
    }
    const std::vector<float> floats(a.da, a.total + M);  // da, sums, total: one run
    const std::string pid = id + "/P" + std::to_string(P);
    if (P == 1) {
      codes1 = codes;
      floats1 = floats;
      for (int64_t r = 0; r < M; ++r) {
        emit(id + "/codes" + std::to_string(r), "i8", &codes[r * K], K);
      }
      emit_f32(id + "/da", a.da, M * a.blocks);
      emit_f32(id + "/sums", a.sums, M * a.groups);
      emit_f32(id + "/total", a.total, M);
    } else {
      const uint8_t same = codes == codes1 && std::memcmp(floats.data(), floats1.data(),
                                                          floats.size() * sizeof(float)) == 0;
      emit(pid + "/same_as_P1", "u8", &same, 1);
    }
    const uint64_t h = fnv1a(a.q, qg::QuantRows::bytes(M, K, per_group));
    emit(pid + "/buffer_hash", "u64", &h, 1);
  }
}

template <typename T>
void quant_checks(Rng& g) {
  for (const int64_t K : {64, 576, 1536}) {
    for (const int64_t M : {1, 2, 3, 7, 9, 25}) {
      const std::vector<T> x = make_x<T>(g, M, K);
      for (const int64_t per_group : {1, 2}) {
        quant_case("quant/" + std::string(type_name<T>()) + "/K" + std::to_string(K) + "/M" +
                       std::to_string(M) + "/g" + std::to_string(per_group),
                   x, M, K, per_group);
      }
    }
  }
  // inf and the float extremes in x: a block with both infinities, one with both extremes, and
  // a -0 in the second row. (A NaN is left out: which lanes' NaN max16 returns, and so a NaN
  // block's scale, is not defined across ISAs.)
  std::vector<T> x = make_x<T>(g, 2, 96);
  const int at[] = {37, 41, 65, 66, 103};
  const uint32_t special[] = {0x7F800000u, 0xFF800000u, 0x7F7FFFFFu, 0xFF7FFFFFu, 0x80000000u};
  for (int i = 0; i < 5; ++i) x[at[i]] = from_float<T>(from_bits(special[i]));
  quant_case("quant/" + std::string(type_name<T>()) + "/special", x, 2, 96, 1);
}

// ---- c. the int8-dot linears -----------------------------------------------------------------

// Scales (and mins) of moderate size in S.
template <typename S>
std::vector<S> make_scales(Rng& g, size_t n, bool mins) {
  std::vector<S> s(n);
  for (size_t i = 0; i < n; ++i) {
    const float v = std::ldexp(g.sym(), -4);
    s[i] = from_float<S>(mins ? v : std::fabs(v) + 0x1p-8f);
  }
  return s;
}

template <typename W, typename T>
void linear_rows(const std::string& id, const W& w, Rng& g, int64_t N, int64_t K) {
  for (const int64_t M : {1, 2, 3, 5, 7, 8, 9, 13, 25, 64}) {
    const std::vector<T> x = make_x<T>(g, M, K);
    std::vector<T> y(M * N);
    qg::int8_path(w, x.data(), M, N, K, y.data());
    emit(id + "/M" + std::to_string(M), type_name<T>(), y.data(), y.size());
  }
}

// Random codes (every byte pattern is a valid tile of 4-, 5- or 8-bit codes) and scales and
// mins (S) in the layouts of qgemm.h, against x of type T.
template <typename S, int Bits, typename T>
void block_linears(Rng& g) {
  for (const int64_t N : {32, 48}) {
    for (const int64_t K : {64, 576}) {
      for (const int64_t per_group : {1, 2}) {
        const int64_t blocks = K / 32, groups = blocks / per_group;
        std::vector<uint8_t> codes(N / 16 * blocks * qg::QBlocks<S, Bits>::kBlockBytes);
        for (uint8_t& c : codes) c = static_cast<uint8_t>(g.u32());
        std::vector<S> sm(N / 16 * groups * 32);
        for (int64_t t = 0; t < N / 16 * groups; ++t) {  // per tile and group: 16 scales, 16 mins
          const std::vector<S> s = make_scales<S>(g, 16, false), m = make_scales<S>(g, 16, true);
          std::copy(s.begin(), s.end(), sm.begin() + 32 * t);
          std::copy(m.begin(), m.end(), sm.begin() + 32 * t + 16);
        }
        const qg::QBlocks<S, Bits> w{codes.data(), sm.data(), K, blocks, groups, per_group};
        const std::string name = Bits == 4 ? "Q4" : Bits == 5 ? "U5" : "U8";
        linear_rows<decltype(w), T>("linear/" + name + "<" + type_name<S>() + ">/x_" +
                                        type_name<T>() + "/N" + std::to_string(N) + "/K" +
                                        std::to_string(K) + "/g" + std::to_string(per_group),
                                    w, g, N, K);
      }
    }
  }
}

template <typename S, typename T>
void q8_linears(Rng& g) {
  for (const int64_t N : {32, 48}) {
    for (const int64_t K : {64, 576}) {
      std::vector<int8_t> codes(N / 16 * K / 32 * 512);
      for (int8_t& c : codes) c = static_cast<int8_t>(g.u32());
      const std::vector<S> scale = make_scales<S>(g, N, false);
      const qg::Q8<S> w{codes.data(), scale.data(), K, K / 32};
      linear_rows<decltype(w), T>("linear/Q8<" + std::string(type_name<S>()) + ">/x_" +
                                      type_name<T>() + "/N" + std::to_string(N) + "/K" +
                                      std::to_string(K),
                                  w, g, N, K);
    }
  }
}

}  // namespace

int main() {
  std::printf("# isa %s, registers per 16 lanes %d, int4 rows per pass %d, int8 rows per pass %d\n",
              vec::kIsa, vec::kRegsPer16, qg::kQ4RowsPerPass, qg::kMaxRowsPerPass);
  vec_float_checks();
  vec_load_store_checks();
  vec_int_checks();
  vec_byte_checks();
  vec_pair_checks();
  Rng gq{6};
  quant_checks<float>(gq);
  quant_checks<bf16_t>(gq);
  quant_checks<f16_t>(gq);
  // Each weight layout's path, and every scale and x type in one of them (each instantiation
  // of int8_path costs ~1 s of compiling per build; the types' loads and stores are checked
  // exhaustively above)
  Rng gl{7};
  block_linears<f16_t, 4, float>(gl);
  block_linears<bf16_t, 4, bf16_t>(gl);
  block_linears<float, 5, bf16_t>(gl);
  block_linears<bf16_t, 8, float>(gl);
  q8_linears<float, float>(gl);
  q8_linears<f16_t, bf16_t>(gl);
  return 0;
}
