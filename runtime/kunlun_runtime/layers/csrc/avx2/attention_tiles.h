// The tiles of the AVX2 tier's decode attention (decode_attention.cpp holds the loop over a
// split's keys and the op): the scores of 8 keys for up to 3 query heads of one KV head, and P·V
// for a few query heads over a run of keys, with the accumulators in registers; each over an FP32
// or BF16 cache row by row, and over a BF16 cache with D % 16 == 0 in the paired layout. A key
// or value vector is loaded and widened once for all heads of a tile. Scores go to and weights
// come from probs, [head in tile][kSegmentKeys]. Only AVX2/FMA instructions are used.
#pragma once

#include <immintrin.h>

#include "vec_avx2.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace kunlun_cpu::avx2 {

// Eight lanes of a cache row widened to FP32 (a BF16 row exactly); the _tail forms read only the
// leading lanes `tail` sets (D % 8 of them, an even count), nothing past the row's end.
inline __m256 load_row8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_row8(const bf16* p) { return widen_bf16x8(p); }
inline __m256 load_row8_tail(const float* p, __m256i tail) { return _mm256_maskload_ps(p, tail); }
inline __m256 load_row8_tail(const bf16* p, __m256i tail) { return widen_bf16x8_masked(p, tail); }

// Keys whose scores a split holds at once, per KV head: their scores are computed, then softmaxed
// together and multiplied into the values, so each query head's running maximum, its correction
// and the rescaling of its accumulators are paid once per segment rather than once per chunk of
// 16 keys, as they were (a third of a one-row attention's time under perf). 128 keys of a KV head
// are 16 KiB of BF16 K, then as much V, and 18 query heads' scores (a row with 5 drafts) 9 KiB;
// segments of 32 and 64 keys ran up to 7 % slower at 6 rows (docs/performance.md).
constexpr int64_t kSegmentKeys = 128;
// A P·V pass keeps kHeadTile × kStripe accumulators, kStripe value vectors and a weight in
// registers: 13 of AVX2's 16 (4 × 3 spills; 3 × 3, 4 × 2 and 2 × 3 run about the same).
constexpr int kStripe = 3;             // 8-lane vectors of D a P·V pass keeps per query head
constexpr int kHeadTile = 3;           // query heads a P·V pass accumulates at once

// Four FP32 vectors in, one 4-lane vector out: lane j holds the sum of the lanes of v[j], added
// within each 128-bit half as (l0 + l2) + (l1 + l3), then the two halves.
inline __m128 transpose_sum4(const __m256 v[4]) {
  const __m256 pairs0 = _mm256_add_ps(_mm256_unpacklo_ps(v[0], v[1]), _mm256_unpackhi_ps(v[0], v[1]));
  const __m256 pairs1 = _mm256_add_ps(_mm256_unpacklo_ps(v[2], v[3]), _mm256_unpackhi_ps(v[2], v[3]));
  const __m256 quads = _mm256_add_ps(_mm256_shuffle_ps(pairs0, pairs1, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(pairs0, pairs1, _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm_add_ps(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1));
}

// q · row for four key rows and TILE query heads of one KV head (q: the first head's row, the
// others padded_dim apart): each key vector is loaded and widened once for all TILE heads, where
// scoring head by head widened it once per head. `full` whole vectors, then (TAIL) the last
// D % 8 lanes by a masked load, so no read passes the end of a row (the pool's last row ends the
// allocation); q is zero padded to whole vectors. Each head's dot products are summed over the
// vectors in order, then across its lanes by transpose_sum4.
template <int TILE, bool TAIL, typename T>
inline void dot4_heads(const float* q, int64_t padded_dim, const T* const rows[4], int64_t full, __m256i tail,
                       __m128 (&scores)[TILE]) {
  __m256 dots[TILE][4];
  _Pragma("GCC unroll 4") for (int g = 0; g < TILE; ++g) {
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) dots[g][i] = _mm256_setzero_ps();
  }
  for (int64_t c = 0; c < full; ++c) {
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) {
      const __m256 key = load_row8(rows[i] + 8 * c);
      _Pragma("GCC unroll 4") for (int g = 0; g < TILE; ++g) {
        dots[g][i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * padded_dim + 8 * c), key, dots[g][i]);
      }
    }
  }
  if constexpr (TAIL) {
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) {
      const __m256 key = load_row8_tail(rows[i] + 8 * full, tail);
      _Pragma("GCC unroll 4") for (int g = 0; g < TILE; ++g) {
        dots[g][i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * padded_dim + 8 * full), key, dots[g][i]);
      }
    }
  }
  _Pragma("GCC unroll 4") for (int g = 0; g < TILE; ++g) scores[g] = transpose_sum4(dots[g]);
}

