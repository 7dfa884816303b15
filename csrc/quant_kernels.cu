// Blockwise int8 / int4 quantization kernels (see quant.cuh for the wire format). Compiles with nvcc alone: no torch
// headers. One thread block per quantization block; fast-math is NOT used (it would flush denormals and approximate
// the divisions): the codes come from a correctly rounded division (__fdiv_rn) and rintf (round half to even).
#include "quant.cuh"

#include "dtype_convert.cuh"

namespace {

using llmpar::from_float;
using llmpar::to_float;

struct Geometry {
  int64_t m;     // values per row
  int64_t nb;    // blocks per row
  int64_t used;  // bytes holding codes: ceil(m * bits / 8)
  int64_t code;  // code bytes, aligned to 4
  int64_t row;   // bytes per wire row
  int bits;
  int block;
  float qmax;
};

Geometry geometry(int64_t m, int bits, int64_t block) {
  Geometry g;
  g.m = m;
  g.nb = (m + block - 1) / block;
  g.used = (m * bits + 7) / 8;
  g.code = (g.used + 3) / 4 * 4;
  g.row = g.code + 4 * g.nb;
  g.bits = bits;
  g.block = static_cast<int>(block);
  g.qmax = bits == 8 ? 127.0f : 7.0f;
  return g;
}

int threads_for(int64_t values) {
  int64_t t = values < 32 ? 32 : values;
  return static_cast<int>(t < LLMPAR_QUANT_THREADS ? t : LLMPAR_QUANT_THREADS);
}

// max over the block of v (>= 0); red: >= 32 floats of shared memory. Ends with a barrier: shared memory written
// before the call is visible to every thread after it.
__device__ __forceinline__ float block_absmax(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < warps ? red[lane] : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) red[32] = v;
  }
  __syncthreads();
  return red[32];
}

__device__ __forceinline__ float code_of(float x, float safe, float qmax) {
  return fminf(fmaxf(rintf(__fdiv_rn(x, safe)), -qmax), qmax);
}

// One block: values [b * block, b * block + count) of one row. Shared memory: block + 33 floats.
template <typename Src, bool kSingle>
__global__ void __launch_bounds__(LLMPAR_QUANT_THREADS)
quantize_kernel(const Src* __restrict__ x, const int64_t* __restrict__ table, int64_t n, int64_t programs,
                uint8_t* __restrict__ wire, float* __restrict__ residual, Geometry g, float scale) {
  extern __shared__ float sh[];
  float* red = sh + g.block;
  const int64_t p = blockIdx.x;
  const int64_t row = p / g.nb, b = p - row * g.nb;
  const int64_t j0 = b * g.block;
  const int count = static_cast<int>(min(static_cast<int64_t>(g.block), g.m - j0));
  const int64_t flat0 = row * g.m + j0;
  // gather; thread t owns the values i = t (mod blockDim) of the block until the barrier in block_absmax
  for (int i = threadIdx.x; i < g.block; i += blockDim.x) sh[i] = 0.0f;
  if constexpr (kSingle) {
    for (int i = threadIdx.x; i < count; i += blockDim.x) sh[i] = to_float<Src>(x[flat0 + i]);
  } else {
    const int64_t t0 = table[3 * n + p], t1 = table[3 * n + programs + p];
    for (int64_t t = t0; t < t1; ++t) {
      const Src* src = reinterpret_cast<const Src*>(table[t]);
      const int64_t start = table[n + t], numel = table[2 * n + t];
      const int64_t lo = start - flat0, hi = lo + numel;  // the tensor's values at block positions [lo, hi)
      for (int i = threadIdx.x; i < count; i += blockDim.x) {
        if (i >= lo && i < hi) sh[i] = to_float<Src>(src[i - lo]);
      }
    }
  }
  float amax = 0.0f;
  const bool unit = scale == 1.0f;
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    float v = unit ? sh[i] : __fmul_rn(sh[i], scale);
    if (residual != nullptr) v = __fadd_rn(v, residual[flat0 + i]);
    sh[i] = v;
    amax = fmaxf(amax, fabsf(v));
  }
  amax = block_absmax(amax, red);
  const float s = __fdiv_rn(amax, g.qmax);
  const float safe = s > 0.0f ? s : 1.0f;
  uint8_t* out = wire + row * g.row;
  if (g.bits == 8) {
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
      const float c = code_of(sh[i], safe, g.qmax);
      out[j0 + i] = static_cast<uint8_t>(static_cast<int8_t>(static_cast<int>(c)));
      if (residual != nullptr) residual[flat0 + i] = __fsub_rn(sh[i], __fmul_rn(c, safe));
    }
  } else {
    const int64_t byte0 = j0 / 2;  // block is even: a block's nibbles fill whole bytes
    for (int k = threadIdx.x; 2 * k < count; k += blockDim.x) {
      const int i0 = 2 * k, i1 = 2 * k + 1;
      const float c0 = code_of(sh[i0], safe, g.qmax);
      const float c1 = i1 < count ? code_of(sh[i1], safe, g.qmax) : 0.0f;  // past m: code 0, nibble 8
      out[byte0 + k] = static_cast<uint8_t>((static_cast<int>(c0) + 8) | ((static_cast<int>(c1) + 8) << 4));
      if (residual != nullptr) {
        residual[flat0 + i0] = __fsub_rn(sh[i0], __fmul_rn(c0, safe));
        if (i1 < count) residual[flat0 + i1] = __fsub_rn(sh[i1], __fmul_rn(c1, safe));
      }
    }
  }
  if (threadIdx.x == 0) reinterpret_cast<float*>(out + g.code)[b] = s;
  if (b == g.nb - 1 && static_cast<int64_t>(threadIdx.x) < g.code - g.used) out[g.used + threadIdx.x] = 0;
}

