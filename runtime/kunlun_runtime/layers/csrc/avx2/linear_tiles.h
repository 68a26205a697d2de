// The tile driver of the AVX2 tier's decode linears, shared by linear_bf16.cpp (BF16 weights) and
// linear_int8.cpp (INT8 weights): row tiles, channel blocks split across the threads, and the
// software prefetch of each thread's weight stream. Only AVX2/FMA instructions are used.
//
// At decode a linear layer multiplies a few activation rows by a weight matrix streamed from
// memory once per step. The weights stay as stored, BF16 or INT8 (half or a quarter of FP32's
// bytes), and are widened in registers; each weight row is read once for all M rows of x. At one
// row the weight stream sets the pace; from about two rows on (BF16) the FP32 arithmetic does, at
// eight MACs per FMA, so the kernels aim at the fewest instructions per weight byte.
//
// Both kernels split the output channels across the intra-op threads (at::parallel_for) in
// blocks of a few channels; a block runs tiles of up to four rows of x back to back, the later
// tiles finding the block's weight in L1, and the tiles take turns at prefetching the thread's
// weight stream ahead.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>

#define KUNLUN_INLINE inline __attribute__((always_inline))

namespace kunlun_cpu::avx2 {

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

inline void check_linear_inputs(const char* op, const at::Tensor& x, const at::Tensor& w,
                                const std::optional<at::Tensor>& bias) {
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

}  // namespace kunlun_cpu::avx2
