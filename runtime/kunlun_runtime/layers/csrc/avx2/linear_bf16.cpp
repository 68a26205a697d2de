// The AVX2 tier's decode linear over BF16 weights (AMD Zen 2/3, Hygon, Intel Haswell on), which
// computes on FP32 activations because BF16 arithmetic is only emulated there:
//
//   kunlun_cpu::linear_bf16(x fp32 [M, K], w bf16 [N, K], bias fp32 [N]?) -> fp32 [M, N]
//
// linear_bf16 computes x · float(w)ᵀ + bias in FP32: BF16 → FP32 is exact, so the result differs
// from an FP32 matmul over the widened weight only in the order of the additions (lane-wise FP32
// accumulators, one horizontal sum per output). The widening takes two cheap ops per 16 weights:
// a 32-bit lane of BF16 holds an even column in its low half and the odd one in its high half, so
// a shift by 16 yields the even columns as FP32 and a mask the odd ones (small tiles mask a read
// one column earlier instead of shifting: see Widen); x is rearranged once per call to match (each
// group of 16 columns as its 8 even, then its 8 odd columns). Widening in column order (vpmovzxwd
// + shift per 8 weights) takes twice the ops and was slower at every batch size, most of all at
// one row on cache-resident weights.
//
// The rows, channel blocks, threads and prefetching are linear_tiles.h's (shared with INT8).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include "linear_tiles.h"
#include "vec_avx2.h"
#include "../kernels.h"

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

// bf16_tile stays out of line: inlined into the parallel loop's lambda, GCC allocated registers
// worse for its 3- and 4-row tiles, which then ran markedly slower (the INT8 tiles, on the other
// hand, gain a little from being inlined).
#define KUNLUN_NOINLINE __attribute__((noinline))

namespace {

using kunlun_cpu::avx2::bf16;
using kunlun_cpu::avx2::dispatch_channels;
using kunlun_cpu::avx2::for_each_tile;
using kunlun_cpu::avx2::Prefetch;
using kunlun_cpu::avx2::StreamPrefetch;
using kunlun_cpu::avx2::Turn;

// Output channels per block for a tile of `rows` rows: enough independent accumulator chains to
// hide the FMA latency, few enough that accumulators and widened weights fit the 16 registers
// (each count chosen by timing its neighbours: fewer channels expose the latency, more spill).
constexpr int bf16_channels(int rows) { return rows == 1 ? 6 : rows == 2 ? 4 : 3; }

// Columns per step: 16 BF16 weights are one 32-byte load; each 32-bit lane holds an even column
// (low half) and the odd one after it (high half), so a shift widens the even columns and a
// mask the odd ones: two cheap ops per 16 weights, where widening in order (vpmovzxwd + shift)
// takes four. The dot product does not care about the order, so x is rearranged once per call to
// match: each group of 16 columns as its 8 even columns, then its 8 odd ones.
constexpr int64_t kGroup = 16;

// x [M, K] → [M, stride] with each group of 16 columns reordered to even, odd; the row padded
// with zeros to `stride` (a multiple of 16).
std::vector<float> split_even_odd(const float* x, int64_t M, int64_t K, int64_t stride) {
  std::vector<float> out(M * stride);
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    float* dst = out.data() + m * stride;
    for (int64_t k = 0; k < stride; k += kGroup) {
      const __m256 a = kunlun_cpu::avx2::load_ps(row + k, K - k);  // past K: zeros
      const __m256 b = kunlun_cpu::avx2::load_ps(row + k + 8, K - k - 8);
      // shuffle_ps works within 128-bit lanes: [a0 a2 b0 b2 | a4 a6 b4 b6], then the 64-bit
      // quarters in order 0 2 1 3.
      const __m256 even = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
      const __m256 odd = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
      _mm256_storeu_ps(dst + k, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), 0xD8)));
      _mm256_storeu_ps(dst + k + 8, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(odd), 0xD8)));
    }
  }
  return out;
}

// Tiles of up to this many rows widen the even columns by a mask too (see Widen).
constexpr int kMaskedEvenRows = 2;

// How bf16_step widens the even columns: by a shift of the group's pairs, or by a mask of the
// pairs read one column earlier (each 32-bit lane then holds an even column in its high half,
// the odd column before it in the low half), where the read may start one column before `w`.
// On an AMD Zen core the mask runs on any of the four FP pipes, the shift on two (one of them an
// FMA pipe): tiles of one or two rows, whose weight streams from memory with few FMAs per weight,
// streamed it faster by masking on a Zen 3 (docs/performance.md), with the same bits. Larger
// tiles keep the shift: their weight comes from L1 once per tile, where the early read straddles
// a cache line every other load, and masking made 4-row tiles markedly slower.
enum class Widen { kShift, kMaskEarly };

// The widening of a tile of MT rows: the first group of a block, whose early column would lie
// before the weight (the first block's, before the allocation), always shifts.
template <int MT>
constexpr Widen widen_for(bool first_group) {
  return MT <= kMaskedEvenRows && !first_group ? Widen::kMaskEarly : Widen::kShift;
}

