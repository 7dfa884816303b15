// torch-facing side of the AdamW kernels: the CUDA kernels of llmpar::adamw_step and llmpar::sum_squares (schemas and
// fake impls: llmpar/ops/_library.py) on top of adamw_kernels.cu. `mode` (`mode_code` in the schema) is the
// LlmparAdamwMode code (adamw.cuh): the position of the mode in llmpar/ops/adamw.py's MODES table.
// Checks here are the last line of defence; llmpar/ops/adamw.py checks first with messages naming the argument.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "adamw.cuh"
#include "capture_check.h"
#include "dtype_code.h"

namespace {

int code_of(at::ScalarType t, const char* what) { return llmpar::dtype_code(t, "the AdamW kernels", what); }

// one dtype per list, contiguous, on `device`, numel matching params; returns the list's dtype code (-1 if empty)
int check_list(at::TensorList list, const char* name, const at::Device& device, at::TensorList params) {
  int code = -1;
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& t = list[i];
    TORCH_CHECK(t.device() == device, name, "[", i, "] is on ", t.device(), ", params on ", device);
    TORCH_CHECK(t.is_contiguous(), name, "[", i, "] must be contiguous");
    TORCH_CHECK(t.numel() == params[i].numel(), name, "[", i, "] has ", t.numel(), " elements, params[", i, "] ",
                params[i].numel());
    const int c = code_of(t.scalar_type(), name);
    TORCH_CHECK_TYPE(code < 0 || c == code, name, "[", i, "] has dtype ", t.scalar_type(), "; one dtype per list");
    code = c;
  }
  return code;
}

const float* scalar_ptr(const c10::optional<at::Tensor>& t, const at::Device& device, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->device() == device && t->scalar_type() == at::kFloat && t->numel() == 1, name,
              " must be a float32 scalar on ", device, ", got ", t->scalar_type(), " on ", t->device());
  return t->data_ptr<float>();
}

