// AdamW on the CPU, the interface between the torch-facing adam_ops.cpp and the torch-free kernels adam_<isa>.cpp.
//
// One call updates one contiguous range of float32 param / grad / exp_avg / exp_avg_sq in place and, when `out` is
// given, writes the updated param into a float32 / bfloat16 / float16 copy (round to nearest even), in the same pass.
// Per element, in float32, with the math and the order of operations of torch's fused CPU AdamW
// (aten/src/ATen/native/cpu/FusedAdamKernel.cpp, ADAMW mode, as the torch 2.13 wheel computes it: m and v come out
// bit-identical, p within an ulp of it in rare elements; the only deliberate difference: g = grad * gscale, where torch
// divides by 1 / gscale):
//   g = grad * gscale;  p = p * decay;  m = fma(lerp_coeff, g - m, lerp_from_grad ? g : m)   (m.lerp_(g, 1 - beta1))
//   v = fma((1 - beta2) * g, g, v * beta2);  p = p + (neg_step_size * m) / (sqrt(v) / bc2_sqrt + eps)
// Every ISA (AVX-512, AVX2, scalar) runs exactly these IEEE operations (no other contraction: -ffp-contract=off), so
// all three give the same bits; the ranges' tails run the vector code on a padded copy.
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

// The vector ISA files (adam_avx2.cpp, adam_avx512.cpp) include this header first, so the standard and intrinsics
// headers above keep the default target; then LLMPAR_TARGET_BEGIN("avx2,fma") ... LLMPAR_TARGET_END() compiles
// what lies between for that ISA, without a global -m flag (the rest of the extension stays portable).
#define LLMPAR_PRAGMA(...) _Pragma(#__VA_ARGS__)
#if defined(__clang__)
#define LLMPAR_TARGET_BEGIN(isa) LLMPAR_PRAGMA(clang attribute push(__attribute__((target(isa))), apply_to = function))
#define LLMPAR_TARGET_END() LLMPAR_PRAGMA(clang attribute pop)
#else
#define LLMPAR_TARGET_BEGIN(isa) LLMPAR_PRAGMA(GCC push_options) LLMPAR_PRAGMA(GCC target(isa))
#define LLMPAR_TARGET_END() LLMPAR_PRAGMA(GCC pop_options)
#endif

namespace llmpar_cpu {

enum OutKind : int { kOutNone = 0, kOutF32 = 1, kOutBF16 = 2, kOutF16 = 3 };
enum Isa : int { kIsaScalar = 0, kIsaAvx2 = 1, kIsaAvx512 = 2, kIsaAvx512Vbmi = 3 };  // (fp32 kernel: 3 runs 2)

// Hyper-parameters of one tensor, rounded once to float32 from double (as torch does).
struct AdamHyper {
  float decay;          // 1 - lr * weight_decay
  float lerp_coeff;     // 1 - beta1 when it is < 0.5, else (1 - beta1) - 1
  int lerp_from_grad;   // 0: m + coeff (g - m); 1: g + coeff (g - m)  (torch's lerp, exact at both ends)
  float beta2;
  float one_minus_beta2;
  float neg_step_size;  // -lr / (1 - beta1^t)
  float bc2_sqrt;       // sqrt(1 - beta2^t)
  float eps;
  float gscale;         // multiplies every grad (1 / loss scale, clip coefficient); 1: none
};

// n elements from the given pointers (out: nullptr, or float / uint16_t bits of bfloat16 / float16 by out kind).
// stream_out: write the out with streaming stores (around the caches: no read for ownership, 2 B of the 32 a bf16
// copy moves per param), for calls that move more memory than the caches hold: the out would not stay there anyway.
struct AdamRange {
  float* param;
  const float* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* out;
  int64_t n;
  bool stream_out;
};

using AdamRangeFn = void (*)(const AdamRange&, const AdamHyper&, int out_kind);

// One per ISA (adam_scalar.cpp, adam_avx2.cpp, adam_avx512.cpp); the vector ones exist on x86-64 only and must only
// be called where the CPU has the instructions (adam_ops.cpp checks with __builtin_cpu_supports).
void adam_range_scalar(const AdamRange& r, const AdamHyper& h, int out_kind);
#if defined(__x86_64__)
void adam_range_avx2(const AdamRange& r, const AdamHyper& h, int out_kind);
void adam_range_avx512(const AdamRange& r, const AdamHyper& h, int out_kind);
#endif

}  // namespace llmpar_cpu
