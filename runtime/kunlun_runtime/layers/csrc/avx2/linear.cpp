// Small-batch (decode) linear kernels for x86 CPUs with AVX2 + FMA: the AVX2 tier (AMD Zen 2/3,
// Hygon, Intel Haswell on), which computes on FP32 activations because BF16 arithmetic is only
// emulated there. Only AVX2/FMA instructions are used.
//
//   kunlun_cpu::linear_bf16(x fp32 [M, K], w bf16 [N, K], bias fp32 [N]?)                 -> fp32 [M, N]
//   kunlun_cpu::linear_int8(x fp32 [M, K], w int8 [N, K], scales fp32 [N], bias fp32 [N]?) -> fp32 [M, N]
//
// At decode a linear layer multiplies a few activation rows by a weight matrix streamed from
// memory once per step. The weights stay as stored, BF16 or INT8 (half or a quarter of FP32's
// bytes), and are widened in registers; each weight row is read once for all M rows of x. At one
// row the weight stream sets the pace; from about two rows on (BF16) the FP32 arithmetic does, at
// eight MACs per FMA, so the kernels aim at the fewest instructions per weight byte.
//
// linear_bf16 computes x · float(w)ᵀ + bias in FP32: BF16 → FP32 is exact, so the result differs
// from an FP32 matmul over the widened weight only in the order of the additions (lane-wise FP32
// accumulators, one horizontal sum per output). The widening takes two cheap ops per 16 weights:
// a 32-bit lane of BF16 holds an even column in its low half and the odd one in its high half, so
// a shift by 16 yields the even columns as FP32 and a mask the odd ones; x is rearranged once per
// call to match (each group of 16 columns as its 8 even, then its 8 odd columns). Widening in
// column order (vpmovzxwd + shift per 8 weights) takes twice the ops and was slower at every
// batch size, most of all at one row on cache-resident weights.
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
// Both kernels split the output channels across the intra-op threads (at::parallel_for) in
// blocks of a few channels; a block runs tiles of up to four rows of x back to back, the later
// tiles finding the block's weight in L1, and the tiles take turns at prefetching the thread's
// weight stream ahead.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include "vec_avx2.h"
#include "../kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#define KUNLUN_INLINE inline __attribute__((always_inline))
// bf16_tile stays out of line: inlined into the parallel loop's lambda, GCC allocated registers
// worse for its 3- and 4-row tiles, which then ran markedly slower (the INT8 tiles, on the other
// hand, gain a little from being inlined).
#define KUNLUN_NOINLINE __attribute__((noinline))

