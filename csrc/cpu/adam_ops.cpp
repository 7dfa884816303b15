// torch-facing side of the CPU AdamW kernel (adam.h): the CPU kernel of llmpar::cpu_adamw_step, whose schema and fake
// impl are defined in llmpar/ops/_library.py (CPU_OPS), plus the module init and build info of llmpar._C_cpu.
// Checks here are the last line of defence; llmpar/ops/cpu_adam.py checks first, with messages naming the argument.
//
// The work: all tensors as one index space, split by at::parallel_for into one contiguous piece per thread (whole
// tensors and slices of them); each piece runs the ISA kernel picked once per call: the widest of AVX-512, AVX2 and
// scalar that both the CPU has (__builtin_cpu_supports) and `isa` allows.
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "adam.h"

namespace {

using llmpar_cpu::AdamHyper;
using llmpar_cpu::AdamRange;
using llmpar_cpu::AdamRangeFn;

constexpr int64_t kGrain = 1 << 15;  // fewer elements than this in all run on the calling thread
// from this many elements a call moves (>= 60 MiB) more than the caches hold: the outs go around them (adam.h)
constexpr int64_t kStreamOut = 1 << 21;

int cpu_isa() {
#if defined(__x86_64__)
  static const int isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
      return static_cast<int>(llmpar_cpu::kIsaAvx512);
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
      return static_cast<int>(llmpar_cpu::kIsaAvx2);
    }
    return static_cast<int>(llmpar_cpu::kIsaScalar);
  }();
  return isa;
#else
  return llmpar_cpu::kIsaScalar;
#endif
}

AdamRangeFn kernel_for(int64_t isa) {
  TORCH_CHECK_VALUE(isa >= 0 && isa <= 3, "cpu_adamw_step: isa=", isa,
                    " is not an ISA code (0 scalar, 1 AVX2, 2 AVX-512, 3 AVX-512 + VBMI)");
  switch (std::min<int>(static_cast<int>(isa), cpu_isa())) {
#if defined(__x86_64__)
    case llmpar_cpu::kIsaAvx512: return &llmpar_cpu::adam_range_avx512;
    case llmpar_cpu::kIsaAvx2: return &llmpar_cpu::adam_range_avx2;
#endif
    default: return &llmpar_cpu::adam_range_scalar;
  }
}

// (TORCH_CHECK_VALUE / _TYPE: Python sees a ValueError / TypeError, as from llmpar's own checks)
void check_list(at::TensorList list, const char* name, at::TensorList params, bool any_float) {
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& t = list[i];
    TORCH_CHECK_VALUE(t.device().is_cpu(), "cpu_adamw_step: ", name, "[", i, "] is on ", t.device(),
                      "; the kernel runs on CPU tensors");
    TORCH_CHECK_VALUE(t.is_contiguous(), "cpu_adamw_step: ", name, "[", i, "] is not contiguous (strides ",
                      t.strides(), ")");
    TORCH_CHECK_VALUE(t.numel() == params[i].numel(), "cpu_adamw_step: ", name, "[", i, "] has ", t.numel(),
                      " elements, params[", i, "] ", params[i].numel());
    const auto dt = t.scalar_type();
    TORCH_CHECK_TYPE(dt == at::kFloat || (any_float && (dt == at::kBFloat16 || dt == at::kHalf)), "cpu_adamw_step: ",
                     name, "[", i, "] has dtype ", dt, (any_float ? "; outs take float32, bfloat16 or float16"
                                                                  : "; the kernel takes float32"));
    TORCH_CHECK_TYPE(!any_float || dt == list[0].scalar_type(), "cpu_adamw_step: ", name, "[", i, "] has dtype ", dt,
                     ", ", name, "[0] ", list[0].scalar_type(), "; one dtype per list");
  }
}

int out_kind(at::TensorList outs) {
  if (outs.empty()) return llmpar_cpu::kOutNone;
  switch (outs[0].scalar_type()) {
    case at::kFloat: return llmpar_cpu::kOutF32;
    case at::kBFloat16: return llmpar_cpu::kOutBF16;
    default: return llmpar_cpu::kOutF16;
  }
}

// as torch's fused CPU AdamW: the scalars in double, rounded once to float32
AdamHyper hyper_of(double step, double lr, double beta1, double beta2, double eps, double weight_decay,
                   double gscale) {
  AdamHyper h;
  h.decay = static_cast<float>(1.0 - lr * weight_decay);
  const float w1 = static_cast<float>(1.0 - beta1);
  const bool small = std::abs(w1) < 0.5f;
  h.lerp_coeff = small ? w1 : w1 - 1.0f;
  h.lerp_from_grad = small ? 0 : 1;
  h.beta2 = static_cast<float>(beta2);
  h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  h.neg_step_size = static_cast<float>(-(lr / (1.0 - std::pow(beta1, step))));
  h.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, step)));
  h.eps = static_cast<float>(eps);
  h.gscale = static_cast<float>(gscale);
  return h;
}

