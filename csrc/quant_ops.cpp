// CUDA kernels of llmpar::quantize_rows / pack_quantize / dequantize_rows / dequantize_sum on top of the torch-free
// launchers in quant_kernels.cu (wire format: quant.cuh, llmpar/ops/quant.py). The schemas, fake impls and CPU
// references are defined in llmpar/ops/_library.py; this file only adds the CUDA kernels.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // not ATen/cuda/CUDAContext.h: that one wants cusparse/cublas headers
#include <torch/library.h>

#include <optional>
#include <vector>

#include "capture_check.h"
#include "dtype_code.h"
#include "quant.cuh"

namespace {

int dtype_code(at::ScalarType t, const char* what) { return llmpar::dtype_code(t, "the quantization kernels", what); }

void check_layout(int64_t m, int64_t bits, int64_t block) {
  TORCH_CHECK(m >= 1, "m=", m, " must be positive");
  TORCH_CHECK(llmpar_quant_supported(static_cast<int>(bits), block), "bits=", bits, ", block=", block,
              ": the kernels take bits 8 or 4 and a power-of-two block in [2, ", LLMPAR_QUANT_MAX_BLOCK, "]");
}

// wire: contiguous uint8 [rows, row_bytes] on a CUDA device, 4-byte aligned (its scales are float32)
void check_wire(const at::Tensor& wire, int64_t m, int64_t bits, int64_t block, int64_t rows) {
  check_layout(m, bits, block);
  const int64_t want = llmpar_quant_row_bytes(m, static_cast<int>(bits), block);
  TORCH_CHECK(wire.is_cuda(), "wire must be a CUDA tensor, got device ", wire.device());
  TORCH_CHECK(wire.scalar_type() == at::kByte && wire.dim() == 2 && wire.size(1) == want && wire.is_contiguous(),
              "wire must be a contiguous uint8 [rows, ", want, "] tensor for m=", m, ", bits=", bits, ", block=", block,
              "; got ", wire.scalar_type(), " ", wire.sizes());
  TORCH_CHECK(rows < 0 || wire.size(0) == rows, "wire has ", wire.size(0), " rows, expected ", rows);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(wire.data_ptr()) % 4 == 0, "wire must be 4-byte aligned");
}

void check_out(const at::Tensor& out, const at::Tensor& wire, at::IntArrayRef shape) {
  TORCH_CHECK(out.device() == wire.device(), "out is on ", out.device(), ", wire on ", wire.device());
  TORCH_CHECK(out.sizes() == shape && out.is_contiguous(), "out must be a contiguous ", shape, " tensor, got ",
              out.sizes(), " strides ", out.strides());
}

void check(cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "llmpar quant kernel launch failed: ", cudaGetErrorString(err));
}

void quantize_rows(const at::Tensor& x, const at::Tensor& wire, int64_t m, int64_t bits, int64_t block) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == m && x.is_contiguous(), "x must be a contiguous [rows, ", m,
              "] tensor, got ", x.sizes());
  check_wire(wire, m, bits, block, x.size(0));
  TORCH_CHECK(x.device() == wire.device(), "x is on ", x.device(), ", wire on ", wire.device());
  const c10::cuda::CUDAGuard guard(wire.device());
  check(llmpar_quant_launch(x.data_ptr(), nullptr, 0, dtype_code(x.scalar_type(), "x"), wire.data_ptr<uint8_t>(),
                            nullptr, x.size(0), m, static_cast<int>(bits), block, 1.0f,
                            c10::cuda::getCurrentCUDAStream().stream()));
}

