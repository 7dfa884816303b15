// AdamW with 8- / 4-bit block-quantized moments (see adamw_lowbit.cuh for the math, the table and the layout);
// kernels/adamw_lowbit.py is the Triton twin. Compiles with nvcc alone: no torch headers. No fast math: the division
// 1 / s, sqrtf and expm1f stay IEEE (the codes must match the contract's float32 math).
#include "adamw_lowbit.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace {

template <typename T> __device__ __forceinline__ float to_f(T x);
template <> __device__ __forceinline__ float to_f<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ float block_max(float x, float* red) {  // x >= 0; every thread gets the block's max
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, o));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) red[warp] = x;
  __syncthreads();
  x = lane < static_cast<int>(blockDim.x >> 5) ? red[lane] : 0.0f;
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, o));
  return x;
}

template <int BITS>
__device__ __forceinline__ int search(const float* mid, float y) {  // the number of midpoints < y
  int code = 0;
#pragma unroll
  for (int s = 1 << (BITS - 1); s > 0; s >>= 1) code += mid[code + s - 1] < y ? s : 0;
  return code;
}

template <int BITS>
__device__ __forceinline__ int code_at(const uint8_t* codes, int64_t e) {
  if constexpr (BITS == 8) {
    return codes[e];
  } else {
    return (codes[e >> 1] >> ((e & 1) * 4)) & 0xF;
  }
}

// writes element e's code (4 bits: even threads write the byte with their odd neighbour's code; whole warps call)
template <int BITS>
__device__ __forceinline__ void put_code(uint8_t* codes, int64_t e, int code, bool valid) {
  if constexpr (BITS == 8) {
    if (valid) codes[e] = static_cast<uint8_t>(code);
  } else {
    const int odd = __shfl_down_sync(0xFFFFFFFFu, valid ? code : 0, 1);
    if (valid && (e & 1) == 0) codes[e >> 1] = static_cast<uint8_t>(code | (odd << 4));
  }
}

__device__ __forceinline__ float one_minus_pow(float ln_b, float t) { return -expm1f(t * ln_b); }

template <int BITS, bool MASTER, typename G>
__global__ void __launch_bounds__(BITS == 8 ? LLMPAR_LOWBIT_BLOCK8 : LLMPAR_LOWBIT_BLOCK4)
lowbit_kernel(const int64_t* __restrict__ table, int64_t n, int64_t num_blocks, LlmparLowbitArgs a) {
  constexpr int B = BITS == 8 ? LLMPAR_LOWBIT_BLOCK8 : LLMPAR_LOWBIT_BLOCK4;
  constexpr int Q = 1 << BITS;
  __shared__ float qm[Q], qv[Q], mid_m[Q], mid_v[Q];
  __shared__ float red[2][32];
  if (a.found_inf != nullptr && *a.found_inf != 0.0f) return;
  for (int k = threadIdx.x; k < Q; k += B) {
    qm[k] = a.qmap_m[k];
    qv[k] = a.qmap_v[k];
  }
  __syncthreads();
  for (int k = threadIdx.x; k < Q - 1; k += B) {
    mid_m[k] = (qm[k] + qm[k + 1]) / 2.0f;
    mid_v[k] = (qv[k] + qv[k + 1]) / 2.0f;
  }
  __syncthreads();
  const float lr = a.lr_ptr != nullptr ? *a.lr_ptr : a.lr;
  const float gscale = a.gscale != nullptr ? *a.gscale : 1.0f;
  const float decay = 1.0f - lr * a.weight_decay;
  for (int64_t qb = blockIdx.x; qb < num_blocks; qb += gridDim.x) {
    int64_t lo = 0, hi = n - 1;  // the last tensor whose first block is <= qb
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (table[mid] <= qb) lo = mid; else hi = mid - 1;
    }
    const int64_t t = lo, blk = qb - table[t];
    auto* param = reinterpret_cast<float*>(table[1 * n + t]);
    auto* pbf = reinterpret_cast<__nv_bfloat16*>(table[1 * n + t]);
    const auto* grad = reinterpret_cast<const G*>(table[2 * n + t]);
    auto* m_codes = reinterpret_cast<uint8_t*>(table[3 * n + t]);
    auto* m_scale = reinterpret_cast<float*>(table[4 * n + t]);
    auto* v_codes = reinterpret_cast<uint8_t*>(table[5 * n + t]);
    auto* v_scale = reinterpret_cast<float*>(table[6 * n + t]);
    auto* master = reinterpret_cast<float*>(table[7 * n + t]);
    const float step = *reinterpret_cast<const float*>(table[8 * n + t]);
    const int64_t numel = table[9 * n + t];
    const float step_size = lr / one_minus_pow(a.ln_beta1, step);
    const float bc2_rsqrt = 1.0f / sqrtf(one_minus_pow(a.ln_beta2, step));
    const int64_t e = blk * B + threadIdx.x;
    const bool valid = e < numel;
    float m = 0.0f, v = 0.0f;
    if (valid) {
      const float g = to_f<G>(grad[e]) * gscale;
      m = qm[code_at<BITS>(m_codes, e)] * m_scale[blk];
      v = qv[code_at<BITS>(v_codes, e)] * v_scale[blk];
      float p = (MASTER ? master[e] : param[e]) * decay;
      m = a.beta1 * m + a.one_minus_beta1 * g;
      v = a.beta2 * v + a.one_minus_beta2 * (g * g);
      p = p - step_size * (m / (sqrtf(v) * bc2_rsqrt + a.eps));
      if constexpr (MASTER) {
        master[e] = p;
        pbf[e] = __float2bfloat16_rn(p);
      } else {
        param[e] = p;
      }
    }
    const float sm = block_max(fabsf(m), red[0]);
    const float sv = block_max(fabsf(v), red[1]);
    // (every code read of this block happened before the reductions' barrier: the writes below cannot race them)
    const int cm = search<BITS>(mid_m, m * (1.0f / (sm == 0.0f ? 1.0f : sm)));  // s == 0: y = 0, the entry nearest 0
    const int cv = search<BITS>(mid_v, v * (1.0f / (sv == 0.0f ? 1.0f : sv)));
    put_code<BITS>(m_codes, e, cm, valid);
    put_code<BITS>(v_codes, e, cv, valid);
    if (threadIdx.x == 0) {
      m_scale[blk] = sm;
      v_scale[blk] = sv;
    }
    __syncthreads();  // red[] is reused by the next block
  }
}

