// How a decode step's attention is divided into tasks, for both kernel tiers (ISA-independent: each
// tier's decode_attention.cpp includes it and compiles it with its own flags, so it holds no
// intrinsics).
//
// A row's attention must be the same bits whatever else the step holds and however many threads
// run it: a draft verified in a step of five rows must see what decoding it alone would, or greedy
// outputs with speculation drift from those without wherever two logits nearly tie. So a row's
// keys are cut into parts at fixed key positions (part_start; and the window's start), each part is
// folded on its own in the same order of additions (chunks aligned to key positions, not to where
// a task starts), and the parts are merged in key order: a plan decides only which thread folds
// which parts, never how a row's sums are grouped. Splitting a row's keys where the threads
// happened to divide them (as this plan once did) merged another grouping of FP32 partial sums for
// the same row in every step whose rows or threads differed.
//
// A task is a range of keys over one block table, for the query heads of one or more of the
// step's sequences ("rows"). Rows that are consecutive positions over the same blocks, as a decode
// row and its speculative drafts are (each runs as a one-token sequence), share one task, so each
// key is read from memory once for all of them rather than once per row: at long contexts a decode
// row's attention is bound by reading its keys and values, and drafts would otherwise multiply
// that traffic. Such a task runs to its last row's end; each row masks the keys past its own
// (probability 0, which adds nothing), so its parts hold exactly the sums it has alone. A task's
// heads are KV-head major, [KVH][rows][H / KVH], so a kernel that serves "H query heads over KVH
// KV heads" serves a task of several rows as H · rows heads, unchanged; its parts' results follow
// one another.
//
// Long ranges are split across threads at part boundaries, as flash-decoding does; each (row,
// head)'s partial results (maximum, sum of exponentials, unnormalised output) are merged by their
// maxima. Tasks differ widely in size, so threads take them heaviest first, each the next one left
// when it finishes (run_tasks): a static split of the task list gave one thread every long range
// and the other the short ones.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace kunlun_cpu::paged {

// Where a row's keys are cut into separately folded parts: every kShortPartKeys keys up to
// kLongPartsFrom, so that two threads share a few hundred keys evenly, then every kLongPartKeys,
// so that the parts' results (H · (D + 2) floats each, written and merged) stay a small share of
// the keys and values read (parts of 128 throughout took 3-6 % longer at 1,500-4,000 keys). Both
// tiers' chunks of keys divide both sizes.
constexpr int64_t kShortPartKeys = 128, kLongPartKeys = 256, kLongPartsFrom = 512;
static_assert(kLongPartsFrom % kShortPartKeys == 0 && kLongPartsFrom % kLongPartKeys == 0);

inline int64_t part_of(int64_t key) {  // the part holding `key`
  return key < kLongPartsFrom ? key / kShortPartKeys
                              : kLongPartsFrom / kShortPartKeys + (key - kLongPartsFrom) / kLongPartKeys;
}

inline int64_t part_start(int64_t part) {  // its first key
  constexpr int64_t short_parts = kLongPartsFrom / kShortPartKeys;
  return part < short_parts ? part * kShortPartKeys : kLongPartsFrom + (part - short_parts) * kLongPartKeys;
}

inline bool starts_part(int64_t key) { return part_start(part_of(key)) == key; }

struct AttentionTask {
  int64_t first_row, rows;      // the rows whose queries it holds: first_row .. first_row + rows - 1
  int64_t key_begin, key_end;   // the keys it attends to, in first_row's block table (each row's
                                // only up to its own context length)
  int64_t head_offset;          // its parts' results start here, rows × H heads a part (maxima, sums;
                                // × D for outputs)
};

struct TaskPart {  // one part of a row's keys, folded by a task
  int64_t task, row_in_task, part_in_task;
};

struct AttentionPlan {
  std::vector<AttentionTask> tasks;
  std::vector<int64_t> first_part;  // [B + 1]: row b's parts, in key order, are parts[first_part[b], first_part[b + 1])
  std::vector<TaskPart> parts;
  std::vector<int64_t> order;       // task indices, heaviest (rows × keys) first
  int64_t heads = 0;                // results held by all tasks together

  // Where head h (of H, in KV-head groups of `group`) of `part`'s row sits among the results.
  int64_t head_index(const TaskPart& part, int64_t h, int64_t H, int64_t group) const {
    const AttentionTask& task = tasks[part.task];
    return task.head_offset + part.part_in_task * task.rows * H +
           ((h / group) * task.rows + part.row_in_task) * group + h % group;
  }
};

// Whether rows a and b (a < b) read the same blocks for b's `length` keys.
inline bool same_blocks(const int64_t* tables, int64_t max_blocks, int64_t a, int64_t b, int64_t length,
                        int64_t block_size) {
  const int64_t count = (length + block_size - 1) / block_size;
  return std::equal(tables + a * max_blocks, tables + a * max_blocks + count, tables + b * max_blocks);
}

