// How a decode step's attention is divided into tasks, for both kernel tiers (ISA-independent: each
// tier's decode_attention.cpp includes it and compiles it with its own flags, so it holds no
// intrinsics).
//
// A task is a range of keys over one block table, for the query heads of one or more of the
// step's sequences ("rows"). Rows that are consecutive positions over the same blocks, as a decode
// row and its speculative drafts are (each runs as a one-token sequence), share one task for the
// keys before the first row's position, so each of those keys is read from memory once for all of
// them rather than once per row: at long contexts a decode row's attention is bound by reading its
// keys and values, and drafts would otherwise multiply that traffic. Each later row adds a small
// task for the keys between (the drafts before it). A task's heads are KV-head major,
// [KVH][rows][H / KVH], so a kernel that serves "H query heads over KVH KV heads" serves a task of
// several rows as H · rows heads, unchanged.
//
// Long ranges are split across threads, as flash-decoding does; each (row, head)'s partial results
// (maximum, sum of exponentials, unnormalised output) are merged by their maxima. Tasks differ
// widely in size (a split of a long range for many rows, a draft's tail of a few keys), so threads
// take them heaviest first, each the next one left when it finishes (run_tasks): a static split of
// the task list gave one thread every long split and the other the tails, and a decode row with
// drafts ran at half speed.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>
#include <vector>

namespace kunlun_cpu::paged {

struct AttentionTask {
  int64_t first_row, rows;      // the rows whose queries it holds: first_row .. first_row + rows - 1
  int64_t key_begin, key_end;   // the keys it attends to, in first_row's block table
  int64_t head_offset;          // its rows × H heads' results start here (maxima, sums; × D for outputs)
};

struct TaskPart {  // one task's share of a row's attention
  int64_t task, row_in_task;
};

struct AttentionPlan {
  std::vector<AttentionTask> tasks;
  std::vector<int64_t> first_part;  // [B + 1]: row b's parts are parts[first_part[b], first_part[b + 1])
  std::vector<TaskPart> parts;
  std::vector<int64_t> order;       // task indices, heaviest (rows × keys) first
  int64_t heads = 0;                // results held by all tasks together

  // Where head h (of H, in KV-head groups of `group`) of `part`'s row sits among the results.
  int64_t head_index(const TaskPart& part, int64_t h, int64_t group) const {
    const AttentionTask& task = tasks[part.task];
    return task.head_offset + ((h / group) * task.rows + part.row_in_task) * group + h % group;
  }
};

// Whether rows a and b (a < b) read the same blocks for b's `length` keys.
inline bool same_blocks(const int64_t* tables, int64_t max_blocks, int64_t a, int64_t b, int64_t length,
                        int64_t block_size) {
  const int64_t count = (length + block_size - 1) / block_size;
  return std::equal(tables + a * max_blocks, tables + a * max_blocks + count, tables + b * max_blocks);
}

// The tasks of B rows (block tables [B, max_blocks], context lengths [B]; window > 0 keeps each
// row's last `window` keys) for H query heads, split until there are about as many tasks as
// threads, down to `min_split_keys` keys a split. Rows are grouped only where every row of the
// group sees its keys from the first one (no window cuts into them), so a group's rows differ only
// in their last few keys. No finer: a decode step's keys are cold (the weights streamed through the
// caches since the layer last ran), and each split starts its own stream of them, whose first
// chunks wait on memory before any prefetch runs ahead (twice as many splits as threads made a
// one-row decode step measurably slower).
inline AttentionPlan plan_attention(const int64_t* tables, const int64_t* lengths, int64_t B, int64_t max_blocks,
                                    int64_t block_size, int64_t window, int64_t H, int64_t threads,
                                    int64_t min_split_keys) {
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
  auto add = [&](int64_t first_row, int64_t rows, int64_t k0, int64_t k1) {
    const int64_t task = static_cast<int64_t>(plan.tasks.size());
    plan.tasks.push_back({first_row, rows, k0, k1, plan.heads});
    plan.heads += rows * H;
    for (int64_t r = 0; r < rows; ++r) row_parts[first_row + r].push_back({task, r});
  };
  for (const auto& [first, rows] : groups) {
    const int64_t shared_end = lengths[first];
    const int64_t start = window > 0 ? std::max<int64_t>(0, shared_end - window) : 0;
    const int64_t length = shared_end - start;
    const int64_t splits = std::max<int64_t>(1, std::min(wanted, length / min_split_keys));
    for (int64_t split = 0; split < splits; ++split) {
      add(first, rows, start + length * split / splits, start + length * (split + 1) / splits);
    }
    for (int64_t r = 1; r < rows; ++r) add(first + r, 1, shared_end, shared_end + r);  // the keys after row 0's
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
