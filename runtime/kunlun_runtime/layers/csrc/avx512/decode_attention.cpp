// Decode attention for x86 CPUs with AVX-512 (BF16 tensors, FP32 arithmetic):
//
//   kunlun_cpu::decode_attention(q [B, H, D], k [B, KVH, D], v [B, KVH, D], cos [B, D], sin [B, D],
//                                k_blocks, v_blocks [NB, BS, KVH, D], block_tables [B, MB],
//                                context_lens [B], scale, window)  -> [B, H * D]
//     one new token per sequence: rotary on q and k, k and v written into the paged cache at
//     position context_len - 1, then softmax(scale · q·Kᵀ) · V over the sequence's blocks
//     (GQA: query head h reads KV head h / (H / KVH); window > 0 keeps the last `window` keys),
//     the probabilities rounded to BF16 before they weigh the values, as HF's eager attention and
//     PyTorch's CPU flash attention round them. One call per layer replaces a scatter, two
//     gathers and an SDPA call, with the reference's roundings.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include "bf16_dot.h"
#include "bf16_vec.h"
#include "rotary_cache.h"
#include "../kernels.h"
#include "../attention_plan.h"
#include "../paged_cache.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using bf16 = c10::BFloat16;
using kunlun_cpu::avx512::check_bf16;
using kunlun_cpu::avx512::even_words;
using kunlun_cpu::avx512::odd_words;
using kunlun_cpu::avx512::rotate;
using kunlun_cpu::vec::load_bf16x16;
using kunlun_cpu::vec::load_words32;
using kunlun_cpu::vec::store_bf16x16;
using kunlun_cpu::vec::tail_mask;
using PagedCache = kunlun_cpu::paged::PagedCache<bf16>;
using kunlun_cpu::paged::gather_slots;

constexpr int64_t kKeyChunk = 64;  // keys scored per pass (their K and V rows stay in L1)
static_assert(kunlun_cpu::paged::kShortPartKeys % kKeyChunk == 0 &&
                  kunlun_cpu::paged::kLongPartKeys % kKeyChunk == 0,
              "a part is whole chunks");
// Where the CPU's FMAs outpace VDPBF16PS (bf16_dot.h), query heads per KV head from which a
// chunk's K and V rows are widened to FP32 once for all of them, its scores and P · V taken in
// FMAs: a row with drafts. With a decode row's 3 heads of SmolLM2 the widening does not pay
// (docs/performance.md).
constexpr int64_t kMinWideHeads = 6;

// Query heads whose P · V accumulators (CHUNKS vectors each) stay in registers together with one
// pair of value rows, interleaved once for all of them.
template <int CHUNKS>
constexpr int64_t head_tile() {
  return CHUNKS <= 2 ? 8 : (CHUNKS <= 4 ? 6 : (CHUNKS <= 8 ? 2 : 1));
}

// 2^f for f in [0, 1): sqrt(2) · e^r, r = (f - 1/2) · ln 2 in [-0.35, 0.35).
inline __m512 exp2_fraction(__m512 f) {
  const __m512 r = _mm512_mul_ps(_mm512_sub_ps(f, _mm512_set1_ps(0.5f)), _mm512_set1_ps(0.693147180559945f));
  return _mm512_mul_ps(kunlun_cpu::vec::exp_taylor6(r), _mm512_set1_ps(1.41421356237309505f));
}

// The BF16 probabilities of 16 base-2 scores t under the whole-number maximum m: 2^(t - m) as
// bf16(2^frac(t)) · 2^(floor(t) - m). The rounding depends on t alone (scaling by a power of two
// is exact), so a key's probability has the same bits whatever maximum its task reached, and a
// row's P · V rounds alike however its keys are split across tasks (a draft row and the same row
// decoded alone). Lanes outside `mask` are 0.
inline __m512 probabilities(__m512 t, float m, __mmask16 mask) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 unit = kunlun_cpu::vec::round_bf16(exp2_fraction(_mm512_sub_ps(t, n)));
  return _mm512_maskz_scalef_ps(mask, unit, _mm512_sub_ps(n, _mm512_set1_ps(m)));
}

// A key's K and V rows (row_bytes each) into L2.
inline void prefetch_rows(const bf16* key, const bf16* value, int64_t row_bytes) {
  const char* k = reinterpret_cast<const char*>(key);
  const char* v = reinterpret_cast<const char*>(value);
  for (int64_t line = 0; line < row_bytes; line += 64) {
    _mm_prefetch(k + line, _MM_HINT_T1);
    _mm_prefetch(v + line, _MM_HINT_T1);
  }
}

