// Multi-tensor AdamW (four precision modes) and sum of squares. Compiles with nvcc alone: no torch headers.
// See adamw.cuh for the math, the table and the random stream; kernels/adamw.py is the Triton twin (same bits).
// No fast math: expm1f/sqrtf/division stay IEEE, and denormal grads are not flushed.
#include "adamw.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

namespace {

template <typename T> __device__ __forceinline__ float to_f(T x);
template <> __device__ __forceinline__ float to_f<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);  // round to nearest even
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0x735A2D97u;
  x ^= x >> 15;
  return x;
}

// stochastic rounding float32 -> bf16 with the low 16 bits of r; NaN stays NaN
__device__ __forceinline__ __nv_bfloat16 bf16_sr(float x, uint32_t r) {
  if (x != x) return __float2bfloat16_rn(x);
  const uint32_t bits = (__float_as_uint(x) + (r & 0xFFFFu)) >> 16;
  return __ushort_as_bfloat16(static_cast<unsigned short>(bits));
}

template <typename T, int K> struct alignas(sizeof(T) * K) Vec { T v[K]; };

struct Consts {
  float decay, lrwd, step_size, bc2_sqrt, gscale, b1, omb1, b2, omb2, eps;
  uint32_t key;
};

// K consecutive elements starting at e (element index within the tensor); K > 1 needs aligned pointers
template <int MODE, typename P, typename G, typename S, typename X, int K>
__device__ __forceinline__ void step_elems(P* p, const G* g, S* m, S* v, X* x, int64_t e, const Consts& c) {
  using VP = Vec<P, K>;
  using VG = Vec<G, K>;
  using VS = Vec<S, K>;
  using VX = Vec<X, K>;
  const VG gv = *reinterpret_cast<const VG*>(g + e);
  VS mv = *reinterpret_cast<const VS*>(m + e);
  VS vv = *reinterpret_cast<const VS*>(v + e);
  VP pv;
  VX xv;
  if constexpr (MODE != LLMPAR_ADAMW_FP32_MASTER) pv = *reinterpret_cast<const VP*>(p + e);
  if constexpr (MODE == LLMPAR_ADAMW_FP32_MASTER || MODE == LLMPAR_ADAMW_BF16_KAHAN) xv = *reinterpret_cast<const VX*>(x + e);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const float gk = to_f<G>(gv.v[k]) * c.gscale;
    const float pk = MODE == LLMPAR_ADAMW_FP32_MASTER ? to_f<X>(xv.v[k]) : to_f<P>(pv.v[k]);
    const float mk = c.b1 * to_f<S>(mv.v[k]) + c.omb1 * gk;
    const float vk = c.b2 * to_f<S>(vv.v[k]) + c.omb2 * (gk * gk);
    const float upd = c.step_size * (mk / (sqrtf(vk) / c.bc2_sqrt + c.eps));
    if constexpr (MODE == LLMPAR_ADAMW_FP32) {
      pv.v[k] = from_f<P>(pk * c.decay - upd);
      mv.v[k] = from_f<S>(mk);
      vv.v[k] = from_f<S>(vk);
    } else if constexpr (MODE == LLMPAR_ADAMW_FP32_MASTER) {
      const float pn = pk * c.decay - upd;
      xv.v[k] = from_f<X>(pn);
      pv.v[k] = from_f<P>(pn);
      mv.v[k] = from_f<S>(mk);
      vv.v[k] = from_f<S>(vk);
    } else if constexpr (MODE == LLMPAR_ADAMW_BF16_SR) {
      const uint32_t r = hash32(static_cast<uint32_t>(e + k) + c.key);
      const uint32_t r2 = hash32(r ^ 0x5BD1E995u);
      pv.v[k] = bf16_sr(pk * c.decay - upd, r);
      mv.v[k] = bf16_sr(mk, r >> 16);
      vv.v[k] = bf16_sr(vk, r2);
    } else {  // Kahan
      const float y = (-c.lrwd * pk - upd) + to_f<X>(xv.v[k]);
      const P pn = from_f<P>(pk + y);
      xv.v[k] = from_f<X>(y - (to_f<P>(pn) - pk));
      pv.v[k] = pn;
      mv.v[k] = from_f<S>(mk);
      vv.v[k] = from_f<S>(vk);
    }
  }
  *reinterpret_cast<VP*>(p + e) = pv;
  *reinterpret_cast<VS*>(m + e) = mv;
  *reinterpret_cast<VS*>(v + e) = vv;
  if constexpr (MODE == LLMPAR_ADAMW_FP32_MASTER || MODE == LLMPAR_ADAMW_BF16_KAHAN) *reinterpret_cast<VX*>(x + e) = xv;
}

