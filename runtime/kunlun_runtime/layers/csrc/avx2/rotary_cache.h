// Rotary and the paged-cache row writes of the AVX2 tier, shared by decode attention (a decode
// row's new K and V go into the cache before it attends, decode_attention.cpp) and rotary_kv_write
// (a prefill chunk's, decode_ops.cpp): both rotate as HF's eager expression does, bit for bit, and
// store rows in the cache's dtype. Header-only: each source compiles it with the tier's flags.
#pragma once

#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include "vec_avx2.h"
#include "../paged_cache.h"

#include <algorithm>
#include <cstdint>
#include <utility>

namespace kunlun_cpu::avx2 {

inline void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32 (the AVX2 kernels compute in FP32), got ",
              t.scalar_type());
}

// q, k, v, cos and sin FP32; the caches both FP32 or both BF16 (the KV cache dtype).
inline void check_rotary_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                                const at::Tensor& sin, const at::Tensor& k_blocks, const at::Tensor& v_blocks) {
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&cos, "cos"}, {&sin, "sin"}}) {
    check_f32(*t, name);
  }
  for (const auto& [t, name] : {std::pair{&k_blocks, "k_blocks"}, {&v_blocks, "v_blocks"}}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16, name,
                " must be float32 or bfloat16 (the AVX2 kernels' KV cache dtypes), got ", t->scalar_type());
  }
  TORCH_CHECK(k_blocks.scalar_type() == v_blocks.scalar_type(), "k_blocks (", k_blocks.scalar_type(),
              ") and v_blocks (", v_blocks.scalar_type(), ") must have one dtype");
  kunlun_cpu::paged::check_rotary_shapes(q, k, v, cos, sin, k_blocks, v_blocks, /*min_head_dim=*/1);
}

// A row of D FP32 values into a cache row: copied, or rounded to BF16.
inline void store_row(const float* src, float* dst, int64_t D) { std::copy(src, src + D, dst); }
inline void store_row(const float* src, bf16* dst, int64_t D) { kunlun_cpu::avx2::narrow_bf16(src, dst, D); }

// The value as computed so far, opaque to the optimiser. GCC contracts a product followed by a
// sum into one FMA (-ffp-contract=fast is its default, and it applies to intrinsics too), which
// rounds once where eager PyTorch rounds twice; passing the products through here keeps them
// rounded, so rotary gives apply_rotary's bits.
inline __m256 rounded(__m256 v) {
  __asm__("" : "+x"(v));
  return v;
}

inline __m256 negate(__m256 v) { return _mm256_xor_ps(v, _mm256_set1_ps(-0.0f)); }  // as -x, zeros included

// HF's rotate-half rotary in FP32: x·cos + rotate_half(x)·sin, rotate_half(x) = [-x2, x1], each
// product rounded before the sum as the eager expression rounds it (see rounded()). `scratch`
// (D floats) holds rotate_half(x) where a half is not a whole number of 8-lane vectors.
inline void rotate(const float* x, const float* cos, const float* sin, int64_t D, float* out, float* scratch) {
  const int64_t half = D / 2;
  if (half % 8 == 0) {  // each vector lies in one half
    for (int64_t i = 0; i < D; i += 8) {
      const __m256 rotated = i < half ? negate(_mm256_loadu_ps(x + i + half)) : _mm256_loadu_ps(x + i - half);
      const __m256 a = rounded(_mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(cos + i)));
      const __m256 b = rounded(_mm256_mul_ps(rotated, _mm256_loadu_ps(sin + i)));
      _mm256_storeu_ps(out + i, _mm256_add_ps(a, b));
    }
    return;
  }
  for (int64_t i = 0; i < half; ++i) scratch[i] = -x[i + half];
  for (int64_t i = half; i < D; ++i) scratch[i] = x[i - half];
  for (int64_t i = 0; i < D; i += 8) {
    const int64_t count = D - i;
    const __m256 a = rounded(_mm256_mul_ps(load_ps(x + i, count), load_ps(cos + i, count)));
    const __m256 b = rounded(_mm256_mul_ps(load_ps(scratch + i, count), load_ps(sin + i, count)));
    store_ps(out + i, _mm256_add_ps(a, b), count);
  }
}

}  // namespace kunlun_cpu::avx2