// acc[m][r] += x[m] · w[r] over one group of 16 columns (x: the group's even/odd halves, row
// stride `stride`; w: the group's 16 BF16 weights of channel 0, row stride K), the even columns
// widened as E says.
template <int MT, int R, Widen E>
KUNLUN_INLINE void bf16_step(__m256 (&acc)[MT][R], const float* x, int64_t stride, const bf16* w, int64_t K) {
  const __m256 high_half = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
  // The even columns for every (row, channel), then the odd ones: R widened weights live at a
  // time, next to the MT·R accumulators, within the 16 registers.
  __m256 wv[R];
  for (int r = 0; r < R; ++r) {
    if constexpr (E == Widen::kMaskEarly) {
      wv[r] = _mm256_and_ps(_mm256_loadu_ps(reinterpret_cast<const float*>(w + r * K - 1)), high_half);
    } else {
      const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * K));
      wv[r] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
    }
  }
  for (int m = 0; m < MT; ++m) {
    const __m256 xv = _mm256_loadu_ps(x + m * stride);
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
  }
  for (int r = 0; r < R; ++r)
    wv[r] = _mm256_and_ps(_mm256_loadu_ps(reinterpret_cast<const float*>(w + r * K)), high_half);
  for (int m = 0; m < MT; ++m) {
    const __m256 xv = _mm256_loadu_ps(x + m * stride + 8);
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
  }
}

// out[m][n0 + r] = x[m] · w[n0 + r] + bias for MT rows of x (xs: the tile's first row, split by
// split_even_odd; out: its output row) and R output channels (w: channel n0's row).
template <int MT, int R, Prefetch P>
KUNLUN_NOINLINE void bf16_tile(const float* xs, int64_t stride, const bf16* w, const float* bias, float* out,
                               int64_t K, int64_t N, int64_t n0, Turn turn) {
  __m256 acc[MT][R];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  // The block's R rows are R·K·2 contiguous bytes, and the thread's blocks follow each other, so
  // its weight is one stream: each 32 columns consume R lines of it, and (on the tile's turn)
  // prefetch the R lines kPrefetchBytes further on.
  StreamPrefetch<P> prefetch(w, turn);
  constexpr Widen kFirst = widen_for<MT>(true), kRest = widen_for<MT>(false);
  int64_t k = 0;
  if (2 * kGroup <= K) {  // the first step, its first group shifted (see widen_for)
    prefetch.template step<R>();
    bf16_step<MT, R, kFirst>(acc, xs, stride, w, K);
    bf16_step<MT, R, kRest>(acc, xs + kGroup, stride, w + kGroup, K);
    k = 2 * kGroup;
  }
  for (; k + 2 * kGroup <= K; k += 2 * kGroup) {
    prefetch.template step<R>();
    bf16_step<MT, R, kRest>(acc, xs + k, stride, w + k, K);
    bf16_step<MT, R, kRest>(acc, xs + k + kGroup, stride, w + k + kGroup, K);
  }
  prefetch.rest(w + R * K);
  if (k + kGroup <= K) {
    if (k == 0) bf16_step<MT, R, kFirst>(acc, xs, stride, w, K);
    else bf16_step<MT, R, kRest>(acc, xs + k, stride, w + k, K);
    k += kGroup;
  }
  if (k < K) {  // the last K % 16 columns: the weight copied, zero-padded (never read past its end)
    alignas(32) bf16 tail[R][kGroup];
    std::memset(tail, 0, sizeof(tail));
    for (int r = 0; r < R; ++r) std::memcpy(tail[r], w + r * K + k, (K - k) * sizeof(bf16));
    bf16_step<MT, R, kFirst>(acc, xs + k, stride, &tail[0][0], kGroup);
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r)
      out[m * N + n0 + r] = kunlun_cpu::avx2::hsum(acc[m][r]) + (bias ? bias[n0 + r] : 0.0f);
}
}  // namespace

namespace kunlun_cpu {

// This tier has the one order: the thread's weight stream, into L1 (see kPrefetchBytes in linear_tiles.h).
std::string weight_prefetch() { return "stream-l1"; }

void set_weight_prefetch(const std::string& policy) {
  TORCH_CHECK(policy == "stream-l1", "the avx2 tier prefetches the weight stream into L1 ('stream-l1') only, not '",
              policy, "'");
}

// This tier has no VDPBF16PS: its kernels widen BF16 to FP32 for FMAs everywhere.
std::string bf16_dot() { return "fma"; }

void set_bf16_dot(const std::string& method) {
  TORCH_CHECK(method == "fma", "the avx2 tier takes BF16 dot products in FP32 FMAs ('fma') only, not '", method, "'");
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  avx2::check_linear_inputs("linear_bf16", x, w, bias);
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "linear_bf16: w must be bfloat16, got ", w.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  const int64_t stride = (K + kGroup - 1) / kGroup * kGroup;
  const std::vector<float> xs = split_even_odd(x.const_data_ptr<float>(), M, K, stride);
  const bf16* wp = w.const_data_ptr<bf16>();
  const float* bp = bias.has_value() ? bias->const_data_ptr<float>() : nullptr;
  float* op = out.mutable_data_ptr<float>();
  dispatch_channels<bf16_channels>(M, [&](auto channels, auto largest_tile) {
    constexpr int R = decltype(channels)::value;
    constexpr int largest = decltype(largest_tile)::value;
    for_each_tile<R, largest>(M, N, R * K * 2, [&](auto mt, auto r, int64_t m0, int64_t n0, auto policy, Turn turn) {
      bf16_tile<decltype(mt)::value, decltype(r)::value, decltype(policy)::value>(
          xs.data() + m0 * stride, stride, wp + n0 * K, bp, op + m0 * N, K, N, n0, turn);
    });
  });
  return out;
}

}  // namespace kunlun_cpu