__device__ __forceinline__ float code_at(const uint8_t* row, int64_t j, int bits) {
  if (bits == 8) return static_cast<float>(static_cast<int8_t>(row[j]));
  const int byte = row[j >> 1];
  return static_cast<float>(((j & 1) ? (byte >> 4) : (byte & 15)) - 8);
}

// kSum false: one block per (row, quantization block); true: one block per quantization block of the m columns.
template <typename Out, bool kSum>
__global__ void __launch_bounds__(LLMPAR_QUANT_THREADS)
dequant_kernel(const uint8_t* __restrict__ wire, Out* __restrict__ out, int64_t rows, Geometry g, bool accumulate) {
  const int64_t p = blockIdx.x;
  const int64_t row = kSum ? 0 : p / g.nb, b = kSum ? p : p - row * g.nb;
  const int64_t j0 = b * g.block;
  const int count = static_cast<int>(min(static_cast<int64_t>(g.block), g.m - j0));
  if constexpr (kSum) {
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
      float acc = accumulate ? to_float<Out>(out[j0 + i]) : 0.0f;
      for (int64_t r = 0; r < rows; ++r) {  // rank order, one rounding per product and per sum
        const uint8_t* in = wire + r * g.row;
        acc = __fadd_rn(acc, __fmul_rn(code_at(in, j0 + i, g.bits), reinterpret_cast<const float*>(in + g.code)[b]));
      }
      out[j0 + i] = from_float<Out>(acc);
    }
  } else {
    const uint8_t* in = wire + row * g.row;
    const float s = reinterpret_cast<const float*>(in + g.code)[b];
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
      out[row * g.m + j0 + i] = from_float<Out>(__fmul_rn(code_at(in, j0 + i, g.bits), s));
    }
  }
}

template <typename Src>
cudaError_t launch_quant(const void* x, const int64_t* d_table, int64_t n, uint8_t* wire, float* residual,
                         int64_t rows, const Geometry& g, float scale, cudaStream_t stream) {
  const int64_t programs = rows * g.nb;
  if (programs == 0) return cudaSuccess;
  const size_t smem = (static_cast<size_t>(g.block) + 33) * sizeof(float);
  const int threads = threads_for(g.bits == 8 ? g.block : g.block / 2);
  // gridDim.x allows 2^31 - 1 blocks: 5e11 values at block 256
  if (x != nullptr) {
    quantize_kernel<Src, true><<<static_cast<unsigned>(programs), threads, smem, stream>>>(
        static_cast<const Src*>(x), d_table, n, programs, wire, residual, g, scale);
  } else {
    quantize_kernel<Src, false><<<static_cast<unsigned>(programs), threads, smem, stream>>>(
        nullptr, d_table, n, programs, wire, residual, g, scale);
  }
  return cudaGetLastError();
}

