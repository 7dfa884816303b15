// AVX-512 build of the AdamW kernel (adam_impl.h), 16 floats per step (F, BW, VL, DQ: the set torch calls AVX512),
// compiled for that ISA by a target pragma (adam.h): adam_ops.cpp calls it only where __builtin_cpu_supports finds
// the instructions. x86-64 only.
#include "adam.h"

#if defined(__x86_64__)
LLMPAR_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#if !defined(__clang__)  // GCC 12 warns about the self-initialised _mm512_undefined_*() inside its own intrinsics
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include "adam_impl.h"

namespace {

struct Avx512 {
  LLMPAR_SIMD_ARITH(_mm512, __m512, 16)
  template <bool NT>
  static void put_half(uint16_t* p, __m256i bits) {
    auto* to = reinterpret_cast<__m256i*>(p);
    if constexpr (NT) _mm256_stream_si256(to, bits); else _mm256_storeu_si256(to, bits);
  }
  template <bool NT>
  static void store_bf16(uint16_t* p, V x) {  // round to nearest even on the bits; NaN: quiet, sign and payload kept
    const __m512i u = _mm512_castps_si512(x);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i r = _mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
    put_half<NT>(p, _mm512_cvtepi32_epi16(r));
  }
  template <bool NT>
  static void store_f16(uint16_t* p, V x) {
    put_half<NT>(p, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

}  // namespace

LLMPAR_ADAM_RANGE(adam_range_avx512, Avx512)

LLMPAR_TARGET_END()
#endif  // __x86_64__
