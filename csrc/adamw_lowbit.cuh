// AdamW with 8- or 4-bit block-quantized moments on the GPU: C interface of adamw_lowbit_kernels.cu (no torch
// headers). Same math as kernels/adamw_lowbit.py (the Triton twin) and the contract of llmpar/ops/lowbit.py:
//   per block of B elements (8 bits: 256, 4 bits: 128) codes uint8 (4 bits: element 2i in the low nibble of byte i),
//   a float32 absmax scale, float32 maps of 2^bits entries (m signed, v unsigned), passed in as data.
//   Per element, float32, t = the tensor's step (already incremented), bcK = 1 - betaK^t = -expm1(t ln betaK):
//     g = G(grad) * gscale;  m = qm[code] * scale;  v = qv[code] * scale;  p = p (1 - lr wd)
//     m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g g;  p = p - lr / bc1 * (m / (sqrt(v) * (1 / sqrt(bc2)) + eps))
//   then per block s = max |x|, y = x * (1 / s) (y = 0 where s = 0), code = the number of midpoints
//   mid[k] = (q[k] + q[k + 1]) / 2 (float32) with mid[k] < y. p: the float32 param, or the float32 master with the
//   bf16 param rounded from it (to nearest even) in the same pass.
// A nonzero *found_inf skips the step. lr_ptr / gscale / found_inf may be null.
//
// Table (device, int64, LLMPAR_LOWBIT_TABLE_ROWS rows of n entries, row-major): first quantization block of tensor
// i, then the addresses of param, grad, m_codes, m_scale, v_codes, v_scale, master (or 0), step (float32 scalar),
// then numel. A CTA of B threads loads both maps and their midpoints into shared memory once, then walks quantization
// blocks (grid-stride), one element a thread; the block absmax is a warp-shuffle + shared-memory reduction.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "bucket.cuh"  // LlmparDtype

#define LLMPAR_LOWBIT_TABLE_ROWS 10
#define LLMPAR_LOWBIT_BLOCK8 256
#define LLMPAR_LOWBIT_BLOCK4 128

#ifdef __cplusplus
extern "C" {
#endif

typedef struct LlmparLowbitArgs {
  float lr;                // used when lr_ptr is null
  const float* lr_ptr;     // device scalar or null
  const float* gscale;     // device scalar multiplying every grad, or null
  const float* found_inf;  // device scalar, nonzero skips the step, or null
  const float* qmap_m;     // device, 2^bits float32, ascending, in [-1, 1]
  const float* qmap_v;     // device, 2^bits float32, ascending, in [0, 1]
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float ln_beta1, ln_beta2;  // natural logs (computed in double on the host)
  float eps, weight_decay;
} LlmparLowbitArgs;

// fills first[i] (first quantization block of tensor i) and returns the number of quantization blocks
int64_t llmpar_lowbit_plan(const int64_t* numels, int64_t n, int bits, int64_t* first);

// bits: 8 or 4; master: params bf16 with float32 masters (else float32 params); grad_dtype: LlmparDtype.
// Anything else: cudaErrorInvalidValue.
cudaError_t llmpar_lowbit_launch(int bits, int master, int grad_dtype, const int64_t* d_table, int64_t n,
                                 int64_t num_blocks, const LlmparLowbitArgs* args, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
