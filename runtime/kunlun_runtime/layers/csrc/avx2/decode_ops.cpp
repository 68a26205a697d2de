// Fused decode-step operators for x86 CPUs with AVX2 + FMA (FP32 tensors, FP32 arithmetic), all
// but attention (decode_attention.cpp).
//
// On these CPUs BF16 arithmetic is emulated, so the AVX2 tier keeps activations, cos/sin and the
// norm weights in FP32, and the reference is plain FP32 math (there are no BF16 roundings to
// reproduce). The KV cache is FP32 or BF16 (`--kv-cache-dtype`): rotary_kv_write stores K and V
// rounded to it, to nearest even (as torch's .to(torch.bfloat16)). As in the AVX-512 tier, each
// operator replaces a chain of ATen calls (RMSNorm is about eight, rotary a dozen) with one pass:
//
//   kunlun_cpu::rms_norm(x [T, H], w [H], eps)                  -> w * (x * 1/sqrt(mean(x²) + eps))
//   kunlun_cpu::add_rms_norm(x [T, H], delta [T, H], w [H], eps) -> (s = x + delta, rms_norm(s))
//   kunlun_cpu::silu_mul(gate_up [T, 2I])                       -> silu(gate) * up
//   kunlun_cpu::rotary_kv_write(q [T, H, D], k [T, KVH, D], v [T, KVH, D], cos [T, D], sin [T, D],
//                               k_blocks, v_blocks, slot_block_ids [T], slot_offsets [T])
//                                 -> (rotated q [T, H, D], rotated k [T, KVH, D])
//     rotary on q and k, k and v written (rounded to the cache's dtype) into the paged cache, for
//     any number of tokens (prefill chunks); attention is left to the caller. The slots must be
//     distinct (as a step's metadata makes them): tokens are written in parallel.
//
// Rotary and the residual add give the same bits as the eager PyTorch expressions (each product
// and sum rounded once, see rotate() in rotary_cache.h); the norm and SiLU differ from PyTorch only
// by summation order and our exp (relative error ~2e-7), i.e. by a few FP32 ulps.
//
// Only AVX2, FMA and F16C instructions are used (built with -mavx2 -mfma -mf16c): no AVX-512, even
// on CPUs that have it. Masked loads and stores (VMASKMOVPS) are kept out of inner loops: they are
// slow on AMD Zen 2 (stores especially), so they only handle row tails.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <immintrin.h>

#include "rotary_cache.h"
#include "vec_avx2.h"
#include "../kernels.h"
#include "../paged_cache.h"

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

using kunlun_cpu::avx2::check_f32;
using kunlun_cpu::avx2::hsum;
using kunlun_cpu::avx2::load_ps;
using kunlun_cpu::avx2::store_ps;
using kunlun_cpu::avx2::bf16;
template <typename T>
using PagedCache = kunlun_cpu::paged::PagedCache<T>;

// ---- RMSNorm -------------------------------------------------------------------------------

float inverse_rms(const float* x, int64_t H, float eps) {
  __m256 squares0 = _mm256_setzero_ps(), squares1 = _mm256_setzero_ps();  // two chains: FMA latency
  int64_t i = 0;
  for (; i + 16 <= H; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    squares0 = _mm256_fmadd_ps(a, a, squares0);
    squares1 = _mm256_fmadd_ps(b, b, squares1);
  }
  for (; i < H; i += 8) {
    const __m256 a = load_ps(x + i, H - i);
    squares0 = _mm256_fmadd_ps(a, a, squares0);
  }
  // As HF: variance + eps in FP32, then the reciprocal of its square root (torch.rsqrt).
  return 1.0f / std::sqrt(hsum(_mm256_add_ps(squares0, squares1)) / static_cast<float>(H) + eps);
}

