// AVX2 + FMA + F16C build of the low-bit AdamW kernel (adam_lowbit.h), 8 floats per vector, compiled for that ISA by a
// target pragma (adam.h): adam_lowbit_ops.cpp calls it where __builtin_cpu_supports finds avx2, fma and f16c but not
// AVX-512 (AMD Zen 2 / 3, Intel before Skylake-SP), or where LLMPAR_CPU_ISA=avx2 caps a wider CPU. x86-64 only.
//
// The shape of adam_lowbit_avx512.h on 8 lanes: one block at a time, dequantize, update, write p (and its bfloat16
// copy), keep the block's new m / v in L1 with their absmax; then quantize them. AVX2 has no mask registers: a
// compare's all-ones lanes are subtracted from integer lanes (+1 where true) or and-ed away. Dequantize: 4 bits, the
// 16 entries by two vpermps blended by bit 3 of the code; 8 bits, one gather from map.q. Quantize: 8 bits, one gather
// from the bucket table (adam_lowbit.h) when the map is bucketed, else the binary search; 4 bits, the search. The
// search's level tables: <= 8 entries by one vpermps (level 0: a broadcast), 16 by two blended by bit 3, 32 - 128 by
// a gather. Codes are packed 32 at a time. Same IEEE operations as adam_lowbit_scalar.cpp in the same order, with no
// contraction (FMA belongs to the target ISA level, never to the math: -ffp-contract=off), so the same bits, NaN grads
// included: the absmax skips a NaN as std::max does. No software prefetch: 0-4 blocks ahead measured within noise (+-4 % on 10M
// params, one thread): the hardware prefetchers follow the streams. A block cut short by the tensor's end runs on a
// padded copy (llmpar_cpu::for_each_block), its absmax masked to the valid lanes.
#include <algorithm>
#include <cstring>

#include "adam_lowbit.h"

#if defined(__x86_64__)
LLMPAR_TARGET_BEGIN("avx2,fma,f16c")

namespace {

using llmpar_cpu::LowbitMap;

inline __m256i ones_where(__m256 mask) { return _mm256_castps_si256(mask); }
inline __m256i set1i(int x) { return _mm256_set1_epi32(x); }

// One map's lookups held in registers for a whole call: its 16 entries (4 bits) and the search's level tables
// 0 - 3 (level 0 broadcast) and 4 (two halves; 8 bits). Levels 5 - 7 are gathered from the map.
struct MapRegs {
  __m256 q[2];
  __m256 level[6];
  bool bucketed;
  MapRegs(const LowbitMap& map, int bits) : bucketed(bits == 8 && map.bucketed != 0) {
    q[0] = _mm256_loadu_ps(map.q);
    q[1] = _mm256_loadu_ps(map.q + 8);
    level[0] = _mm256_set1_ps(map.level[0][0]);
    for (int l = 1; l < 4; ++l) level[l] = _mm256_loadu_ps(map.level[l]);
    level[4] = _mm256_loadu_ps(map.level[4]);
    level[5] = _mm256_loadu_ps(map.level[4] + 8);
  }
};

// 16 floats t0 (entries 0-7), t1 (8-15) looked up at j (int lanes < 16): vpermps reads j's low 3 bits, bit 3 blends
inline __m256 lookup16(__m256 t0, __m256 t1, __m256i j) {
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t0, j), _mm256_permutevar8x32_ps(t1, j),
                          _mm256_castsi256_ps(_mm256_slli_epi32(j, 28)));
}

// the number of midpoints < y: j = the code's top L bits, one bit more per level (NaN: 0, as the scalar search)
template <int BITS, int L = 0>
inline __m256i search(const LowbitMap& map, const MapRegs& r, __m256 y, __m256i j) {
  if constexpr (L == BITS) {
    return j;
  } else {
    __m256 t;
    if constexpr (L == 0) {
      t = r.level[0];
    } else if constexpr (L <= 3) {
      t = _mm256_permutevar8x32_ps(r.level[L], j);
    } else if constexpr (L == 4) {
      t = lookup16(r.level[4], r.level[5], j);
    } else {
      t = _mm256_i32gather_ps(map.level[L], j, 4);
    }
    const __m256i lt = ones_where(_mm256_cmp_ps(t, y, _CMP_LT_OQ));
    j = _mm256_sub_epi32(_mm256_add_epi32(j, j), lt);  // 2j + 1 where level < y
    return search<BITS, L + 1>(map, r, y, j);
  }
}

