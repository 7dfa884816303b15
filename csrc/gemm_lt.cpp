// llmpar::linear_lt: y = act(x @ W^T + b) (+ residual) through cuBLASLt and its fused epilogues.
//   x: [M, K], weight: [N, K], bias: [N] or None, residual: [M, N] or None (act 0 only) -> y: [M, N] in x's dtype.
//   act: 0 none, 1 gelu (tanh approximation), 4 relu (codes of llmpar.kernels.gemm.ACTS). cuBLASLt has no silu or
//   erf-gelu epilogue: those stay on the Triton kernel. A residual goes in as C with beta = 1, which cuBLASLt adds
//   before the epilogue's activation, so it is only accepted without one.
// Row-major y = x W^T is column-major y^T = W^T(T) x^T: A = W (op T), B = x (op N), D = y^T, m = N, n = M, k = K;
// the bias runs along m, i.e. along the output features. fp32 accumulate (CUBLAS_COMPUTE_32F, no TF32).
// Pointer alignment: cuBLASLt is told each operand's real alignment (slices of flat buffers may be 2-byte aligned);
// when it has no algorithm for them, the inputs are copied to aligned buffers, and failing that the op runs on ATen.
// llmpar::linear_lt_aux: (gelu_tanh(x W^T + b), x W^T + b) through the GELU_AUX epilogue: the forward of a gelu
//   layer that keeps the pre-activation for llmpar::bias_act_backward (csrc/bias_act_ops.cpp). The pre-activation is a
//   [M, N] view of a [M, ceil(N / 8) * 8] buffer (cuBLASLt's leading-dimension rule for the aux matrix).
// Built only where cublasLt.h is found (csrc/build_config.py); llmpar/ops/gemm.py dispatches linear_act to it.
// This file adds the CUDA kernels; the schemas and fake impls are in llmpar/ops/_library.py.
// cuBLASLt is reached through dlopen/dlsym of the libcublasLt that torch itself loads (same soname major as the
// header), so the extension needs no link flag: the JIT build (llmpar/ops/_ext.py) passes none, and a missing
// library turns into an error at call time instead of an extension that does not load.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // not ATen/cuda/CUDAContext.h: that one wants cusparse headers
#include <torch/library.h>

#include <cublasLt.h>
#include <dlfcn.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <tuple>
#include <string>
#include <unordered_map>

namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;  // what cuBLAS recommends on Hopper