// steps[i] += 1, then one AdamW step of every tensor with t = steps[i]; outs[i] (if given) = the new params[i], rounded
void cpu_adamw_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                    at::TensorList outs, at::TensorList steps, double lr, double beta1, double beta2, double eps,
                    double weight_decay, double gscale, int64_t isa) {
  const size_t n = params.size();
  const std::pair<const char*, size_t> lengths[] = {
      {"grads", grads.size()}, {"exp_avgs", exp_avgs.size()}, {"exp_avg_sqs", exp_avg_sqs.size()},
      {"steps", steps.size()}};
  for (const auto& [name, size] : lengths) {
    TORCH_CHECK_VALUE(size == n, "cpu_adamw_step: ", name, " has ", size, " tensors but params has ", n);
  }
  TORCH_CHECK_VALUE(outs.empty() || outs.size() == n, "cpu_adamw_step: outs has ", outs.size(),
                    " tensors; give none or one per param (", n, ")");
  check_list(params, "params", params, false);
  check_list(grads, "grads", params, false);
  check_list(exp_avgs, "exp_avgs", params, false);
  check_list(exp_avg_sqs, "exp_avg_sqs", params, false);
  check_list(outs, "outs", params, true);
  const AdamRangeFn fn = kernel_for(isa);
  const int kind = out_kind(outs);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& s = steps[i];
    TORCH_CHECK_TYPE(s.device().is_cpu() && s.scalar_type() == at::kFloat && s.numel() == 1, "cpu_adamw_step: steps[",
                     i, "] must be a float32 scalar on the CPU, got ", s.scalar_type(), " of shape ", s.sizes(), " on ",
                     s.device());
  }
  // every check passed: from here on the call mutates (steps first: t counts this step, as in torch's AdamW)
  std::vector<AdamHyper> hyper(n);
  std::vector<int64_t> start(n + 1, 0);
  for (size_t i = 0; i < n; ++i) {
    float* step = steps[i].data_ptr<float>();
    *step += 1.0f;
    hyper[i] = hyper_of(static_cast<double>(*step), lr, beta1, beta2, eps, weight_decay, gscale);
    start[i + 1] = start[i] + params[i].numel();
  }
  const int64_t total = start[n];
  if (total == 0) return;
  const bool stream = kind != llmpar_cpu::kOutNone && total >= kStreamOut;
  at::parallel_for(0, total, kGrain, [&](int64_t begin, int64_t end) {
    size_t t = std::upper_bound(start.begin(), start.end(), begin) - start.begin() - 1;
    for (; begin < end; ++t) {
      const int64_t stop = std::min(end, start[t + 1]);
      if (stop == begin) continue;  // an empty tensor
      const int64_t off = begin - start[t];
      void* out = nullptr;
      if (kind != llmpar_cpu::kOutNone) {
        out = static_cast<char*>(outs[t].data_ptr()) + off * static_cast<int64_t>(outs[t].element_size());
      }
      const AdamRange r{params[t].data_ptr<float>() + off, grads[t].data_ptr<float>() + off,
                        exp_avgs[t].data_ptr<float>() + off, exp_avg_sqs[t].data_ptr<float>() + off, out,
                        stop - begin, stream};
      fn(r, hyper[t], kind);
      begin = stop;
    }
  });
}

}  // namespace

// The torch version built against (-DLLMPAR_TORCH_VERSION=2.13.0 from csrc/build_config.py), read WITHOUT loading
// the .so by llmpar/ops/_ext.py's _MARKER: a wheel's build for another torch is not loaded.
#define LLMPAR_QUOTE(...) LLMPAR_QUOTE_(__VA_ARGS__)
#define LLMPAR_QUOTE_(...) #__VA_ARGS__
extern "C" __attribute__((used, visibility("default"))) const char llmpar_cpu_build_info[] =
    "LLMPAR_BUILD_INFO torch=" LLMPAR_QUOTE(LLMPAR_TORCH_VERSION) " cuda=cpu";

TORCH_LIBRARY_IMPL(llmpar, CPU, m) {
  m.impl("cpu_adamw_step", &cpu_adamw_step);
}

// `import llmpar._C_cpu` (the setup.py build) only needs a module object: loading the library registers the kernel
extern "C" PyObject* PyInit__C_cpu(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C_cpu", "llmpar CPU ops (see torch.ops.llmpar)", -1,
                                      nullptr};
  return PyModule_Create(&module);
}