// Eight keys' dot products (low: keys 0-3, high: 4-7) of TILE heads, scaled, lanes past `count`
// -inf, into probs[g * kSegmentKeys ..] (see attend_split).
template <int TILE>
inline void store_scores(const __m128 (&low)[TILE], const __m128 (&high)[TILE], int64_t count, float scale,
                         float* probs) {
  for (int g = 0; g < TILE; ++g) {
    __m256 scores = _mm256_mul_ps(_mm256_set_m128(high[g], low[g]), _mm256_set1_ps(scale));
    if (count < 8) scores = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), scores, _mm256_castsi256_ps(tail_mask(count)));
    _mm256_storeu_ps(probs + g * kSegmentKeys, scores);  // a multiple of 8: whole vectors fit
  }
}

template <int TILE, bool TAIL, typename T>
void score8_heads(const float* q, int64_t padded_dim, const T* const rows[8], int64_t count, int64_t full,
                  __m256i tail, float scale, float* probs) {
  __m128 low[TILE], high[TILE];
  dot4_heads<TILE, TAIL, T>(q, padded_dim, rows, full, tail, low);
  dot4_heads<TILE, TAIL, T>(q, padded_dim, rows + 4, full, tail, high);
  store_scores<TILE>(low, high, count, scale, probs);
}

template <typename T>
using ScoreFn = void (*)(const float*, int64_t, const T* const*, int64_t, int64_t, __m256i, float, float*);

// Query heads scored together: 4 keys × 3 heads of accumulators with a widened key vector fill 13
// of AVX2's 16 registers.
constexpr int kScoreTile = 3;

template <bool TAIL, typename T>
ScoreFn<T> pick_score(int tile) {
  static_assert(kScoreTile == 3, "one case per tile size");
  switch (tile) {
    case 1: return &score8_heads<1, TAIL, T>;
    case 2: return &score8_heads<2, TAIL, T>;
    default: return &score8_heads<3, TAIL, T>;
  }
}

// acc[g] = acc[g] · corrections[g] + Σ_j probs[g][j] · value_j over one stripe of W vectors of D
// (from vector `first`) for TILE query heads, the accumulators in registers. TAIL: the stripe's
// last vector is a row tail, read by a masked load. The constant loops are unrolled by pragma:
// GCC otherwise unrolled them only after deciding that `sum` lives in memory, and stored all of
// it to the stack on every key.
template <int W, int TILE, bool TAIL, typename T>
void accumulate_values(const T* const* value_slots, int64_t head_offset, int64_t n, const float* probs,
                       const float* corrections, float* acc, int64_t padded_dim, int64_t first, __m256i tail) {
  __m256 sum[TILE][W];
  _Pragma("GCC unroll 4") for (int g = 0; g < TILE; ++g) {
    const __m256 correction = _mm256_set1_ps(corrections[g]);
    _Pragma("GCC unroll 4") for (int c = 0; c < W; ++c) {
      sum[g][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + g * padded_dim + 8 * (first + c)), correction);
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    const T* row = value_slots[j] + head_offset + 8 * first;
    __m256 value[W];
    _Pragma("GCC unroll 4") for (int c = 0; c < W; ++c) {
      value[c] = TAIL && c == W - 1 ? load_row8_tail(row + 8 * c, tail) : load_row8(row + 8 * c);
    }
    _Pragma("GCC unroll 4") for (int g = 0; g < TILE; ++g) {
      const __m256 weight = _mm256_broadcast_ss(probs + g * kSegmentKeys + j);
      _Pragma("GCC unroll 4") for (int c = 0; c < W; ++c) sum[g][c] = _mm256_fmadd_ps(weight, value[c], sum[g][c]);
    }
  }
  _Pragma("GCC unroll 4") for (int g = 0; g < TILE; ++g) {
    _Pragma("GCC unroll 4") for (int c = 0; c < W; ++c) {
      _mm256_storeu_ps(acc + g * padded_dim + 8 * (first + c), sum[g][c]);
    }
  }
}