#define LLMPAR_LT_CHECK(expr)                                                                       \
  do {                                                                                              \
    cublasStatus_t _st = (expr);                                                                    \
    TORCH_CHECK(_st == CUBLAS_STATUS_SUCCESS, "cuBLASLt call " #expr " failed with status ", int(_st)); \
  } while (0)

#define LLMPAR_LT_FUNCS(X)                                                                                    \
  X(cublasLtCreate) X(cublasLtMatmulDescCreate) X(cublasLtMatmulDescDestroy) X(cublasLtMatmulDescSetAttribute) \
  X(cublasLtMatrixLayoutCreate) X(cublasLtMatrixLayoutDestroy) X(cublasLtMatmulPreferenceCreate)              \
  X(cublasLtMatmulPreferenceDestroy) X(cublasLtMatmulPreferenceSetAttribute) X(cublasLtMatmulAlgoGetHeuristic) \
  X(cublasLtMatmul)

struct LtApi {
#define LLMPAR_LT_PTR(name) decltype(&::name) name = nullptr;
  LLMPAR_LT_FUNCS(LLMPAR_LT_PTR)
#undef LLMPAR_LT_PTR
};

const LtApi& lt() {
  static const LtApi api = [] {
    LtApi a;
    const std::string soname = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
    void* lib = dlopen(soname.c_str(), RTLD_NOW | RTLD_GLOBAL);
    TORCH_CHECK(lib != nullptr, "linear_lt: cannot load ", soname, ": ", dlerror());
#define LLMPAR_LT_SYM(name)                                                            \
    a.name = reinterpret_cast<decltype(&::name)>(dlsym(lib, #name));                  \
    TORCH_CHECK(a.name != nullptr, "linear_lt: ", soname, " has no symbol " #name);
    LLMPAR_LT_FUNCS(LLMPAR_LT_SYM)
#undef LLMPAR_LT_SYM
    return a;
  }();
  return api;
}

cublasLtHandle_t handle_for(int device) {
  static std::mutex mu;
  static std::unordered_map<int, cublasLtHandle_t> handles;
  std::lock_guard<std::mutex> lock(mu);
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cublasLtHandle_t h = nullptr;
  LLMPAR_LT_CHECK(lt().cublasLtCreate(&h));
  handles.emplace(device, h);
  return h;
}

cudaDataType_t cuda_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return CUDA_R_32F;
    case at::kHalf: return CUDA_R_16F;
    case at::kBFloat16: return CUDA_R_16BF;
    default: TORCH_CHECK_TYPE(false, "linear_lt takes float32, float16, bfloat16; got ", t);
  }
  return CUDA_R_32F;
}

// RAII holders so that an error (TORCH_CHECK throws) frees the descriptors
struct Desc {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Desc() {
    if (pref) lt().cublasLtMatmulPreferenceDestroy(pref);
    if (d) lt().cublasLtMatrixLayoutDestroy(d);
    if (c) lt().cublasLtMatrixLayoutDestroy(c);
    if (b) lt().cublasLtMatrixLayoutDestroy(b);
    if (a) lt().cublasLtMatrixLayoutDestroy(a);
    if (op) lt().cublasLtMatmulDescDestroy(op);
  }
};

void check_args(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, int64_t act,
                const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "linear_lt: x and weight must be 2-D, got ", x.sizes(), " and ",
              weight.sizes());
  TORCH_CHECK(x.size(1) == weight.size(1), "linear_lt: x ", x.sizes(), " and weight ", weight.sizes(),
              " disagree on K");
  TORCH_CHECK_TYPE(x.scalar_type() == weight.scalar_type(), "linear_lt: x (", x.scalar_type(), ") and weight (",
                   weight.scalar_type(), ") must share a dtype");
  TORCH_CHECK(act == 0 || act == 1 || act == 4, "linear_lt: act ", act,
              " has no cuBLASLt epilogue (0 none, 1 gelu_tanh, 4 relu)");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), "linear_lt: bias ", bias->sizes(),
                " must be [", weight.size(0), "]");
    TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), "linear_lt: bias dtype must be ", x.scalar_type());
  }
  if (residual.has_value()) {
    TORCH_CHECK(act == 0, "linear_lt: a residual is added before the epilogue's activation; only act 0 takes one");
    TORCH_CHECK(residual->sizes() == at::IntArrayRef({x.size(0), weight.size(0)}), "linear_lt: residual ",
                residual->sizes(), " must be [", x.size(0), ", ", weight.size(0), "]");
    TORCH_CHECK_TYPE(residual->scalar_type() == x.scalar_type(), "linear_lt: residual dtype must be ",
                     x.scalar_type());
  }
}

// The largest power of two (<= 256) dividing the address: what cuBLASLt may assume of a pointer. Tensors that are
// slices of a bigger buffer (ZeRO's flat buffers, row chunks) are often only 2- or 4-byte aligned, while cuBLASLt
// assumes 256 unless told otherwise (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES; torch sets them the same way).
uint32_t alignment_of(const void* ptr) {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  uint32_t align = 256;
  while (align > 1 && address % align != 0) align /= 2;
  return align;
}

// t itself when 16-byte aligned, else an aligned copy (fresh allocations are 256-byte aligned)
at::Tensor aligned16(const at::Tensor& t) {
  return !t.defined() || alignment_of(t.data_ptr()) >= 16 ? t : t.clone(at::MemoryFormat::Contiguous);
}