void pack_quantize(at::TensorList tensors, const at::Tensor& wire, int64_t rows, int64_t m, int64_t bits,
                   int64_t block, double scale, const std::optional<at::Tensor>& residual) {
  check_wire(wire, m, bits, block, rows);
  float* res = nullptr;
  if (residual.has_value() && residual->defined()) {
    const at::Tensor& r = *residual;
    TORCH_CHECK(r.device() == wire.device() && r.scalar_type() == at::kFloat && r.dim() == 1 &&
                    r.numel() == rows * m && r.is_contiguous(),
                "residual must be a contiguous float32 [", rows * m, "] tensor on ", wire.device(), ", got ",
                r.scalar_type(), " ", r.sizes(), " on ", r.device());
    res = r.data_ptr<float>();
  }
  std::vector<at::Tensor> live;
  int src_dtype = LLMPAR_F32;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.device() == wire.device(), "tensors[", i, "] is on ", t.device(), ", wire on ", wire.device());
    if (t.numel() == 0) continue;
    TORCH_CHECK(t.is_contiguous(), "tensors[", i, "] must be contiguous (strides ", t.strides(), ")");
    const int code = dtype_code(t.scalar_type(), "tensors");
    TORCH_CHECK_TYPE(live.empty() || code == src_dtype, "tensors[", i, "] has dtype ", t.scalar_type(),
                     "; all tensors of one launch must share a dtype");
    src_dtype = code;
    live.push_back(t);
  }
  const int64_t n = static_cast<int64_t>(live.size());
  const int64_t nb = (m + block - 1) / block, programs = rows * nb;
  llmpar_refuse_capture("pack_quantize");
  at::Tensor table = at::empty({3 * n + 2 * programs}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = table.data_ptr<int64_t>();
  int64_t offset = 0;
  for (int64_t i = 0; i < n; ++i) {
    h[i] = reinterpret_cast<int64_t>(live[i].data_ptr());
    h[n + i] = offset;
    h[2 * n + i] = live[i].numel();
    offset += live[i].numel();
  }
  TORCH_CHECK(offset <= rows * m, "tensors hold ", offset, " elements, more than rows * m = ", rows * m);
  llmpar_quant_plan(h, n, rows, m, block);
  const c10::cuda::CUDAGuard guard(wire.device());
  // non_blocking from pinned memory: the caching host allocator keeps `table` alive until the copy has run
  const at::Tensor d_table = table.to(wire.device(), /*non_blocking=*/true);
  check(llmpar_quant_launch(nullptr, d_table.data_ptr<int64_t>(), n, src_dtype, wire.data_ptr<uint8_t>(), res, rows,
                            m, static_cast<int>(bits), block, static_cast<float>(scale),
                            c10::cuda::getCurrentCUDAStream().stream()));
}

void dequantize_rows(const at::Tensor& wire, const at::Tensor& out, int64_t m, int64_t bits, int64_t block) {
  check_wire(wire, m, bits, block, -1);
  check_out(out, wire, {wire.size(0), m});
  const c10::cuda::CUDAGuard guard(wire.device());
  check(llmpar_dequant_launch(wire.data_ptr<uint8_t>(), out.data_ptr(), dtype_code(out.scalar_type(), "out"),
                              wire.size(0), m, static_cast<int>(bits), block, 0, 0,
                              c10::cuda::getCurrentCUDAStream().stream()));
}

void dequantize_sum(const at::Tensor& wire, const at::Tensor& out, int64_t m, int64_t bits, int64_t block,
                    bool accumulate) {
  check_wire(wire, m, bits, block, -1);
  check_out(out, wire, {m});
  const c10::cuda::CUDAGuard guard(wire.device());
  check(llmpar_dequant_launch(wire.data_ptr<uint8_t>(), out.data_ptr(), dtype_code(out.scalar_type(), "out"),
                              wire.size(0), m, static_cast<int>(bits), block, 1, accumulate ? 1 : 0,
                              c10::cuda::getCurrentCUDAStream().stream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(llmpar, CUDA, m) {
  m.impl("quantize_rows", &quantize_rows);
  m.impl("pack_quantize", &pack_quantize);
  m.impl("dequantize_rows", &dequantize_rows);
  m.impl("dequantize_sum", &dequantize_sum);
}