__device__ __forceinline__ int64_t find_tensor(const int64_t* __restrict__ first, int64_t n, int64_t b) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {  // last tensor whose first block is <= b
    const int64_t mid = (lo + hi + 1) >> 1;
    if (first[mid] <= b) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <typename T, int K> __device__ __forceinline__ bool aligned(const T* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % (sizeof(T) * K) == 0;
}

template <int MODE, typename P, typename G>
__global__ void __launch_bounds__(LLMPAR_ADAMW_THREADS)
adamw_kernel(const int64_t* __restrict__ table, int64_t n, LlmparAdamwArgs a) {
  using S = typename std::conditional<(MODE <= LLMPAR_ADAMW_FP32_MASTER), float, __nv_bfloat16>::type;
  using X = typename std::conditional<(MODE == LLMPAR_ADAMW_FP32_MASTER), float, __nv_bfloat16>::type;
  constexpr int K = LLMPAR_ADAMW_VEC;
  if (a.found_inf != nullptr && *a.found_inf != 0.0f) return;
  const int64_t b = blockIdx.x;
  const int64_t t = find_tensor(table, n, b);
  P* p = reinterpret_cast<P*>(table[1 * n + t]);
  const G* g = reinterpret_cast<const G*>(table[2 * n + t]);
  S* m = reinterpret_cast<S*>(table[3 * n + t]);
  S* v = reinterpret_cast<S*>(table[4 * n + t]);
  X* x = reinterpret_cast<X*>(table[5 * n + t]);
  const float step = *reinterpret_cast<const float*>(table[6 * n + t]);
  const int64_t numel = table[7 * n + t];
  const uint32_t salt = static_cast<uint32_t>(table[8 * n + t]);

  const float lr = a.lr_ptr != nullptr ? *a.lr_ptr : a.lr;
  Consts c;
  c.decay = 1.0f - lr * a.weight_decay;
  c.lrwd = lr * a.weight_decay;
  c.step_size = lr / -expm1f(step * a.ln_beta1);
  c.bc2_sqrt = sqrtf(-expm1f(step * a.ln_beta2));
  c.gscale = a.gscale != nullptr ? *a.gscale : 1.0f;
  c.b1 = a.beta1; c.omb1 = a.one_minus_beta1; c.b2 = a.beta2; c.omb2 = a.one_minus_beta2; c.eps = a.eps;
  c.key = hash32(hash32(static_cast<uint32_t>(step) * 0x3C6EF372u + salt) ^ a.seed);

  const int64_t start = (b - table[t]) * LLMPAR_ADAMW_CHUNK;
  const int64_t count = min(static_cast<int64_t>(LLMPAR_ADAMW_CHUNK), numel - start);
  const bool vec = aligned<P, K>(p + start) && aligned<G, K>(g + start) && aligned<S, K>(m + start) &&
                   aligned<S, K>(v + start) && (x == nullptr || aligned<X, K>(x + start));
  int64_t done = 0;
  if (vec) {
    const int64_t nvec = count / K;
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x)
      step_elems<MODE, P, G, S, X, K>(p, g, m, v, x, start + i * K, c);
    done = nvec * K;
  }
  for (int64_t i = done + threadIdx.x; i < count; i += blockDim.x)
    step_elems<MODE, P, G, S, X, 1>(p, g, m, v, x, start + i, c);
}

template <typename G>
__global__ void __launch_bounds__(LLMPAR_ADAMW_THREADS)
sum_squares_kernel(const int64_t* __restrict__ table, int64_t n, float* __restrict__ partials) {
  const int64_t b = blockIdx.x;
  const int64_t t = find_tensor(table, n, b);
  const G* g = reinterpret_cast<const G*>(table[n + t]);
  const int64_t start = (b - table[t]) * LLMPAR_ADAMW_CHUNK;
  const int64_t count = min(static_cast<int64_t>(LLMPAR_ADAMW_CHUNK), table[2 * n + t] - start);
  float acc = 0.0f;
  int64_t done = 0;
  constexpr int K = LLMPAR_ADAMW_VEC;
  if (aligned<G, K>(g + start)) {
    const int64_t nvec = count / K;
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
      const Vec<G, K> gv = *reinterpret_cast<const Vec<G, K>*>(g + start + i * K);
#pragma unroll
      for (int k = 0; k < K; ++k) { const float f = to_f<G>(gv.v[k]); acc = fmaf(f, f, acc); }
    }
    done = nvec * K;
  }
  for (int64_t i = done + threadIdx.x; i < count; i += blockDim.x) {
    const float f = to_f<G>(g[start + i]);
    acc = fmaf(f, f, acc);
  }
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xFFFFFFFFu, acc, off);
  __shared__ float warp_sums[LLMPAR_ADAMW_THREADS / 32];
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int w = 0; w < LLMPAR_ADAMW_THREADS / 32; ++w) total += warp_sums[w];
    partials[b] = total;
  }
}

