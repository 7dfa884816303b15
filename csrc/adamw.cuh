// Multi-tensor AdamW step in four precision modes, and a multi-tensor sum of squares (grad norm): C interface of
// adamw_kernels.cu (no torch headers). Same math, table and random bits as kernels/adamw.py (the Triton twin).
//
// AdamW per element, float32 math, t = the tensor's step (already incremented), bcK = 1 - betaK^t = -expm1(t ln betaK):
//   g = G(grad) * gscale;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p = p (1 - lr wd) - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
// Modes: FP32 (p, m, v float32) | FP32_MASTER (x = float32 master is p; param = rn(master), bf16 or fp16; m, v float32)
//        | BF16_SR (p, m, v bf16, every write stochastically rounded) | BF16_KAHAN (p, m, v bf16 nearest; x = bf16
//        compensation: y = update + x, p' = rn(p + y), x' = rn(y - (p' - p))).
// A nonzero *found_inf skips the step (nothing read or written). lr_ptr / gscale / found_inf may be null.
//
// Table (device, int64, 9 rows of n entries, row-major): first block of tensor i, then the addresses of param, grad,
// exp_avg, exp_avg_sq, extra (master / compensation / 0), step (float32 scalar), then numel, then salt. Block b finds
// its tensor by binary search in row 0 and handles LLMPAR_ADAMW_CHUNK elements of it, 16-byte vector accesses when
// every pointer of the tensor is aligned. Stochastic rounding: 16 random bits from hash32 of
// (element index + hash32(hash32(uint32(t) * 0x3C6EF372 + salt) ^ seed)) are added below the bf16 mantissa, then cut.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "bucket.cuh"  // LlmparDtype

#define LLMPAR_ADAMW_THREADS 256
#define LLMPAR_ADAMW_VEC 8  // elements per vector access: 16 B of bf16, 2 x 16 B of float32
#define LLMPAR_ADAMW_CHUNK (LLMPAR_ADAMW_THREADS * LLMPAR_ADAMW_VEC * 2)  // 4096 elements per block
#define LLMPAR_ADAMW_TABLE_ROWS 9

#ifdef __cplusplus
extern "C" {
#endif

enum LlmparAdamwMode { LLMPAR_ADAMW_FP32 = 0, LLMPAR_ADAMW_FP32_MASTER = 1, LLMPAR_ADAMW_BF16_SR = 2,
                       LLMPAR_ADAMW_BF16_KAHAN = 3 };

typedef struct LlmparAdamwArgs {
  float lr;                // used when lr_ptr is null
  const float* lr_ptr;     // device scalar or null
  const float* gscale;     // device scalar multiplying every grad, or null
  const float* found_inf;  // device scalar, nonzero skips the step, or null
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float ln_beta1, ln_beta2;  // natural logs (computed in double on the host)
  float eps, weight_decay;
  uint32_t seed;
} LlmparAdamwArgs;

// fills first[i] (first block of tensor i) and returns the number of blocks
int64_t llmpar_adamw_plan(const int64_t* numels, int64_t n, int64_t* first);

// mode: LlmparAdamwMode; param_dtype / grad_dtype: LlmparDtype. Supported: FP32 with F32 params; FP32_MASTER with
// BF16/F16 params; BF16_* with BF16 params; grads F32/F16/BF16 in every mode. Else cudaErrorInvalidValue.
cudaError_t llmpar_adamw_launch(int mode, int param_dtype, int grad_dtype, const int64_t* d_table, int64_t n,
                                int64_t num_blocks, const LlmparAdamwArgs* args, cudaStream_t stream);

// partials[b] = sum of float32 squares of block b's elements; table rows: first block, address, numel (3 x n)
cudaError_t llmpar_sum_squares_launch(int dtype, const int64_t* d_table, int64_t n, int64_t num_blocks,
                                      float* partials, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
