// Blockwise symmetric int8 / int4 quantization on a "wire" buffer: C interface of quant_kernels.cu (no torch headers).
//
// A wire buffer is uint8 [rows, row_bytes], one independent row of m values per peer (llmpar/ops/quant.py is the
// contract):
//   bytes [0, code_bytes)          bits=8: int8 code c in [-127, 127] per byte; bits=4: value j in the low (j even) /
//                                  high (j odd) nibble of byte j / 2, stored as c + 8, c in [-7, 7] (missing last
//                                  value: 8); then zeros up to code_bytes = round_up(ceil(m * bits / 8), 4)
//   bytes [code_bytes, row_bytes)  float32 scale of each group of `block` values: s = absmax / qmax (qmax 127 or 7)
//   c = clamp(rint(x / s), -qmax, qmax), 0 where s == 0      (correctly rounded division, round half to even)
// One thread block per quantization block. Quantize: gather x (float32) into shared memory, x = x * scale (+ residual),
// block absmax (warp shuffles + shared memory), then codes, scale, residual = x - c * s (error feedback) and, in the
// row's last block, the zero alignment bytes. Every product and sum is rounded on its own (__fmul_rn / __fadd_rn: no
// FMA contraction), so the kernels round exactly like the torch path of llmpar/ops/quant.py.
//
// Pack table (int64, device copy), n source tensors, P = rows * nb programs (nb = ceil(m / block)):
//   table[0*n + i] = address of tensor i, table[1*n + i] = its first value's position in the rows * m values,
//   table[2*n + i] = its numel, table[3*n + p] = first tensor overlapping block p, table[3*n + P + p] = one past the
//   last. llmpar_quant_plan fills the block part on the host from the tensor part (tensors in order, back to back).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "bucket.cuh"  // LlmparDtype: the element types the kernels read and write

#define LLMPAR_QUANT_MAX_BLOCK 4096  // values of one block held in shared memory (the ops layer falls back above)
#define LLMPAR_QUANT_THREADS 256     // most threads per block

#ifdef __cplusplus
extern "C" {
#endif

// Whether the kernels take this bits / block (bits 8 or 4; block a power of two in [2, LLMPAR_QUANT_MAX_BLOCK]).
int llmpar_quant_supported(int bits, int64_t block);

// bytes of a row's codes (aligned to 4) and of a whole wire row
int64_t llmpar_quant_code_bytes(int64_t m, int bits);
int64_t llmpar_quant_row_bytes(int64_t m, int bits, int64_t block);

// fill table[3n : 3n + 2 * rows * nb] (host memory) from table[n : 3n] (starts, numels)
void llmpar_quant_plan(int64_t* table, int64_t n, int64_t rows, int64_t m, int64_t block);

// Quantize rows * m values into wire. Source: x (contiguous [rows, m] of src_dtype) when not null, else the tensors
// of d_table (n of them, src_dtype). residual: float32 [rows * m] or null; scale multiplies the source values.
cudaError_t llmpar_quant_launch(const void* x, const int64_t* d_table, int64_t n, int src_dtype, uint8_t* wire,
                                float* residual, int64_t rows, int64_t m, int bits, int64_t block, float scale,
                                cudaStream_t stream);

// sum == 0: out [rows, m] = c * s of each row; sum != 0: out [m] (+)= sum over rows, in order, of c * s (float32
// accumulator, one rounding to out_dtype at the end; accumulate: start from out instead of 0).
cudaError_t llmpar_dequant_launch(const uint8_t* wire, void* out, int out_dtype, int64_t rows, int64_t m, int bits,
                                  int64_t block, int sum, int accumulate, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
