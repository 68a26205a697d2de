// Fused decode-step operators for x86 CPUs with AVX-512 (BF16 tensors, FP32 arithmetic), all but
// attention (decode_attention.cpp).
//
// A decode step of a small model is dominated by per-operator overhead: RMSNorm alone is about
// eight ATen calls, rotary embedding a dozen, and paged attention a scatter, two gathers and an
// SDPA call, per layer. These operators do each of those in one call, with the reference's
// roundings (every BF16 intermediate that HF rounds is rounded here too):
//
//   kunlun_cpu::rms_norm(x [T, H], w [H], eps)                  -> bf16(w * bf16(x * rsqrt(mean(x²) + eps)))
//   kunlun_cpu::add_rms_norm(x [T, H], delta [T, H], w [H], eps) -> (s = bf16(x + delta), rms_norm(s))
//   kunlun_cpu::silu_mul(gate_up [T, 2I])                       -> bf16(bf16(silu(gate)) * up)
//   kunlun_cpu::rotary_kv_write(q [T, H, D], k [T, KVH, D], v [T, KVH, D], cos [T, D], sin [T, D],
//                               k_blocks, v_blocks, slot_block_ids [T], slot_offsets [T])
//                                 -> (rotated q [T, H, D], rotated k [T, KVH, D])
//     rotary on q and k and the K/V write into the paged cache for any number of tokens (prefill
//     chunks), in one pass instead of a dozen ATen calls and two scatters per layer; attention is
//     left to the caller. The slots must be distinct (as a step's metadata makes them): tokens
//     are written in parallel.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include "bf16_vec.h"
#include "rotary_cache.h"
#include "../kernels.h"
#include "../paged_cache.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

using bf16 = c10::BFloat16;
using kunlun_cpu::avx512::check_bf16;
using kunlun_cpu::avx512::rotate;
using kunlun_cpu::vec::load_bf16x16;
using kunlun_cpu::vec::store_bf16x16;
using kunlun_cpu::vec::exp_nonpositive;
using kunlun_cpu::vec::tail_mask;
using PagedCache = kunlun_cpu::paged::PagedCache<bf16>;

// ---- RMSNorm -------------------------------------------------------------------------------

void rms_norm_row(const float* x, const bf16* w, bf16* out, int64_t H, float eps) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < H; i += 16) {
    const __m512 v = _mm512_maskz_loadu_ps(tail_mask(H - i), x + i);
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const __m512 inv =
      _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(H) + eps));
  for (int64_t i = 0; i < H; i += 16) {  // bf16(w * bf16(x * inv))
    const __mmask16 mask = tail_mask(H - i);
    const __m512 normed = kunlun_cpu::vec::round_bf16(_mm512_mul_ps(_mm512_maskz_loadu_ps(mask, x + i), inv));
    store_bf16x16(out + i, _mm512_mul_ps(load_bf16x16(w + i, mask), normed), mask);
  }
}

}  // namespace

