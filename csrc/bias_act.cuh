// Fused bias-activation backward: C interface of bias_act_kernels.cu (no torch headers).
//
//   grad: [M, N] (row stride ld_grad), pre: [M, N] (row stride ld_pre), the pre-activation z = x W^T + b
//   grad_pre[m, n] = Out(grad[m, n] * act'(pre[m, n]))      (contiguous [M, N], Out = pre's dtype; fp32 math)
//   grad_bias[n]   = sum_m grad[m, n] * act'(pre[m, n])     (fp32, summed before the rounding to Out)
// act: 0 none (pre not read), 1 gelu_tanh, 2 gelu_erf, 3 silu, 4 relu (the codes of llmpar.kernels.gemm.ACTS).
// One pass over grad/pre: each block owns LLMPAR_BIAS_ACT_COLS columns of a slice of the rows and writes its fp32
// column sums to partial[slice, :]; a second, small launch adds the `splits` partials per column in a fixed order
// (deterministic: no atomics).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "bucket.cuh"  // LlmparDtype

#define LLMPAR_BIAS_ACT_COLS 32
#define LLMPAR_BIAS_ACT_ROWS 8

#ifdef __cplusplus
extern "C" {
#endif

// how many row slices (the partial buffer is fp32 [splits, N]) a launch for [M, N] uses
int64_t llmpar_bias_act_splits(int64_t M, int64_t N);

cudaError_t llmpar_bias_act_backward_launch(const void* grad, int grad_dtype, int64_t ld_grad, const void* pre,
                                            int pre_dtype, int64_t ld_pre, void* grad_pre, float* partial,
                                            float* grad_bias, int64_t M, int64_t N, int act, int64_t splits,
                                            cudaStream_t stream);

#ifdef __cplusplus
}
#endif