// Scores of one query head (qv: its PAIRS vectors of 32 BF16) against 16 keys (slots[i] + offset),
// scaled: one VDPBF16PS per pair of dimensions and key, then one transpose-reduce. `count` < 16
// keys leave the other lanes zero. Every bound is known at compile time for a whole block, so the
// 16 dot products stay in registers. Meanwhile the rows of the first `ahead` of ahead_keys /
// ahead_values (+ the offsets) go into L2, one key's between two dot products (issued together
// they stall on the line fill buffers).
template <int PAIRS, bool WHOLE, bool FULL>
inline __m512 score16(const __m512bh* qv, const __mmask32* pair_mask, const bf16* const* slots, int64_t offset,
                      int64_t count, __m512 scale, const bf16* const* ahead_keys, const bf16* const* ahead_values,
                      int64_t value_offset, int64_t ahead, int64_t row_bytes) {
  __m512 dots[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    dots[i] = _mm512_setzero_ps();
    if (i < ahead) prefetch_rows(ahead_keys[i] + offset, ahead_values[i] + value_offset, row_bytes);
    if (!WHOLE && i >= count) continue;
    const bf16* key = slots[i] + offset;
#pragma GCC unroll 8
    for (int c = 0; c < PAIRS; ++c) {
      dots[i] = _mm512_dpbf16_ps(dots[i], qv[c], (__m512bh)load_words32<FULL>(key + 32 * c, pair_mask[c]));
    }
  }
  return _mm512_mul_ps(kunlun_cpu::vec::transpose_sum16(dots), scale);
}

// score16 over keys widened to FP32 (by attend_split, once per chunk and KV head): each key's
// PAIRS pairs of 16 even and 16 odd dimensions; q_even / q_odd the query's, widened alike.
// fma(even, fma(odd, dot)) per pair of dimensions is VDPBF16PS's arithmetic in its order (the
// products of BF16 values are exact in FP32), so the scores have score16's bits.
template <int PAIRS, bool WHOLE>
inline __m512 score16_wide(const __m512* q_even, const __m512* q_odd, const float* keys, int64_t count,
                           __m512 scale) {
  __m512 dots[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    dots[i] = _mm512_setzero_ps();
    if (!WHOLE && i >= count) continue;
#pragma GCC unroll 8
    for (int c = 0; c < PAIRS; ++c) {
      const float* key = keys + (i * PAIRS + c) * 32;
      dots[i] = _mm512_fmadd_ps(q_even[c], _mm512_load_ps(key),
                                _mm512_fmadd_ps(q_odd[c], _mm512_load_ps(key + 16), dots[i]));
    }
  }
  return _mm512_mul_ps(kunlun_cpu::vec::transpose_sum16(dots), scale);
}

// P · V for TILE query heads over n value rows (slots[j] + offset), two keys to a VDPBF16PS: the
// probabilities of each head as BF16 pairs (pairs + g * kKeyChunk / 2: keys 2i and 2i + 1 in the
// low and high half of element i), each pair of value rows interleaved element by element once for
// all TILE heads; accumulators at base + g * D, multiplied by corrections[g] (the previous chunks'
// rescaling to the new maximum) as they are loaded. An odd last key pairs with a probability of 0
// (and its own row again).
template <int TILE, int CHUNKS, bool FULL>
inline void weigh_values(const uint32_t* pairs, const bf16* const* slots, int64_t offset, int64_t n,
                         const __mmask32* pair_mask, const __mmask16* lane_mask, const float* corrections,
                         float* base, int64_t D) {
  constexpr int PAIRS = (CHUNKS + 1) / 2;
  // Element 2i of a pair's first row and of its second, for i in the low (high) 16 of the 32.
  static constexpr uint16_t kInterleave[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                               8,  40, 9,  41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i low = _mm512_loadu_si512(kInterleave);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  __m512 sum[TILE][CHUNKS];
  for (int g = 0; g < TILE; ++g) {  // the sums so far, rescaled to this chunk's maximum
    const __m512 correction = _mm512_set1_ps(corrections[g]);
    for (int c = 0; c < CHUNKS; ++c)
      sum[g][c] = _mm512_mul_ps(_mm512_maskz_loadu_ps(lane_mask[c], base + g * D + 16 * c), correction);
  }
  for (int64_t j = 0; j < n; j += 2) {
    const bf16* first = slots[j] + offset;
    const bf16* second = j + 1 < n ? slots[j + 1] + offset : first;
    __m512i value[CHUNKS];
    for (int c = 0; c < PAIRS; ++c) {
      const __m512i a = load_words32<FULL>(first + 32 * c, pair_mask[c]);
      const __m512i b = load_words32<FULL>(second + 32 * c, pair_mask[c]);
      value[2 * c] = _mm512_permutex2var_epi16(a, low, b);
      if (2 * c + 1 < CHUNKS) value[2 * c + 1] = _mm512_permutex2var_epi16(a, high, b);
    }
    for (int g = 0; g < TILE; ++g) {
      const __m512bh weight = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[g * (kKeyChunk / 2) + j / 2]));
      for (int c = 0; c < CHUNKS; ++c) sum[g][c] = _mm512_dpbf16_ps(sum[g][c], (__m512bh)value[c], weight);
    }
  }
  for (int g = 0; g < TILE; ++g)
    for (int c = 0; c < CHUNKS; ++c) _mm512_mask_storeu_ps(base + g * D + 16 * c, lane_mask[c], sum[g][c]);
}

