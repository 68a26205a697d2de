// Decode attention for x86 CPUs with AVX2 + FMA (FP32 queries, an FP32 or BF16 paged KV cache):
//
//   kunlun_cpu::decode_attention(q [B, H, D], k [B, KVH, D], v [B, KVH, D], cos [B, D], sin [B, D],
//                                k_blocks, v_blocks [NB, BS, KVH, D], block_tables [B, MB],
//                                context_lens [B], scale, window)  -> [B, H * D]
//     one new token per sequence: rotary on q and k, k and v written (rounded to the cache's
//     dtype) into the paged cache at position context_len - 1, then softmax(scale · q·Kᵀ) · V
//     over the sequence's blocks (GQA: query head h reads KV head h / (H / KVH); window > 0
//     keeps the last `window` keys). One call replaces a scatter, two gathers and an SDPA call.
//
// On these CPUs BF16 arithmetic is emulated, so the AVX2 tier keeps activations, cos/sin and the
// norm weights in FP32, and the reference is plain FP32 math (there are no BF16 roundings to
// reproduce). The KV cache is FP32 or BF16 (`--kv-cache-dtype`): a BF16 cache holds K and V rounded
// to nearest even (as torch's .to(torch.bfloat16)) and is widened to FP32 in registers as attention
// reads it, so attention computes in FP32 over the rounded keys and values. It differs from
// PyTorch's attention over the same cache only by summation order and our exp (relative error
// ~2e-7), i.e. by a few FP32 ulps.
//
// Only AVX2, FMA and F16C instructions are used (built with -mavx2 -mfma -mf16c): no AVX-512, even
// on CPUs that have it. Masked loads and stores (VMASKMOVPS) are kept out of inner loops: they are
// slow on AMD Zen 2 (stores especially), so they only handle row tails.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include "attention_tiles.h"
#include "rotary_cache.h"
#include "vec_avx2.h"
#include "../kernels.h"
#include "../attention_plan.h"
#include "../paged_cache.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using kunlun_cpu::avx2::bf16;
using kunlun_cpu::avx2::check_rotary_inputs;
using kunlun_cpu::avx2::hmax;
using kunlun_cpu::avx2::hsum;
using kunlun_cpu::avx2::kHeadTile;
using kunlun_cpu::avx2::kPairedScoreTile;
using kunlun_cpu::avx2::kPairedValueTile;
using kunlun_cpu::avx2::kScoreTile;
using kunlun_cpu::avx2::kSegmentKeys;
using kunlun_cpu::avx2::kStripe;
using kunlun_cpu::avx2::pair_lanes;
using kunlun_cpu::avx2::pick_accumulate;
using kunlun_cpu::avx2::pick_accumulate_paired;
using kunlun_cpu::avx2::pick_score;
using kunlun_cpu::avx2::pick_score_paired_tile;
using kunlun_cpu::avx2::rotate;
using kunlun_cpu::avx2::store_ps;
using kunlun_cpu::avx2::store_row;
using kunlun_cpu::avx2::tail_mask;
using kunlun_cpu::avx2::unpair_lanes;
using kunlun_cpu::paged::gather_slots;
template <typename T>
using PagedCache = kunlun_cpu::paged::PagedCache<T>;

static_assert(kunlun_cpu::paged::kShortPartKeys % kSegmentKeys == 0 &&
                  kunlun_cpu::paged::kLongPartKeys % kSegmentKeys == 0,
              "a part is whole segments");
// How far ahead of the key rows being scored the next ones are prefetched (in reading order); 32,
// 64 or 128 keys ahead, or into L1, ran no faster.
constexpr int64_t kPrefetchKeys = 16;

template <typename T>
struct AttentionShape {
  int64_t H, KVH, D, padded_dim;  // padded_dim: D rounded up to whole vectors (q and acc rows)
  const PagedCache<T>* keys;
  const PagedCache<T>* values;
  int64_t block_size;
  float scale;
};