namespace {

using kunlun_cpu::avx2::bf16;

// Rows of x per tile: a tile holds rows × channels FP32 accumulators in registers, and AVX2 has
// 16. Four rows by three channels beat eight rows by one (each widened weight feeds more FMAs per
// load of x); a batch above four rows runs as several tiles over each channel block, whose weight
// is then still in L1, so the weight streams in from memory once per call at any M.
constexpr int kTileRows = 4;

// Software prefetch distance along each thread's weight stream, in bytes. The hardware prefetcher
// alone does not keep a weight stream from DRAM at full speed; a few KiB ahead is too short to
// hide the latency at one row, anywhere in the tens of KiB does about as well. The lines go to L1
// (_MM_HINT_T0): on the AMD cores this tier was tuned on, that beat L2 (_MM_HINT_T1) at one row and
// tied from two rows on (the AVX-512 tier, tuned on a Xeon, found the opposite: it depends on the core).
constexpr int64_t kPrefetchBytes = 16384;

// Output channels per block for a tile of `rows` rows: enough independent accumulator chains to
// hide the FMA latency, few enough that accumulators and widened weights fit the 16 registers
// (each count chosen by timing its neighbours: fewer channels expose the latency, more spill).
constexpr int bf16_channels(int rows) { return rows == 1 ? 6 : rows == 2 ? 4 : 3; }
// The INT8 kernel also keeps each row's q, |q| and block scale in registers, so it takes no more
// channels than BF16, fewer at one and four rows (chosen the same way; more were no faster).
constexpr int int8_channels(int rows) { return rows <= 2 ? 4 : rows == 3 ? 3 : 2; }

// The main loops prefetch R lines per R lines consumed; when K is not a multiple of their step,
// the block's share of the stream ends past the last line they prefetched: prefetch_rest takes
// the lines up to `end`.
// (Addresses are integers here: the stream runs past the end of w at the last block, harmlessly
// for a prefetch, but not for pointer arithmetic.)
KUNLUN_INLINE void prefetch_line(uintptr_t address) {
  _mm_prefetch(reinterpret_cast<const char*>(address), _MM_HINT_T0);
}
KUNLUN_INLINE void prefetch_rest(uintptr_t ahead, uintptr_t end) {
  for (; ahead < end; ahead += 64) prefetch_line(ahead);
}

template <int N>
using Int = std::integral_constant<int, N>;

// Calls fn(Int<rows>) for rows in [1, MaxRows] (MaxRows <= kTileRows).
template <int MaxRows = kTileRows, typename Fn>
KUNLUN_INLINE void dispatch_rows(int64_t rows, Fn fn) {
  static_assert(kTileRows == 4 && MaxRows >= 1 && MaxRows <= kTileRows);
  switch (std::min<int64_t>(rows, MaxRows)) {
    case 1: fn(Int<1>{}); break;
    case 2: if constexpr (MaxRows >= 2) fn(Int<2>{}); break;
    case 3: if constexpr (MaxRows >= 3) fn(Int<3>{}); break;
    default: if constexpr (MaxRows >= 4) fn(Int<4>{}); break;
  }
}

// How M rows split into tiles: as few tiles as kTileRows allows, their sizes differing by at
// most one (M = 5 → 3 + 2, not 4 + 1: the channel count is set by the largest tile).
struct TilePlan {
  int64_t tiles, base, extra;
  explicit TilePlan(int64_t M) : tiles((M + kTileRows - 1) / kTileRows), base(M / tiles), extra(M % tiles) {}
  int64_t largest() const { return base + (extra > 0); }
  int64_t rows(int64_t t) const { return base + (t < extra); }
};

// Which steps of a channel block's loop prefetch the weight stream ahead: every step (a block's
// only tile), the tile's turns (one of several tiles: steps whose index modulo `of` is `mine`),
// or none (the channels past the last whole block). Every tile of a block walks the same
// addresses ahead, so the tiles' turns together issue each prefetch once.
enum class Prefetch { kEvery, kTurns, kNone };
struct Turn {
  int64_t mine = 0, of = 1;
};
template <Prefetch P>
using Policy = std::integral_constant<Prefetch, P>;

// Prefetches the R lines a step of 32 columns consumes, kPrefetchBytes on, in the steps that are
// the tile's (turns: a countdown, as a division per step showed at one row).
template <Prefetch P>
class StreamPrefetch {
 public:
  StreamPrefetch(const void* w, Turn turn)
      : ahead_(reinterpret_cast<uintptr_t>(w) + kPrefetchBytes), period_(turn.of), wait_(turn.mine) {}
  template <int R>
  KUNLUN_INLINE void step() {
    if (mine()) {
      for (int r = 0; r < R; ++r) prefetch_line(ahead_ + r * 64);
      wait_ = period_;
    }
    --wait_;
    ahead_ += R * 64;
  }
  // The lines from here to the block's end (`end`: past its last whole step), if the step is the tile's.
  KUNLUN_INLINE void rest(const void* end) {
    if (mine()) prefetch_rest(ahead_, reinterpret_cast<uintptr_t>(end) + kPrefetchBytes);
  }

 private:
  KUNLUN_INLINE bool mine() const { return P == Prefetch::kEvery || (P == Prefetch::kTurns && wait_ == 0); }
  uintptr_t ahead_;
  int64_t period_, wait_;
};

// Calls fn(Int<R>, Int<rows>) with rows = the largest tile of M rows, R = ChannelsFor(rows).
template <int (*ChannelsFor)(int), typename Fn>
void dispatch_channels(int64_t M, Fn fn) {
  dispatch_rows(TilePlan(M).largest(), [&](auto rows) { fn(Int<ChannelsFor(decltype(rows)::value)>{}, rows); });
}

// Runs tile(rows, channels, m0, n0, policy, turn) over every (row tile, channel block): the
// output channels go in blocks of R, split across the intra-op threads; each block runs all row
// tiles back to back, so its weight comes from memory once (the later tiles find the block in
// L1). The tiles of a block take turns at prefetching the thread's weight stream ahead: when the
// first tile prefetched all of it, the stream stood still while the later ones computed (measured
// on a Zen 3: a step's linears 1.08-1.13x faster at 5-12 rows). The channels past the last whole
// block go one at a time, without prefetching.
template <int R, int MaxRows, typename Tile>
void for_each_tile(int64_t M, int64_t N, int64_t block_bytes, Tile tile) {
  const TilePlan plan(M);
  const int64_t num_blocks = (N + R - 1) / R;
  // At least ~32 KiB of weight per task, so a small layer is not split finer than it is worth.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, block_bytes));
  at::parallel_for(0, num_blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * R;
      int64_t m0 = 0;
      for (int64_t t = 0; t < plan.tiles; ++t) {
        const int64_t rows = plan.rows(t);
        dispatch_rows<MaxRows>(rows, [&](auto mt) {
          if (n0 + R > N) {
            for (int64_t n = n0; n < N; ++n) tile(mt, Int<1>{}, m0, n, Policy<Prefetch::kNone>{}, Turn{});
          } else if (plan.tiles == 1) {
            tile(mt, Int<R>{}, m0, n0, Policy<Prefetch::kEvery>{}, Turn{});
          } else {
            tile(mt, Int<R>{}, m0, n0, Policy<Prefetch::kTurns>{}, Turn{t, plan.tiles});
          }
        });
        m0 += rows;
      }
    }
  });
}

