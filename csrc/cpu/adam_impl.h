// The AdamW loop of adam.h over a SIMD traits type S, included by each adam_<isa>.cpp after its target pragma.
//
// S provides: type V (S::W floats), load / store (unaligned), set1, add, sub, mul, div, sqrt, fma(a, b, c) = a * b + c
// rounded once; for the out: put<NT> (float32), store_bf16<NT> / store_f16<NT> (round to nearest even; a bfloat16 NaN
// stays NaN, quiet), streaming stores to an aligned address when NT and S::kStream (then S::fence() after them).
// Everything here has internal linkage (anonymous namespace): the same source is compiled once per ISA with different
// target flags, and a shared inline copy picked by the linker could run AVX-512 code on a CPU without it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "adam.h"

// The arithmetic members of a vector traits type S over the intrinsics _mm256_* / _mm512_* (PREFIX) on VEC.
#define LLMPAR_SIMD_ARITH(PREFIX, VEC, WIDTH)                                      \
  using V = VEC;                                                                   \
  static constexpr int W = WIDTH;                                                  \
  static V load(const float* p) { return PREFIX##_loadu_ps(p); }                   \
  static void store(float* p, V x) { PREFIX##_storeu_ps(p, x); }                   \
  static V set1(float x) { return PREFIX##_set1_ps(x); }                           \
  static V add(V a, V b) { return PREFIX##_add_ps(a, b); }                         \
  static V sub(V a, V b) { return PREFIX##_sub_ps(a, b); }                         \
  static V mul(V a, V b) { return PREFIX##_mul_ps(a, b); }                         \
  static V div(V a, V b) { return PREFIX##_div_ps(a, b); }                         \
  static V sqrt(V a) { return PREFIX##_sqrt_ps(a); }                               \
  static V fma(V a, V b, V c) { return PREFIX##_fmadd_ps(a, b, c); }               \
  static constexpr bool kStream = true;                                            \
  static void fence() { _mm_sfence(); }                                            \
  template <bool NT>                                                               \
  static void put(float* p, V x) {                                                 \
    if constexpr (NT) PREFIX##_stream_ps(p, x); else PREFIX##_storeu_ps(p, x);     \
  }

// Defines llmpar_cpu::NAME (adam.h) as the loop over traits type S.
#define LLMPAR_ADAM_RANGE(NAME, S)                                                             \
  void llmpar_cpu::NAME(const AdamRange& r, const AdamHyper& h, int out_kind) { adam_dispatch<S>(r, h, out_kind); }

namespace {

template <class S>
struct AdamConsts {
  typename S::V decay, coeff, beta2, w2, neg_step, bc2, eps, gscale;
  bool from_grad;
  explicit AdamConsts(const llmpar_cpu::AdamHyper& h)
      : decay(S::set1(h.decay)), coeff(S::set1(h.lerp_coeff)), beta2(S::set1(h.beta2)),
        w2(S::set1(h.one_minus_beta2)), neg_step(S::set1(h.neg_step_size)), bc2(S::set1(h.bc2_sqrt)),
        eps(S::set1(h.eps)), gscale(S::set1(h.gscale)), from_grad(h.lerp_from_grad != 0) {}
};

// S::W elements at offset i; NT: the out store is a streaming one (aligned, around the caches)
template <class S, int OUT, bool NT>
inline void adam_block(const AdamConsts<S>& c, float* p, const float* g, float* m, float* v, void* out, int64_t i) {
  using V = typename S::V;
  const V gv = S::mul(S::load(g + i), c.gscale);
  V pv = S::mul(S::load(p + i), c.decay);
  V mv = S::load(m + i);
  mv = S::fma(c.coeff, S::sub(gv, mv), c.from_grad ? gv : mv);
  const V vv = S::fma(S::mul(c.w2, gv), gv, S::mul(S::load(v + i), c.beta2));
  S::store(m + i, mv);
  S::store(v + i, vv);
  const V denom = S::add(S::div(S::sqrt(vv), c.bc2), c.eps);
  pv = S::add(pv, S::div(S::mul(c.neg_step, mv), denom));
  S::store(p + i, pv);
  if constexpr (OUT == llmpar_cpu::kOutF32) {
    S::template put<NT>(static_cast<float*>(out) + i, pv);
  } else if constexpr (OUT == llmpar_cpu::kOutBF16) {
    S::template store_bf16<NT>(static_cast<uint16_t*>(out) + i, pv);
  } else if constexpr (OUT == llmpar_cpu::kOutF16) {
    S::template store_f16<NT>(static_cast<uint16_t*>(out) + i, pv);
  }
}

// whole vectors from begin to end (end - begin a multiple of S::W)
template <class S, int OUT, bool NT>
void adam_vectors(const AdamConsts<S>& c, const llmpar_cpu::AdamRange& r, int64_t begin, int64_t end) {
  // the pointers in locals: the intrinsics' stores may alias anything, r's fields would be reloaded every step
  float* const param = r.param;
  const float* const grad = r.grad;
  float* const exp_avg = r.exp_avg;
  float* const exp_avg_sq = r.exp_avg_sq;
  void* const out = r.out;
  for (int64_t i = begin; i < end; i += S::W) {
    adam_block<S, OUT, NT>(c, param, grad, exp_avg, exp_avg_sq, out, i);
  }
}

// k < S::W elements from `at`: the same vector code on a zero-padded copy (padding lanes are computed and dropped)
template <class S, int OUT>
void adam_partial(const AdamConsts<S>& c, const llmpar_cpu::AdamRange& r, int64_t at, int64_t k) {
  if (k <= 0) return;
  constexpr int W = S::W;
  alignas(64) float p[W] = {}, g[W] = {}, m[W] = {}, v[W] = {}, o[W] = {};
  const size_t bytes = static_cast<size_t>(k) * sizeof(float);
  std::memcpy(p, r.param + at, bytes);
  std::memcpy(g, r.grad + at, bytes);
  std::memcpy(m, r.exp_avg + at, bytes);
  std::memcpy(v, r.exp_avg_sq + at, bytes);
  adam_block<S, OUT, false>(c, p, g, m, v, o, 0);
  std::memcpy(r.param + at, p, bytes);
  std::memcpy(r.exp_avg + at, m, bytes);
  std::memcpy(r.exp_avg_sq + at, v, bytes);
  if constexpr (OUT == llmpar_cpu::kOutF32) {
    std::memcpy(static_cast<float*>(r.out) + at, o, bytes);
  } else if constexpr (OUT != llmpar_cpu::kOutNone) {  // o holds W uint16 values in its first W * 2 bytes
    std::memcpy(static_cast<uint16_t*>(r.out) + at, o, static_cast<size_t>(k) * sizeof(uint16_t));
  }
}

template <class S, int OUT>
void adam_loop(const llmpar_cpu::AdamRange& r, const llmpar_cpu::AdamHyper& h) {
  constexpr int W = S::W;
  const AdamConsts<S> c(h);
  if constexpr (OUT != llmpar_cpu::kOutNone && S::kStream) {
    // streaming stores of the out: a head up to the first out address aligned to a whole vector of it, then the
    // vectors (a store fence after them), then the tail
    constexpr uintptr_t size = OUT == llmpar_cpu::kOutF32 ? sizeof(float) : sizeof(uint16_t);
    constexpr uintptr_t span = W * size;  // bytes of out per vector: the alignment its streaming store needs
    const uintptr_t addr = reinterpret_cast<uintptr_t>(r.out);
    if (r.stream_out && addr % size == 0) {
      const int64_t head = std::min<int64_t>(r.n, static_cast<int64_t>((span - addr % span) % span / size));
      const int64_t end = head + (r.n - head) / W * W;
      adam_partial<S, OUT>(c, r, 0, head);
      adam_vectors<S, OUT, true>(c, r, head, end);
      S::fence();
      adam_partial<S, OUT>(c, r, end, r.n - end);
      return;
    }
  }
  const int64_t end = r.n - r.n % W;
  adam_vectors<S, OUT, false>(c, r, 0, end);
  adam_partial<S, OUT>(c, r, end, r.n - end);
}

template <class S>
void adam_dispatch(const llmpar_cpu::AdamRange& r, const llmpar_cpu::AdamHyper& h, int out_kind) {
  switch (out_kind) {
    case llmpar_cpu::kOutF32: adam_loop<S, llmpar_cpu::kOutF32>(r, h); break;
    case llmpar_cpu::kOutBF16: adam_loop<S, llmpar_cpu::kOutBF16>(r, h); break;
    case llmpar_cpu::kOutF16: adam_loop<S, llmpar_cpu::kOutF16>(r, h); break;
    default: adam_loop<S, llmpar_cpu::kOutNone>(r, h); break;
  }
}

}  // namespace