// y (+)= act(x W^T + b) into y ([M, N], contiguous; beta = 1 adds its contents: the residual); with `aux` (gelu only,
// [M, aux_ld] row-major, aux_ld % 8 == 0 as cuBLASLt asks) the GELU_AUX epilogue also stores the pre-activation z.
// Returns false, having done nothing, when cuBLASLt offers no algorithm for these shapes and pointer alignments.
bool lt_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, int64_t act, bool accumulate,
               at::Tensor& y, at::Tensor* aux, int64_t aux_ld) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const cudaDataType_t dt = cuda_type(x.scalar_type());
  Desc desc;
  LLMPAR_LT_CHECK(lt().cublasLtMatmulDescCreate(&desc.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t opT = CUBLAS_OP_T, opN = CUBLAS_OP_N;
  LLMPAR_LT_CHECK(lt().cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSA, &opT, sizeof(opT)));
  LLMPAR_LT_CHECK(lt().cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSB, &opN, sizeof(opN)));
  const bool has_bias = bias.defined();
  cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT;
  if (aux != nullptr) {
    epi = has_bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
  } else if (has_bias) {
    epi = act == 1 ? CUBLASLT_EPILOGUE_GELU_BIAS : act == 4 ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_BIAS;
  } else if (act == 1) {
    epi = CUBLASLT_EPILOGUE_GELU;
  } else if (act == 4) {
    epi = CUBLASLT_EPILOGUE_RELU;
  }
  if (has_bias) {
    const void* bias_ptr = bias.data_ptr();
    LLMPAR_LT_CHECK(lt().cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr,
                                                        sizeof(bias_ptr)));
  }
  if (aux != nullptr) {
    const void* aux_ptr = aux->data_ptr();
    LLMPAR_LT_CHECK(lt().cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux_ptr,
                                                        sizeof(aux_ptr)));
    LLMPAR_LT_CHECK(lt().cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld,
                                                        sizeof(aux_ld)));
  }
  LLMPAR_LT_CHECK(lt().cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));

  // column-major views: A = W as [K, N] (ld K, op T), B = x as [K, M] (ld K), C = D = y^T as [N, M] (ld N)
  LLMPAR_LT_CHECK(lt().cublasLtMatrixLayoutCreate(&desc.a, dt, K, N, K));
  LLMPAR_LT_CHECK(lt().cublasLtMatrixLayoutCreate(&desc.b, dt, K, M, K));
  LLMPAR_LT_CHECK(lt().cublasLtMatrixLayoutCreate(&desc.c, dt, N, M, N));
  LLMPAR_LT_CHECK(lt().cublasLtMatrixLayoutCreate(&desc.d, dt, N, M, N));

  at::Tensor workspace = at::empty({static_cast<int64_t>(kWorkspaceBytes)}, x.options().dtype(at::kByte));
  size_t ws = kWorkspaceBytes;
  LLMPAR_LT_CHECK(lt().cublasLtMatmulPreferenceCreate(&desc.pref));
  LLMPAR_LT_CHECK(lt().cublasLtMatmulPreferenceSetAttribute(desc.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                            sizeof(ws)));
  // the alignment each operand really has (A = W, B = x, C = D = y)
  const uint32_t align_a = alignment_of(w.data_ptr()), align_b = alignment_of(x.data_ptr());
  const uint32_t align_cd = alignment_of(y.data_ptr());
  LLMPAR_LT_CHECK(lt().cublasLtMatmulPreferenceSetAttribute(desc.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                            &align_a, sizeof(align_a)));
  LLMPAR_LT_CHECK(lt().cublasLtMatmulPreferenceSetAttribute(desc.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                            &align_b, sizeof(align_b)));
  LLMPAR_LT_CHECK(lt().cublasLtMatmulPreferenceSetAttribute(desc.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                            &align_cd, sizeof(align_cd)));
  LLMPAR_LT_CHECK(lt().cublasLtMatmulPreferenceSetAttribute(desc.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                            &align_cd, sizeof(align_cd)));
  cublasLtHandle_t handle = handle_for(x.get_device());
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  const cublasStatus_t st = lt().cublasLtMatmulAlgoGetHeuristic(handle, desc.op, desc.a, desc.b, desc.c, desc.d,
                                                                desc.pref, 1, &heur, &found);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || (st == CUBLAS_STATUS_SUCCESS && found == 0)) return false;
  LLMPAR_LT_CHECK(st);

  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  LLMPAR_LT_CHECK(lt().cublasLtMatmul(handle, desc.op, &alpha, w.data_ptr(), desc.a, x.data_ptr(), desc.b, &beta,
                                      y.data_ptr(), desc.c, y.data_ptr(), desc.d, &heur.algo, workspace.data_ptr(), ws,
                                      c10::cuda::getCurrentCUDAStream().stream()));
  return true;
}

