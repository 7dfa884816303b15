// torch-facing side of the CPU low-bit AdamW kernel (adam_lowbit.h): the CPU kernel of llmpar::cpu_adamw_lowbit_step,
// whose schema and fake impl are defined in llmpar/ops/_library.py (CPU_OPS). llmpar/ops/lowbit_kernels.py checks the
// arguments first with messages naming them; the checks here are the last line of defence.
//
// The work: the blocks of all tensors as one index space, split by at::parallel_for into contiguous pieces of whole
// blocks; each piece runs the ISA kernel picked once per call: the widest build that both the CPU has
// (__builtin_cpu_supports) and `isa` allows: AVX-512 with VBMI (adam_lowbit_avx512_vbmi.cpp), AVX-512
// (adam_lowbit_avx512.cpp), AVX2 + FMA + F16C (adam_lowbit_avx2.cpp), else scalar. All give the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "adam_lowbit.h"

namespace {

using llmpar_cpu::LowbitHyper;
using llmpar_cpu::LowbitMap;
using llmpar_cpu::LowbitRange;
using llmpar_cpu::LowbitRangeFn;

constexpr int64_t kGrainBlocks = 128;  // fewer blocks than this run on the calling thread

// the widest ISA code this CPU runs: 3 (AVX-512 F / BW / VL / DQ + VBMI), 2 (without VBMI), 1 (AVX2 + FMA + F16C),
// or 0
int lowbit_isa() {
#if defined(__x86_64__)
  static const int isa = [] {
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))) {
      const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                        __builtin_cpu_supports("f16c");
      return static_cast<int>(avx2 ? llmpar_cpu::kIsaAvx2 : llmpar_cpu::kIsaScalar);
    }
    return static_cast<int>(__builtin_cpu_supports("avx512vbmi") ? llmpar_cpu::kIsaAvx512Vbmi
                                                                   : llmpar_cpu::kIsaAvx512);
  }();
  return isa;
#else
  return llmpar_cpu::kIsaScalar;
#endif
}

LowbitRangeFn kernel_for(int64_t isa) {
  TORCH_CHECK_VALUE(isa >= 0 && isa <= 3, "cpu_adamw_lowbit_step: isa=", isa,
                    " is not an ISA code (0 scalar, 1 AVX2, 2 AVX-512, 3 AVX-512 + VBMI)");
  switch (std::min<int>(static_cast<int>(isa), lowbit_isa())) {
#if defined(__x86_64__)
    case llmpar_cpu::kIsaAvx512Vbmi: return &llmpar_cpu::adam_lowbit_avx512_vbmi;
    case llmpar_cpu::kIsaAvx512: return &llmpar_cpu::adam_lowbit_avx512;
    case llmpar_cpu::kIsaAvx2: return &llmpar_cpu::adam_lowbit_avx2;
#endif
    default: return &llmpar_cpu::adam_lowbit_scalar;
  }
}

void check(const at::Tensor& t, const char* name, size_t i, at::ScalarType dtype, int64_t numel) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "cpu_adamw_lowbit_step: ", name, "[", i, "] is on ", t.device(),
                    "; the kernel runs on CPU tensors");
  TORCH_CHECK_VALUE(t.is_contiguous(), "cpu_adamw_lowbit_step: ", name, "[", i, "] is not contiguous");
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, "cpu_adamw_lowbit_step: ", name, "[", i, "] has dtype ", t.scalar_type(),
                   "; it takes ", dtype);
  TORCH_CHECK_VALUE(t.numel() == numel, "cpu_adamw_lowbit_step: ", name, "[", i, "] has ", t.numel(),
                    " elements; expected ", numel);
}

// the prepared map (search tables, byte planes, 8-bit bucket tables: ~10 us to build), kept by content for the next
// calls (a few maps at most: the last 8 are kept)
std::shared_ptr<const LowbitMap> prepare(const at::Tensor& qmap, const char* name, int64_t bits) {
  TORCH_CHECK_TYPE(qmap.device().is_cpu() && qmap.scalar_type() == at::kFloat && qmap.dim() == 1 &&
                       qmap.numel() == (int64_t{1} << bits),
                   "cpu_adamw_lowbit_step: ", name, " must be a float32 CPU vector of ", int64_t{1} << bits,
                   " entries, got ", qmap.scalar_type(), " ", qmap.sizes(), " on ", qmap.device());
  const at::Tensor q = qmap.contiguous();
  const auto* bytes = reinterpret_cast<const uint8_t*>(q.data_ptr<float>());
  std::vector<uint8_t> key(bytes, bytes + q.numel() * sizeof(float));
  static std::mutex mutex;
  static std::vector<std::pair<std::vector<uint8_t>, std::shared_ptr<const LowbitMap>>> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  for (const auto& [k, map] : cache) {
    if (k == key) return map;
  }
  auto map = std::make_shared<LowbitMap>();
  llmpar_cpu::lowbit_prepare_map(q.data_ptr<float>(), static_cast<int>(bits), map.get());
  if (cache.size() >= 8) cache.erase(cache.begin());
  cache.emplace_back(std::move(key), map);
  return map;
}

