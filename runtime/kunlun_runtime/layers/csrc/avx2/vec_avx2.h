// AVX2 + FMA helpers for the AVX2 tier: 8 FP32 lanes; BF16 weights and KV rows widened in
// registers, KV rows narrowed to BF16 on the way into a BF16 cache.
//
// BF16 → FP32 is exact (the BF16 bits become the upper half of the FP32 bits), so a kernel that
// widens in registers computes what an FP32 matmul over the widened weight computes, up to the
// order of the additions. FP32 → BF16 rounds to nearest even, as torch's .to(torch.bfloat16).
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace kunlun_cpu::avx2 {

using bf16 = c10::BFloat16;

// Lanes [0, count) set (all-ones), the rest clear, for _mm256_maskload_ps / _mm256_maskstore_ps.
inline __m256i tail_mask(int64_t count) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int32_t n = count <= 0 ? 0 : (count >= 8 ? 8 : static_cast<int32_t>(count));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes);
}

inline __m256 load_ps(const float* p, int64_t count) {  // count < 8: masked, the rest zero
  return count >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, tail_mask(count));
}

inline void store_ps(float* p, __m256 v, int64_t count) {
  if (count >= 8) {
    _mm256_storeu_ps(p, v);
  } else {
    _mm256_maskstore_ps(p, tail_mask(count), v);
  }
}

// Eight BF16 values (16 bytes) widened to FP32.
inline __m256 widen_bf16x8(const bf16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline __m256 widen_bf16x8_tail(const bf16* p, int64_t count) {  // count < 8, the rest zero
  alignas(16) uint16_t buffer[8] = {};
  for (int64_t i = 0; i < count; ++i) buffer[i] = reinterpret_cast<const uint16_t*>(p)[i];
  return widen_bf16x8(reinterpret_cast<const bf16*>(buffer));
}

// Eight BF16 values of which only the leading lanes set in `lanes` (an FP32 lane mask of an even
// number of lanes, as tail_mask makes it) are read: whole 32-bit pairs by a masked load, so nothing
// past them is touched (a cache row may end its allocation); the other lanes are zero.
inline __m256 widen_bf16x8_masked(const bf16* p, __m256i lanes) {
  const __m128i pairs = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(lanes, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6)));
  const __m128i raw = _mm_maskload_epi32(reinterpret_cast<const int*>(p), pairs);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// Eight FP32 values rounded to BF16, to nearest even (ties to the even BF16); a NaN becomes the
// quiet NaN 0x7FC0 (as c10::BFloat16 makes it), ±inf and values rounding past the largest BF16
// become ±inf, as torch's conversion gives them.
inline __m128i narrow_bf16x8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  // Each 32-bit lane holds 0..0xFFFF, so the unsigned-saturating pack keeps it; it packs within each
  // 128-bit half, and the permute joins the halves' low quadwords.
  const __m256i packed = _mm256_packus_epi32(rounded, rounded);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

// `count` FP32 values rounded to BF16 (narrow_bf16x8's rounding, the tail through c10's own).
inline void narrow_bf16(const float* src, bf16* dst, int64_t count) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), narrow_bf16x8(_mm256_loadu_ps(src + i)));
  }
  for (; i < count; ++i) dst[i] = bf16(src[i]);
}

inline float hsum(__m256 v) {
  const __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 sum2 = _mm_add_ps(sum4, _mm_movehl_ps(sum4, sum4));
  return _mm_cvtss_f32(_mm_add_ss(sum2, _mm_movehdup_ps(sum2)));
}

inline float hmax(__m256 v) {
  const __m128 max4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 max2 = _mm_max_ps(max4, _mm_movehl_ps(max4, max4));
  return _mm_cvtss_f32(_mm_max_ss(max2, _mm_movehdup_ps(max2)));
}

// e^x for x <= 0 (softmax arguments): 2^n · p(r), r = x − n·ln2 in [−ln2/2, ln2/2], a degree-6
// Taylor polynomial (relative error below 2e-7); x below -87 gives 0, a NaN stays NaN.
inline __m256 exp_nonpositive(__m256 input) {
  const __m256 nan = _mm256_cmp_ps(input, input, _CMP_UNORD_Q);
  const __m256 underflow = _mm256_cmp_ps(input, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  const __m256 x = _mm256_max_ps(input, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // 2^n built in the exponent field (n in [-126, 0] here, so no overflow).
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
  result = _mm256_andnot_ps(underflow, result);
  return _mm256_blendv_ps(result, input, nan);  // a NaN argument stays NaN
}

}  // namespace kunlun_cpu::avx2