// The same math without cuBLASLt, for shapes and alignments it has no algorithm for: z = x W^T + b through cuBLAS
// (at::linear, fp32 accumulate, rounded to x's dtype), then the activation in fp32 (+ y's residual), one more rounding.
void aten_matmul(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, int64_t act, bool accumulate,
                 at::Tensor& y, at::Tensor* pre) {
  const at::Tensor z = at::linear(x, w, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
  if (pre != nullptr) pre->copy_(z);
  const at::Tensor z32 = z.to(at::kFloat);
  const at::Tensor a = act == 1 ? at::gelu(z32, "tanh") : act == 4 ? at::relu(z32) : z32;
  if (accumulate) {
    y.copy_(y.to(at::kFloat).add_(a));
  } else {
    y.copy_(a);
  }
}

// lt_matmul, else once more on 16-byte aligned copies of the inputs, else aten_matmul: never an error for a layout
void linear_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, int64_t act, bool accumulate,
                 at::Tensor& y, at::Tensor* aux, int64_t aux_ld, at::Tensor* pre) {
  const at::Tensor b = aligned16(bias);  // no alignment preference exists for the epilogue's bias pointer
  if (lt_matmul(x, w, b, act, accumulate, y, aux, aux_ld)) return;
  const at::Tensor xa = aligned16(x), wa = aligned16(w);
  if ((xa.data_ptr() != x.data_ptr() || wa.data_ptr() != w.data_ptr()) &&
      lt_matmul(xa, wa, b, act, accumulate, y, aux, aux_ld)) {
    return;
  }
  aten_matmul(x, w, b, act, accumulate, y, pre);
}

// act(b) (+ residual) for an empty product (K = 0), without cuBLASLt; z gets the pre-activation when given
at::Tensor empty_product(const at::Tensor& x, int64_t N, const at::Tensor& bias, int64_t act, at::Tensor y,
                         bool add_to_y, at::Tensor* z) {
  const int64_t M = x.size(0);
  at::Tensor pre = bias.defined() ? bias.expand({M, N}).to(at::kFloat)
                                  : at::zeros({M, N}, x.options().dtype(at::kFloat));
  if (z != nullptr) z->copy_(pre);
  at::Tensor a = act == 1 ? at::gelu(pre, "tanh") : act == 4 ? at::relu(pre) : pre;
  return add_to_y ? y.add_(a.to(y.scalar_type())) : y.copy_(a);
}

at::Tensor linear_lt(const at::Tensor& x_in, const at::Tensor& w_in, const std::optional<at::Tensor>& bias_in,
                     int64_t act, const std::optional<at::Tensor>& residual_in) {
  check_args(x_in, w_in, bias_in, act, residual_in);
  TORCH_CHECK(x_in.is_cuda() && w_in.device() == x_in.device(), "linear_lt: tensors must be on one CUDA device");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const bool res = residual_in.has_value();
  at::Tensor y = res ? residual_in->contiguous().clone() : at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  at::Tensor bias = bias_in.has_value() ? bias_in->contiguous() : at::Tensor();
  if (K == 0) return empty_product(x, N, bias, act, y, res, nullptr);
  linear_into(x, w, bias, act, res, y, nullptr, 0, nullptr);
  return y;
}

// (gelu_tanh(x W^T + b), x W^T + b): the forward of a gelu layer that keeps z for its backward (GELU_AUX epilogue)
std::tuple<at::Tensor, at::Tensor> linear_lt_aux(const at::Tensor& x_in, const at::Tensor& w_in,
                                                 const std::optional<at::Tensor>& bias_in) {
  check_args(x_in, w_in, bias_in, 1, std::nullopt);
  TORCH_CHECK(x_in.is_cuda() && w_in.device() == x_in.device(), "linear_lt_aux: tensors must be on one CUDA device");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t ld = (N + 7) / 8 * 8;  // cuBLASLt wants the GELU aux leading dimension divisible by 8
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor aux = at::empty({M, ld}, x.options());
  at::Tensor pre = aux.narrow(1, 0, N);
  if (M == 0 || N == 0) return {y, pre};
  at::Tensor bias = bias_in.has_value() ? bias_in->contiguous() : at::Tensor();
  if (K == 0) {
    empty_product(x, N, bias, 1, y, false, &pre);
    return {y, pre};
  }
  linear_into(x, w, bias, 1, false, y, &aux, ld, &pre);
  return {y, pre};
}

}  // namespace

TORCH_LIBRARY_IMPL(llmpar, CUDA, m) {
  m.impl("linear_lt", &linear_lt);
  m.impl("linear_lt_aux", &linear_lt_aux);
}
