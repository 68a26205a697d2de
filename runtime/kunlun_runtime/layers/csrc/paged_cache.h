// The paged KV cache as both kernel tiers address it: a K or V cache [NB, BS, KVH, D] seen through
// its strides, the slot pointers of a sequence's positions, and the checks on what decode_attention
// and rotary_kv_write are given (q/k/v, cos/sin and cache shapes, block tables and context lengths,
// slot ids), and the prefetch of a range of positions' rows. ISA-independent, templated over the
// cache's element type (BF16 in the AVX-512 tier, FP32 or BF16 in the AVX2 tier): each tier's
// decode_attention.cpp and decode_ops.cpp include it and compile it with their own flags, so it
// holds no intrinsics but SSE's prefetch, which every x86-64 CPU has.
#pragma once

#include <ATen/core/Tensor.h>
#include <xmmintrin.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <utility>

namespace kunlun_cpu::paged {

template <typename T>
struct PagedCache {
  T* data;
  int64_t block_stride, slot_stride, head_stride;
  T* at(int64_t block, int64_t slot, int64_t head) const {
    return data + block * block_stride + slot * slot_stride + head * head_stride;
  }
};

template <typename T>
PagedCache<T> cache(const at::Tensor& blocks) {
  TORCH_CHECK(blocks.dim() == 4 && blocks.stride(3) == 1, "k/v blocks must be [NB, BS, KVH, D], D contiguous");
  return {blocks.mutable_data_ptr<T>(), blocks.stride(0), blocks.stride(1), blocks.stride(2)};
}

// q [T, H, D], k and v [T, KVH, D] (rows of D contiguous, so q, k, v may be views of a fused qkv
// row), cos and sin [T, D], K/V caches [NB, BS, KVH, D]: shapes consistent, H a multiple of KVH, D
// even and at least `min_head_dim` (the AVX2 tier refuses D = 0, the AVX-512 tier takes it). The
// dtypes are the caller's to check (check_rotary_inputs, or a tier whose cache dtype differs).
inline void check_rotary_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                                const at::Tensor& sin, const at::Tensor& k_blocks, const at::Tensor& v_blocks,
                                int64_t min_head_dim) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [tokens, heads, D]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  TORCH_CHECK(D >= min_head_dim && D % 2 == 0, "head_dim must be even, got ", D);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "query heads (", H, ") must be a multiple of KV heads (", KVH, ")");
  TORCH_CHECK(k.size(0) == T && v.size(0) == T && v.size(1) == KVH && k.size(2) == D && v.size(2) == D,
              "k and v must be [tokens, KVH, D] like q");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "q, k, v rows must be contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D,
              "cos and sin must be contiguous [tokens, D]");
  TORCH_CHECK(k_blocks.sizes() == v_blocks.sizes() && k_blocks.dim() == 4 && k_blocks.size(2) == KVH &&
                  k_blocks.size(3) == D,
              "k_blocks and v_blocks must be [NB, BS, KVH, D]");
}

// check_rotary_shapes, with every tensor (caches included) of the tier's dtype (`check_dtype`,
// whose message names it).
inline void check_rotary_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                                const at::Tensor& sin, const at::Tensor& k_blocks, const at::Tensor& v_blocks,
                                void (*check_dtype)(const at::Tensor&, const char*), int64_t min_head_dim) {
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&cos, "cos"}, {&sin, "sin"},
                                {&k_blocks, "k_blocks"}, {&v_blocks, "v_blocks"}}) {
    check_dtype(*t, name);
  }
  check_rotary_shapes(q, k, v, cos, sin, k_blocks, v_blocks, min_head_dim);
}

// block_tables int64 [B, MB] and context_lens int64 [B], each context at least one token and within
// its table, each block it covers a block of `blocks` [NB, BS, ...]: every block read or written is
// checked before anything is written.
inline void check_block_tables(const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t B,
                               const at::Tensor& blocks) {
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
                  block_tables.is_contiguous() && context_lens.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == B && context_lens.numel() == B,
              "block_tables must be int64 [B, MB] and context_lens int64 [B]");
  const int64_t block_size = blocks.size(1), num_blocks = blocks.size(0), max_blocks = block_tables.size(1);
  const int64_t* tables = block_tables.const_data_ptr<int64_t>();
  const int64_t* lengths = context_lens.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lengths[b] >= 1 && lengths[b] <= max_blocks * block_size, "context length ", lengths[b],
                " of sequence ", b, " does not fit its block table");
    for (int64_t i = 0; i < (lengths[b] + block_size - 1) / block_size; ++i) {
      const int64_t block = tables[b * max_blocks + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " out of range");
    }
  }
}

// slot_block_ids and slot_offsets int64 [T], each slot one of `blocks` [NB, BS, ...]: every slot is
// checked before anything is written.
inline void check_slots(const at::Tensor& slot_block_ids, const at::Tensor& slot_offsets, int64_t T,
                        const at::Tensor& blocks) {
  TORCH_CHECK(slot_block_ids.scalar_type() == at::kLong && slot_offsets.scalar_type() == at::kLong &&
                  slot_block_ids.is_contiguous() && slot_offsets.is_contiguous() && slot_block_ids.numel() == T &&
                  slot_offsets.numel() == T,
              "slot_block_ids and slot_offsets must be int64 [T]");
  const int64_t num_blocks = blocks.size(0), block_size = blocks.size(1);
  const int64_t* block_ids = slot_block_ids.const_data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(block_ids[t] >= 0 && block_ids[t] < num_blocks, "block id ", block_ids[t], " out of range");
    TORCH_CHECK(offsets[t] >= 0 && offsets[t] < block_size, "slot offset ", offsets[t], " out of range");
  }
}

// Prefetches into L2 the K and V rows, every KV head's, of positions [start, end) of a sequence: a
// run of slots within a block is one contiguous range of each cache.
template <typename T>
void prefetch_slots(const PagedCache<T>& keys, const PagedCache<T>& values, const int64_t* table,
                    int64_t block_size, int64_t start, int64_t end) {
  for (int64_t position = start; position < end;) {
    const int64_t block = position / block_size, slot = position % block_size;
    const int64_t count = std::min(block_size - slot, end - position);
    for (const PagedCache<T>* cache : {&keys, &values}) {
      const uintptr_t first = reinterpret_cast<uintptr_t>(cache->at(table[block], slot, 0));
      const uintptr_t last = first + count * cache->slot_stride * sizeof(T);
      for (uintptr_t line = first & ~uintptr_t{63}; line < last; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T1);
      }
    }
    position += count;
  }
}

// Slot pointers (KV head 0) for positions [start, end) of a sequence, walked block by block.
template <typename T>
void gather_slots(const PagedCache<T>& cache, const int64_t* table, int64_t block_size, int64_t start, int64_t end,
                  const T** slots) {
  for (int64_t position = start; position < end;) {
    const int64_t block = position / block_size, slot = position % block_size;
    const int64_t count = std::min(block_size - slot, end - position);
    const T* row = cache.at(table[block], slot, 0);
    for (int64_t i = 0; i < count; ++i) slots[position - start + i] = row + i * cache.slot_stride;
    position += count;
  }
}

}  // namespace kunlun_cpu::paged
