// Rotary for the AVX-512 tier, shared by decode attention (a decode row's new q and k,
// decode_attention.cpp) and rotary_kv_write (a prefill chunk's, decode_ops.cpp), with HF's BF16
// roundings, and the check both make of their BF16 inputs. Header-only: each source compiles it
// with the tier's flags.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include "bf16_vec.h"

#include <cstdint>

namespace kunlun_cpu::avx512 {

using bf16 = c10::BFloat16;

inline float round_bf16(float value) { return static_cast<float>(bf16(value)); }

inline void check_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16");
}

// HF's rotate-half rotary with its roundings: bf16(bf16(x·cos) + bf16(rotate_half(x)·sin)).
inline void rotate(const bf16* x, const bf16* cos, const bf16* sin, int64_t D, float* out) {
  const int64_t half = D / 2;
  if (half % 16 == 0) {  // each 16-lane chunk lies in one half
    for (int64_t i = 0; i < D; i += 16) {
      const __m512 rotated = i < half ? vec::negate(vec::load_bf16x16(x + i + half, 0xFFFF))
                                      : vec::load_bf16x16(x + i - half, 0xFFFF);
      const __m512 a =
          vec::round_bf16(_mm512_mul_ps(vec::load_bf16x16(x + i, 0xFFFF), vec::load_bf16x16(cos + i, 0xFFFF)));
      const __m512 b = vec::round_bf16(_mm512_mul_ps(rotated, vec::load_bf16x16(sin + i, 0xFFFF)));
      _mm512_storeu_ps(out + i, vec::round_bf16(_mm512_add_ps(a, b)));
    }
    return;
  }
  for (int64_t i = 0; i < D; ++i) {
    const float rotated = i < half ? -static_cast<float>(x[i + half]) : static_cast<float>(x[i - half]);
    const float a = round_bf16(static_cast<float>(x[i]) * static_cast<float>(cos[i]));
    const float b = round_bf16(rotated * static_cast<float>(sin[i]));
    out[i] = round_bf16(a + b);
  }
}

}  // namespace kunlun_cpu::avx512
