// Host side, for the *_ops.cpp bindings: a tensor's dtype as the kernels' LlmparDtype code (bucket.cuh), or a
// TypeError naming the argument, its dtype and what `who` accepts.
#pragma once

#include <ATen/ATen.h>

#include "bucket.cuh"  // LlmparDtype

namespace llmpar {

inline int dtype_code(at::ScalarType t, const char* who, const char* what) {
  switch (t) {
    case at::kFloat: return LLMPAR_F32;
    case at::kHalf: return LLMPAR_F16;
    case at::kBFloat16: return LLMPAR_BF16;
    default: TORCH_CHECK_TYPE(false, who, ": ", what, " has dtype ", t, "; it takes float32, float16, bfloat16");
  }
  return -1;
}

}  // namespace llmpar