// one low-bit AdamW step of every tensor, t = steps[i] (already incremented); outs[i] (if given) = bf16 params[i]
void cpu_adamw_lowbit_step(at::TensorList params, at::TensorList grads, at::TensorList m_codes,
                           at::TensorList m_scales, at::TensorList v_codes, at::TensorList v_scales,
                           at::TensorList outs, const at::Tensor& qmap_m, const at::Tensor& qmap_v,
                           at::IntArrayRef steps, int64_t bits, double lr, double beta1, double beta2, double eps,
                           double weight_decay, double gscale, int64_t isa) {
  TORCH_CHECK_VALUE(bits == 8 || bits == 4, "cpu_adamw_lowbit_step: bits=", bits, "; it takes 8 or 4");
  const size_t n = params.size();
  TORCH_CHECK_VALUE(grads.size() == n && m_codes.size() == n && m_scales.size() == n && v_codes.size() == n &&
                        v_scales.size() == n && steps.size() == n && (outs.empty() || outs.size() == n),
                    "cpu_adamw_lowbit_step: list lengths disagree with params (", n, ")");
  const int64_t block = llmpar_cpu::lowbit_block(static_cast<int>(bits));
  std::vector<int64_t> first(n + 1, 0);
  std::vector<LowbitHyper> hyper(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t numel = params[i].numel();
    const int64_t nb = (numel + block - 1) / block;
    check(params[i], "params", i, at::kFloat, numel);
    check(grads[i], "grads", i, at::kFloat, numel);
    check(m_codes[i], "m_codes", i, at::kByte, bits == 8 ? numel : (numel + 1) / 2);
    check(v_codes[i], "v_codes", i, at::kByte, bits == 8 ? numel : (numel + 1) / 2);
    check(m_scales[i], "m_scales", i, at::kFloat, nb);
    check(v_scales[i], "v_scales", i, at::kFloat, nb);
    if (!outs.empty()) check(outs[i], "outs", i, at::kBFloat16, numel);
    TORCH_CHECK_VALUE(steps[i] >= 1, "cpu_adamw_lowbit_step: steps[", i, "]=", steps[i], "; t counts from 1");
    const double t = static_cast<double>(steps[i]);
    LowbitHyper& h = hyper[i];
    h.decay = static_cast<float>(1.0 - lr * weight_decay);
    h.beta1 = static_cast<float>(beta1);
    h.one_minus_beta1 = static_cast<float>(1.0 - beta1);
    h.beta2 = static_cast<float>(beta2);
    h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
    h.step_size = static_cast<float>(lr / -std::expm1(t * std::log(beta1)));
    h.bc2_rsqrt = static_cast<float>(1.0 / std::sqrt(-std::expm1(t * std::log(beta2))));
    h.eps = static_cast<float>(eps);
    h.gscale = static_cast<float>(gscale);
    first[i + 1] = first[i] + nb;
  }
  const auto mm = prepare(qmap_m, "qmap_m", bits);
  const auto vm = prepare(qmap_v, "qmap_v", bits);
  const LowbitRangeFn fn = kernel_for(isa);
  const int b = static_cast<int>(bits);
  at::parallel_for(0, first[n], kGrainBlocks, [&](int64_t begin, int64_t end) {
    size_t t = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    for (; begin < end; ++t) {
      const int64_t stop = std::min(end, first[t + 1]);
      if (stop == begin) continue;  // an empty tensor
      const LowbitRange r{params[t].data_ptr<float>(), grads[t].data_ptr<float>(), m_codes[t].data_ptr<uint8_t>(),
                          m_scales[t].data_ptr<float>(), v_codes[t].data_ptr<uint8_t>(),
                          v_scales[t].data_ptr<float>(),
                          outs.empty() ? nullptr : reinterpret_cast<uint16_t*>(outs[t].data_ptr()),
                          params[t].numel(), begin - first[t], stop - first[t]};
      fn(r, hyper[t], *mm, *vm, b);
      begin = stop;
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(llmpar, CPU, m) {
  m.impl("cpu_adamw_lowbit_step", &cpu_adamw_lowbit_step);
}