// 8 bits, a bucketed map: the code of y by one gather from the bucket table (adam_lowbit.h), as bucket_code of
// adam_lowbit_avx512.h
inline __m256i bucket_code(const LowbitMap& map, __m256 y) {
  const __m256i u = _mm256_castps_si256(y);
  const __m256i neg = _mm256_srai_epi32(u, 31);  // all ones where y < 0
  const __m256i mag = _mm256_and_si256(u, set1i(0x7FFFFFFF));
  const __m256i low = _mm256_and_si256(_mm256_xor_si256(mag, neg), set1i(0xFFFF));
  __m256i b = _mm256_sub_epi32(_mm256_srli_epi32(mag, llmpar_cpu::kBucketShift),
                               set1i(static_cast<int>(llmpar_cpu::kBucketBase)));
  b = _mm256_min_epi32(_mm256_max_epi32(b, _mm256_setzero_si256()), set1i(llmpar_cpu::kBucketCount - 1));
  b = _mm256_add_epi32(b, _mm256_and_si256(neg, set1i(llmpar_cpu::kBucketCount)));
  const __m256i e = _mm256_i32gather_epi32(reinterpret_cast<const int*>(&map.bucket[0][0]), b, 4);
  const __m256i up = _mm256_cmpgt_epi32(low, _mm256_and_si256(e, set1i(0xFFFF)));  // low bits above the midpoint's
  const __m256i code = _mm256_sub_epi32(_mm256_srli_epi32(e, 16), up);
  return _mm256_andnot_si256(ones_where(_mm256_cmp_ps(y, y, _CMP_UNORD_Q)), code);  // NaN: 0
}

template <int BITS>
inline __m256i quantize(const LowbitMap& map, const MapRegs& r, __m256 y) {
  if constexpr (BITS == 8) {
    if (r.bucketed) return bucket_code(map, y);
  }
  return search<BITS>(map, r, y, _mm256_setzero_si256());
}

template <int BITS>
inline __m256i load_codes(const uint8_t* codes, int v) {  // 8 codes of vector v of the block, as int lanes
  if constexpr (BITS == 8) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * v)));
  } else {
    int32_t word;
    std::memcpy(&word, codes + 4 * v, sizeof(word));
    const __m128i bytes = _mm_cvtsi32_si128(word);
    const __m256i twice = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes));  // byte i in lanes 2i, 2i + 1
    return _mm256_and_si256(_mm256_srlv_epi32(twice, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4)), set1i(0xF));
  }
}

// the codes of vectors v0 .. v0 + 3 (int lanes < 2^BITS), 32 codes, stored in order
template <int BITS>
inline void store_codes4(uint8_t* codes, int v0, const __m256i* c) {
  const __m256i ab = _mm256_packus_epi32(c[0], c[1]);  // u16: a0-3 b0-3 | a4-7 b4-7
  const __m256i cd = _mm256_packus_epi32(c[2], c[3]);
  const __m256i bytes = _mm256_packus_epi16(ab, cd);  // a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7
  const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if constexpr (BITS == 8) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 8 * v0), ordered);
  } else {  // u16 lane i = c[2i] | c[2i + 1] << 8  ->  c[2i] | c[2i + 1] << 4
    const __m256i lo = _mm256_and_si256(ordered, _mm256_set1_epi16(0x000F));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(ordered, 4), _mm256_set1_epi16(0x00F0));
    const __m256i nib = _mm256_or_si256(lo, hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 4 * v0),
                     _mm_packus_epi16(_mm256_castsi256_si128(nib), _mm256_extracti128_si256(nib, 1)));
  }
}

template <int BITS>
inline __m256 dequant(const LowbitMap& map, const MapRegs& r, __m256i code) {
  if constexpr (BITS == 8) {
    return _mm256_i32gather_ps(map.q, code, 4);
  } else {
    return lookup16(r.q[0], r.q[1], code);
  }
}