template <int MODE, typename P, typename G>
cudaError_t launch3(const int64_t* d_table, int64_t n, int64_t num_blocks, const LlmparAdamwArgs* a,
                    cudaStream_t stream) {
  adamw_kernel<MODE, P, G><<<static_cast<unsigned>(num_blocks), LLMPAR_ADAMW_THREADS, 0, stream>>>(d_table, n, *a);
  return cudaGetLastError();
}

template <int MODE, typename P>
cudaError_t launch_grad(int grad_dtype, const int64_t* d_table, int64_t n, int64_t num_blocks,
                        const LlmparAdamwArgs* a, cudaStream_t stream) {
  switch (grad_dtype) {
    case LLMPAR_F32: return launch3<MODE, P, float>(d_table, n, num_blocks, a, stream);
    case LLMPAR_F16: return launch3<MODE, P, __half>(d_table, n, num_blocks, a, stream);
    case LLMPAR_BF16: return launch3<MODE, P, __nv_bfloat16>(d_table, n, num_blocks, a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

extern "C" int64_t llmpar_adamw_plan(const int64_t* numels, int64_t n, int64_t* first) {
  int64_t blocks = 0;
  for (int64_t i = 0; i < n; ++i) {
    first[i] = blocks;
    blocks += (numels[i] + LLMPAR_ADAMW_CHUNK - 1) / LLMPAR_ADAMW_CHUNK;
  }
  return blocks;
}

extern "C" cudaError_t llmpar_adamw_launch(int mode, int param_dtype, int grad_dtype, const int64_t* d_table,
                                           int64_t n, int64_t num_blocks, const LlmparAdamwArgs* args,
                                           cudaStream_t stream) {
  if (num_blocks == 0 || n == 0) return cudaSuccess;
  if (mode == LLMPAR_ADAMW_FP32 && param_dtype == LLMPAR_F32)
    return launch_grad<LLMPAR_ADAMW_FP32, float>(grad_dtype, d_table, n, num_blocks, args, stream);
  if (mode == LLMPAR_ADAMW_FP32_MASTER && param_dtype == LLMPAR_BF16)
    return launch_grad<LLMPAR_ADAMW_FP32_MASTER, __nv_bfloat16>(grad_dtype, d_table, n, num_blocks, args, stream);
  if (mode == LLMPAR_ADAMW_FP32_MASTER && param_dtype == LLMPAR_F16)
    return launch_grad<LLMPAR_ADAMW_FP32_MASTER, __half>(grad_dtype, d_table, n, num_blocks, args, stream);
  if (mode == LLMPAR_ADAMW_BF16_SR && param_dtype == LLMPAR_BF16)
    return launch_grad<LLMPAR_ADAMW_BF16_SR, __nv_bfloat16>(grad_dtype, d_table, n, num_blocks, args, stream);
  if (mode == LLMPAR_ADAMW_BF16_KAHAN && param_dtype == LLMPAR_BF16)
    return launch_grad<LLMPAR_ADAMW_BF16_KAHAN, __nv_bfloat16>(grad_dtype, d_table, n, num_blocks, args, stream);
  return cudaErrorInvalidValue;
}

extern "C" cudaError_t llmpar_sum_squares_launch(int dtype, const int64_t* d_table, int64_t n, int64_t num_blocks,
                                                 float* partials, cudaStream_t stream) {
  if (num_blocks == 0 || n == 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(num_blocks);
  switch (dtype) {
    case LLMPAR_F32: sum_squares_kernel<float><<<grid, LLMPAR_ADAMW_THREADS, 0, stream>>>(d_table, n, partials); break;
    case LLMPAR_F16: sum_squares_kernel<__half><<<grid, LLMPAR_ADAMW_THREADS, 0, stream>>>(d_table, n, partials); break;
    case LLMPAR_BF16:
      sum_squares_kernel<__nv_bfloat16><<<grid, LLMPAR_ADAMW_THREADS, 0, stream>>>(d_table, n, partials);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}
