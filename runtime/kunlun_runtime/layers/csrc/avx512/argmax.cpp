// Greedy sampling's argmax over FP32 logits, one AVX-512 pass per row.
//
//   kunlun_cpu::argmax_rows(logits [S, V] FP32) -> [S] int64
//     as torch.argmax(logits, dim=-1): the first index of each row's maximum, or of the row's
//     first NaN where it has one.
//
// torch's CPU argmax is a generic reduction, far below the memory bandwidth: over a whole
// vocabulary it is a visible share of a decode step (docs/platforms.md has the comparison).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "bf16_vec.h"
#include "../kernels.h"

namespace {

int64_t argmax_row(const float* x, int64_t V) {
  // Per lane: the largest value so far and where it was first seen (strictly greater replaces).
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i best_index = _mm512_setzero_si512();
  __m512i index = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i step = _mm512_set1_epi32(16);
  for (int64_t i = 0; i < V; i += 16, index = _mm512_add_epi32(index, step)) {
    const __mmask16 mask = kunlun_cpu::vec::tail_mask(V - i);
    const __m512 v = _mm512_maskz_loadu_ps(mask, x + i);
    if (_mm512_mask_cmp_ps_mask(mask, v, v, _CMP_UNORD_Q)) {  // a NaN: torch returns the first one
      for (int64_t j = i;; ++j) {
        if (std::isnan(x[j])) return j;
      }
    }
    const __mmask16 greater = _mm512_mask_cmp_ps_mask(mask, v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, greater, v);
    best_index = _mm512_mask_mov_epi32(best_index, greater, index);
  }
  // Across lanes: the maximum, and the smallest index holding it (all -inf gives index 0).
  const float top = _mm512_reduce_max_ps(best);
  const __mmask16 holders = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(holders, best_index);
}

}  // namespace

namespace kunlun_cpu {

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "argmax_rows: logits must be contiguous FP32 [S, V]");
  const int64_t S = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0 && V < (int64_t{1} << 31), "argmax_rows: V must be in [1, 2^31)");
  at::Tensor out = at::empty({S}, logits.options().dtype(at::kLong));
  const float* lp = logits.const_data_ptr<float>();
  int64_t* op = out.mutable_data_ptr<int64_t>();
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) op[row] = argmax_row(lp + row * V, V);
  });
  return out;
}

}  // namespace kunlun_cpu