// weigh_values for the last `tile` (< head_tile) heads of a group.
template <int CHUNKS, bool FULL, int TILE = 1>
inline void weigh_values_tail(int64_t tile, const uint32_t* pairs, const bf16* const* slots, int64_t offset,
                              int64_t n, const __mmask32* pair_mask, const __mmask16* lane_mask,
                              const float* corrections, float* base, int64_t D) {
  if constexpr (TILE < head_tile<CHUNKS>()) {
    if (tile == TILE) {
      return weigh_values<TILE, CHUNKS, FULL>(pairs, slots, offset, n, pair_mask, lane_mask, corrections, base, D);
    }
    return weigh_values_tail<CHUNKS, FULL, TILE + 1>(tile, pairs, slots, offset, n, pair_mask, lane_mask,
                                                     corrections, base, D);
  }
}

// weigh_values in FMAs over value rows widened to FP32 (values: n rows of 16 · CHUNKS floats, by
// attend_split once per chunk and KV head) and each head's probabilities as FP32 (probs + g *
// kKeyChunk, the BF16 values weigh_values takes, 0 past the head's keys), in VDPBF16PS's order:
// per pair of keys the second's product, then the first's, each rounded (an odd last key pairs
// with a probability of 0 and its own row again, as there). The same bits as weigh_values.
template <int TILE, int CHUNKS>
inline void weigh_values_wide(const float* probs, const float* values, int64_t n, const __mmask16* lane_mask,
                              const float* corrections, float* base, int64_t D) {
  constexpr int64_t kRow = 16 * CHUNKS;
  __m512 sum[TILE][CHUNKS];
  for (int g = 0; g < TILE; ++g) {
    const __m512 correction = _mm512_set1_ps(corrections[g]);
    for (int c = 0; c < CHUNKS; ++c)
      sum[g][c] = _mm512_mul_ps(_mm512_maskz_loadu_ps(lane_mask[c], base + g * D + 16 * c), correction);
  }
  for (int64_t j = 0; j < n; j += 2) {
    const float* first = values + j * kRow;
    const float* second = j + 1 < n ? first + kRow : first;
    for (int g = 0; g < TILE; ++g) {
      const __m512 weight = _mm512_set1_ps(probs[g * kKeyChunk + j + 1]);
      for (int c = 0; c < CHUNKS; ++c) sum[g][c] = _mm512_fmadd_ps(weight, _mm512_load_ps(second + 16 * c), sum[g][c]);
    }
    for (int g = 0; g < TILE; ++g) {
      const __m512 weight = _mm512_set1_ps(probs[g * kKeyChunk + j]);
      for (int c = 0; c < CHUNKS; ++c) sum[g][c] = _mm512_fmadd_ps(weight, _mm512_load_ps(first + 16 * c), sum[g][c]);
    }
  }
  for (int g = 0; g < TILE; ++g)
    for (int c = 0; c < CHUNKS; ++c) _mm512_mask_storeu_ps(base + g * D + 16 * c, lane_mask[c], sum[g][c]);
}

// weigh_values_wide for the last `tile` (< head_tile) heads of a group.
template <int CHUNKS, int TILE = 1>
inline void weigh_values_wide_tail(int64_t tile, const float* probs, const float* values, int64_t n,
                                   const __mmask16* lane_mask, const float* corrections, float* base, int64_t D) {
  if constexpr (TILE < head_tile<CHUNKS>()) {
    if (tile == TILE) return weigh_values_wide<TILE, CHUNKS>(probs, values, n, lane_mask, corrections, base, D);
    return weigh_values_wide_tail<CHUNKS, TILE + 1>(tile, probs, values, n, lane_mask, corrections, base, D);
  }
}

// 2^whole for a whole number (or -inf: 0), exactly: VSCALEFSS, no call into libm's exp2f (which
// was a tenth of a draft row's attention, once per query head and chunk of keys).
inline float exact_pow2(float whole) { return _mm_cvtss_f32(_mm_scalef_ss(_mm_set_ss(1.0f), _mm_set_ss(whole))); }

// Query heads per KV head from which their maxima and sums are reduced 16 at a time
// (transpose_max16, sum16_halving); fewer, as a row without drafts has, one at a time.
constexpr int64_t kBatchedHeads = 8;

