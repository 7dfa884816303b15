// Portable build of the AdamW kernel (adam_impl.h) on plain floats: the fallback where the CPU has neither AVX2 nor
// AVX-512 (and where LLMPAR_CPU_ISA=scalar asks for it). Same operations, hence the same bits, as the vector builds.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "adam_impl.h"

namespace {

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

// float -> bfloat16 bits, round to nearest even; NaN stays NaN (quiet bit set, sign and top payload kept)
uint16_t bf16_bits(float x) {
  const uint32_t u = bits_of(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// float -> float16 bits, round to nearest even (what F16C's vcvtps2ph does with _MM_FROUND_TO_NEAREST_INT)
uint16_t f16_bits(float x) {
  const uint32_t u = bits_of(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));  // NaN, quiet
  if (a >= 0x47800000u) return static_cast<uint16_t>(sign | 0x7C00u);                         // >= 2^16: inf
  if (a >= 0x38800000u) {  // a normal float16 (>= 2^-14): rebias the exponent by 127 - 15, round 13 bits away
    const uint32_t r = a - 0x38000000u;                  // (a carry out of the mantissa bumps the exponent,
    return static_cast<uint16_t>(sign | ((r + 0x0FFFu + ((r >> 13) & 1u)) >> 13));  // up to inf at 65520)
  }
  if (a < 0x33000000u) return static_cast<uint16_t>(sign);  // < 2^-25: rounds to zero (2^-25 itself: a tie, to 0)
  // a float16 subnormal: the value in units of 2^-24 is mant * 2^(e - 126), e in [102, 112]
  const uint32_t e = a >> 23;
  const uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - e;  // 14..24
  const uint32_t q = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  return static_cast<uint16_t>(sign | (q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u)));
}

struct Scalar {
  using V = float;
  static constexpr int W = 1;
  static V load(const float* p) { return *p; }
  static void store(float* p, V x) { *p = x; }
  static V set1(float x) { return x; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V sqrt(V a) { return std::sqrt(a); }
  static V fma(V a, V b, V c) { return std::fma(a, b, c); }
  static constexpr bool kStream = false;  // (plain stores only)
  template <bool NT>
  static void put(float* p, V x) { *p = x; }
  template <bool NT>
  static void store_bf16(uint16_t* p, V x) { *p = bf16_bits(x); }
  template <bool NT>
  static void store_f16(uint16_t* p, V x) { *p = f16_bits(x); }
  static void fence() {}
};

}  // namespace

LLMPAR_ADAM_RANGE(adam_range_scalar, Scalar)