template <typename T>
using AccumulateFn = void (*)(const T* const*, int64_t, int64_t, const float*, const float*, float*, int64_t,
                              int64_t, __m256i);

template <int W, int TILE, typename T>
AccumulateFn<T> pick_accumulate(bool tail) {
  return tail ? &accumulate_values<W, TILE, true, T> : &accumulate_values<W, TILE, false, T>;
}

template <int TILE, typename T>
AccumulateFn<T> pick_accumulate(int width, bool tail) {
  static_assert(kStripe >= 1 && kStripe <= 4, "one case per stripe width");
  switch (width) {
    case 1: return pick_accumulate<1, TILE, T>(tail);
    case 2: return pick_accumulate<std::min(2, kStripe), TILE, T>(tail);
    case 3: return pick_accumulate<std::min(3, kStripe), TILE, T>(tail);
    default: return pick_accumulate<kStripe, TILE, T>(tail);
  }
}

template <typename T>
AccumulateFn<T> pick_accumulate(int tile, int width, bool tail) {
  static_assert(kHeadTile >= 1 && kHeadTile <= 3, "one case per tile size");
  switch (tile) {
    case 1: return pick_accumulate<1, T>(width, tail);
    case 2: return pick_accumulate<std::min(2, kHeadTile), T>(width, tail);
    default: return pick_accumulate<kHeadTile, T>(width, tail);
  }
}

// The paired layout of a BF16 cache (D a multiple of 16): one 32-byte load holds 16 values, whose
// even ones widen by a shift (each 32-bit lane's low half moved up) and odd ones by a mask (the
// high half kept), two operations where two 8-value widenings took four. So q and the
// accumulators hold each 16 values of D as its 8 even ones, then its 8 odd ones (pair_lanes);
// the merge puts them back in order (unpair_lanes). It pays where a sequence has rows with drafts:
// one row's attention waits on its keys from memory, while more rows compute over the same keys,
// and widening is part of that compute; one row runs the same.
// Query heads scored at once: 3, with q read from memory (4 keys × 3 heads of sums and a key's two
// halves leave no registers for q), because a tile of 2 splits a row's 3 heads of a KV head and
// widens each key twice. Heads accumulated at once over values: 6 (12 sums, a value's two halves
// and a weight: 15 registers), so each value is widened once for 6 heads; 3 or 4 ran within the
// noise of it (docs/performance.md).
constexpr int kPairedScoreTile = 3;
constexpr int kPairedValueTile = 6;

inline void widen_pair(const bf16* p, __m256& even, __m256& odd) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  odd = _mm256_and_ps(_mm256_castsi256_ps(raw), _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Each 16 values of row (D of them) as the 8 at even places, then the 8 at odd places.
inline void pair_lanes(float* row, int64_t D) {
  for (int64_t d = 0; d < D; d += 16) {
    const __m256 low = _mm256_loadu_ps(row + d), high = _mm256_loadu_ps(row + d + 8);
    // Within each 128-bit half the shuffle takes lanes 0, 2 (then 1, 3) of low and of high; the
    // 64-bit permute then orders the halves' quadwords as low's, high's.
    const __m256 even = _mm256_shuffle_ps(low, high, _MM_SHUFFLE(2, 0, 2, 0));
    const __m256 odd = _mm256_shuffle_ps(low, high, _MM_SHUFFLE(3, 1, 3, 1));
    _mm256_storeu_ps(row + d, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), 0xD8)));
    _mm256_storeu_ps(row + d + 8, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(odd), 0xD8)));
  }
}

// The 16 values of D that pair_lanes put as (even, odd), in order: out[0..7], out[8..15].
inline void unpair_lanes(__m256 even, __m256 odd, float* out) {
  const __m256 low = _mm256_unpacklo_ps(even, odd), high = _mm256_unpackhi_ps(even, odd);
  _mm256_storeu_ps(out, _mm256_permute2f128_ps(low, high, 0x20));
  _mm256_storeu_ps(out + 8, _mm256_permute2f128_ps(low, high, 0x31));
}

