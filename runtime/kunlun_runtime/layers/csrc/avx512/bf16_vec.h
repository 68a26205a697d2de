// AVX-512 helpers for BF16 tensors: 16 lanes in, FP32 arithmetic, 16 lanes out.
//
// Rounding to BF16 is round-to-nearest-even on the bit pattern with NaN kept quiet, exactly as
// c10::BFloat16(float) does, so vectorised code gives the same bits as the scalar conversions
// the eager reference makes (VCVTNEPS2BF16 would flush denormal inputs to zero; this does not).
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace kunlun_cpu::vec {

using bf16 = c10::BFloat16;

inline __mmask16 tail_mask(int64_t count) {  // the first min(max(count, 0), 16) lanes
  if (count <= 0) return 0;
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
}

// 32 16-bit elements (BF16 or INT16) from p: all of them with a plain load (FULL) or the lanes of
// `mask`. A masked load costs more on Intel cores: a loop of VDPBF16PS with its operands loaded
// masked ran at 0.7x the rate of plain loads on a Xeon, so whole vectors take the plain one.
template <bool FULL>
inline __m512i load_words32(const void* p, __mmask32 mask) {
  if constexpr (FULL) return _mm512_loadu_si512(p);
  return _mm512_maskz_loadu_epi16(mask, p);
}

inline __m512 load_bf16x16(const bf16* p, __mmask16 mask) {
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, reinterpret_cast<const void*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// The BF16 bit patterns of 16 floats, in the upper 16 bits of each 32-bit lane.
inline __m512i bf16_bits_rne(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7FC00000));
}

// float(bf16(v)) lane by lane.
inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_and_si512(bf16_bits_rne(v), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

inline __m512 negate(__m512 v) {  // flips the sign bit, zeros included (as -x does)
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
}

// Sixteen FP32 vectors in, one out: lane j holds combine() over the lanes of v[j], in one fixed
// tree (within 128-bit lanes, then across them).
template <typename Combine>
inline __m512 transpose_reduce16(const __m512 v[16], Combine combine) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [v2i 0+2, v2i+1 0+2, v2i 1+3, v2i+1 1+3]
    pairs[i] = combine(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lanes of v4i .. v4i+3 combined
    quads[i] = combine(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 2; ++i) {  // 128-bit lanes pairwise: [q2i L0+L1, q2i L2+L3, q2i+1 L0+L1, q2i+1 L2+L3]
    halves[i] = combine(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return combine(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                 _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Lane j: the sum of the lanes of v[j].
inline __m512 transpose_sum16(const __m512 v[16]) {
  return transpose_reduce16(v, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
}

// Lane j: the largest lane of v[j].
inline __m512 transpose_max16(const __m512 v[16]) {
  return transpose_reduce16(v, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); });
}

// The sum of v's lanes, halving: lane i + lane i + 8, then i + 4, i + 2, i + 1 (the order GCC's
// _mm512_reduce_add_ps takes, spelled out so that it cannot change with the compiler).
inline float sum_halving(__m512 v) {
  const __m256 eighths = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 fourths = _mm_add_ps(_mm256_castps256_ps128(eighths), _mm256_extractf128_ps(eighths, 1));
  const __m128 halves = _mm_add_ps(fourths, _mm_movehl_ps(fourths, fourths));
  return _mm_cvtss_f32(_mm_add_ss(halves, _mm_movehdup_ps(halves)));
}

// sum_halving of sixteen vectors at once: lane j of the result is sum_halving(v[j]), bit for bit
// (the same additions with the same operands, four vectors' halves to a register), in 46
// instructions where sixteen sum_halving calls take ~130 (at 8+ rows a linear kernel's block of
// 2 weight rows ends in 16 such sums, a large share of its time at K = 576).
inline __m512 sum16_halving(const __m512 v[16]) {
  __m512 eighths[8], fourths[4], halves[2];
  for (int i = 0; i < 8; ++i) {  // 256-bit halves of v2i | v2i+1: lane i + lane i + 8
    eighths[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lane L: the fourths of v4i+L
    fourths[i] = _mm512_add_ps(_mm512_shuffle_f32x4(eighths[2 * i], eighths[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(eighths[2 * i], eighths[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  for (int i = 0; i < 2; ++i) {  // 128-bit lane L: the halves of v8i+L, then of v8i+4+L
    halves[i] = _mm512_add_ps(_mm512_shuffle_ps(fourths[2 * i], fourths[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(fourths[2 * i], fourths[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // Lane 4L + e holds the sum of v[L + 4e]; the permutation puts v[j]'s in lane j.
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}

// 16 × 16 transpose of 32-bit elements: out[j] lane i = in[i] lane j.
inline void transpose16x16(const __m512i in[16], __m512i out[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {  // 32-bit interleave of row pairs
    a[2 * i] = _mm512_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4i + j], 128-bit lane L: element 4L + j of rows 4i .. 4i + 3
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // gather 128-bit lane L of b[j], b[4 + j], b[8 + j], b[12 + j]
    const __m512i even_lo = _mm512_shuffle_i32x4(b[j], b[4 + j], 0x88);
    const __m512i odd_lo = _mm512_shuffle_i32x4(b[j], b[4 + j], 0xDD);
    const __m512i even_hi = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x88);
    const __m512i odd_hi = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xDD);
    out[j] = _mm512_shuffle_i32x4(even_lo, even_hi, 0x88);
    out[8 + j] = _mm512_shuffle_i32x4(even_lo, even_hi, 0xDD);
    out[4 + j] = _mm512_shuffle_i32x4(odd_lo, odd_hi, 0x88);
    out[12 + j] = _mm512_shuffle_i32x4(odd_lo, odd_hi, 0xDD);
  }
}

// e^r for |r| <= ln2 / 2: the degree-6 Taylor polynomial (relative error below 2e-7).
inline __m512 exp_taylor6(__m512 r) {
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
}

// e^x for x <= 0 (softmax arguments): 2^n · p(r), r = x − n·ln2 in [−ln2/2, ln2/2], p the degree-6
// Taylor polynomial, clamped so that very negative x gives 0.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-88.0f), x);  // this operand order keeps a NaN x a NaN
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  return _mm512_scalef_ps(exp_taylor6(r), n);
}

inline void store_bf16x16(bf16* p, __m512 v, __mmask16 mask) {
  const __m256i packed = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits_rne(v), 16));
  _mm256_mask_storeu_epi16(reinterpret_cast<void*>(p), mask, packed);
}

}  // namespace kunlun_cpu::vec
