// The AVX2 tier's decode linear over INT8 weights (one FP32 scale per output channel):
//
//   kunlun_cpu::linear_int8(x fp32 [M, K], w int8 [N, K], scales fp32 [N], bias fp32 [N]?) -> fp32 [M, N]
//
// linear_int8 is W8A8 with dynamic activation scales, the scheme of llama.cpp's Q8_0 dot product
// on AVX2: each row of x is quantized once per call to INT8 in blocks of 32 (scale = max|x| /
// 127, round to nearest even), and each block's dot product with a weight row runs in exact
// integer arithmetic: maddubs(|q|, w · sign(q)) multiplies and adds pairs (at most 2 · 127², no
// INT16 saturation) and madd with ones adds pairs of those into INT32 lanes; the INT32 sums are
// scaled by the block's activation scale into FP32 accumulators, and the channel's weight scale
// and the bias come last. The activations' rounding (at most max|x_block| / 254 per element) is
// the price: about 0.5 % (RMS) of the output for Gaussian activations, 1 % with scattered
// outliers 20x the rest; the per-channel INT8 rounding of Gaussian weights alone costs 0.8 %.
// Widening the INT8 weights to FP32 instead (W8A16: cvtepi8_epi32 + cvtepi32_ps + FMA on FP32 x,
// no activation rounding) was slower: clearly at one row, where W8A8 spends 5 ops per 32 weights
// and W8A16 3 per 8, and still at eight rows, where W8A16 is FMA-bound; so W8A8 it is. (INT16
// activations with madd on sign-extended weights, which skips the sign trick, was slower than
// either.)
//
// The rows, channel blocks, threads and prefetching are linear_tiles.h's (shared with BF16).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include "linear_tiles.h"
#include "vec_avx2.h"
#include "../kernels.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

using kunlun_cpu::avx2::dispatch_channels;
using kunlun_cpu::avx2::for_each_tile;
using kunlun_cpu::avx2::Prefetch;
using kunlun_cpu::avx2::StreamPrefetch;
using kunlun_cpu::avx2::Turn;

// Output channels per block for a tile of `rows` rows (see bf16_channels in linear_bf16.cpp): the
// INT8 kernel also keeps each row's q, |q| and block scale in registers, so it takes no more
// channels than BF16, fewer at one and four rows (chosen the same way; more were no faster).
constexpr int int8_channels(int rows) { return rows <= 2 ? 4 : rows == 3 ? 3 : 2; }

constexpr int64_t kQBlock = 32;  // activations per INT8 scale: one ymm of INT8

// x quantized per row in blocks of kQBlock: q (INT8, the row padded with zeros to a whole
// number of blocks), |q| (the unsigned operand of maddubs, computed once here rather than per
// output channel) and one FP32 scale per block.
struct QuantizedRows {
  int64_t blocks, stride;  // blocks per row; INT8 elements per row (blocks · kQBlock)
  std::vector<int8_t> q, abs_q;
  std::vector<float> scales;
};

// 32 floats → 32 INT8 (already rounded and within [-127, 127]) in order.
KUNLUN_INLINE __m256i pack_int8x32(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256i ab = _mm256_packs_epi32(_mm256_cvtps_epi32(a), _mm256_cvtps_epi32(b));
  const __m256i cd = _mm256_packs_epi32(_mm256_cvtps_epi32(c), _mm256_cvtps_epi32(d));
  // packs interleaves the 128-bit lanes: dwords come out as a0 b0 c0 d0 a1 b1 c1 d1.
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Per block: scale = max|x| / 127, q = round_half_even(x · (1 / scale)) clamped to ±127. A block
// whose max |x| is below 1e-30 is all zeros with scale 0 (its reciprocal could overflow); a row
// with a NaN or an infinity gets NaN scales and zero q, so its outputs are NaN as a float matmul's
// would be.
QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  QuantizedRows qr;
  qr.blocks = (K + kQBlock - 1) / kQBlock;
  qr.stride = qr.blocks * kQBlock;
  qr.q.assign(M * qr.stride, 0);
  qr.abs_q.assign(M * qr.stride, 0);
  qr.scales.assign(M * qr.blocks, 0.0f);
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    __m256 non_finite = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      const __m256 v = kunlun_cpu::avx2::load_ps(row + k, K - k);
      non_finite = _mm256_or_ps(non_finite, _mm256_cmp_ps(_mm256_sub_ps(v, v), _mm256_setzero_ps(), _CMP_NEQ_UQ));
    }
    float* scales = qr.scales.data() + m * qr.blocks;
    if (_mm256_movemask_ps(non_finite) != 0) {
      std::fill(scales, scales + qr.blocks, std::numeric_limits<float>::quiet_NaN());
      continue;
    }
    for (int64_t block = 0; block < qr.blocks; ++block) {
      const int64_t k0 = block * kQBlock;
      __m256 v[4];
      __m256 largest = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = kunlun_cpu::avx2::load_ps(row + k0 + 8 * i, K - k0 - 8 * i);  // past K: zeros
        largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign_bit, v[i]));
      }
      const float amax = kunlun_cpu::avx2::hmax(largest);
      if (amax < 1e-30f) continue;  // zeros, scale 0
      const float scale = amax / 127.0f;
      const __m256 inverse = _mm256_set1_ps(1.0f / scale);
      for (int i = 0; i < 4; ++i) {
        const __m256 scaled =
            _mm256_round_ps(_mm256_mul_ps(v[i], inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v[i] = _mm256_min_ps(_mm256_max_ps(scaled, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
      }
      const __m256i q = pack_int8x32(v[0], v[1], v[2], v[3]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qr.q.data() + m * qr.stride + k0), q);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qr.abs_q.data() + m * qr.stride + k0), _mm256_abs_epi8(q));
      scales[block] = scale;
    }
  }
  return qr;
}

