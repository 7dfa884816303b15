// AVX-512 + VBMI build of the low-bit AdamW kernel (adam_lowbit_avx512.h: the 8-bit dequantize by byte lookups),
// compiled for that ISA by a target pragma (adam.h): adam_lowbit_ops.cpp calls it where __builtin_cpu_supports finds
// avx512vbmi besides F / BW / VL / DQ, unless LLMPAR_CPU_ISA caps the ISA lower. Compiled for AVX512-BF16 too:
// the bf16 copies use vcvtneps2bf16 where __builtin_cpu_supports finds it (Zen 4, Sapphire Rapids; not Ice Lake).
#include "adam_lowbit.h"

#if defined(__x86_64__)
LLMPAR_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bf16,avx2,fma,f16c")
#define LLMPAR_LOWBIT_VBMI 1
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include "adam_lowbit_avx512.h"

void llmpar_cpu::adam_lowbit_avx512_vbmi(const LowbitRange& r, const LowbitHyper& h, const LowbitMap& m,
                                         const LowbitMap& v, int bits) {
  static const bool bf16 = [] {  // vcvtneps2bf16 for the bf16 copies (store_bf16), where the CPU has it
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
  }();
  if (bits == 8) {
    bf16 ? run<8, true>(r, h, m, v) : run<8, false>(r, h, m, v);
  } else {
    bf16 ? run<4, true>(r, h, m, v) : run<4, false>(r, h, m, v);
  }
}

LLMPAR_TARGET_END()
#endif  // __x86_64__
