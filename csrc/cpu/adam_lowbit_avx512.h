// The AVX-512 low-bit AdamW kernel (adam_lowbit.h) as templates, included by adam_lowbit_avx512.cpp and
// adam_lowbit_avx512_vbmi.cpp after each has opened its target pragma; the second defines LLMPAR_LOWBIT_VBMI, which
// turns on the 8-bit dequantize by byte lookups (AVX512-VBMI: Ice Lake, Zen 4 and later) and, where the CPU has
// AVX512-BF16, vcvtneps2bf16 for the bf16 copies.
//
// One block at a time: dequantize, update, write p (and its bfloat16 copy), keep the block's new m / v in L1 with
// their absmax; then quantize them. Dequantize: 4 bits, one permutexvar of the 16 entries; 8 bits, without VBMI 8
// permutex2var of 32 entries blended by the code's bits 5-7 (18 instructions per 16 codes), with VBMI the 4 bytes of
// the entries looked up for 64 codes at once (2 vpermi2b of 128 entries per byte, blended by the top bit) and
// interleaved back into floats (23 instructions per 64 codes). Quantize: 8 bits, one gather from the map's bucket
// table (bucket_code; a 16-lane gather costs ~11 cycles on the team's Sapphire Rapids, against ~40 instructions for
// the 8-level search it replaces); 4 bits, and maps the tables refuse, a binary search whose level tables live in
// registers.
// Per param, one thread, 64K params in cache (Sapphire Rapids): 8 bits ~1.2 ns, 4 bits ~0.9 ns, against ~2.0 / ~1.1
// ns for the division-per-element, search-only kernel before. Same IEEE operations as adam_lowbit_scalar.cpp (no
// contraction), so the same bits. A block cut short by the tensor's end runs on a padded copy, its absmax masked to
// the valid lanes. (Software prefetch 1-16 blocks ahead measured within noise on tensors larger than the caches.)
#pragma once

#include "adam_lowbit.h"

namespace {

using llmpar_cpu::LowbitMap;

// a table of 2^L floats looked up at j (int lanes, 0 <= j < 2^L): one permute up to 32 entries; above, the two
// halves looked up and blended by bit L - 1 of j (256 entries: 8 permutex2var and 7 blends)
template <int L>
inline __m512 lookup(const float* t, __m512i j) {
  if constexpr (L <= 4) {
    return _mm512_permutexvar_ps(j, _mm512_load_ps(t));
  } else if constexpr (L == 5) {
    return _mm512_permutex2var_ps(_mm512_load_ps(t), j, _mm512_load_ps(t + 16));
  } else {
    const __mmask16 upper = _mm512_test_epi32_mask(j, _mm512_set1_epi32(1 << (L - 1)));
    return _mm512_mask_blend_ps(upper, lookup<L - 1>(t, j), lookup<L - 1>(t + (1 << (L - 1)), j));
  }
}

// the number of midpoints < y (4 bits, and 8-bit maps the bucket tables refuse): j = the code's top L bits, one bit
// more per level
template <int BITS, int L = 0>
inline __m512i search(const LowbitMap& map, __m512 y, __m512i j) {
  if constexpr (L == BITS) {
    return j;
  } else if constexpr (L == 0) {  // one midpoint for every lane: a broadcast, no lookup
    const __mmask16 lt = _mm512_cmp_ps_mask(_mm512_set1_ps(map.level[0][0]), y, _CMP_LT_OQ);
    return search<BITS, 1>(map, y, _mm512_maskz_mov_epi32(lt, _mm512_set1_epi32(1)));
  } else {
    const __mmask16 lt = _mm512_cmp_ps_mask(lookup<L>(map.level[L], j), y, _CMP_LT_OQ);
    j = _mm512_add_epi32(j, j);
    j = _mm512_mask_add_epi32(j, lt, j, _mm512_set1_epi32(1));
    return search<BITS, L + 1>(map, y, j);
  }
}

// 8 bits, a bucketed map: the code of y by one gather from the bucket table (adam_lowbit.h), in place of the 8-level
// search (-30 % of the step)
inline __m512i bucket_code(const LowbitMap& map, __m512 y) {
  const __m512i u = _mm512_castps_si512(y);
  const __m512i neg = _mm512_srai_epi32(u, 31);  // all ones where y < 0
  const __m512i mag = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i low = _mm512_and_si512(_mm512_xor_si512(mag, neg), _mm512_set1_epi32(0xFFFF));
  __m512i b = _mm512_sub_epi32(_mm512_srli_epi32(mag, llmpar_cpu::kBucketShift),
                               _mm512_set1_epi32(static_cast<int>(llmpar_cpu::kBucketBase)));
  b = _mm512_min_epi32(_mm512_max_epi32(b, _mm512_setzero_si512()), _mm512_set1_epi32(llmpar_cpu::kBucketCount - 1));
  b = _mm512_add_epi32(b, _mm512_and_si512(neg, _mm512_set1_epi32(llmpar_cpu::kBucketCount)));
  const __m512i e = _mm512_i32gather_epi32(b, map.bucket[0], 4);
  const __m512i base = _mm512_srli_epi32(e, 16);
  const __mmask16 up = _mm512_cmpgt_epi32_mask(low, _mm512_and_si512(e, _mm512_set1_epi32(0xFFFF)));
  const __m512i code = _mm512_mask_add_epi32(base, up, base, _mm512_set1_epi32(1));
  return _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_setzero_si512());  // NaN: 0
}

