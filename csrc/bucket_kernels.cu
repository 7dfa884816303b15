// Multi-tensor pack/unpack kernels for gradient buckets. Compiles with nvcc alone: no torch headers.
// Math: dst = Dst(float(src) * scale), one rounding. Scale 1 skips the multiply (exact copies and widening casts).
// fast-math is NOT used: it flushes denormals to zero, and small gradients are denormal often enough to matter.
#include "bucket.cuh"

#include "dtype_convert.cuh"

namespace {

using llmpar::from_float;
using llmpar::to_float;

template <typename T> struct alignas(sizeof(T) * LLMPAR_BUCKET_VEC) Vec { T v[LLMPAR_BUCKET_VEC]; };

template <typename Src, typename Dst>
__device__ __forceinline__ Dst convert(Src x, float scale, bool unit_scale) {
  const float f = to_float<Src>(x);
  return from_float<Dst>(unit_scale ? f : f * scale);
}

// One block: LLMPAR_BUCKET_CHUNK elements of one tensor. Vectorised (4 elements per access) when both sides are aligned.
template <typename Src, typename Dst>
__global__ void __launch_bounds__(LLMPAR_BUCKET_THREADS)
bucket_kernel(int direction, char* flat, const int64_t* __restrict__ table, int64_t n, int64_t num_blocks, float scale) {
  const int64_t b = blockIdx.x;
  const int64_t t = table[3 * n + b];
  const int64_t start = table[3 * n + num_blocks + b];
  const int64_t numel = table[n + t];
  const int64_t offset = table[2 * n + t];
  char* tensor = reinterpret_cast<char*>(table[t]);
  const Src* src;
  Dst* dst;
  if (direction == 0) {
    src = reinterpret_cast<const Src*>(tensor) + start;
    dst = reinterpret_cast<Dst*>(flat) + offset + start;
  } else {
    src = reinterpret_cast<const Src*>(flat) + offset + start;
    dst = reinterpret_cast<Dst*>(tensor) + start;
  }
  const int64_t count = min(static_cast<int64_t>(LLMPAR_BUCKET_CHUNK), numel - start);
  const bool unit_scale = scale == 1.0f;
  const bool aligned = (reinterpret_cast<uintptr_t>(src) % sizeof(Vec<Src>) == 0) &&
                       (reinterpret_cast<uintptr_t>(dst) % sizeof(Vec<Dst>) == 0);
  int64_t done = 0;
  if (aligned) {
    const int64_t nvec = count / LLMPAR_BUCKET_VEC;
    const Vec<Src>* vsrc = reinterpret_cast<const Vec<Src>*>(src);
    Vec<Dst>* vdst = reinterpret_cast<Vec<Dst>*>(dst);
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
      const Vec<Src> in = vsrc[i];
      Vec<Dst> out;
#pragma unroll
      for (int k = 0; k < LLMPAR_BUCKET_VEC; ++k) out.v[k] = convert<Src, Dst>(in.v[k], scale, unit_scale);
      vdst[i] = out;
    }
    done = nvec * LLMPAR_BUCKET_VEC;
  }
  for (int64_t i = done + threadIdx.x; i < count; i += blockDim.x) dst[i] = convert<Src, Dst>(src[i], scale, unit_scale);
}

template <typename Src, typename Dst>
cudaError_t launch_typed(int direction, void* flat, const int64_t* d_table, int64_t n, int64_t num_blocks, float scale,
                         cudaStream_t stream) {
  if (num_blocks == 0) return cudaSuccess;
  // gridDim.x allows 2^31-1 blocks = 8.8e12 elements: no second grid dimension needed
  bucket_kernel<Src, Dst><<<static_cast<unsigned>(num_blocks), LLMPAR_BUCKET_THREADS, 0, stream>>>(
      direction, static_cast<char*>(flat), d_table, n, num_blocks, scale);
  return cudaGetLastError();
}

template <typename Src>
cudaError_t launch_src(int dst_dtype, int direction, void* flat, const int64_t* d_table, int64_t n, int64_t num_blocks,
                       float scale, cudaStream_t stream) {
  switch (dst_dtype) {
    case LLMPAR_F32: return launch_typed<Src, float>(direction, flat, d_table, n, num_blocks, scale, stream);
    case LLMPAR_F16: return launch_typed<Src, __half>(direction, flat, d_table, n, num_blocks, scale, stream);
    case LLMPAR_BF16: return launch_typed<Src, __nv_bfloat16>(direction, flat, d_table, n, num_blocks, scale, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

extern "C" int64_t llmpar_bucket_num_blocks(const int64_t* numels, int64_t n) {
  int64_t blocks = 0;
  for (int64_t i = 0; i < n; ++i) blocks += (numels[i] + LLMPAR_BUCKET_CHUNK - 1) / LLMPAR_BUCKET_CHUNK;
  return blocks;
}

extern "C" void llmpar_bucket_plan_blocks(int64_t* table, int64_t n, int64_t num_blocks) {
  int64_t b = 0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t start = 0; start < table[n + i]; start += LLMPAR_BUCKET_CHUNK, ++b) {
      table[3 * n + b] = i;
      table[3 * n + num_blocks + b] = start;
    }
  }
}

extern "C" cudaError_t llmpar_bucket_launch(int direction, void* flat, const int64_t* d_table, int64_t n,
                                            int64_t num_blocks, int src_dtype, int dst_dtype, float scale,
                                            cudaStream_t stream) {
  if (direction != 0 && direction != 1) return cudaErrorInvalidValue;
  switch (src_dtype) {
    case LLMPAR_F32: return launch_src<float>(dst_dtype, direction, flat, d_table, n, num_blocks, scale, stream);
    case LLMPAR_F16: return launch_src<__half>(dst_dtype, direction, flat, d_table, n, num_blocks, scale, stream);
    case LLMPAR_BF16:
      return launch_src<__nv_bfloat16>(dst_dtype, direction, flat, d_table, n, num_blocks, scale, stream);
    default: return cudaErrorInvalidValue;
  }
}