// ---- BF16 weights ---------------------------------------------------------------------------

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

// acc[m][r] += x[m] · w[r] over one group of 16 columns (x: the group's even/odd halves, row
// stride `stride`; w: the group's 16 BF16 weights of channel 0, row stride K).
template <int MT, int R>
KUNLUN_INLINE void bf16_step(__m256 (&acc)[MT][R], const float* x, int64_t stride, const bf16* w, int64_t K) {
  const __m256 high_half = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u)));
  // The even columns for every (row, channel), then the odd ones: R widened weights live at a
  // time, next to the MT·R accumulators, within the 16 registers.
  __m256 wv[R];
  for (int r = 0; r < R; ++r) {
    const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * K));
    wv[r] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
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
  int64_t k = 0;
  for (; k + 2 * kGroup <= K; k += 2 * kGroup) {
    prefetch.template step<R>();
    bf16_step(acc, xs + k, stride, w + k, K);
    bf16_step(acc, xs + k + kGroup, stride, w + k + kGroup, K);
  }
  prefetch.rest(w + R * K);
  if (k + kGroup <= K) {
    bf16_step(acc, xs + k, stride, w + k, K);
    k += kGroup;
  }
  if (k < K) {  // the last K % 16 columns: the weight copied, zero-padded (never read past its end)
    alignas(32) bf16 tail[R][kGroup];
    std::memset(tail, 0, sizeof(tail));
    for (int r = 0; r < R; ++r) std::memcpy(tail[r], w + r * K + k, (K - k) * sizeof(bf16));
    bf16_step(acc, xs + k, stride, &tail[0][0], kGroup);
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r)
      out[m * N + n0 + r] = kunlun_cpu::avx2::hsum(acc[m][r]) + (bias ? bias[n0 + r] : 0.0f);
}

// ---- INT8 weights, INT8 activations (W8A8) ---------------------------------------------------

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

// ---- Input checks ---------------------------------------------------------------------------

void check_inputs(const char* op, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D [M, K], got ", x.dim(), "-D ", x.sizes());
  TORCH_CHECK(w.dim() == 2, op, ": w must be 2-D [N, K], got ", w.dim(), "-D ", w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32 (the AVX2 tier's activations), got ",
              x.scalar_type());
  TORCH_CHECK(x.size(0) >= 1, op, ": x must have at least one row");
  TORCH_CHECK(x.size(1) == w.size(1), op, ": x has ", x.size(1), " columns but w has ", w.size(1));
  TORCH_CHECK(x.is_cpu() && w.is_cpu(), op, ": x and w must be CPU tensors");
  TORCH_CHECK(x.is_contiguous(), op, ": x must be contiguous");
  TORCH_CHECK(w.is_contiguous(), op, ": w must be contiguous");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->numel() == w.size(0) &&
                    bias->is_contiguous() && bias->is_cpu(),
                op, ": bias must be a contiguous float32 vector of ", w.size(0), " elements, got ",
                bias->scalar_type(), " ", bias->sizes());
  }
}

}  // namespace

namespace kunlun_cpu {

// This tier has the one order: the thread's weight stream, into L1 (see kPrefetchBytes).
std::string weight_prefetch() { return "stream-l1"; }

void set_weight_prefetch(const std::string& policy) {
  TORCH_CHECK(policy == "stream-l1", "the avx2 tier prefetches the weight stream into L1 ('stream-l1') only, not '",
              policy, "'");
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  check_inputs("linear_bf16", x, w, bias);
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

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  check_inputs("linear_int8", x, w, bias);
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