// The tasks of B rows (block tables [B, max_blocks], context lengths [B]; window > 0 keeps each
// row's last `window` keys) for H query heads, split at the part boundaries nearest to even shares
// of the keys until there are about as many tasks as threads. Rows are grouped only where every row
// of the group sees its keys from the first one (no window cuts into them), so a group's rows
// differ only in their last few keys. No finer: a decode step's keys are cold (the weights streamed
// through the caches since the layer last ran), and each task starts its own stream of them, whose
// first chunks wait on memory before any prefetch runs ahead (twice as many splits as threads made
// a one-row decode step measurably slower); a task folds its parts one after another in one stream.
inline AttentionPlan plan_attention(const int64_t* tables, const int64_t* lengths, int64_t B, int64_t max_blocks,
                                    int64_t block_size, int64_t window, int64_t H, int64_t threads) {
  std::vector<std::pair<int64_t, int64_t>> groups;  // (first row, rows)
  for (int64_t b = 0; b < B;) {
    int64_t rows = 1;
    while (b + rows < B && lengths[b + rows] == lengths[b] + rows && (window <= 0 || lengths[b + rows] <= window) &&
           same_blocks(tables, max_blocks, b, b + rows, lengths[b + rows], block_size)) {
      ++rows;
    }
    groups.emplace_back(b, rows);
    b += rows;
  }
  AttentionPlan plan;
  std::vector<std::vector<TaskPart>> row_parts(B);
  const int64_t count = static_cast<int64_t>(groups.size());
  const int64_t wanted = (threads + count - 1) / count;
  for (const auto& [first, rows] : groups) {
    const int64_t start = window > 0 ? std::max<int64_t>(0, lengths[first] - window) : 0;
    const int64_t end = lengths[first + rows - 1];
    const int64_t first_part = part_of(start), end_part = part_of(end - 1) + 1;
    const int64_t splits = std::max<int64_t>(1, std::min(wanted, end_part - first_part));
    std::vector<int64_t> cuts{first_part};  // the splits' first parts, then end_part
    for (int64_t split = 1; split < splits; ++split) {
      const int64_t target = start + (end - start) * split / splits;
      int64_t part = part_of(target);
      if (target - part_start(part) > part_start(part + 1) - target) ++part;
      cuts.push_back(std::clamp(part, cuts.back() + 1, end_part - (splits - split)));
    }
    cuts.push_back(end_part);
    for (int64_t split = 0; split < splits; ++split) {
      const int64_t p0 = cuts[split], p1 = cuts[split + 1];
      const int64_t task = static_cast<int64_t>(plan.tasks.size());
      plan.tasks.push_back({first, rows, std::max(start, part_start(p0)), std::min(end, part_start(p1)), plan.heads});
      plan.heads += (p1 - p0) * rows * H;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t p = p0; p < p1 && part_start(p) < lengths[first + r]; ++p) {
          row_parts[first + r].push_back({task, r, p - p0});
        }
      }
    }
  }
  plan.first_part.assign(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    plan.first_part[b + 1] = plan.first_part[b] + static_cast<int64_t>(row_parts[b].size());
    plan.parts.insert(plan.parts.end(), row_parts[b].begin(), row_parts[b].end());
  }
  plan.order.resize(plan.tasks.size());
  std::iota(plan.order.begin(), plan.order.end(), int64_t{0});
  auto work = [&](int64_t t) { return plan.tasks[t].rows * (plan.tasks[t].key_end - plan.tasks[t].key_begin); };
  std::stable_sort(plan.order.begin(), plan.order.end(), [&](int64_t a, int64_t b) { return work(a) > work(b); });
  return plan;
}

// Head h of row b's parts, merged: their results' indices in key order (`index`) and their weights
// (`weight`): each part's exp(maximum - the largest) (`rescale`, the tier's exp of its maxima's
// base) over the total of its sums so rescaled, added in key order.
template <typename Rescale>
void merge_weights(const AttentionPlan& plan, int64_t b, int64_t h, int64_t H, int64_t group, const float* maxima,
                   const float* sums, Rescale rescale, std::vector<int64_t>& index, std::vector<float>& weight) {
  index.clear();
  for (int64_t p = plan.first_part[b]; p < plan.first_part[b + 1]; ++p) {
    index.push_back(plan.head_index(plan.parts[p], h, H, group));
  }
  float largest = -INFINITY;
  for (const int64_t i : index) largest = std::max(largest, maxima[i]);
  weight.clear();
  float total = 0.0f;
  for (const int64_t i : index) {
    weight.push_back(rescale(maxima[i] - largest));
    total += sums[i] * weight.back();
  }
  for (float& w : weight) w /= total;
}

// Runs `worker(take)` once on each intra-op thread (as many as there are tasks, at most): take()
// returns the index of the next task to run, heaviest first, or -1 when none is left, so per-thread
// scratch lives in the worker and a thread that finishes early takes more.
template <typename Worker>
void run_tasks(const AttentionPlan& plan, Worker worker) {
  const int64_t count = static_cast<int64_t>(plan.order.size());
  std::atomic<int64_t> next{0};
  auto take = [&]() -> int64_t {
    const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
    return i < count ? plan.order[i] : -1;
  };
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) { worker(take); });
}

}  // namespace kunlun_cpu::paged
