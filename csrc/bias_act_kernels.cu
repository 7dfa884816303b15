// Fused bias-activation backward (see bias_act.cuh). Compiles with nvcc alone: no torch headers.
// The activation derivatives are the formulas of the Triton kernels (kernels/gemm.py, _act_grad), in fp32.
#include "bias_act.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace {

template <typename T> __device__ __forceinline__ float load_f32(const T* p);
template <> __device__ __forceinline__ float load_f32<float>(const float* p) { return *p; }
template <> __device__ __forceinline__ float load_f32<__half>(const __half* p) { return __half2float(*p); }
template <> __device__ __forceinline__ float load_f32<__nv_bfloat16>(const __nv_bfloat16* p) {
  return __bfloat162float(*p);
}

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float act_grad(float z, int act) {
  switch (act) {
    case 1: {  // gelu, tanh approximation
      const float t = tanhf(0.7978845608028654f * (z + 0.044715f * z * z * z));
      return 0.5f * (1.0f + t) + 0.5f * z * (1.0f - t * t) * 0.7978845608028654f * (1.0f + 0.134145f * z * z);
    }
    case 2:  // gelu, erf
      return 0.5f * (1.0f + erff(z * 0.7071067811865476f)) + z * 0.3989422804014327f * expf(-0.5f * z * z);
    case 3: {  // silu
      const float s = 1.0f / (1.0f + expf(-z));
      return s * (1.0f + z * (1.0f - s));
    }
    case 4:  // relu
      return z > 0.0f ? 1.0f : 0.0f;
    default:
      return 1.0f;
  }
}

// grid (ceil(N / COLS), splits), block (COLS, ROWS): thread (c, r) walks rows r, r + ROWS * splits, ... of its slice
template <typename G, typename Z>
__global__ void __launch_bounds__(LLMPAR_BIAS_ACT_COLS * LLMPAR_BIAS_ACT_ROWS)
bias_act_backward_kernel(const G* __restrict__ grad, int64_t ld_grad, const Z* __restrict__ pre, int64_t ld_pre,
                         Z* __restrict__ grad_pre, float* __restrict__ partial, int64_t M, int64_t N, int act) {
  __shared__ float sums[LLMPAR_BIAS_ACT_ROWS][LLMPAR_BIAS_ACT_COLS + 1];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * LLMPAR_BIAS_ACT_COLS + threadIdx.x;
  const int64_t step = static_cast<int64_t>(LLMPAR_BIAS_ACT_ROWS) * gridDim.y;
  float acc = 0.0f;
  if (col < N) {
    for (int64_t row = static_cast<int64_t>(blockIdx.y) * LLMPAR_BIAS_ACT_ROWS + threadIdx.y; row < M; row += step) {
      float g = load_f32<G>(grad + row * ld_grad + col);
      if (act != 0) g *= act_grad(load_f32<Z>(pre + row * ld_pre + col), act);
      grad_pre[row * N + col] = from_f32<Z>(g);
      acc += g;
    }
  }
  sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < N) {
    float total = 0.0f;
#pragma unroll
    for (int r = 0; r < LLMPAR_BIAS_ACT_ROWS; ++r) total += sums[r][threadIdx.x];
    partial[static_cast<int64_t>(blockIdx.y) * N + col] = total;
  }
}

__global__ void sum_partials_kernel(const float* __restrict__ partial, float* __restrict__ out, int64_t splits,
                                    int64_t N) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= N) return;
  float total = 0.0f;
  for (int64_t s = 0; s < splits; ++s) total += partial[s * N + col];
  out[col] = total;
}

struct LaunchArgs {
  const void* grad;
  int64_t ld_grad;
  const void* pre;
  int64_t ld_pre;
  void* grad_pre;
  float* partial;
  int64_t M, N;
  int act;
  int64_t splits;
  cudaStream_t stream;
};

template <typename G, typename Z>
void launch_typed(const LaunchArgs& a) {
  const dim3 block(LLMPAR_BIAS_ACT_COLS, LLMPAR_BIAS_ACT_ROWS);
  const dim3 grid(static_cast<unsigned>((a.N + LLMPAR_BIAS_ACT_COLS - 1) / LLMPAR_BIAS_ACT_COLS),
                  static_cast<unsigned>(a.splits));
  bias_act_backward_kernel<G, Z><<<grid, block, 0, a.stream>>>(
      static_cast<const G*>(a.grad), a.ld_grad, static_cast<const Z*>(a.pre), a.ld_pre, static_cast<Z*>(a.grad_pre),
      a.partial, a.M, a.N, a.act);
}

template <typename G>
bool launch_pre(int pre_dtype, const LaunchArgs& a) {
  switch (pre_dtype) {
    case LLMPAR_F32: launch_typed<G, float>(a); return true;
    case LLMPAR_F16: launch_typed<G, __half>(a); return true;
    case LLMPAR_BF16: launch_typed<G, __nv_bfloat16>(a); return true;
    default: return false;
  }
}

}  // namespace

extern "C" int64_t llmpar_bias_act_splits(int64_t M, int64_t N) {
  // about 1024 blocks of 256 threads in all, each slice at least ROWS rows
  const int64_t col_blocks = (N + LLMPAR_BIAS_ACT_COLS - 1) / LLMPAR_BIAS_ACT_COLS;
  const int64_t by_rows = (M + LLMPAR_BIAS_ACT_ROWS - 1) / LLMPAR_BIAS_ACT_ROWS;
  int64_t splits = col_blocks > 0 ? 1024 / col_blocks : 1;
  splits = splits < by_rows ? splits : by_rows;
  splits = splits < 1024 ? splits : 1024;
  return splits > 1 ? splits : 1;
}

extern "C" cudaError_t llmpar_bias_act_backward_launch(const void* grad, int grad_dtype, int64_t ld_grad,
                                                       const void* pre, int pre_dtype, int64_t ld_pre, void* grad_pre,
                                                       float* partial, float* grad_bias, int64_t M, int64_t N, int act,
                                                       int64_t splits, cudaStream_t stream) {
  if (M <= 0 || N <= 0 || splits <= 0) return cudaErrorInvalidValue;
  const LaunchArgs a{grad, ld_grad, pre, ld_pre, grad_pre, partial, M, N, act, splits, stream};
  bool ok = false;
  switch (grad_dtype) {
    case LLMPAR_F32: ok = launch_pre<float>(pre_dtype, a); break;
    case LLMPAR_F16: ok = launch_pre<__half>(pre_dtype, a); break;
    case LLMPAR_BF16: ok = launch_pre<__nv_bfloat16>(pre_dtype, a); break;
    default: break;
  }
  if (!ok) return cudaErrorInvalidValue;
  const int threads = 256;
  sum_partials_kernel<<<static_cast<unsigned>((N + threads - 1) / threads), threads, 0, stream>>>(partial, grad_bias,
                                                                                                  splits, N);
  return cudaGetLastError();
}
