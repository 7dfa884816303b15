// torch-facing side of the low-bit AdamW kernel: the CUDA kernel of llmpar::adamw_lowbit_step (schema and fake impl:
// llmpar/ops/_library.py) on top of adamw_lowbit_kernels.cu. llmpar/ops/lowbit_kernels.py checks the arguments
// first with messages naming them and increments the steps; the checks here are the last line of defence.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "adamw_lowbit.cuh"
#include "capture_check.h"
#include "dtype_code.h"

namespace {

void check(const at::Tensor& t, const char* name, size_t i, const at::Device& device, at::ScalarType dtype,
           int64_t numel) {
  TORCH_CHECK_VALUE(t.device() == device, "adamw_lowbit_step: ", name, "[", i, "] is on ", t.device(), ", params on ",
                    device);
  TORCH_CHECK_VALUE(t.is_contiguous(), "adamw_lowbit_step: ", name, "[", i, "] must be contiguous");
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, "adamw_lowbit_step: ", name, "[", i, "] has dtype ", t.scalar_type(),
                   "; it takes ", dtype);
  TORCH_CHECK_VALUE(t.numel() == numel, "adamw_lowbit_step: ", name, "[", i, "] has ", t.numel(),
                    " elements; expected ", numel);
}

const float* scalar_ptr(const c10::optional<at::Tensor>& t, const at::Device& device, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->device() == device && t->scalar_type() == at::kFloat && t->numel() == 1, "adamw_lowbit_step: ",
              name, " must be a float32 scalar on ", device, ", got ", t->scalar_type(), " on ", t->device());
  return t->data_ptr<float>();
}

void adamw_lowbit_step(at::TensorList params, at::TensorList grads, at::TensorList m_codes, at::TensorList m_scales,
                       at::TensorList v_codes, at::TensorList v_scales, at::TensorList masters, at::TensorList steps,
                       const at::Tensor& qmap_m, const at::Tensor& qmap_v, int64_t bits, double lr,
                       const c10::optional<at::Tensor>& lr_tensor, const c10::optional<at::Tensor>& gscale,
                       const c10::optional<at::Tensor>& found_inf, double beta1, double beta2, double eps,
                       double weight_decay) {
  TORCH_CHECK_VALUE(bits == 8 || bits == 4, "adamw_lowbit_step: bits=", bits, "; it takes 8 or 4");
  const size_t n = params.size();
  if (n == 0) return;
  const bool master = !masters.empty();
  TORCH_CHECK_VALUE(grads.size() == n && m_codes.size() == n && m_scales.size() == n && v_codes.size() == n &&
                        v_scales.size() == n && steps.size() == n && (!master || masters.size() == n),
                    "adamw_lowbit_step: list lengths disagree with params (", n, ")");
  const at::Device device = params[0].device();
  TORCH_CHECK_VALUE(device.is_cuda(), "adamw_lowbit_step: params must be CUDA tensors, got ", device);
  const c10::cuda::CUDAGuard guard(device);
  for (const auto* q : {&qmap_m, &qmap_v}) {
    TORCH_CHECK_TYPE(q->device() == device && q->scalar_type() == at::kFloat && q->is_contiguous() &&
                         q->numel() == (int64_t{1} << bits),
                     "adamw_lowbit_step: the maps must be contiguous float32 [", int64_t{1} << bits, "] on ", device);
  }
  const int64_t block = bits == 8 ? LLMPAR_LOWBIT_BLOCK8 : LLMPAR_LOWBIT_BLOCK4;
  const at::ScalarType g_type = grads[0].scalar_type();
  const int g_code = llmpar::dtype_code(g_type, "adamw_lowbit_step", "grads");
  std::vector<int64_t> rows(LLMPAR_LOWBIT_TABLE_ROWS * n), numels(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t k = params[i].numel();
    const int64_t nb = (k + block - 1) / block, cb = bits == 8 ? k : (k + 1) / 2;
    check(params[i], "params", i, device, master ? at::kBFloat16 : at::kFloat, k);
    check(grads[i], "grads", i, device, g_type, k);
    check(m_codes[i], "m_codes", i, device, at::kByte, cb);
    check(v_codes[i], "v_codes", i, device, at::kByte, cb);
    check(m_scales[i], "m_scales", i, device, at::kFloat, nb);
    check(v_scales[i], "v_scales", i, device, at::kFloat, nb);
    if (master) check(masters[i], "masters", i, device, at::kFloat, k);
    check(steps[i], "steps", i, device, at::kFloat, 1);
    numels[i] = k;
    const at::Tensor* cols[] = {&params[i], &grads[i], &m_codes[i], &m_scales[i], &v_codes[i], &v_scales[i]};
    for (int r = 0; r < 6; ++r) rows[(r + 1) * n + i] = reinterpret_cast<int64_t>(cols[r]->data_ptr());
    rows[7 * n + i] = master ? reinterpret_cast<int64_t>(masters[i].data_ptr()) : 0;
    rows[8 * n + i] = reinterpret_cast<int64_t>(steps[i].data_ptr());
    rows[9 * n + i] = k;
  }
  const int64_t num_blocks = llmpar_lowbit_plan(numels.data(), static_cast<int64_t>(n), static_cast<int>(bits),
                                                rows.data());
  llmpar_refuse_capture("adamw_lowbit_step");
  at::Tensor host = at::empty({static_cast<int64_t>(rows.size())},
                              at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::copy(rows.begin(), rows.end(), host.data_ptr<int64_t>());
  const at::Tensor d_table = host.to(device, /*non_blocking=*/true);  // the caching host allocator keeps `host` alive
  LlmparLowbitArgs a;
  a.lr = static_cast<float>(lr);
  a.lr_ptr = scalar_ptr(lr_tensor, device, "lr");
  a.gscale = scalar_ptr(gscale, device, "gscale");
  a.found_inf = scalar_ptr(found_inf, device, "found_inf");
  a.qmap_m = qmap_m.data_ptr<float>();
  a.qmap_v = qmap_v.data_ptr<float>();
  a.beta1 = static_cast<float>(beta1);
  a.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  a.beta2 = static_cast<float>(beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  a.ln_beta1 = static_cast<float>(std::log(beta1));
  a.ln_beta2 = static_cast<float>(std::log(beta2));
  a.eps = static_cast<float>(eps);
  a.weight_decay = static_cast<float>(weight_decay);
  const cudaError_t err = llmpar_lowbit_launch(static_cast<int>(bits), master ? 1 : 0, g_code,
                                               d_table.data_ptr<int64_t>(), static_cast<int64_t>(n), num_blocks, &a,
                                               c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "llmpar low-bit adamw kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace

TORCH_LIBRARY_IMPL(llmpar, CUDA, m) {
  m.impl("adamw_lowbit_step", &adamw_lowbit_step);
}