at::Tensor to_device(std::vector<int64_t>& rows, const at::Device& device, const char* op) {
  llmpar_refuse_capture(op);
  at::Tensor host = at::empty({static_cast<int64_t>(rows.size())},
                              at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::copy(rows.begin(), rows.end(), host.data_ptr<int64_t>());
  // non_blocking from pinned memory: the caching host allocator keeps `host` alive until the copy has run
  return host.to(device, /*non_blocking=*/true);
}

void adamw_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                at::TensorList extras, at::TensorList steps, at::IntArrayRef salts, int64_t mode, double lr,
                const c10::optional<at::Tensor>& lr_tensor, const c10::optional<at::Tensor>& gscale,
                const c10::optional<at::Tensor>& found_inf, double beta1, double beta2, double eps, double weight_decay,
                int64_t seed) {
  const int64_t n = static_cast<int64_t>(params.size());
  if (n == 0) return;
  TORCH_CHECK(mode >= 0 && mode <= 3, "mode must be 0..3 (fp32, fp32_master, bf16_sr, bf16_kahan), got ", mode);
  const bool has_extra = mode == LLMPAR_ADAMW_FP32_MASTER || mode == LLMPAR_ADAMW_BF16_KAHAN;
  TORCH_CHECK(grads.size() == params.size() && exp_avgs.size() == params.size() &&
              exp_avg_sqs.size() == params.size() && steps.size() == params.size() &&
              salts.size() == params.size() && extras.size() == (has_extra ? params.size() : 0),
              "adamw_step: list lengths disagree with params (", n, ")");
  const at::Device device = params[0].device();
  TORCH_CHECK(device.is_cuda(), "params must be CUDA tensors, got ", device);
  const c10::cuda::CUDAGuard guard(device);
  const int p_code = check_list(params, "params", device, params);
  const int g_code = check_list(grads, "grads", device, params);
  const int s_code = check_list(exp_avgs, "exp_avgs", device, params);
  TORCH_CHECK(check_list(exp_avg_sqs, "exp_avg_sqs", device, params) == s_code, "exp_avg_sqs dtype != exp_avgs dtype");
  const int want_s = mode <= LLMPAR_ADAMW_FP32_MASTER ? LLMPAR_F32 : LLMPAR_BF16;
  TORCH_CHECK_TYPE(s_code == want_s, "exp_avgs have the wrong dtype for mode ", mode);
  if (has_extra) {
    const int want_x = mode == LLMPAR_ADAMW_FP32_MASTER ? LLMPAR_F32 : LLMPAR_BF16;
    TORCH_CHECK_TYPE(check_list(extras, "extras", device, params) == want_x, "extras have the wrong dtype");
  }
  std::vector<int64_t> rows(LLMPAR_ADAMW_TABLE_ROWS * n);
  std::vector<int64_t> numels(n);
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& s = steps[i];
    TORCH_CHECK(s.device() == device && s.scalar_type() == at::kFloat && s.numel() == 1, "steps[", i,
                "] must be a float32 scalar on ", device);
    numels[i] = params[i].numel();
    rows[1 * n + i] = reinterpret_cast<int64_t>(params[i].data_ptr());
    rows[2 * n + i] = reinterpret_cast<int64_t>(grads[i].data_ptr());
    rows[3 * n + i] = reinterpret_cast<int64_t>(exp_avgs[i].data_ptr());
    rows[4 * n + i] = reinterpret_cast<int64_t>(exp_avg_sqs[i].data_ptr());
    rows[5 * n + i] = has_extra ? reinterpret_cast<int64_t>(extras[i].data_ptr()) : 0;
    rows[6 * n + i] = reinterpret_cast<int64_t>(s.data_ptr());
    rows[7 * n + i] = numels[i];
    rows[8 * n + i] = salts[i] & 0xFFFFFFFFLL;
  }
  const int64_t num_blocks = llmpar_adamw_plan(numels.data(), n, rows.data());
  TORCH_CHECK(num_blocks < (int64_t{1} << 31), "adamw_step: ", num_blocks, " blocks exceed the grid limit");
  at::Tensor d_table = to_device(rows, device, "adamw_step");
  LlmparAdamwArgs a;
  a.lr = static_cast<float>(lr);
  a.lr_ptr = scalar_ptr(lr_tensor, device, "lr");
  a.gscale = scalar_ptr(gscale, device, "gscale");
  a.found_inf = scalar_ptr(found_inf, device, "found_inf");
  a.beta1 = static_cast<float>(beta1);
  a.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  a.beta2 = static_cast<float>(beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  a.ln_beta1 = static_cast<float>(std::log(beta1));
  a.ln_beta2 = static_cast<float>(std::log(beta2));
  a.eps = static_cast<float>(eps);
  a.weight_decay = static_cast<float>(weight_decay);
  a.seed = static_cast<uint32_t>(seed & 0x7FFFFFFF);
  const cudaError_t err = llmpar_adamw_launch(static_cast<int>(mode), p_code, g_code, d_table.data_ptr<int64_t>(), n,
                                              num_blocks, &a, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "llmpar adamw kernel launch failed (mode ", mode, "): ", cudaGetErrorString(err));
}

at::Tensor sum_squares(at::TensorList tensors) {
  TORCH_CHECK(!tensors.empty(), "sum_squares: tensors is empty");
  const at::Device device = tensors[0].device();
  TORCH_CHECK(device.is_cuda(), "tensors must be CUDA tensors, got ", device);
  const c10::cuda::CUDAGuard guard(device);
  const int code = check_list(tensors, "tensors", device, tensors);
  const int64_t n = static_cast<int64_t>(tensors.size());
  std::vector<int64_t> rows(3 * n), numels(n);
  for (int64_t i = 0; i < n; ++i) {
    numels[i] = tensors[i].numel();
    rows[n + i] = reinterpret_cast<int64_t>(tensors[i].data_ptr());
    rows[2 * n + i] = numels[i];
  }
  const int64_t num_blocks = llmpar_adamw_plan(numels.data(), n, rows.data());
  at::Tensor partials = at::zeros({std::max<int64_t>(num_blocks, 1)}, tensors[0].options().dtype(at::kFloat));
  if (num_blocks == 0) return partials;
  at::Tensor d_table = to_device(rows, device, "sum_squares");
  const cudaError_t err = llmpar_sum_squares_launch(code, d_table.data_ptr<int64_t>(), n, num_blocks,
                                                    partials.data_ptr<float>(),
                                                    c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "llmpar sum_squares kernel launch failed: ", cudaGetErrorString(err));
  return partials;
}

}  // namespace

TORCH_LIBRARY_IMPL(llmpar, CUDA, m) {
  m.impl("adamw_step", &adamw_step);
  m.impl("sum_squares", &sum_squares);
}