// dot4_heads over the paired layout: per 16 values of D, four keys widened by a load, a shift and
// a mask each, against q's even and odd vectors of TILE heads (with 3 heads the compiler reads
// those as FMA operands from L1: the sums and the key's halves fill the registers).
template <int TILE>
inline void dot4_heads_paired(const float* q, int64_t padded_dim, const bf16* const rows[4], int64_t pairs,
                              __m128 (&scores)[TILE]) {
  __m256 dots[TILE][4];
  _Pragma("GCC unroll 4") for (int g = 0; g < TILE; ++g) {
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) dots[g][i] = _mm256_setzero_ps();
  }
  for (int64_t c = 0; c < pairs; ++c) {
    __m256 even_q[TILE], odd_q[TILE];
    _Pragma("GCC unroll 4") for (int g = 0; g < TILE; ++g) {
      even_q[g] = _mm256_loadu_ps(q + g * padded_dim + 16 * c);
      odd_q[g] = _mm256_loadu_ps(q + g * padded_dim + 16 * c + 8);
    }
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) {
      __m256 even, odd;
      widen_pair(rows[i] + 16 * c, even, odd);
      _Pragma("GCC unroll 4") for (int g = 0; g < TILE; ++g) {
        dots[g][i] = _mm256_fmadd_ps(even_q[g], even, dots[g][i]);
        dots[g][i] = _mm256_fmadd_ps(odd_q[g], odd, dots[g][i]);
      }
    }
  }
  _Pragma("GCC unroll 4") for (int g = 0; g < TILE; ++g) scores[g] = transpose_sum4(dots[g]);
}

template <int TILE>
void score8_heads_paired(const float* q, int64_t padded_dim, const bf16* const rows[8], int64_t count,
                         int64_t pairs, __m256i, float scale, float* probs) {
  __m128 low[TILE], high[TILE];
  dot4_heads_paired<TILE>(q, padded_dim, rows, pairs, low);
  dot4_heads_paired<TILE>(q, padded_dim, rows + 4, pairs, high);
  store_scores<TILE>(low, high, count, scale, probs);
}

template <int TILE>
ScoreFn<bf16> pick_score_paired_tile(int tile) {
  if constexpr (TILE == 1) {
    return &score8_heads_paired<1>;
  } else {
    return tile == TILE ? &score8_heads_paired<TILE> : pick_score_paired_tile<TILE - 1>(tile);
  }
}

// accumulate_values over the paired layout, one 16-value pair of D (`pair`) for TILE heads: one
// load and two widening operations per value, shared by 2 × TILE FMAs.
template <int TILE>
void accumulate_values_paired(const bf16* const* value_slots, int64_t head_offset, int64_t n, const float* probs,
                              const float* corrections, float* acc, int64_t padded_dim, int64_t pair) {
  __m256 sum[TILE][2];
  _Pragma("GCC unroll 8") for (int g = 0; g < TILE; ++g) {
    const __m256 correction = _mm256_set1_ps(corrections[g]);
    _Pragma("GCC unroll 2") for (int c = 0; c < 2; ++c) {
      sum[g][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + g * padded_dim + 16 * pair + 8 * c), correction);
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    __m256 even, odd;
    widen_pair(value_slots[j] + head_offset + 16 * pair, even, odd);
    _Pragma("GCC unroll 8") for (int g = 0; g < TILE; ++g) {
      const __m256 weight = _mm256_broadcast_ss(probs + g * kSegmentKeys + j);
      sum[g][0] = _mm256_fmadd_ps(weight, even, sum[g][0]);
      sum[g][1] = _mm256_fmadd_ps(weight, odd, sum[g][1]);
    }
  }
  _Pragma("GCC unroll 8") for (int g = 0; g < TILE; ++g) {
    _Pragma("GCC unroll 2") for (int c = 0; c < 2; ++c) {
      _mm256_storeu_ps(acc + g * padded_dim + 16 * pair + 8 * c, sum[g][c]);
    }
  }
}

using PairedAccumulateFn = void (*)(const bf16* const*, int64_t, int64_t, const float*, const float*, float*,
                                    int64_t, int64_t);

template <int TILE>
PairedAccumulateFn pick_accumulate_paired(int tile) {
  if constexpr (TILE == 1) {
    return &accumulate_values_paired<1>;
  } else {
    return tile == TILE ? &accumulate_values_paired<TILE> : pick_accumulate_paired<TILE - 1>(tile);
  }
}

}  // namespace kunlun_cpu::avx2
