// Greedy sampling's argmax over FP32 logits with AVX2: two passes over each row.
//
//   kunlun_cpu::argmax_rows(logits [S, V] FP32) -> [S] int64
//     as torch.argmax(logits, dim=-1): the first index of each row's maximum (ties: the smallest
//     index; -0.0 and +0.0 tie), the index of the row's first NaN where it has one, and 0 for a
//     row that is all -inf.
//
// torch's CPU argmax is a generic reduction, far below the memory bandwidth (docs/platforms.md
// has the comparison). Here the first pass finds the maximum with VMAXPS alone, four independent
// accumulators and a NaN check, two instructions per 8 logits and no index bookkeeping; the second
// finds the first index holding it, one compare per 8 logits, and stops there. The row (192 KiB
// for SmolLM2) is still in L2 for the second pass, which on average reads half of it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "vec_avx2.h"
#include "../kernels.h"

namespace {

using kunlun_cpu::avx2::load_ps;

int64_t first_nan(const float* x, int64_t from, int64_t V) {
  for (int64_t j = from; j < V; ++j) {
    if (std::isnan(x[j])) return j;
  }
  return -1;  // not reached: the caller saw a NaN
}

int64_t argmax_row(const float* x, int64_t V) {
  const __m256 lowest = _mm256_set1_ps(-INFINITY);
  __m256 best0 = lowest, best1 = lowest, best2 = lowest, best3 = lowest;
  int64_t i = 0;
  // Pass 1: the maximum. VMAXPS returns its second operand when either is a NaN, so it cannot
  // carry a NaN along; UNORD compares (two vectors each) flag them instead, checked once per 32.
  for (; i + 32 <= V; i += 32) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    const __m256 c = _mm256_loadu_ps(x + i + 16), d = _mm256_loadu_ps(x + i + 24);
    const __m256 nan = _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q), _mm256_cmp_ps(c, d, _CMP_UNORD_Q));
    if (!_mm256_testz_ps(nan, nan)) return first_nan(x, i, V);
    best0 = _mm256_max_ps(best0, a);
    best1 = _mm256_max_ps(best1, b);
    best2 = _mm256_max_ps(best2, c);
    best3 = _mm256_max_ps(best3, d);
  }
  for (; i < V; i += 8) {  // masked lanes read 0.0, so they are set to -inf, which cannot win
    const int64_t count = V - i;
    __m256 a = load_ps(x + i, count);
    if (count < 8) {
      a = _mm256_blendv_ps(lowest, a, _mm256_castsi256_ps(kunlun_cpu::avx2::tail_mask(count)));
    }
    const __m256 nan = _mm256_cmp_ps(a, a, _CMP_UNORD_Q);
    if (!_mm256_testz_ps(nan, nan)) return first_nan(x, i, V);
    best0 = _mm256_max_ps(best0, a);
  }
  const float top = kunlun_cpu::avx2::hmax(_mm256_max_ps(_mm256_max_ps(best0, best1), _mm256_max_ps(best2, best3)));
  // Pass 2: the first index equal to it (all -inf: index 0, which holds -inf).
  const __m256 target = _mm256_set1_ps(top);
  int64_t j = 0;
  for (; j + 8 <= V; j += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), target, _CMP_EQ_OQ));
    if (mask != 0) return j + __builtin_ctz(static_cast<unsigned>(mask));
  }
  for (; j < V; ++j) {
    if (x[j] == top) return j;
  }
  return 0;  // not reached: the maximum is one of the row's values
}

}  // namespace

namespace kunlun_cpu {

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "argmax_rows: logits must be contiguous FP32 [S, V]");
  const int64_t S = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "argmax_rows: V must be at least 1");
  at::Tensor out = at::empty({S}, logits.options().dtype(at::kLong));
  const float* lp = logits.const_data_ptr<float>();
  int64_t* op = out.mutable_data_ptr<int64_t>();
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) op[row] = argmax_row(lp + row * V, V);
  });
  return out;
}

}  // namespace kunlun_cpu