template <int BITS>
inline __m512i quantize(const LowbitMap& map, __m512 y) {
  if constexpr (BITS == 8) {
    if (map.bucketed) return bucket_code(map, y);
  }
  return search<BITS>(map, y, _mm512_setzero_si512());
}

template <int BITS>
inline __m512i load_codes(const uint8_t* codes, int v) {  // 16 codes of vector v of the block, as int lanes
  if constexpr (BITS == 8) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * v)));
  } else {  // byte i in qword i: its low nibble to dword 2i, its high nibble (shifted up 28) to dword 2i + 1
    const __m512i b = _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * v)));
    return _mm512_and_si512(_mm512_or_si512(b, _mm512_slli_epi64(b, 28)), _mm512_set1_epi64(0x0000000F0000000FLL));
  }
}

template <int BITS>
inline void store_codes(uint8_t* codes, int v, __m512i c) {
  if constexpr (BITS == 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 16 * v), _mm512_cvtepi32_epi8(c));
  } else {  // qword i = c[2i] | c[2i + 1] << 32: its low byte after | (>> 28) is c[2i] | c[2i + 1] << 4
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + 8 * v), _mm512_cvtepi64_epi8(_mm512_or_si512(c, _mm512_srli_epi64(c, 28))));
  }
}

#if defined(LLMPAR_LOWBIT_VBMI)
// 64 codes -> out[0..4): q[code] as 4 vectors of 16, in order. Byte k of every entry is looked up for all 64 codes
// (plane[k]: 256 bytes; vpermi2b over entries 0-127 and 128-255, blended by the code's top bit); unpacks interleave
// the 4 byte planes into floats within each 128-bit lane, so the codes are first permuted into the order that makes
// those lanes come out in place: code position 16 L + 4 g + i holds code 16 g + 4 L + i (out[g], lane L, float i).
inline void dequant64(const LowbitMap& map, const uint8_t* codes, __m512* out) {
  alignas(64) static const uint8_t order[64] = {
      0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39,
      52, 53, 54, 55, 8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59, 12, 13, 14, 15, 28, 29, 30, 31,
      44, 45, 46, 47, 60, 61, 62, 63};
  const __m512i c = _mm512_permutexvar_epi8(_mm512_load_si512(order), _mm512_loadu_si512(codes));
  const __mmask64 top = _mm512_movepi8_mask(c);
  __m512i b[4];
  for (int k = 0; k < 4; ++k) {
    const uint8_t* t = map.plane[k];
    const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(t), c, _mm512_load_si512(t + 64));
    const __m512i hi = _mm512_permutex2var_epi8(_mm512_load_si512(t + 128), c, _mm512_load_si512(t + 192));
    b[k] = _mm512_mask_blend_epi8(top, lo, hi);
  }
  const __m512i w01l = _mm512_unpacklo_epi8(b[0], b[1]), w01h = _mm512_unpackhi_epi8(b[0], b[1]);
  const __m512i w23l = _mm512_unpacklo_epi8(b[2], b[3]), w23h = _mm512_unpackhi_epi8(b[2], b[3]);
  out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w01l, w23l));
  out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w01l, w23l));
  out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(w01h, w23h));
  out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(w01h, w23h));
}
constexpr bool kVbmi = true;
#else
inline void dequant64(const LowbitMap&, const uint8_t*, __m512*) {}
constexpr bool kVbmi = false;
#endif

template <int BITS>
inline __m512 dequant(const LowbitMap& map, __m512i code) {
  return lookup<BITS>(map.q, code);
}

// CVT (AVX512-BF16, the VBMI build on CPUs that have it): vcvtneps2bf16, unless a lane is denormal (the instruction
// flushes those to 0; the bits below round them)
template <bool CVT>
inline void store_bf16(uint16_t* p, __m512 x) {  // round to nearest even on the bits; NaN: quiet
#if defined(LLMPAR_LOWBIT_VBMI)
  if constexpr (CVT) {
    if (_mm512_fpclass_ps_mask(x, 0x20) == 0) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
      return;
    }
  }
#endif
  const __m512i u = _mm512_castps_si512(x);
  const __m512i hi = _mm512_srli_epi32(u, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7FFF));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512i r = _mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

