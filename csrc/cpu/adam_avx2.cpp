// AVX2 + FMA + F16C build of the AdamW kernel (adam_impl.h), 8 floats per step, compiled for that ISA by a target
// pragma (adam.h): adam_ops.cpp calls it only where __builtin_cpu_supports finds the instructions. x86-64 only.
#include "adam.h"

#if defined(__x86_64__)
LLMPAR_TARGET_BEGIN("avx2,fma,f16c")
#include "adam_impl.h"

namespace {

struct Avx2 {
  LLMPAR_SIMD_ARITH(_mm256, __m256, 8)
  template <bool NT>
  static void put_half(uint16_t* p, __m128i bits) {
    auto* to = reinterpret_cast<__m128i*>(p);
    if constexpr (NT) _mm_stream_si128(to, bits); else _mm_storeu_si128(to, bits);
  }
  template <bool NT>
  static void store_bf16(uint16_t* p, V x) {  // round to nearest even on the bits; NaN: quiet, sign and payload kept
    const __m256i u = _mm256_castps_si256(x);
    const __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i r = _mm256_blendv_epi8(rounded, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
    put_half<NT>(p, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
  }
  template <bool NT>
  static void store_f16(uint16_t* p, V x) {
    put_half<NT>(p, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

}  // namespace

LLMPAR_ADAM_RANGE(adam_range_avx2, Avx2)

LLMPAR_TARGET_END()
#endif  // __x86_64__