// The new running maxima of `count` query heads (whole numbers, base 2: the ceiling of the
// largest score so far) from their lanes' largest scores in this chunk, and each head's
// correction for what it summed before: an exact power of two, or 0 where the head had no keys
// yet (maximum -inf). corrections holds count rounded up to 16.
inline void update_maxima(const __m512* lanes, int64_t count, float* maxima, float* corrections) {
  if (count < kBatchedHeads) {
    for (int64_t g = 0; g < count; ++g) {
      const float new_max = std::max(maxima[g], std::ceil(_mm512_reduce_max_ps(lanes[g])));
      corrections[g] = maxima[g] == -INFINITY ? 0.0f : exact_pow2(maxima[g] - new_max);
      maxima[g] = new_max;
    }
    return;
  }
  for (int64_t g0 = 0; g0 < count; g0 += 16) {
    const __mmask16 mask = tail_mask(count - g0);
    const __m512 largest = kunlun_cpu::vec::transpose_max16(lanes + g0);
    const __m512 old_max = _mm512_maskz_loadu_ps(mask, maxima + g0);
    const __m512 new_max =
        _mm512_max_ps(old_max, _mm512_roundscale_ps(largest, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC));
    const __mmask16 first = _mm512_cmp_ps_mask(old_max, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
    _mm512_mask_storeu_ps(maxima + g0, mask, new_max);
    _mm512_storeu_ps(corrections + g0,
                     _mm512_maskz_scalef_ps(~first, _mm512_set1_ps(1.0f), _mm512_sub_ps(old_max, new_max)));
  }
}

// sums = sums · correction + the lane sums of this chunk's probabilities (sum_halving's order
// either way: the same bits for a head however many heads its task has).
inline void update_sums(const __m512* lanes, int64_t count, const float* corrections, float* sums) {
  if (count < kBatchedHeads) {
    for (int64_t g = 0; g < count; ++g) sums[g] = sums[g] * corrections[g] + kunlun_cpu::vec::sum_halving(lanes[g]);
    return;
  }
  for (int64_t g0 = 0; g0 < count; g0 += 16) {
    const __mmask16 mask = tail_mask(count - g0);
    const __m512 scaled = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, sums + g0), _mm512_loadu_ps(corrections + g0));
    _mm512_mask_storeu_ps(sums + g0, mask, _mm512_add_ps(scaled, kunlun_cpu::vec::sum16_halving(lanes + g0)));
  }
}

