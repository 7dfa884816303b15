// CUDA graph capture and the ops that build a per-call table (tensor addresses, sizes, block plan): adamw_step,
// sum_squares, adamw_lowbit_step, pack_bucket / unpack_bucket, pack_quantize. Each fills the table in a temporary
// pinned host buffer and copies it to the device asynchronously; the caching host allocator hands that buffer to a
// later call as soon as the copy has run. Captured in a CUDA graph, the copy node keeps reading the buffer's host
// address on every replay, by then another call's table: the kernel would update the wrong tensors. So these ops
// refuse to be captured, with an error that says why, before they allocate or enqueue anything (the capture stays
// valid: a timing harness can end it and run the op eagerly). Torch-facing .cpp files only (c10 headers).
#pragma once

#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/util/Exception.h>

inline void llmpar_refuse_capture(const char* op) {
  TORCH_CHECK(c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None, "llmpar::", op,
              " cannot run under CUDA graph capture: it copies a per-call table of tensor addresses from a temporary "
              "pinned host buffer, which a graph replay would read after a later call reused it. Run it outside the "
              "captured region (eagerly), or capture the torch backend (LLMPAR_BACKEND=torch) instead");
}
