// Portable build of the low-bit AdamW kernel (adam_lowbit.h) on plain floats, and the map preparation shared by every
// ISA. The fallback where the CPU lacks AVX-512 (or LLMPAR_CPU_ISA caps it); same IEEE operations as the vector build.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "adam_lowbit.h"

namespace {

uint16_t bf16_bits(float x) {  // round to nearest even; NaN stays NaN (quiet)
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <int BITS>
inline int code_at(const uint8_t* codes, int64_t i) {
  if constexpr (BITS == 8) {
    return codes[i];
  } else {
    return (codes[i >> 1] >> ((i & 1) * 4)) & 0xF;
  }
}

template <int BITS>
inline int search(const llmpar_cpu::LowbitMap& map, float y) {
  int code = 0;
  for (int l = 0; l < BITS; ++l) {
    const int s = 1 << (BITS - 1 - l);
    code += map.level[l][code >> (BITS - l)] < y ? s : 0;
  }
  return code;
}

int search_any(const llmpar_cpu::LowbitMap& map, int bits, float y) {
  return bits == 8 ? search<8>(map, y) : search<4>(map, y);
}

template <int BITS>
void quantize_block(const float* x, int k, float s, const llmpar_cpu::LowbitMap& map, uint8_t* codes, int64_t i0) {
  const float r = 1.0f / s;
  for (int i = 0; i < k; ++i) {
    const int c = s == 0.0f ? map.zero_code : search<BITS>(map, x[i] * r);
    if constexpr (BITS == 8) {
      codes[i0 + i] = static_cast<uint8_t>(c);
    } else {
      const int64_t e = i0 + i;
      uint8_t& byte = codes[e >> 1];
      byte = (e & 1) ? static_cast<uint8_t>((byte & 0x0F) | (c << 4)) : static_cast<uint8_t>(c);  // high nibble: 0
    }
  }
}

template <int BITS>
void run(const llmpar_cpu::LowbitRange& r, const llmpar_cpu::LowbitHyper& h, const llmpar_cpu::LowbitMap& mm,
         const llmpar_cpu::LowbitMap& vm) {
  constexpr int B = llmpar_cpu::lowbit_block(BITS);
  float mb[B], vb[B];
  for (int64_t b = r.block_begin; b < r.block_end; ++b) {
    const int64_t i0 = b * B;
    const int k = static_cast<int>(std::min<int64_t>(B, r.n - i0));
    const float ms = r.m_scale[b], vs = r.v_scale[b];
    float mabs = 0.0f, vabs = 0.0f;
    for (int i = 0; i < k; ++i) {
      const int64_t e = i0 + i;
      const float g = r.grad[e] * h.gscale;
      float m = mm.q[code_at<BITS>(r.m_codes, e)] * ms;
      float v = vm.q[code_at<BITS>(r.v_codes, e)] * vs;
      float p = r.param[e] * h.decay;
      m = h.beta1 * m + h.one_minus_beta1 * g;
      v = h.beta2 * v + h.one_minus_beta2 * (g * g);
      const float denom = std::sqrt(v) * h.bc2_rsqrt + h.eps;
      p = p - h.step_size * (m / denom);
      r.param[e] = p;
      if (r.out != nullptr) r.out[e] = bf16_bits(p);
      mb[i] = m;
      vb[i] = v;
      mabs = std::max(mabs, std::fabs(m));
      vabs = std::max(vabs, std::fabs(v));
    }
    quantize_block<BITS>(mb, k, mabs, mm, r.m_codes, i0);
    quantize_block<BITS>(vb, k, vabs, vm, r.v_codes, i0);
    r.m_scale[b] = mabs;
    r.v_scale[b] = vabs;
  }
}

// LowbitMap::bucket from the midpoints (adam_lowbit.h); bucketed = 0 where the map does not qualify
void build_buckets(llmpar_cpu::LowbitMap* map, int nmid) {
  using llmpar_cpu::kBucketBase;
  using llmpar_cpu::kBucketCount;
  map->bucketed = 0;
  std::vector<int> mids(2 * kBucketCount, 0);  // [sign][bucket]: midpoints inside
  std::vector<uint32_t> low(2 * kBucketCount, 0);
  int negative = 0;
  for (int k = 0; k < nmid; ++k) {
    const float m = map->mid[k];
    const float a = std::fabs(m);
    if (!(a > 0.0f)) return;  // 0 or NaN
    uint32_t u;
    std::memcpy(&u, &a, sizeof(u));
    const int64_t b = static_cast<int64_t>(u >> llmpar_cpu::kBucketShift) - kBucketBase;
    if (b <= 0 || b >= kBucketCount - 1) return;
    const int64_t at = (m < 0.0f) * kBucketCount + b;
    if (mids[at]++ > 0) return;
    low[at] = u & 0xFFFFu;
    negative += m < 0.0f;
  }
  uint32_t below = negative, larger = 0;
  for (int b = 0; b < kBucketCount; ++b) {
    map->bucket[0][b] = below << 16 | (mids[b] ? low[b] : 0xFFFFu);
    below += mids[b];
    const int nb = kBucketCount - 1 - b;
    map->bucket[1][nb] = larger << 16 | (0xFFFFu - (mids[kBucketCount + nb] ? low[kBucketCount + nb] : 0u));
    larger += mids[kBucketCount + nb];
  }
  map->bucketed = 1;
}

}  // namespace

void llmpar_cpu::lowbit_prepare_map(const float* q, int bits, LowbitMap* out) {
  std::memset(static_cast<void*>(out), 0, sizeof(LowbitMap));
  const int n = 1 << bits;
  std::copy(q, q + n, out->q);
  for (int k = 0; k + 1 < n; ++k) out->mid[k] = (q[k] + q[k + 1]) / 2.0f;
  for (int j = 0; j < n; ++j) {
    uint32_t u;
    std::memcpy(&u, &q[j], sizeof(u));
    for (int k = 0; k < 4; ++k) out->plane[k][j] = static_cast<uint8_t>(u >> (8 * k));
  }
  for (int l = 0; l < bits; ++l) {
    const int s = 1 << (bits - 1 - l);
    for (int j = 0; j < (1 << l); ++j) out->level[l][j] = out->mid[j * 2 * s + s - 1];
  }
  out->zero_code = search_any(*out, bits, 0.0f);  // the entry nearest 0, ties to the lower code (y = 0's code)
  if (bits == 8) build_buckets(out, n - 1);
}

void llmpar_cpu::adam_lowbit_scalar(const LowbitRange& r, const LowbitHyper& h, const LowbitMap& m,
                                    const LowbitMap& v, int bits) {
  if (bits == 8) {
    run<8>(r, h, m, v);
  } else {
    run<4>(r, h, m, v);
  }
}