// One task (attention_plan.h): every query head (q: H rows of padded_dim FP32, rotated, zero
// padded) of `rows` rows over keys [start, end), row r's only up to row_ends[r], as flash-decoding
// does it: per head and part of the keys the running maximum score, the sum of exponentials
// relative to it, and the unnormalised output (acc, H × padded_dim), the parts' results one after
// another, merged by the caller. The keys go in segments aligned to key positions (multiples of
// kSegmentKeys, which divides a part); a row's keys past its end score -inf, adding exact zeros
// to its sums, and its P·V stops at its own last key: each part of a row is folded in the same
// order of additions, and under the same maxima, whichever task folds it, with whichever other
// rows. Within a segment, KV head by
// KV head: first every query head's scores (each key vector loaded and widened once for up to
// kScoreTile query heads that share its KV head: one FMA chain per key and head, one
// transpose-reduce per 4 keys and head), then one softmax step per query head over the whole
// segment, then P·V (each value vector widened once for up to kHeadTile heads). Reading order
// is K rows of a KV head's segment, then its V rows: as K rows are scored, the K rows
// kPrefetchKeys ahead in that order and the V rows of the same keys are prefetched into L2
// (blocks sit in random order, which the hardware prefetcher cannot follow), a row per key,
// spread out rather than all at once (issued all at once they stall on the line fill buffers, as
// the AVX-512 kernel found). Those rows are one KV head's of each slot, a third of it strided
// through the block, and left cold keys arriving at ~9 GB/s where the weights stream at 20-25:
// the next segment's slots are prefetched too, whole (every KV head's K and V rows of a key are
// contiguous), a share at each score step.
template <bool TAIL, bool PAIRED, typename T>
void attend_split(const float* q, const AttentionShape<T>& s, const int64_t* table, int64_t start, int64_t end,
                  const int64_t* row_ends, int64_t rows, float* maxima, float* sums, float* acc) {
  static_assert(!PAIRED || (!TAIL && std::is_same_v<T, bf16>), "the paired layout is a BF16 cache's, D % 16 == 0");
  static_assert(kSegmentKeys % 8 == 0, "scores are stored as whole vectors of 8 keys");
  const int64_t H = s.H, KVH = s.KVH, D = s.D, padded_dim = s.padded_dim, group = H / KVH;
  const int64_t row_heads = group / rows;  // a KV head's query heads: [rows][row_heads]
  const PagedCache<T>& keys = *s.keys;
  const PagedCache<T>& values = *s.values;
  const int64_t full = D / 8, vectors = padded_dim / 8, length = end - start;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  const __m256i tail = tail_mask(D % 8);
  std::vector<float> probs_storage(kSegmentKeys * group), corrections(group);  // probs: [head in group][key]
  float* probs = probs_storage.data();
  std::vector<const T*> key_slots(length), value_slots(length);  // KV head 0's rows of each key
  gather_slots(keys, table, s.block_size, start, end, key_slots.data());
  gather_slots(values, table, s.block_size, start, end, value_slots.data());
  auto begin_part = [&] {
    for (int64_t h = 0; h < H; ++h) maxima[h] = -INFINITY, sums[h] = 0.0f;
    std::fill(acc, acc + H * padded_dim, 0.0f);
  };
  begin_part();
  std::vector<int64_t> valid(rows);  // each row's keys in the segment: a prefix of it
  // Where the segment holding key start + offset ends, as an offset.
  const auto segment_end = [start, length](int64_t offset) {
    return std::min(length, ((start + offset) / kSegmentKeys + 1) * kSegmentKeys - start);
  };
  // The first kPrefetchKeys keys' rows up front: a decode step's keys are cold (the weights
  // streamed through the caches since this layer last ran), and nothing prefetched them.
  kunlun_cpu::paged::prefetch_slots(keys, values, table, s.block_size, start, std::min(end, start + kPrefetchKeys));
  const auto prefetch_row = [row_bytes](const T* row) {
    const char* bytes = reinterpret_cast<const char*>(row);
    for (int64_t offset = 0; offset < row_bytes; offset += 64) _mm_prefetch(bytes + offset, _MM_HINT_T1);
  };
  // A slot's rows of every KV head, contiguous: from its KV head 0 row on, a slot stride's bytes.
  const int64_t key_slot_bytes = keys.slot_stride * static_cast<int64_t>(sizeof(T));
  const int64_t value_slot_bytes = values.slot_stride * static_cast<int64_t>(sizeof(T));
  const auto prefetch_slot = [](const T* slot, int64_t bytes) {
    const char* first = reinterpret_cast<const char*>(slot);
    for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch(first + offset, _MM_HINT_T1);
  };
  for (int64_t s0 = 0, n = 0; s0 < length; s0 += n) {
    n = segment_end(s0) - s0;
    const int64_t score_steps = (n + 7) / 8;
    if (s0 > 0 && kunlun_cpu::paged::starts_part(start + s0)) {  // the next part's results
      maxima += H, sums += H, acc += H * padded_dim;
      begin_part();
    }
    bool ragged = false;  // a row's keys end inside the segment (the drafts' after it are not its own)
    for (int64_t r = 0; r < rows; ++r) {
      valid[r] = std::clamp<int64_t>(row_ends[r] - start - s0, 0, n);
      ragged |= valid[r] < n;
    }
    const T* const* segment_keys = key_slots.data() + s0;
    const T* const* segment_values = value_slots.data() + s0;
    for (int64_t kv = 0; kv < KVH; ++kv) {
      for (int64_t j = 0; j < n; j += 8) {
        const int64_t count = std::min<int64_t>(8, n - j);
        const T* rows[8];
        for (int64_t i = 0; i < 8; ++i) {  // lanes past the segment re-read its first key, masked off
          rows[i] = segment_keys[j + (i < count ? i : 0)] + kv * keys.head_stride;
        }
        for (int64_t i = j; i < j + count; ++i) {
          // The K row kPrefetchKeys ahead: in this KV head's segment, the next KV head's, or the
          // next segment's first KV head; and this key's V row, read once the segment is scored.
          int64_t ahead = i + kPrefetchKeys, ahead_kv = kv, ahead_s0 = s0;
          if (ahead >= n) {
            ahead -= n;
            if (++ahead_kv == KVH) ahead_kv = 0, ahead_s0 += n;
          }
          if (ahead_s0 + ahead < length) prefetch_row(key_slots[ahead_s0 + ahead] + ahead_kv * keys.head_stride);
          prefetch_row(segment_values[i] + kv * values.head_stride);
        }
        // A share of the next segment's slots, whole, at each of this segment's score steps.
        const int64_t steps = KVH * score_steps, step = kv * score_steps + j / 8;
        const int64_t next = s0 + n, next_n = segment_end(next) - next;
        for (int64_t i = next + step * next_n / steps; i < next + (step + 1) * next_n / steps; ++i) {
          prefetch_slot(key_slots[i], key_slot_bytes);
          prefetch_slot(value_slots[i], value_slot_bytes);
        }
        if constexpr (PAIRED) {
          for (int64_t g0 = 0; g0 < group; g0 += kPairedScoreTile) {
            const int tile = static_cast<int>(std::min<int64_t>(kPairedScoreTile, group - g0));
            pick_score_paired_tile<kPairedScoreTile>(tile)(q + (kv * group + g0) * padded_dim, padded_dim, rows, count,
                                                           D / 16, tail, s.scale, probs + g0 * kSegmentKeys + j);
          }
        } else {
          for (int64_t g0 = 0; g0 < group; g0 += kScoreTile) {
            const int tile = static_cast<int>(std::min<int64_t>(kScoreTile, group - g0));
            pick_score<TAIL, T>(tile)(q + (kv * group + g0) * padded_dim, padded_dim, rows, count, full, tail, s.scale,
                                      probs + g0 * kSegmentKeys + j);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = kv * group + g;
        float* p = probs + g * kSegmentKeys;
        const int64_t keys_here = valid[g / row_heads];
        if (keys_here == 0) {  // none here (a later row's draft keys): its sums and outputs stay as they are
          corrections[g] = maxima[h] == -INFINITY ? 0.0f : 1.0f;
          continue;
        }
        std::fill(p + keys_here, p + n, -INFINITY);
        __m256 max_lanes = _mm256_set1_ps(-INFINITY);
        for (int64_t j = 0; j < n; j += 8) max_lanes = _mm256_max_ps(max_lanes, _mm256_loadu_ps(p + j));
        const float new_max = std::max(maxima[h], hmax(max_lanes));
        corrections[g] = maxima[h] == -INFINITY ? 0.0f : std::exp(maxima[h] - new_max);
        __m256 total = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j += 8) {  // masked-off keys score -inf: they add 0
          const __m256 e = kunlun_cpu::avx2::exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + j), _mm256_set1_ps(new_max)));
          _mm256_storeu_ps(p + j, e);
          total = _mm256_add_ps(total, e);
        }
        sums[h] = sums[h] * corrections[g] + hsum(total);
        maxima[h] = new_max;
      }
      // P · V for this KV head's query heads g_begin .. g_end - 1 over the segment's first `count`
      // keys, in stripes of D and tiles of heads so the accumulators stay in registers; the earlier
      // segments' sums are rescaled on the way.
      const auto weigh = [&](int64_t g_begin, int64_t g_end, int64_t count) {
        if constexpr (PAIRED) {
          for (int64_t g0 = g_begin; g0 < g_end; g0 += kPairedValueTile) {
            const int tile = static_cast<int>(std::min<int64_t>(kPairedValueTile, g_end - g0));
            for (int64_t pair = 0; pair < D / 16; ++pair) {
              pick_accumulate_paired<kPairedValueTile>(tile)(segment_values, kv * values.head_stride, count,
                                                             probs + g0 * kSegmentKeys, corrections.data() + g0,
                                                             acc + (kv * group + g0) * padded_dim, padded_dim, pair);
            }
          }
          return;
        }
        for (int64_t g0 = g_begin; g0 < g_end; g0 += kHeadTile) {
          const int tile = static_cast<int>(std::min<int64_t>(kHeadTile, g_end - g0));
          for (int64_t first = 0; first < vectors; first += kStripe) {
            const int width = static_cast<int>(std::min<int64_t>(kStripe, vectors - first));
            pick_accumulate<T>(tile, width, TAIL && first + width == vectors)(
                segment_values, kv * values.head_stride, count, probs + g0 * kSegmentKeys, corrections.data() + g0,
                acc + (kv * group + g0) * padded_dim, padded_dim, first, tail);
          }
        }
      };
      if (!ragged) {
        weigh(0, group, n);
      } else {  // each row over its own keys: another row's value rows never reach it, not even times 0
        for (int64_t r = 0; r < rows; ++r) weigh(r * row_heads, (r + 1) * row_heads, valid[r]);
      }
    }
  }
}

}  // namespace