void normalise_row(const float* x, const float* w, float* out, int64_t H, float inverse) {
  const __m256 inv = _mm256_set1_ps(inverse);
  for (int64_t i = 0; i < H; i += 8) {  // w * (x * inv), HF's order of the two products
    const int64_t count = H - i;
    store_ps(out + i, _mm256_mul_ps(load_ps(w + i, count), _mm256_mul_ps(load_ps(x + i, count), inv)), count);
  }
}

// ---- SiLU ----------------------------------------------------------------------------------

// silu(g) · up for 8 lanes: g · sigmoid(g), sigmoid from e = e^-|g| <= 1 (never overflows):
// 1 / (1 + e) for g >= 0, e / (1 + e) for g < 0. e is 2^n · p(r) with p a degree-7 Taylor
// polynomial on |r| <= ln2/2 (relative error ~5e-9) and 2^n applied in two halves, the second
// last of all, so that for g < -87 (e below FP32's normal range) the product g · e is rounded once,
// where it lands, instead of losing e's bits to a subnormal first; g < -110 gives -0 (|silu(g)| is
// below half the smallest subnormal there), as does -inf. NaN stays NaN. Accurate to a few 1e-7
// relative for every g whose SiLU is a normal float (torch's x / (1 + exp(-x)) turns g < -88.7
// into -0 where the true value is still normal down to -91.5).
inline __m256 silu(__m256 g) {
  const __m256 x = _mm256_max_ps(_mm256_set1_ps(-110.0f), _mm256_or_ps(g, _mm256_set1_ps(-0.0f)));  // -|g|; NaN kept
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // [-159, 0]
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // n = n1 + n2 with n1, n2 in [-80, 0]: both 2^n1 and 2^n2 are normal floats.
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1);
  const __m256i n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 scale1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 scale2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  const __m256 partial = _mm256_mul_ps(p, scale1);  // e · 2^-n2, normal
  const __m256 denominator = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_mul_ps(partial, scale2));  // 1 + e in [1, 2]
  // 1 / (1 + e): reciprocal estimate (12 bits) and one Newton step (~1.5e-7 relative), several
  // times cheaper than VDIVPS, which would dominate a prefill-sized call.
  __m256 reciprocal = _mm256_rcp_ps(denominator);
  reciprocal = _mm256_mul_ps(reciprocal, _mm256_fnmadd_ps(denominator, reciprocal, _mm256_set1_ps(2.0f)));
  const __m256 ratio = _mm256_mul_ps(g, reciprocal);
  const __m256 negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 result = _mm256_blendv_ps(ratio, _mm256_mul_ps(_mm256_mul_ps(ratio, partial), scale2), negative);
  const __m256 vanishing = _mm256_cmp_ps(g, _mm256_set1_ps(-110.0f), _CMP_LT_OQ);
  return _mm256_blendv_ps(result, _mm256_set1_ps(-0.0f), vanishing);
}

}  // namespace

