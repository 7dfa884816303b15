// AdamW with 8- or 4-bit block-quantized moments on the CPU: the interface between the torch-facing
// adam_lowbit_ops.cpp and the torch-free kernels adam_lowbit_<isa>.cpp (the contract: llmpar/ops/lowbit.py).
//
// One flat tensor of n elements in blocks of B (8 bits: 256, 4 bits: 128). m_codes / v_codes: uint8, one code a byte
// (8 bits) or two (4 bits: element 2i in the low nibble of byte i, 2i + 1 in the high one); m_scale / v_scale: float32,
// one per block (the block's absmax). Dequantize: x = q[code] * scale. Per element, in float32, t = the step after
// its increment:
//   g = grad * gscale;  m = deq(m);  v = deq(v);  p = p * decay  (decay = 1 - lr * wd)
//   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) (g g)
//   p = p - step_size * (m / (sqrt(v) * bc2_rsqrt + eps))   (step_size = lr / (1 - beta1^t), bc2_rsqrt = 1 / sqrt(1 - beta2^t))
// then per block s = max |x| of the new m (v); s == 0: every code is zero_code; else y = x * r, r = 1 / s (one float32 division per block)
// and code = the number of midpoints mid[k] = (q[k] + q[k + 1]) / 2 with mid[k] < y (ties to the lower code).
// p is the float32 param or master; out (if not null) receives p as bfloat16, round to nearest even, in the same pass.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "adam.h"  // LLMPAR_TARGET_BEGIN / END, Isa