template <int BITS, bool MASTER>
cudaError_t launch_grad(int grad_dtype, const int64_t* d_table, int64_t n, int64_t num_blocks,
                        const LlmparLowbitArgs* a, cudaStream_t stream) {
  constexpr int B = BITS == 8 ? LLMPAR_LOWBIT_BLOCK8 : LLMPAR_LOWBIT_BLOCK4;
  const unsigned grid = static_cast<unsigned>(num_blocks < 65535 * 8 ? num_blocks : 65535 * 8);
  switch (grad_dtype) {
    case LLMPAR_F32: lowbit_kernel<BITS, MASTER, float><<<grid, B, 0, stream>>>(d_table, n, num_blocks, *a); break;
    case LLMPAR_F16: lowbit_kernel<BITS, MASTER, __half><<<grid, B, 0, stream>>>(d_table, n, num_blocks, *a); break;
    case LLMPAR_BF16:
      lowbit_kernel<BITS, MASTER, __nv_bfloat16><<<grid, B, 0, stream>>>(d_table, n, num_blocks, *a);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

extern "C" int64_t llmpar_lowbit_plan(const int64_t* numels, int64_t n, int bits, int64_t* first) {
  const int64_t b = bits == 8 ? LLMPAR_LOWBIT_BLOCK8 : LLMPAR_LOWBIT_BLOCK4;
  int64_t acc = 0;
  for (int64_t i = 0; i < n; ++i) {
    first[i] = acc;
    acc += (numels[i] + b - 1) / b;
  }
  return acc;
}

extern "C" cudaError_t llmpar_lowbit_launch(int bits, int master, int grad_dtype, const int64_t* d_table, int64_t n,
                                            int64_t num_blocks, const LlmparLowbitArgs* args, cudaStream_t stream) {
  if (num_blocks <= 0) return cudaSuccess;
  if (bits == 8) {
    return master ? launch_grad<8, true>(grad_dtype, d_table, n, num_blocks, args, stream)
                  : launch_grad<8, false>(grad_dtype, d_table, n, num_blocks, args, stream);
  }
  if (bits == 4) {
    return master ? launch_grad<4, true>(grad_dtype, d_table, n, num_blocks, args, stream)
                  : launch_grad<4, false>(grad_dtype, d_table, n, num_blocks, args, stream);
  }
  return cudaErrorInvalidValue;
}