namespace kunlun_cpu {

namespace {

// decode_attention over a cache of T (float or BF16), its inputs checked.
template <typename T>
at::Tensor decode_attention_over(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                                 const at::Tensor& sin, const at::Tensor& k_blocks, const at::Tensor& v_blocks,
                                 const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                 int64_t window) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  TORCH_CHECK(B >= 1, "decode_attention needs at least one sequence");
  paged::check_block_tables(block_tables, context_lens, B, k_blocks);
  const PagedCache<T> keys = paged::cache<T>(k_blocks), values = paged::cache<T>(v_blocks);
  const int64_t block_size = k_blocks.size(1), max_blocks = block_tables.size(1);
  const int64_t* tables = block_tables.const_data_ptr<int64_t>();
  const int64_t* lengths = context_lens.const_data_ptr<int64_t>();
  const float* cp = cos.const_data_ptr<float>();
  const float* sp = sin.const_data_ptr<float>();

  // The new token's K (rotated) and V go into the cache first (rounded to its dtype): it attends
  // to itself as it is stored.
  std::vector<float> scratch(D), rotated(D);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t position = lengths[b] - 1;
    const int64_t block = tables[b * max_blocks + position / block_size], slot = position % block_size;
    for (int64_t h = 0; h < KVH; ++h) {
      rotate(k.const_data_ptr<float>() + b * k.stride(0) + h * k.stride(1), cp + b * D, sp + b * D, D,
             rotated.data(), scratch.data());
      store_row(rotated.data(), keys.at(block, slot, h), D);
      store_row(v.const_data_ptr<float>() + b * v.stride(0) + h * v.stride(1), values.at(block, slot, h), D);
    }
  }
  at::Tensor out = at::empty({B, H * D}, q.options());
  float* op = out.mutable_data_ptr<float>();
  const int64_t padded_dim = (D + 7) / 8 * 8;
  const AttentionShape<T> shape{H, KVH, D, padded_dim, &keys, &values, block_size, static_cast<float>(scale)};
  // A task is a range of keys for the query heads of one or more sequences (attention_plan.h):
  // each slot it covers is read once for all of them.
  const int64_t group = H / KVH;
  const paged::AttentionPlan plan = paged::plan_attention(tables, lengths, B, max_blocks, block_size, window, H,
                                                          at::get_num_threads());
  std::vector<float> maxima(plan.heads), sums(plan.heads), partial(plan.heads * padded_dim);
  constexpr bool kBF16 = std::is_same_v<T, bf16>;
  const bool paired = kBF16 && D % 16 == 0;
  auto attend = D % 8 != 0 ? &attend_split<true, false, T> : &attend_split<false, false, T>;
  if constexpr (kBF16) {
    if (paired) attend = &attend_split<false, true, T>;
  }
  paged::run_tasks(plan, [&](auto take) {
    std::vector<float> queries, rotate_scratch(D);
    for (int64_t t = take(); t >= 0; t = take()) {
      const paged::AttentionTask& task = plan.tasks[t];
      queries.assign(task.rows * H * padded_dim, 0.0f);  // rows zero padded
      for (int64_t r = 0; r < task.rows; ++r) {
        const int64_t b = task.first_row + r;
        for (int64_t h = 0; h < H; ++h) {
          rotate(q.const_data_ptr<float>() + b * q.stride(0) + h * q.stride(1), cp + b * D, sp + b * D, D,
                 queries.data() + (((h / group) * task.rows + r) * group + h % group) * padded_dim,
                 rotate_scratch.data());
        }
      }
      if (paired) {
        for (int64_t row = 0; row < task.rows * H; ++row) pair_lanes(queries.data() + row * padded_dim, D);
      }
      AttentionShape<T> task_shape = shape;
      task_shape.H = task.rows * H;
      attend(
          queries.data(), task_shape, tables + task.first_row * max_blocks, task.key_begin, task.key_end,
          lengths + task.first_row, task.rows, maxima.data() + task.head_offset, sums.data() + task.head_offset,
          partial.data() + task.head_offset * padded_dim);
    }
  });
  at::parallel_for(0, B * H, 16, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> index;  // a row's parts' results, in key order
    std::vector<float> weight;   // and their weights
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / H, h = item % H;
      paged::merge_weights(plan, b, h, H, group, maxima.data(), sums.data(), [](float x) { return std::exp(x); },
                           index, weight);
      const auto merged = [&](int64_t d) {  // lanes d .. d + 7 of the parts' outputs, weighted
        __m256 sum = _mm256_setzero_ps();
        for (size_t p = 0; p < index.size(); ++p) {
          sum = _mm256_fmadd_ps(_mm256_set1_ps(weight[p]), _mm256_loadu_ps(partial.data() + index[p] * padded_dim + d),
                                sum);
        }
        return sum;
      };
      float* out = op + b * H * D + h * D;
      if (paired) {
        for (int64_t d = 0; d < D; d += 16) unpair_lanes(merged(d), merged(d + 8), out + d);
      } else {
        for (int64_t d = 0; d < D; d += 8) store_ps(out + d, merged(d), D - d);  // masked only for a row tail
      }
    }
  });
  return out;
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                            const at::Tensor& sin, const at::Tensor& k_blocks, const at::Tensor& v_blocks,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            int64_t window) {
  check_rotary_inputs(q, k, v, cos, sin, k_blocks, v_blocks);
  const auto over = k_blocks.scalar_type() == at::kBFloat16 ? &decode_attention_over<bf16> : &decode_attention_over<float>;
  return over(q, k, v, cos, sin, k_blocks, v_blocks, block_tables, context_lens, scale, window);
}

}  // namespace kunlun_cpu