namespace llmpar_cpu {

constexpr int kLowbitMaxCodes = 256;
// The bucket tables of the 8-bit quantizer: |y|'s float32 bits >> 16 (exponent and 7 mantissa bits) less the bits of
// 2^-24, clamped to [0, kBucketCount): bucket 0 holds every |y| < 2^-24 (1 + 1/128), the last every |y| >= 2 - 2^-6.
constexpr int kBucketShift = 16;
constexpr uint32_t kBucketBase = (127 - 24) << 7;
constexpr int kBucketCount = 25 << 7;

// One quantization map, prepared once per call from its float32 tensor (2^bits entries, sorted ascending).
struct alignas(64) LowbitMap {
  float q[kLowbitMaxCodes];      // the map (first 2^bits entries)
  float mid[kLowbitMaxCodes];    // mid[k] = (q[k] + q[k + 1]) / 2, k < 2^bits - 1
  // binary search, level l (l = 0 .. bits - 1, stride s = 2^(bits - 1 - l)): entry j = mid[j * 2s + s - 1];
  // code = 0; for each level: code += s if level[l][code / 2s] < y. Unused entries are 0.
  float level[8][128];
  int zero_code;                 // the code of y = 0: the entry nearest 0, ties to the lower code
  alignas(64) uint8_t plane[4][kLowbitMaxCodes];  // plane[k][j] = byte k of q[j]'s float32 bits (little-endian; the VBMI lookup)
  // 8 bits: code = (e >> 16) + (low > (e & 0xFFFF)), e = bucket[y < 0][bucket of |y|], low = |y|'s low 16 bits (y >= 0)
  // or 0xFFFF - them (y < 0); NaN: 0. Exact (the search's codes) when `bucketed`: no midpoint is 0, lies in the first
  // or last bucket, or shares a bucket with another of its sign (the maps of lowbit_maps.py qualify); else 0 and the
  // search runs. Positive y: e = (number of midpoints below the bucket) << 16 | the low bits of the one inside (0xFFFF:
  // none). Negative y: (number of negative midpoints of larger magnitude than the bucket's) << 16 | 0xFFFF - the low
  // bits of the one inside (0xFFFF: none).
  int bucketed;
  alignas(64) uint32_t bucket[2][kBucketCount];
};

// Hyper-parameters of one tensor, rounded once to float32 from double.
struct LowbitHyper {
  float decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_rsqrt, eps, gscale;
};

// Blocks [block_begin, block_end) of one tensor of n elements (pointers to the tensor's first element).
struct LowbitRange {
  float* param;
  const float* grad;
  uint8_t* m_codes;
  float* m_scale;
  uint8_t* v_codes;
  float* v_scale;
  uint16_t* out;  // bfloat16 bits, or nullptr
  int64_t n;
  int64_t block_begin, block_end;
};

using LowbitRangeFn = void (*)(const LowbitRange&, const LowbitHyper&, const LowbitMap& m, const LowbitMap& v,
                               int bits);

inline constexpr int lowbit_block(int bits) { return bits == 8 ? 256 : 128; }

// The blocks [block_begin, block_end) of r, one call fn(p, g, m_codes, m_scale, v_codes, v_scale, out, k) each
// (the block's first element, code byte and scale; out nullptr when r has none; k valid elements): the blocks wholly
// inside the tensor in place, the tensor's last, partial block on a zero-padded copy (64-byte aligned), copied back
// with the unused high nibble of its last code byte cleared at 4 bits. The loop of the vector builds.
template <int BITS, typename Fn>
inline void for_each_block(const LowbitRange& r, Fn&& fn) {
  constexpr int B = lowbit_block(BITS);
  constexpr int CB = B * BITS / 8;  // code bytes per block
  const int64_t full = std::min(r.block_end, r.n / B);
  for (int64_t b = r.block_begin; b < full; ++b) {
    const int64_t i0 = b * B;
    fn(r.param + i0, r.grad + i0, r.m_codes + b * CB, r.m_scale + b, r.v_codes + b * CB, r.v_scale + b,
       r.out != nullptr ? r.out + i0 : nullptr, B);
  }
  for (int64_t b = std::max(full, r.block_begin); b < r.block_end; ++b) {
    const int64_t i0 = b * B;
    const int k = static_cast<int>(r.n - i0);
    const int kb = (k * BITS + 7) / 8;
    alignas(64) float p[B] = {}, g[B] = {};
    alignas(64) uint8_t mc[CB] = {}, vc[CB] = {};
    alignas(64) uint16_t o[B];
    std::memcpy(p, r.param + i0, sizeof(float) * k);
    std::memcpy(g, r.grad + i0, sizeof(float) * k);
    std::memcpy(mc, r.m_codes + b * CB, kb);
    std::memcpy(vc, r.v_codes + b * CB, kb);
    fn(p, g, mc, r.m_scale + b, vc, r.v_scale + b, r.out != nullptr ? o : nullptr, k);
    if (BITS == 4 && (k & 1)) {
      mc[kb - 1] &= 0x0F;
      vc[kb - 1] &= 0x0F;
    }
    std::memcpy(r.param + i0, p, sizeof(float) * k);
    std::memcpy(r.m_codes + b * CB, mc, kb);
    std::memcpy(r.v_codes + b * CB, vc, kb);
    if (r.out != nullptr) std::memcpy(r.out + i0, o, sizeof(uint16_t) * k);
  }
}

// builds a LowbitMap from 2^bits floats
void lowbit_prepare_map(const float* q, int bits, LowbitMap* out);

void adam_lowbit_scalar(const LowbitRange& r, const LowbitHyper& h, const LowbitMap& m, const LowbitMap& v, int bits);
#if defined(__x86_64__)
void adam_lowbit_avx2(const LowbitRange& r, const LowbitHyper& h, const LowbitMap& m, const LowbitMap& v, int bits);
void adam_lowbit_avx512(const LowbitRange& r, const LowbitHyper& h, const LowbitMap& m, const LowbitMap& v, int bits);
void adam_lowbit_avx512_vbmi(const LowbitRange& r, const LowbitHyper& h, const LowbitMap& m, const LowbitMap& v,
                             int bits);
#endif

}  // namespace llmpar_cpu