namespace kunlun_cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_bf16(x, "x");
  check_bf16(w, "w");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(1),
              "rms_norm: x must be contiguous [T, H] and w [H]");
  const int64_t T = x.size(0), H = x.size(1);
  at::Tensor out = at::empty_like(x);
  const bf16* xp = x.const_data_ptr<bf16>();
  bf16* op = out.mutable_data_ptr<bf16>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(H);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < H; i += 16) {
        const __mmask16 mask = tail_mask(H - i);
        _mm512_mask_storeu_ps(row.data() + i, mask, load_bf16x16(xp + t * H + i, mask));
      }
      rms_norm_row(row.data(), w.const_data_ptr<bf16>(), op + t * H, H, static_cast<float>(eps));
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w,
                                                double eps) {
  check_bf16(x, "x");
  check_bf16(delta, "delta");
  check_bf16(w, "w");
  TORCH_CHECK(x.dim() == 2 && x.sizes() == delta.sizes() && x.is_contiguous() && delta.is_contiguous() &&
                  w.is_contiguous() && w.numel() == x.size(1),
              "add_rms_norm: x and delta must be contiguous [T, H] and w [H]");
  const int64_t T = x.size(0), H = x.size(1);
  at::Tensor sum = at::empty_like(x);
  at::Tensor out = at::empty_like(x);
  const bf16* xp = x.const_data_ptr<bf16>();
  const bf16* dp = delta.const_data_ptr<bf16>();
  bf16* sp = sum.mutable_data_ptr<bf16>();
  bf16* op = out.mutable_data_ptr<bf16>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(H);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < H; i += 16) {  // s = bf16(x + delta), kept in FP32 for the norm
        const __mmask16 mask = tail_mask(H - i);
        const __m512 s = kunlun_cpu::vec::round_bf16(
            _mm512_add_ps(load_bf16x16(xp + t * H + i, mask), load_bf16x16(dp + t * H + i, mask)));
        store_bf16x16(sp + t * H + i, s, mask);
        _mm512_mask_storeu_ps(row.data() + i, mask, s);
      }
      rms_norm_row(row.data(), w.const_data_ptr<bf16>(), op + t * H, H, static_cast<float>(eps));
    }
  });
  return {sum, out};
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_bf16(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be contiguous [T, 2 * I]");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor out = at::empty({T, I}, gate_up.options());
  const bf16* gp = gate_up.const_data_ptr<bf16>();
  bf16* op = out.mutable_data_ptr<bf16>();
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const bf16* gate = gp + t * 2 * I;
      const bf16* up = gate + I;
      for (int64_t i = 0; i < I; i += 16) {
        const __mmask16 mask = tail_mask(I - i);
        const __m512 g = load_bf16x16(gate + i, mask);
        // sigmoid(g) from e = exp(-|g|) <= 1: 1 / (1 + e) for g >= 0, e / (1 + e) otherwise.
        const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
        const __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.0f), e);
        const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
        const __m512 numerator = _mm512_mask_blend_ps(negative, _mm512_set1_ps(1.0f), e);
        // 1 / (1 + e) by a reciprocal estimate and one Newton step (relative error ~2^-28, far
        // below the BF16 rounding that follows; VDIVPS was most of the kernel's time in prefill).
        __m512 reciprocal = _mm512_rcp14_ps(denominator);
        reciprocal = _mm512_mul_ps(reciprocal, _mm512_fnmadd_ps(denominator, reciprocal, _mm512_set1_ps(2.0f)));
        const __m512 silu = kunlun_cpu::vec::round_bf16(_mm512_mul_ps(g, _mm512_mul_ps(numerator, reciprocal)));
        store_bf16x16(op + t * I + i, _mm512_mul_ps(silu, load_bf16x16(up + i, mask)), mask);  // as eager
      }
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> rotary_kv_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   const at::Tensor& cos, const at::Tensor& sin,
                                                   const at::Tensor& k_blocks, const at::Tensor& v_blocks,
                                                   const at::Tensor& slot_block_ids, const at::Tensor& slot_offsets) {
  paged::check_rotary_inputs(q, k, v, cos, sin, k_blocks, v_blocks, check_bf16, /*min_head_dim=*/0);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  paged::check_slots(slot_block_ids, slot_offsets, T, k_blocks);
  const PagedCache keys = paged::cache<bf16>(k_blocks), values = paged::cache<bf16>(v_blocks);
  const int64_t* blocks = slot_block_ids.const_data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.const_data_ptr<int64_t>();
  at::Tensor q_out = at::empty({T, H, D}, q.options());
  at::Tensor k_out = at::empty({T, KVH, D}, k.options());
  const bf16* cp = cos.const_data_ptr<bf16>();
  const bf16* sp = sin.const_data_ptr<bf16>();
  bf16* qo = q_out.mutable_data_ptr<bf16>();
  bf16* ko = k_out.mutable_data_ptr<bf16>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> rotated(D);
    auto store = [&](bf16* dst) {
      for (int64_t d = 0; d < D; d += 16) {
        const __mmask16 mask = tail_mask(D - d);
        store_bf16x16(dst + d, _mm512_maskz_loadu_ps(mask, rotated.data() + d), mask);
      }
    };
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        rotate(q.const_data_ptr<bf16>() + t * q.stride(0) + h * q.stride(1), cp + t * D, sp + t * D, D, rotated.data());
        store(qo + (t * H + h) * D);
      }
      for (int64_t h = 0; h < KVH; ++h) {
        rotate(k.const_data_ptr<bf16>() + t * k.stride(0) + h * k.stride(1), cp + t * D, sp + t * D, D, rotated.data());
        store(ko + (t * KVH + h) * D);
        std::copy(ko + (t * KVH + h) * D, ko + (t * KVH + h + 1) * D, keys.at(blocks[t], offsets[t], h));
        const bf16* value = v.const_data_ptr<bf16>() + t * v.stride(0) + h * v.stride(1);
        std::copy(value, value + D, values.at(blocks[t], offsets[t], h));
      }
    }
  });
  return {q_out, k_out};
}

}  // namespace kunlun_cpu
