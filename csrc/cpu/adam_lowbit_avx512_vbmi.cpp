// AVX-512 + VBMI build of the low-bit AdamW kernel (adam_lowbit_avx512.h: the 8-bit dequantize by byte lookups),
// compiled for that ISA by a target pragma (adam.h): adam_lowbit_ops.cpp calls it where __builtin_cpu_supports finds
// avx512vbmi besides F / BW / VL / DQ, unless LLMPAR_CPU_ISA caps the ISA lower.
#include "adam_lowbit.h"

#if defined(__x86_64__)
LLMPAR_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx2,fma,f16c")
#define LLMPAR_LOWBIT_VBMI 1
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include "adam_lowbit_avx512.h"

void llmpar_cpu::adam_lowbit_avx512_vbmi(const LowbitRange& r, const LowbitHyper& h, const LowbitMap& m,
                                         const LowbitMap& v, int bits) {
  if (bits == 8) {
    run<8>(r, h, m, v);
  } else {
    run<4>(r, h, m, v);
  }
}

LLMPAR_TARGET_END()
#endif  // __x86_64__