// totals[m][r] += scale_x[m] · Σ over one block of q[m] · w[r], the sum in exact integers:
// maddubs(|q|, w · sign(q)) adds pairs of products of at most 127 · 127 (no INT16 saturation),
// madd with ones adds pairs of those into INT32 lanes.
template <int MT, int R>
KUNLUN_INLINE void w8a8_step(__m256 (&totals)[MT][R], const __m256i (&wv)[R], const int8_t* q, const int8_t* abs_q,
                             const float* x_scales, int64_t stride, int64_t blocks, int64_t block) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int m = 0; m < MT; ++m) {
    const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + m * stride + block * kQBlock));
    const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(abs_q + m * stride + block * kQBlock));
    const __m256 scale = _mm256_broadcast_ss(x_scales + m * blocks + block);
    for (int r = 0; r < R; ++r) {
      const __m256i products = _mm256_maddubs_epi16(xa, _mm256_sign_epi8(wv[r], xq));
      const __m256i sums = _mm256_madd_epi16(products, ones);
      totals[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, totals[m][r]);
    }
  }
}

template <int R>
KUNLUN_INLINE void load_w_block(__m256i (&wv)[R], const int8_t* w, int64_t K, int64_t k) {
  for (int r = 0; r < R; ++r) wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * K + k));
}

template <int MT, int R, Prefetch P>
void w8a8_tile(const QuantizedRows& qr, int64_t m0, const int8_t* w, const float* scales, const float* bias,
               float* out, int64_t K, int64_t N, int64_t n0, Turn turn) {
  const int8_t* q = qr.q.data() + m0 * qr.stride;
  const int8_t* abs_q = qr.abs_q.data() + m0 * qr.stride;
  const float* x_scales = qr.scales.data() + m0 * qr.blocks;
  __m256 totals[MT][R];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) totals[m][r] = _mm256_setzero_ps();
  StreamPrefetch<P> prefetch(w, turn);  // as in bf16_tile
  const int64_t full = K / kQBlock;
  int64_t block = 0;
  __m256i wv[R];
  for (; block + 2 <= full; block += 2) {  // two blocks: one 64-byte line of each weight row
    prefetch.template step<R>();
    load_w_block(wv, w, K, block * kQBlock);
    w8a8_step(totals, wv, q, abs_q, x_scales, qr.stride, qr.blocks, block);
    load_w_block(wv, w, K, (block + 1) * kQBlock);
    w8a8_step(totals, wv, q, abs_q, x_scales, qr.stride, qr.blocks, block + 1);
  }
  prefetch.rest(w + R * K);
  if (block < full) {
    load_w_block(wv, w, K, block * kQBlock);
    w8a8_step(totals, wv, q, abs_q, x_scales, qr.stride, qr.blocks, block);
    ++block;
  }
  if (block < qr.blocks) {  // K % 32 columns left: the weight copied, never read past its end
    const int64_t k = block * kQBlock;
    alignas(32) int8_t tail[R][kQBlock] = {};
    for (int r = 0; r < R; ++r) std::memcpy(tail[r], w + r * K + k, K - k);
    for (int r = 0; r < R; ++r) wv[r] = _mm256_load_si256(reinterpret_cast<const __m256i*>(tail[r]));
    w8a8_step(totals, wv, q, abs_q, x_scales, qr.stride, qr.blocks, block);
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) {
      const int64_t n = n0 + r;
      out[m * N + n] = kunlun_cpu::avx2::hsum(totals[m][r]) * scales[n] + (bias ? bias[n] : 0.0f);
    }
}
}  // namespace

namespace kunlun_cpu {

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  avx2::check_linear_inputs("linear_int8", x, w, bias);
  TORCH_CHECK(w.scalar_type() == at::kChar, "linear_int8: w must be int8, got ", w.scalar_type());
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 1 && scales.numel() == w.size(0) &&
                  scales.is_contiguous() && scales.is_cpu(),
              "linear_int8: scales must be a contiguous float32 vector of ", w.size(0), " elements, got ",
              scales.scalar_type(), " ", scales.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const QuantizedRows qr = quantize_rows(x.const_data_ptr<float>(), M, K);
  at::Tensor out = at::empty({M, N}, x.options());
  const int8_t* wp = w.const_data_ptr<int8_t>();
  const float* sp = scales.const_data_ptr<float>();
  const float* bp = bias.has_value() ? bias->const_data_ptr<float>() : nullptr;
  float* op = out.mutable_data_ptr<float>();
  dispatch_channels<int8_channels>(M, [&](auto channels, auto largest_tile) {
    constexpr int R = decltype(channels)::value;
    constexpr int largest = decltype(largest_tile)::value;
    for_each_tile<R, largest>(M, N, R * K, [&](auto mt, auto r, int64_t m0, int64_t n0, auto policy, Turn turn) {
      w8a8_tile<decltype(mt)::value, decltype(r)::value, decltype(policy)::value>(qr, m0, wp + n0 * K, sp, bp,
                                                                                  op + m0 * N, K, N, n0, turn);
    });
  });
  return out;
}

}  // namespace kunlun_cpu