template <typename Out>
cudaError_t launch_dequant(const uint8_t* wire, void* out, int64_t rows, const Geometry& g, int sum, int accumulate,
                           cudaStream_t stream) {
  const int threads = threads_for(g.block);
  Out* o = static_cast<Out*>(out);
  if (sum) {
    if (g.nb == 0) return cudaSuccess;
    dequant_kernel<Out, true><<<static_cast<unsigned>(g.nb), threads, 0, stream>>>(wire, o, rows, g, accumulate != 0);
  } else {
    if (rows * g.nb == 0) return cudaSuccess;
    dequant_kernel<Out, false><<<static_cast<unsigned>(rows * g.nb), threads, 0, stream>>>(wire, o, rows, g, false);
  }
  return cudaGetLastError();
}

}  // namespace

extern "C" int llmpar_quant_supported(int bits, int64_t block) {
  return (bits == 8 || bits == 4) && block >= 2 && block <= LLMPAR_QUANT_MAX_BLOCK && (block & (block - 1)) == 0;
}

extern "C" int64_t llmpar_quant_code_bytes(int64_t m, int bits) { return ((m * bits + 7) / 8 + 3) / 4 * 4; }

extern "C" int64_t llmpar_quant_row_bytes(int64_t m, int bits, int64_t block) {
  return llmpar_quant_code_bytes(m, bits) + 4 * ((m + block - 1) / block);
}

extern "C" void llmpar_quant_plan(int64_t* table, int64_t n, int64_t rows, int64_t m, int64_t block) {
  const int64_t nb = (m + block - 1) / block, programs = rows * nb;
  const int64_t* start = table + n;
  const int64_t* numel = table + 2 * n;
  int64_t t0 = 0, t1 = 0;  // block starts grow with p: one sweep
  for (int64_t p = 0; p < programs; ++p) {
    const int64_t row = p / nb, b = p - row * nb;
    const int64_t lo = row * m + b * block, hi = row * m + ((b + 1) * block < m ? (b + 1) * block : m);
    while (t0 < n && start[t0] + numel[t0] <= lo) ++t0;
    while (t1 < n && start[t1] < hi) ++t1;
    table[3 * n + p] = t0;
    table[3 * n + programs + p] = t1 > t0 ? t1 : t0;
  }
}

extern "C" cudaError_t llmpar_quant_launch(const void* x, const int64_t* d_table, int64_t n, int src_dtype,
                                           uint8_t* wire, float* residual, int64_t rows, int64_t m, int bits,
                                           int64_t block, float scale, cudaStream_t stream) {
  if (!llmpar_quant_supported(bits, block) || m < 1 || rows < 0) return cudaErrorInvalidValue;
  const Geometry g = geometry(m, bits, block);
  switch (src_dtype) {
    case LLMPAR_F32: return launch_quant<float>(x, d_table, n, wire, residual, rows, g, scale, stream);
    case LLMPAR_F16: return launch_quant<__half>(x, d_table, n, wire, residual, rows, g, scale, stream);
    case LLMPAR_BF16: return launch_quant<__nv_bfloat16>(x, d_table, n, wire, residual, rows, g, scale, stream);
    default: return cudaErrorInvalidValue;
  }
}

extern "C" cudaError_t llmpar_dequant_launch(const uint8_t* wire, void* out, int out_dtype, int64_t rows, int64_t m,
                                             int bits, int64_t block, int sum, int accumulate, cudaStream_t stream) {
  if (!llmpar_quant_supported(bits, block) || m < 1 || rows < 0) return cudaErrorInvalidValue;
  const Geometry g = geometry(m, bits, block);
  switch (out_dtype) {
    case LLMPAR_F32: return launch_dequant<float>(wire, out, rows, g, sum, accumulate, stream);
    case LLMPAR_F16: return launch_dequant<__half>(wire, out, rows, g, sum, accumulate, stream);
    case LLMPAR_BF16: return launch_dequant<__nv_bfloat16>(wire, out, rows, g, sum, accumulate, stream);
    default: return cudaErrorInvalidValue;
  }
}
