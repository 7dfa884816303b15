// llmpar::bias_act_backward: the fused bias-activation backward of a linear layer (kernels in bias_act_kernels.cu).
// This file adds its CUDA kernel; the schema and fake impl are in llmpar/ops/_library.py.
//   grad: [M, N] (dY, float32/float16/bfloat16), pre: [M, N] (the pre-activation z, float32/float16/bfloat16),
//   act: 0 none, 1 gelu_tanh, 2 gelu_erf, 3 silu, 4 relu
//   -> (grad_pre = dY * act'(z) in pre's dtype [M, N], grad_bias = sum_rows(dY * act'(z)) in float32 [N])
// in one pass over dY and z. For relu, relu(z) may be passed as pre (same sign test). cuBLASLt's DGELU_BGRAD /
// DRELU_BGRAD epilogues fuse this into the GEMM that *produces* dY (the next layer's input-gradient GEMM); inside
// one layer dY arrives ready-made, so this kernel serves every activation, silu and erf-gelu included.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "bias_act.cuh"
#include "dtype_code.h"

namespace {

int code_of(const at::Tensor& t, const char* what) {
  return llmpar::dtype_code(t.scalar_type(), "bias_act_backward", what);
}

void check_args(const at::Tensor& grad, const at::Tensor& pre, int64_t act) {
  TORCH_CHECK(grad.dim() == 2, "bias_act_backward: grad must be 2-D [M, N], got ", grad.sizes());
  TORCH_CHECK(pre.sizes() == grad.sizes(), "bias_act_backward: pre ", pre.sizes(), " must match grad ", grad.sizes());
  TORCH_CHECK(act >= 0 && act <= 4, "bias_act_backward: act ", act,
              " is not an activation code (0 none, 1 gelu_tanh, 2 gelu_erf, 3 silu, 4 relu)");
  code_of(grad, "grad");
  code_of(pre, "pre");
}

std::tuple<at::Tensor, at::Tensor> bias_act_backward(const at::Tensor& grad_in, const at::Tensor& pre_in, int64_t act) {
  check_args(grad_in, pre_in, act);
  TORCH_CHECK(grad_in.is_cuda() && pre_in.device() == grad_in.device(),
              "bias_act_backward: grad and pre must be on one CUDA device, got ", grad_in.device(), " and ",
              pre_in.device());
  const c10::cuda::CUDAGuard guard(grad_in.device());
  // rows may be strided; each row must be dense
  const at::Tensor grad = grad_in.stride(1) == 1 ? grad_in : grad_in.contiguous();
  const at::Tensor pre = pre_in.stride(1) == 1 ? pre_in : pre_in.contiguous();
  const int64_t M = grad.size(0), N = grad.size(1);
  at::Tensor grad_pre = at::empty({M, N}, pre.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor grad_bias = at::empty({N}, grad.options().dtype(at::kFloat));
  if (N == 0) return {grad_pre, grad_bias};
  if (M == 0) return {grad_pre, grad_bias.zero_()};
  const int64_t splits = llmpar_bias_act_splits(M, N);
  at::Tensor partial = at::empty({splits, N}, grad_bias.options());
  const cudaError_t err = llmpar_bias_act_backward_launch(
      grad.data_ptr(), code_of(grad, "grad"), grad.stride(0), pre.data_ptr(), code_of(pre, "pre"), pre.stride(0),
      grad_pre.data_ptr(), partial.data_ptr<float>(), grad_bias.data_ptr<float>(), M, N, static_cast<int>(act),
      splits, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "bias_act_backward kernel launch failed: ", cudaGetErrorString(err));
  return {grad_pre, grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(llmpar, CUDA, m) { m.impl("bias_act_backward", &bias_act_backward); }