// One task (attention_plan.h): every query head (q: H rows of D, BF16, rotated) of `rows` rows over
// keys [start, end), row r's only up to row_ends[r], as flash-decoding does it: per head and part
// of the keys the running maximum score, the sum of exponentials relative to it, and the
// unnormalised output (acc, H × D), the parts' results one after another, merged by the caller.
// Chunks are aligned to key positions (multiples of kKeyChunk, which divides a part); a row's keys
// past its end score nothing (exact zeros in its sums), and its P · V stops at its own last key:
// each part of a row is folded in the same order of additions whichever task folds it, with
// whichever other rows. Each chunk of kKeyChunk slots is read from memory once for all heads:
// scores come 16 keys at a time from VDPBF16PS dot products (FP32 accumulation) with one
// transpose-reduce, in base 2 under a whole-number running maximum (probabilities()); each pair of
// value rows is interleaved once for up to head_tile query heads that share its KV head and weighed
// by their BF16 probabilities in VDPBF16PS (half the instructions of FP32 P · V, which was most of
// a draft row's attention); while a chunk computes, the next chunk's K and V rows are prefetched
// into L2 (blocks sit in random order, which the hardware prefetcher cannot follow), a key's rows
// between two dot products as the first query head of each KV head scores them. Issuing the whole
// next chunk's prefetches up front stalled on the line fill buffers (a profile put a large share of
// this kernel's samples on those instructions); spread out, into L2, they were a small gain at
// every batch and context size tried. Per chunk and KV head, all its query heads are scored before
// their maxima are updated together, and all their probabilities summed before their sums are
// (update_maxima, update_sums). Where a task has kMinWideHeads query heads per KV head or more (a
// row with drafts) and the CPU's FMAs outpace VDPBF16PS (bf16_dot.h), the chunk's K and V rows
// are widened to FP32 once per KV head and the same arithmetic runs in FMAs in VDPBF16PS's order
// (score16_wide, weigh_values_wide): the same bits, and a row with drafts' attention ~1.2-1.3x as
// fast where the FMAs do twice VDPBF16PS's multiply-adds (docs/performance.md). CHUNKS =
// ceil(D / 16) (or more: the masks zero the lanes past D); FULL where D = 16 · CHUNKS, whose K and
// V rows load unmasked (load_words32).
template <int CHUNKS, bool FULL>
void attend_split(const bf16* q, int64_t H, int64_t KVH, int64_t D, const PagedCache& keys, const PagedCache& values,
                  const int64_t* table, int64_t block_size, int64_t start, int64_t end, const int64_t* row_ends,
                  int64_t rows, float scale, float* maxima, float* sums, float* acc) {
  constexpr int PAIRS = (CHUNKS + 1) / 2;
  constexpr int64_t kTile = head_tile<CHUNKS>();
  const int64_t group = H / KVH, row_heads = group / rows;  // a KV head's query heads: [rows][row_heads]
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(bf16));
  __mmask32 pair_mask[PAIRS];
  for (int c = 0; c < PAIRS; ++c) {
    const int64_t left = D - 32 * c;
    pair_mask[c] = left >= 32 ? ~__mmask32(0) : (left <= 0 ? __mmask32(0) : (__mmask32(1) << left) - 1);
  }
  __mmask16 lane_mask[CHUNKS];
  for (int c = 0; c < CHUNKS; ++c) lane_mask[c] = tail_mask(D - 16 * c);
  // Scores in base 2 (scale · log2 e): probabilities are powers of two of them (probabilities()).
  const __m512 scale_v = _mm512_set1_ps(scale * 1.44269504088896341f);
  // [head in group][key]: scores, then (widened, below) probabilities
  std::vector<float> probs_storage(kKeyChunk * group);
  float* probs = probs_storage.data();
  std::vector<uint32_t> pair_storage(kKeyChunk / 2 * group);  // [head in group][pair of keys], BF16 pairs
  uint32_t* pairs = pair_storage.data();
  // With kMinWideHeads query heads or more where the CPU's FMAs outpace VDPBF16PS (bf16_dot.h): a
  // chunk's K and V rows of one KV head widened to FP32 for score16_wide and weigh_values_wide
  // (64-byte aligned, as they load them).
  const bool wide = group >= kMinWideHeads && kunlun_cpu::avx512::bf16_dot_policy().load(std::memory_order_relaxed) ==
                                                  kunlun_cpu::avx512::Bf16Dot::kFma;
  // (Empty, with no allocation, for a decode row alone.)
  std::vector<float> wide_storage(wide ? kKeyChunk * (PAIRS * 32 + 16 * CHUNKS) + 16 : 0);
  float* wide_keys =
      wide ? reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(wide_storage.data()) + 63) & ~uintptr_t(63))
           : nullptr;
  float* wide_values = wide ? wide_keys + kKeyChunk * PAIRS * 32 : nullptr;
  // Per query head of a KV head: its lanes' largest score, then its probabilities' lane sums
  // (rounded up to 16 heads, the tail's lanes unused); and its correction for the chunk.
  const int64_t padded_group = (group + 15) / 16 * 16;
  std::vector<__m512> head_lanes(padded_group, _mm512_setzero_ps());
  std::vector<float> corrections(padded_group);
  // Slot pointers of this chunk and the next, swapped as the chunks advance.
  const bf16* slot_storage[4][kKeyChunk];
  const bf16** key_slots = slot_storage[0];
  const bf16** value_slots = slot_storage[1];
  const bf16** next_key_slots = slot_storage[2];
  const bf16** next_value_slots = slot_storage[3];
  auto begin_part = [&] {
    for (int64_t h = 0; h < H; ++h) maxima[h] = -INFINITY, sums[h] = 0.0f;
    std::fill(acc, acc + H * D, 0.0f);
  };
  begin_part();
  const auto chunk_end = [end](int64_t key) { return std::min(end, (key / kKeyChunk + 1) * kKeyChunk); };
  std::vector<int64_t> valid(rows);  // each row's keys in the chunk: a prefix of it
  // The first two chunks' rows up front: a decode step's keys are cold (the weights streamed through
  // the caches since this layer last ran), and nothing prefetched them; from then on each chunk
  // prefetches the next one while it computes.
  kunlun_cpu::paged::prefetch_slots(keys, values, table, block_size, start, chunk_end(chunk_end(start)));
  gather_slots(keys, table, block_size, start, chunk_end(start), key_slots);
  gather_slots(values, table, block_size, start, chunk_end(start), value_slots);
  for (int64_t c0 = start, n = 0; c0 < end; c0 += n) {
    n = chunk_end(c0) - c0;
    const int64_t next = c0 + n < end ? chunk_end(c0 + n) - c0 - n : 0;
    if (c0 > start && kunlun_cpu::paged::starts_part(c0)) {  // the next part's results
      maxima += H, sums += H, acc += H * D;
      begin_part();
    }
    bool ragged = false;  // a row's keys end inside the chunk (the drafts' after it are not its own)
    for (int64_t r = 0; r < rows; ++r) {
      valid[r] = std::clamp<int64_t>(row_ends[r] - c0, 0, n);
      ragged |= valid[r] < n;
    }
    if (next > 0) {
      gather_slots(keys, table, block_size, c0 + n, c0 + n + next, next_key_slots);
      gather_slots(values, table, block_size, c0 + n, c0 + n + next, next_value_slots);
    }
    for (int64_t kv = 0; kv < KVH; ++kv) {
      const int64_t key_offset = kv * keys.head_stride, value_offset = kv * values.head_stride;
      float* head_maxima = maxima + kv * group;
      float* head_sums = sums + kv * group;
      // Every query head's scores first, then all their maxima; their probabilities, then all
      // their sums: reduced 16 heads at a time where a row has drafts (one head at a time, with a
      // scalar update and a libm exp2f each, they were a quarter of this kernel's time there).
      if (wide) {
        // The chunk's K rows widened once for all the KV head's query heads, the next chunk's
        // rows of this KV head prefetched between them (as score16 does from the first head).
        for (int64_t i = 0; i < n; ++i) {
          if (i < next) prefetch_rows(next_key_slots[i] + key_offset, next_value_slots[i] + value_offset, row_bytes);
          const bf16* key = key_slots[i] + key_offset;
          for (int c = 0; c < PAIRS; ++c) {
            const __m512i v = load_words32<FULL>(key + 32 * c, pair_mask[c]);
            _mm512_store_ps(wide_keys + (i * PAIRS + c) * 32, even_words(v));
            _mm512_store_ps(wide_keys + (i * PAIRS + c) * 32 + 16, odd_words(v));
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        __m512bh qv[PAIRS];
        __m512 q_even[PAIRS], q_odd[PAIRS];
        for (int c = 0; c < PAIRS; ++c) {
          qv[c] = (__m512bh)_mm512_maskz_loadu_epi16(pair_mask[c], q + (kv * group + g) * D + 32 * c);
          if (wide) q_even[c] = even_words((__m512i)qv[c]), q_odd[c] = odd_words((__m512i)qv[c]);
        }
        float* p = probs + g * kKeyChunk;
        const int64_t keys_here = valid[g / row_heads];
        __m512 max_lanes = _mm512_set1_ps(-INFINITY);
        int64_t j = 0;
        // The first query head of each KV head prefetches the next chunk's rows of that KV head.
        auto ahead = [&](int64_t first) { return g == 0 ? std::clamp<int64_t>(next - first, 0, 16) : 0; };
        for (; j + 16 <= n; j += 16) {
          const __m512 scores =
              wide ? score16_wide<PAIRS, true>(q_even, q_odd, wide_keys + j * PAIRS * 32, 16, scale_v)
                   : score16<PAIRS, true, FULL>(qv, pair_mask, key_slots + j, key_offset, 16, scale_v,
                                                next_key_slots + j, next_value_slots + j, value_offset, ahead(j),
                                                row_bytes);
          _mm512_storeu_ps(p + j, scores);
          max_lanes = _mm512_mask_max_ps(max_lanes, tail_mask(keys_here - j), max_lanes, scores);
        }
        if (j < n) {
          const __mmask16 mask = tail_mask(n - j);
          const __m512 scores =
              wide ? score16_wide<PAIRS, false>(q_even, q_odd, wide_keys + j * PAIRS * 32, n - j, scale_v)
                   : score16<PAIRS, false, FULL>(qv, pair_mask, key_slots + j, key_offset, n - j, scale_v,
                                                 next_key_slots + j, next_value_slots + j, value_offset, ahead(j),
                                                 row_bytes);
          _mm512_mask_storeu_ps(p + j, mask, scores);
          max_lanes = _mm512_mask_max_ps(max_lanes, mask & tail_mask(keys_here - j), max_lanes, scores);
        }
        head_lanes[g] = max_lanes;
      }
      update_maxima(head_lanes.data(), group, head_maxima, corrections.data());
      for (int64_t g = 0; g < group; ++g) {
        float* p = probs + g * kKeyChunk;
        const int64_t keys_here = valid[g / row_heads];
        const float new_max = head_maxima[g];
        __m512 total = _mm512_setzero_ps();
        uint32_t* pair = pairs + g * (kKeyChunk / 2);
        for (int64_t i = 0; i < n; i += 32) {  // 32 probabilities, packed as 16 BF16 pairs of keys (0 past its own)
          const __mmask16 first = tail_mask(keys_here - i), second = tail_mask(keys_here - i - 16);
          const __m512 e0 = probabilities(_mm512_maskz_loadu_ps(first, p + i), new_max, first);
          const __m512 e1 = probabilities(_mm512_maskz_loadu_ps(second, p + i + 16), new_max, second);
          total = _mm512_add_ps(total, _mm512_add_ps(e0, e1));
          if (wide) {  // as FP32 in place of the scores, as the BF16 conversion makes them: denormals 0
            const __m512 smallest = _mm512_set1_ps(FLT_MIN);
            _mm512_storeu_ps(p + i, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(e0, smallest, _CMP_GE_OQ), e0));
            _mm512_storeu_ps(p + i + 16, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(e1, smallest, _CMP_GE_OQ), e1));
          } else {  // exact: each is a BF16 value already
            _mm512_storeu_si512(pair + i / 2, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
          }
        }
        head_lanes[g] = total;
      }
      update_sums(head_lanes.data(), group, corrections.data(), head_sums);
      // P · V for this KV head's query heads g_begin .. g_end - 1 over the chunk's first `count`
      // keys, kTile at a time so the accumulators stay in registers.
      float* base = acc + kv * group * D;
      if (wide) {  // the chunk's value rows widened once for all the KV head's query heads
        for (int64_t i = 0; i < n; ++i) {
          const bf16* value = value_slots[i] + value_offset;
          for (int c = 0; c < CHUNKS; ++c) {
            const __m256i words = FULL ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(value + 16 * c))
                                       : _mm256_maskz_loadu_epi16(lane_mask[c], value + 16 * c);
            _mm512_store_ps(wide_values + i * 16 * CHUNKS + 16 * c,
                            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(words), 16)));
          }
        }
      }
      const auto weigh = [&](int64_t g_begin, int64_t g_end, int64_t count) {
        int64_t g0 = g_begin;
        if (wide) {
          for (; g0 + kTile <= g_end; g0 += kTile) {
            weigh_values_wide<kTile, CHUNKS>(probs + g0 * kKeyChunk, wide_values, count, lane_mask,
                                             corrections.data() + g0, base + g0 * D, D);
          }
          if (g0 < g_end) {
            weigh_values_wide_tail<CHUNKS>(g_end - g0, probs + g0 * kKeyChunk, wide_values, count, lane_mask,
                                           corrections.data() + g0, base + g0 * D, D);
          }
          return;
        }
        for (; g0 + kTile <= g_end; g0 += kTile) {
          weigh_values<kTile, CHUNKS, FULL>(pairs + g0 * (kKeyChunk / 2), value_slots, value_offset, count,
                                            pair_mask, lane_mask, corrections.data() + g0, base + g0 * D, D);
        }
        if (g0 < g_end) {
          weigh_values_tail<CHUNKS, FULL>(g_end - g0, pairs + g0 * (kKeyChunk / 2), value_slots, value_offset,
                                          count, pair_mask, lane_mask, corrections.data() + g0, base + g0 * D, D);
        }
      };
      if (!ragged) {
        weigh(0, group, n);
      } else {  // each row over its own keys: another row's value rows never reach it, not even times 0
        for (int64_t r = 0; r < rows; ++r) weigh(r * row_heads, (r + 1) * row_heads, valid[r]);
      }
    }
    std::swap(key_slots, next_key_slots);
    std::swap(value_slots, next_value_slots);
  }
}