struct Consts {
  __m512 decay, b1, w1, b2, w2, step, bc2, eps, gscale;
  explicit Consts(const llmpar_cpu::LowbitHyper& h)
      : decay(_mm512_set1_ps(h.decay)), b1(_mm512_set1_ps(h.beta1)), w1(_mm512_set1_ps(h.one_minus_beta1)),
        b2(_mm512_set1_ps(h.beta2)), w2(_mm512_set1_ps(h.one_minus_beta2)), step(_mm512_set1_ps(h.step_size)),
        bc2(_mm512_set1_ps(h.bc2_rsqrt)), eps(_mm512_set1_ps(h.eps)), gscale(_mm512_set1_ps(h.gscale)) {}
};

// One block of B elements at p / g / mc / vc / out (k of them valid, the rest padding); scales in *ms / *vs.
template <int BITS, bool CVT>
inline void block(const Consts& c, const LowbitMap& mm, const LowbitMap& vm, float* p, const float* g, uint8_t* mc,
                  float* ms, uint8_t* vc, float* vs, uint16_t* out, int k) {
  constexpr int B = llmpar_cpu::lowbit_block(BITS);
  constexpr int NV = B / 16;
  alignas(64) float mb[B];
  alignas(64) float vb[B];
  const __m512 msv = _mm512_set1_ps(*ms), vsv = _mm512_set1_ps(*vs);
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  __m512 mabs = _mm512_setzero_ps(), vabs = _mm512_setzero_ps();
  for (int v0 = 0; v0 < NV; v0 += 4) {
    __m512 qm[4], qv[4];
    if constexpr (BITS == 8 && kVbmi) {
      dequant64(mm, mc + 16 * v0, qm);
      dequant64(vm, vc + 16 * v0, qv);
    } else {
      for (int u = 0; u < 4; ++u) {
        qm[u] = dequant<BITS>(mm, load_codes<BITS>(mc, v0 + u));
        qv[u] = dequant<BITS>(vm, load_codes<BITS>(vc, v0 + u));
      }
    }
    for (int u = 0; u < 4; ++u) {
      const int v = v0 + u;
      const __m512 gv = _mm512_mul_ps(_mm512_loadu_ps(g + 16 * v), c.gscale);
      __m512 m = _mm512_mul_ps(qm[u], msv);
      __m512 s = _mm512_mul_ps(qv[u], vsv);
      __m512 pv = _mm512_mul_ps(_mm512_loadu_ps(p + 16 * v), c.decay);
      m = _mm512_add_ps(_mm512_mul_ps(c.b1, m), _mm512_mul_ps(c.w1, gv));
      s = _mm512_add_ps(_mm512_mul_ps(c.b2, s), _mm512_mul_ps(c.w2, _mm512_mul_ps(gv, gv)));
      const __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(s), c.bc2), c.eps);
      pv = _mm512_sub_ps(pv, _mm512_mul_ps(c.step, _mm512_div_ps(m, denom)));
      _mm512_storeu_ps(p + 16 * v, pv);
      if (out != nullptr) store_bf16<CVT>(out + 16 * v, pv);
      _mm512_store_ps(mb + 16 * v, m);
      _mm512_store_ps(vb + 16 * v, s);
      const int valid = k - 16 * v;
      const __mmask16 live = valid >= 16 ? __mmask16(0xFFFF) : valid <= 0 ? __mmask16(0) : __mmask16((1u << valid) - 1);
      mabs = _mm512_mask_max_ps(mabs, live, _mm512_and_ps(m, absmask), mabs);  // NaN: keeps mabs, as std::max
      vabs = _mm512_mask_max_ps(vabs, live, _mm512_and_ps(s, absmask), vabs);
    }
  }
  const float m_max = _mm512_reduce_max_ps(mabs), v_max = _mm512_reduce_max_ps(vabs);
  const __m512 mrcp = _mm512_set1_ps(1.0f / m_max), vrcp = _mm512_set1_ps(1.0f / v_max);
  for (int v = 0; v < NV; ++v) {
    const __m512i cm = m_max == 0.0f ? _mm512_set1_epi32(mm.zero_code)
                                     : quantize<BITS>(mm, _mm512_mul_ps(_mm512_load_ps(mb + 16 * v), mrcp));
    const __m512i cv = v_max == 0.0f ? _mm512_set1_epi32(vm.zero_code)
                                     : quantize<BITS>(vm, _mm512_mul_ps(_mm512_load_ps(vb + 16 * v), vrcp));
    store_codes<BITS>(mc, v, cm);
    store_codes<BITS>(vc, v, cv);
  }
  *ms = m_max;
  *vs = v_max;
}

template <int BITS, bool CVT = false>
void run(const llmpar_cpu::LowbitRange& r, const llmpar_cpu::LowbitHyper& h, const LowbitMap& mm,
         const LowbitMap& vm) {
  const Consts c(h);
  llmpar_cpu::for_each_block<BITS>(r, [&](float* p, const float* g, uint8_t* mc, float* ms, uint8_t* vc, float* vs,
                                          uint16_t* out, int k) {
    block<BITS, CVT>(c, mm, vm, p, g, mc, ms, vc, vs, out, k);
  });
}

}  // namespace