namespace kunlun_cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_f32(x, "x");
  check_f32(w, "w");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(1),
              "rms_norm: x must be contiguous [T, H] and w [H]");
  const int64_t T = x.size(0), H = x.size(1);
  at::Tensor out = at::empty_like(x);
  const float* xp = x.const_data_ptr<float>();
  const float* wp = w.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      normalise_row(xp + t * H, wp, op + t * H, H, inverse_rms(xp + t * H, H, static_cast<float>(eps)));
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w,
                                                double eps) {
  check_f32(x, "x");
  check_f32(delta, "delta");
  check_f32(w, "w");
  TORCH_CHECK(x.dim() == 2 && x.sizes() == delta.sizes() && x.is_contiguous() && delta.is_contiguous() &&
                  w.is_contiguous() && w.numel() == x.size(1),
              "add_rms_norm: x and delta must be contiguous [T, H] and w [H]");
  const int64_t T = x.size(0), H = x.size(1);
  at::Tensor sum = at::empty_like(x);
  at::Tensor out = at::empty_like(x);
  const float* xp = x.const_data_ptr<float>();
  const float* dp = delta.const_data_ptr<float>();
  const float* wp = w.const_data_ptr<float>();
  float* sp = sum.mutable_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* s = sp + t * H;
      for (int64_t i = 0; i < H; i += 8) {  // s = x + delta, as the eager add (one rounding)
        const int64_t count = H - i;
        store_ps(s + i, _mm256_add_ps(load_ps(xp + t * H + i, count), load_ps(dp + t * H + i, count)), count);
      }
      normalise_row(s, wp, op + t * H, H, inverse_rms(s, H, static_cast<float>(eps)));
    }
  });
  return {sum, out};
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_f32(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be contiguous [T, 2 * I]");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor out = at::empty({T, I}, gate_up.options());
  const float* gp = gate_up.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* gate = gp + t * 2 * I;
      const float* up = gate + I;
      float* o = op + t * I;
      int64_t i = 0;
      for (; i + 8 <= I; i += 8) {
        _mm256_storeu_ps(o + i, _mm256_mul_ps(silu(_mm256_loadu_ps(gate + i)), _mm256_loadu_ps(up + i)));
      }
      if (i < I) store_ps(o + i, _mm256_mul_ps(silu(load_ps(gate + i, I - i)), load_ps(up + i, I - i)), I - i);
    }
  });
  return out;
}

namespace {

// rotary_kv_write into a cache of C (float or BF16), its inputs checked.
template <typename C>
std::tuple<at::Tensor, at::Tensor> rotary_kv_write_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                        const at::Tensor& cos, const at::Tensor& sin,
                                                        const at::Tensor& k_blocks, const at::Tensor& v_blocks,
                                                        const at::Tensor& slot_block_ids,
                                                        const at::Tensor& slot_offsets) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  const PagedCache<C> keys = paged::cache<C>(k_blocks), values = paged::cache<C>(v_blocks);
  const int64_t* blocks = slot_block_ids.const_data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.const_data_ptr<int64_t>();
  at::Tensor q_out = at::empty({T, H, D}, q.options());
  at::Tensor k_out = at::empty({T, KVH, D}, k.options());
  const float* cp = cos.const_data_ptr<float>();
  const float* sp = sin.const_data_ptr<float>();
  float* qo = q_out.mutable_data_ptr<float>();
  float* ko = k_out.mutable_data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(D);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        avx2::rotate(q.const_data_ptr<float>() + t * q.stride(0) + h * q.stride(1), cp + t * D, sp + t * D, D,
               qo + (t * H + h) * D, scratch.data());
      }
      for (int64_t h = 0; h < KVH; ++h) {
        float* rotated = ko + (t * KVH + h) * D;
        avx2::rotate(k.const_data_ptr<float>() + t * k.stride(0) + h * k.stride(1), cp + t * D, sp + t * D, D, rotated,
               scratch.data());
        avx2::store_row(rotated, keys.at(blocks[t], offsets[t], h), D);
        avx2::store_row(v.const_data_ptr<float>() + t * v.stride(0) + h * v.stride(1),
                        values.at(blocks[t], offsets[t], h), D);
      }
    }
  });
  return {q_out, k_out};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rotary_kv_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   const at::Tensor& cos, const at::Tensor& sin,
                                                   const at::Tensor& k_blocks, const at::Tensor& v_blocks,
                                                   const at::Tensor& slot_block_ids, const at::Tensor& slot_offsets) {
  avx2::check_rotary_inputs(q, k, v, cos, sin, k_blocks, v_blocks);
  paged::check_slots(slot_block_ids, slot_offsets, q.size(0), k_blocks);
  const auto into =
      k_blocks.scalar_type() == at::kBFloat16 ? &rotary_kv_write_into<bf16> : &rotary_kv_write_into<float>;
  return into(q, k, v, cos, sin, k_blocks, v_blocks, slot_block_ids, slot_offsets);
}

}  // namespace kunlun_cpu
