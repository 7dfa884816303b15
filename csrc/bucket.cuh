// Multi-tensor pack/unpack of gradient buckets: C interface of bucket_kernels.cu (no torch headers).
//
// A "bucket" is one flat buffer holding n tensors back to back: tensor i lives in flat[offsets[i] : offsets[i] + numels[i]].
//   pack:   flat[offsets[i] + j]  = Out(float(tensor_i[j]) * scale)
//   unpack: tensor_i[j]           = Out(float(flat[offsets[i] + j]) * scale)
// One launch covers all tensors. The launch reads a device-side int64 table (see bucket_table_size):
//   table[0*n + i] = address of tensor i, table[1*n + i] = numel of tensor i, table[2*n + i] = element offset in flat,
//   table[3*n + b] = tensor handled by block b, table[3*n + num_blocks + b] = first element (within that tensor) of block b.
// Each block handles LLMPAR_BUCKET_CHUNK elements of one tensor; bucket_plan_blocks fills the block part on the host.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#define LLMPAR_BUCKET_THREADS 256
#define LLMPAR_BUCKET_VEC 4
#define LLMPAR_BUCKET_CHUNK (LLMPAR_BUCKET_THREADS * LLMPAR_BUCKET_VEC * 4)  // 4096 elements per block

#ifdef __cplusplus
extern "C" {
#endif

// element types understood by the kernels
enum LlmparDtype { LLMPAR_F32 = 0, LLMPAR_F16 = 1, LLMPAR_BF16 = 2 };

// number of blocks needed for tensors with these numels
int64_t llmpar_bucket_num_blocks(const int64_t* numels, int64_t n);

// fill table[3n : 3n + 2*num_blocks] (host memory) from table[n : 2n] (numels)
void llmpar_bucket_plan_blocks(int64_t* table, int64_t n, int64_t num_blocks);

// direction: 0 = pack (tensors -> flat), 1 = unpack (flat -> tensors).
// src_dtype / dst_dtype: LlmparDtype of what is read / written. d_table: device copy of the table.
cudaError_t llmpar_bucket_launch(int direction, void* flat, const int64_t* d_table, int64_t n, int64_t num_blocks,
                                 int src_dtype, int dst_dtype, float scale, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
