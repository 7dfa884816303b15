// CUDA kernels of llmpar::pack_bucket / llmpar::unpack_bucket on top of the torch-free launcher in bucket_kernels.cu,
// plus the module init and build info of llmpar._C. The schemas (and fake impls) of every llmpar:: op are defined once,
// in llmpar/ops/_library.py: the csrc/*.cpp files only add CUDA kernels with TORCH_LIBRARY_IMPL(llmpar, CUDA, m).
// Lighter headers than torch/extension.h (no pybind11): the op is reached through torch.ops.llmpar, not pybind.
#include <Python.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>  // not ATen/cuda/CUDAContext.h: that one wants cusparse/cublas headers
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "bucket.cuh"
#include "capture_check.h"
#include "dtype_code.h"

namespace {

int dtype_code(at::ScalarType t, const char* what) { return llmpar::dtype_code(t, "llmpar._C bucket ops", what); }

// Checks the list, builds the int64 table (see bucket.cuh) in pinned memory and copies it to the flat's device.
// Returns the source/destination dtype of the list and fills num_blocks.
int check_and_table(const at::Tensor& flat, at::TensorList tensors, const char* list_name, at::Tensor& d_table,
                    int64_t& num_blocks) {
  TORCH_CHECK(flat.is_cuda(), "flat buffer must be a CUDA tensor, got device ", flat.device());
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous(), "flat buffer must be 1-D and contiguous, got shape ",
              flat.sizes(), " strides ", flat.strides());
  const int64_t n = static_cast<int64_t>(tensors.size());
  int list_dtype = -1;
  std::vector<int64_t> numels(n);
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.device() == flat.device(), list_name, "[", i, "] is on ", t.device(), ", flat buffer on ", flat.device());
    TORCH_CHECK(t.is_contiguous(), list_name, "[", i, "] must be contiguous (strides ", t.strides(), ")");
    const int code = dtype_code(t.scalar_type(), list_name);
    TORCH_CHECK_TYPE(list_dtype < 0 || code == list_dtype, list_name, "[", i, "] has dtype ", t.scalar_type(),
                     "; all tensors of one launch must share a dtype");
    list_dtype = code;
    numels[i] = t.numel();
    total += numels[i];
  }
  TORCH_CHECK(total <= flat.numel(), list_name, " hold ", total, " elements, flat buffer only ", flat.numel());
  num_blocks = llmpar_bucket_num_blocks(numels.data(), n);
  at::Tensor table = at::empty({3 * n + 2 * num_blocks}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = table.data_ptr<int64_t>();
  int64_t offset = 0;
  for (int64_t i = 0; i < n; ++i) {
    h[i] = reinterpret_cast<int64_t>(tensors[i].data_ptr());
    h[n + i] = numels[i];
    h[2 * n + i] = offset;
    offset += numels[i];
  }
  llmpar_bucket_plan_blocks(h, n, num_blocks);
  // non_blocking from pinned memory: the caching host allocator keeps `table` alive until the copy has run
  d_table = table.to(flat.device(), /*non_blocking=*/true);
  return list_dtype;
}

void launch(int direction, const at::Tensor& flat, at::TensorList tensors, double scale, const char* list_name) {
  if (tensors.empty()) return;
  llmpar_refuse_capture(direction == 0 ? "pack_bucket" : "unpack_bucket");
  const c10::cuda::CUDAGuard guard(flat.device());
  at::Tensor d_table;
  int64_t num_blocks = 0;
  const int list_dtype = check_and_table(flat, tensors, list_name, d_table, num_blocks);
  const int flat_dtype = dtype_code(flat.scalar_type(), "flat buffer");
  const int src = direction == 0 ? list_dtype : flat_dtype;
  const int dst = direction == 0 ? flat_dtype : list_dtype;
  const cudaError_t err = llmpar_bucket_launch(direction, flat.data_ptr(), d_table.data_ptr<int64_t>(), tensors.size(),
                                               num_blocks, src, dst, static_cast<float>(scale),
                                               c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "llmpar bucket kernel launch failed: ", cudaGetErrorString(err));
}

void pack_bucket(at::TensorList tensors, const at::Tensor& out, double scale) { launch(0, out, tensors, scale, "tensors"); }

void unpack_bucket(const at::Tensor& flat, at::TensorList outs, double scale) { launch(1, flat, outs, scale, "outs"); }

}  // namespace

// Build info read by llmpar/ops/_ext.py from the file's bytes, before loading it: a .so built for another torch is
// skipped instead of loaded (its kernel registrations could not be undone). Versions come from build_config.py.
#define LLMPAR_STR_(x) #x
#define LLMPAR_STR(x) LLMPAR_STR_(x)
#ifndef LLMPAR_TORCH_VERSION
#define LLMPAR_TORCH_VERSION unknown
#endif
#ifndef LLMPAR_CUDA_VERSION
#define LLMPAR_CUDA_VERSION unknown
#endif
extern "C" __attribute__((used, visibility("default"))) const char llmpar_build_info[] =
    "LLMPAR_BUILD_INFO torch=" LLMPAR_STR(LLMPAR_TORCH_VERSION) " cuda=" LLMPAR_STR(LLMPAR_CUDA_VERSION);

TORCH_LIBRARY_IMPL(llmpar, CUDA, m) {
  m.impl("pack_bucket", &pack_bucket);
  m.impl("unpack_bucket", &unpack_bucket);
}

// `import llmpar._C` only needs a module object: loading the library runs the kernel registrations of
// csrc/*.cpp (before or after llmpar/ops/_library.py defines the schemas: the dispatcher takes either order).
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "llmpar CUDA ops (see torch.ops.llmpar)", -1, nullptr};
  return PyModule_Create(&module);
}