inline void store_bf16(uint16_t* p, __m256 x) {  // round to nearest even on the bits; NaN: quiet
  const __m256i u = _mm256_castps_si256(x);
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(hi, set1i(1)), set1i(0x7FFF));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i nan = ones_where(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i r = _mm256_blendv_epi8(rounded, _mm256_or_si256(hi, set1i(0x40)), nan);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

inline float hmax(__m256 x) {  // lanes are never NaN
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  a = _mm_max_ps(a, _mm_shuffle_ps(a, a, 1));
  return _mm_cvtss_f32(a);
}

struct Consts {
  __m256 decay, b1, w1, b2, w2, step, bc2, eps, gscale;
  explicit Consts(const llmpar_cpu::LowbitHyper& h)
      : decay(_mm256_set1_ps(h.decay)), b1(_mm256_set1_ps(h.beta1)), w1(_mm256_set1_ps(h.one_minus_beta1)),
        b2(_mm256_set1_ps(h.beta2)), w2(_mm256_set1_ps(h.one_minus_beta2)), step(_mm256_set1_ps(h.step_size)),
        bc2(_mm256_set1_ps(h.bc2_rsqrt)), eps(_mm256_set1_ps(h.eps)), gscale(_mm256_set1_ps(h.gscale)) {}
};

// the codes of one moment of the block from its new values x (absmax s), written at codes
template <int BITS>
inline void quantize_block(const LowbitMap& map, const MapRegs& r, const float* x, float s, uint8_t* codes) {
  constexpr int B = llmpar_cpu::lowbit_block(BITS);
  if (s == 0.0f) {  // every code is the zero code
    std::memset(codes, BITS == 8 ? map.zero_code : map.zero_code * 17, B * BITS / 8);
    return;
  }
  const __m256 rcp = _mm256_set1_ps(1.0f / s);
  for (int v0 = 0; v0 < B / 8; v0 += 4) {
    __m256i c[4];
    for (int u = 0; u < 4; ++u) c[u] = quantize<BITS>(map, r, _mm256_mul_ps(_mm256_load_ps(x + 8 * (v0 + u)), rcp));
    store_codes4<BITS>(codes, v0, c);
  }
}

// One block of B elements at p / g / mc / vc / out (PARTIAL: k of them valid, the rest padding); scales in *ms / *vs.
template <int BITS, bool PARTIAL>
inline void block(const Consts& c, const LowbitMap& mm, const MapRegs& mr, const LowbitMap& vm, const MapRegs& vr,
                  float* p, const float* g, uint8_t* mc, float* ms, uint8_t* vc, float* vs, uint16_t* out, int k) {
  constexpr int B = llmpar_cpu::lowbit_block(BITS);
  alignas(32) float mb[B];
  alignas(32) float vb[B];
  const __m256 msv = _mm256_set1_ps(*ms), vsv = _mm256_set1_ps(*vs);
  const __m256 absmask = _mm256_castsi256_ps(set1i(0x7FFFFFFF));
  __m256 mabs = _mm256_setzero_ps(), vabs = _mm256_setzero_ps();
  for (int v = 0; v < B / 8; ++v) {
    const __m256 gv = _mm256_mul_ps(_mm256_loadu_ps(g + 8 * v), c.gscale);
    __m256 m = _mm256_mul_ps(dequant<BITS>(mm, mr, load_codes<BITS>(mc, v)), msv);
    __m256 s = _mm256_mul_ps(dequant<BITS>(vm, vr, load_codes<BITS>(vc, v)), vsv);
    __m256 pv = _mm256_mul_ps(_mm256_loadu_ps(p + 8 * v), c.decay);
    m = _mm256_add_ps(_mm256_mul_ps(c.b1, m), _mm256_mul_ps(c.w1, gv));
    s = _mm256_add_ps(_mm256_mul_ps(c.b2, s), _mm256_mul_ps(c.w2, _mm256_mul_ps(gv, gv)));
    const __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(s), c.bc2), c.eps);
    pv = _mm256_sub_ps(pv, _mm256_mul_ps(c.step, _mm256_div_ps(m, denom)));
    _mm256_storeu_ps(p + 8 * v, pv);
    if (out != nullptr) store_bf16(out + 8 * v, pv);
    _mm256_store_ps(mb + 8 * v, m);
    _mm256_store_ps(vb + 8 * v, s);
    __m256 am = _mm256_and_ps(m, absmask), av = _mm256_and_ps(s, absmask);
    if constexpr (PARTIAL) {  // padding lanes: +0, which leaves the absmax as it is
      const __m256 live = _mm256_castsi256_ps(
          _mm256_cmpgt_epi32(set1i(k - 8 * v), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
      am = _mm256_and_ps(am, live);
      av = _mm256_and_ps(av, live);
    }
    mabs = _mm256_max_ps(am, mabs);  // a NaN |m| keeps mabs (maxps returns its second operand), as std::max
    vabs = _mm256_max_ps(av, vabs);
  }
  const float m_max = hmax(mabs), v_max = hmax(vabs);
  quantize_block<BITS>(mm, mr, mb, m_max, mc);
  quantize_block<BITS>(vm, vr, vb, v_max, vc);
  *ms = m_max;
  *vs = v_max;
}

template <int BITS>
void run(const llmpar_cpu::LowbitRange& r, const llmpar_cpu::LowbitHyper& h, const LowbitMap& mm,
         const LowbitMap& vm) {
  const Consts c(h);
  const MapRegs mr(mm, BITS), vr(vm, BITS);
  constexpr int B = llmpar_cpu::lowbit_block(BITS);
  llmpar_cpu::for_each_block<BITS>(r, [&](float* p, const float* g, uint8_t* mc, float* ms, uint8_t* vc, float* vs,
                                          uint16_t* out, int k) {
    if (k == B) {
      block<BITS, false>(c, mm, mr, vm, vr, p, g, mc, ms, vc, vs, out, B);
    } else {
      block<BITS, true>(c, mm, mr, vm, vr, p, g, mc, ms, vc, vs, out, k);
    }
  });
}

}  // namespace

void llmpar_cpu::adam_lowbit_avx2(const LowbitRange& r, const LowbitHyper& h, const LowbitMap& m, const LowbitMap& v,
                                  int bits) {
  if (bits == 8) {
    run<8>(r, h, m, v);
  } else {
    run<4>(r, h, m, v);
  }
}

LLMPAR_TARGET_END()
#endif  // __x86_64__