void attend(const bf16* q, int64_t H, int64_t KVH, int64_t D, const PagedCache& keys, const PagedCache& values,
            const int64_t* table, int64_t block_size, int64_t start, int64_t end, const int64_t* row_ends,
            int64_t rows, float scale, float* maxima, float* sums, float* acc) {
  auto run = [&](auto chunks) {  // FULL where D fills its CHUNKS exactly (no lane masked off)
    constexpr int CHUNKS = decltype(chunks)::value;
    if (D == 16 * CHUNKS) {
      return attend_split<CHUNKS, true>(q, H, KVH, D, keys, values, table, block_size, start, end, row_ends, rows,
                                        scale, maxima, sums, acc);
    }
    attend_split<CHUNKS, false>(q, H, KVH, D, keys, values, table, block_size, start, end, row_ends, rows, scale,
                                maxima, sums, acc);
  };
  switch ((D + 15) / 16) {
    case 2: return run(std::integral_constant<int, 2>{});
    case 4: return run(std::integral_constant<int, 4>{});
    case 8: return run(std::integral_constant<int, 8>{});
    default: return run(std::integral_constant<int, 16>{});
  }
}

}  // namespace

namespace kunlun_cpu {

std::string bf16_dot() {
  return avx512::bf16_dot_policy().load() == avx512::Bf16Dot::kFma ? "fma" : "dpbf16";
}

void set_bf16_dot(const std::string& method) {
  TORCH_CHECK(method == "fma" || method == "dpbf16", "BF16 dot products must be 'fma' or 'dpbf16', not '", method,
              "'");
  TORCH_CHECK(method == "dpbf16" || avx512::fma_matches_dpbf16(),
              "this CPU's VDPBF16PS rounds otherwise than FMAs in its order: 'fma' would change decode attention's "
              "bits, so it keeps 'dpbf16'");
  avx512::bf16_dot_policy().store(method == "fma" ? avx512::Bf16Dot::kFma : avx512::Bf16Dot::kDpbf16);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                            const at::Tensor& sin, const at::Tensor& k_blocks, const at::Tensor& v_blocks,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            int64_t window) {
  paged::check_rotary_inputs(q, k, v, cos, sin, k_blocks, v_blocks, check_bf16, /*min_head_dim=*/0);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  TORCH_CHECK(B >= 1, "decode_attention needs at least one sequence");
  TORCH_CHECK(D <= 256 && H / KVH <= 256, "head_dim and query heads per KV head must be at most 256, got ", D,
              " and ", H / KVH);
  paged::check_block_tables(block_tables, context_lens, B, k_blocks);
  const PagedCache keys = paged::cache<bf16>(k_blocks), values = paged::cache<bf16>(v_blocks);
  const int64_t block_size = k_blocks.size(1), max_blocks = block_tables.size(1);
  const int64_t* tables = block_tables.const_data_ptr<int64_t>();
  const int64_t* lengths = context_lens.const_data_ptr<int64_t>();
  const bf16* cp = cos.const_data_ptr<bf16>();
  const bf16* sp = sin.const_data_ptr<bf16>();

  // The new token's K (rotated) and V go into the cache first: it attends to itself.
  std::vector<float> rotated(D);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t position = lengths[b] - 1;
    const int64_t block = tables[b * max_blocks + position / block_size], slot = position % block_size;
    for (int64_t h = 0; h < KVH; ++h) {
      rotate(k.const_data_ptr<bf16>() + b * k.stride(0) + h * k.stride(1), cp + b * D, sp + b * D, D, rotated.data());
      bf16* key = keys.at(block, slot, h);
      for (int64_t d = 0; d < D; ++d) key[d] = bf16(rotated[d]);
      const bf16* value = v.const_data_ptr<bf16>() + b * v.stride(0) + h * v.stride(1);
      std::copy(value, value + D, values.at(block, slot, h));
    }
  }
  at::Tensor out = at::empty({B, H * D}, q.options());
  bf16* op = out.mutable_data_ptr<bf16>();
  // A task is a range of keys for the query heads of one or more sequences (attention_plan.h):
  // each slot it covers is read once for all of them.
  const int64_t group = H / KVH;
  const paged::AttentionPlan plan = paged::plan_attention(tables, lengths, B, max_blocks, block_size, window, H,
                                                          at::get_num_threads());
  std::vector<float> maxima(plan.heads), sums(plan.heads), partial(plan.heads * D);
  paged::run_tasks(plan, [&](auto take) {
    std::vector<float> rotated_q(D);
    std::vector<bf16> queries;
    for (int64_t t = take(); t >= 0; t = take()) {
      const paged::AttentionTask& task = plan.tasks[t];
      queries.resize(task.rows * H * D);
      for (int64_t r = 0; r < task.rows; ++r) {
        const int64_t b = task.first_row + r;
        for (int64_t h = 0; h < H; ++h) {
          rotate(q.const_data_ptr<bf16>() + b * q.stride(0) + h * q.stride(1), cp + b * D, sp + b * D, D,
                 rotated_q.data());
          bf16* query = queries.data() + (((h / group) * task.rows + r) * group + h % group) * D;
          for (int64_t d = 0; d < D; d += 16) {
            const __mmask16 mask = tail_mask(D - d);
            store_bf16x16(query + d, _mm512_maskz_loadu_ps(mask, rotated_q.data() + d), mask);
          }
        }
      }
      attend(queries.data(), task.rows * H, KVH, D, keys, values, tables + task.first_row * max_blocks, block_size,
             task.key_begin, task.key_end, lengths + task.first_row, task.rows, static_cast<float>(scale),
             maxima.data() + task.head_offset,
             sums.data() + task.head_offset, partial.data() + task.head_offset * D);
    }
  });
  at::parallel_for(0, B * H, 16, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> index;  // a row's parts' results, in key order
    std::vector<float> weight;   // and their weights
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / H, h = item % H;
      // The maxima are base 2 and whole numbers: the rescalings are exact powers of two.
      paged::merge_weights(plan, b, h, H, group, maxima.data(), sums.data(), exact_pow2, index, weight);
      for (int64_t d = 0; d < D; d += 16) {
        const __mmask16 mask = tail_mask(D - d);
        __m512 merged = _mm512_setzero_ps();
        for (size_t p = 0; p < index.size(); ++p) {
          merged = _mm512_fmadd_ps(_mm512_set1_ps(weight[p]),
                                   _mm512_maskz_loadu_ps(mask, partial.data() + index[p] * D + d), merged);
        }
        store_bf16x16(op + b * H * D + h * D + d, merged, mask);
      }
    }
  });
  return out;
}

}  // namespace kunlun_cpu
