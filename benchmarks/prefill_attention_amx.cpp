// An experiment, not part of the runtime: causal attention of one fresh prompt on the AMX tile
// units, measured against SDPA's flash kernel by benchmarks/bench_prefill_attention.py (which
// builds it together with the runtime's amx_linear.cpp for the tile helpers).
//
//   kunlun_experiment::prefill_attention(q [T, H, D], k [T, KVH, D], v [T, KVH, D], scale) -> [T, H * D]
//     softmax(scale · q·kᵀ, causal) · v for every query head; GQA: head h reads KV head
//     h / (H / KVH). D must be a multiple of 32. BF16 in and out, FP32 scores and softmax.
//
// Flash-attention style, without the score matrix: a task is 16 query rows of one head, with the
// queries in the vector lanes (one lane per row: the running maxima, sums and rescaling are
// plain vector operations, no horizontal reductions). It walks the keys up to its last row in
// blocks of 128: Sᵀ = K·Qᵀ on the tile units (K as the A operand, Qᵀ repacked as B), the online
// softmax in FP32 with the probabilities rounded to BF16 (as SDPA's flash kernel rounds them),
// and (P·V)ᵀ = Vᵀ·Pᵀ on the tile units again. K and Vᵀ are repacked per KV head once per call.
//
// It beats SDPA on short prompts but not clearly on long ones (the benchmark times both; results
// in docs/platforms.md and the README's Performance section), so the runtime keeps SDPA. Where
// the time goes on a long prompt (parts switched off in turn): the score products with their tile
// stores and the packing take many times what the products' count at the tile unit's rate would
// (a profile puts the samples after the tile stores: each score block makes a round trip between
// the tile and vector units through memory), then the softmax (much of it the exponentials),
// then P·V. Tried and not kept, each slower than this version on long prompts: computing S with
// the queries as the A operand and the softmax row by row (even with four accumulators in flight
// it waits on those round trips); a task of all the query heads of a KV head, each phase run for
// every head before the next so that each round trip has other work in between; straight-line
// code with fixed tile numbers at D = 64.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_vec.h"
#include "kernels.h"

namespace {

using bf16 = c10::BFloat16;
using kunlun_cpu::vec::exp_nonpositive;
using kunlun_cpu::vec::store_bf16x16;

constexpr int64_t kRows = 16;       // query rows per task: one tile's rows
constexpr int64_t kKeyBlock = 128;  // keys per online-softmax step
constexpr int64_t kTileK = 32;      // BF16 elements along a tile's reduction dimension
constexpr int64_t kTileElems = 512;  // 16 rows × 64 bytes of BF16

// C += A·B for accumulator tiles 2-5, A in tile 0 or 1 and B in tile 6 or 7, chosen at run time
// (tile numbers are immediates). Alternating the A and B tiles lets a load proceed while the
// previous product still reads its operands; four accumulators keep four products in flight.
inline void dot(int c, int a, int b) {
#define KUNLUN_DOT(C, A, B) \
  if (c == C && a == A && b == B) {            \
    _tile_dpbf16ps(C, A, B);                     \
    return;                                      \
  }
#define KUNLUN_DOT_AB(C) KUNLUN_DOT(C, 0, 6) KUNLUN_DOT(C, 0, 7) KUNLUN_DOT(C, 1, 6) KUNLUN_DOT(C, 1, 7)
  KUNLUN_DOT_AB(2) KUNLUN_DOT_AB(3) KUNLUN_DOT_AB(4) KUNLUN_DOT_AB(5)
#undef KUNLUN_DOT_AB
#undef KUNLUN_DOT
}

inline void load_tile(int tile, const void* p, int64_t stride_bytes) {
  switch (tile) {
    case 0: _tile_loadd(0, p, stride_bytes); break;
    case 1: _tile_loadd(1, p, stride_bytes); break;
    case 6: _tile_loadd(6, p, stride_bytes); break;
    default: _tile_loadd(7, p, stride_bytes); break;
  }
}

inline void zero_tile(int tile) {
  switch (tile) {
    case 2: _tile_zero(2); break;
    case 3: _tile_zero(3); break;
    case 4: _tile_zero(4); break;
    default: _tile_zero(5); break;
  }
}

inline void store_tile(int tile, float* out, int64_t stride_bytes) {
  switch (tile) {
    case 2: _tile_stored(2, out, stride_bytes); break;
    case 3: _tile_stored(3, out, stride_bytes); break;
    case 4: _tile_stored(4, out, stride_bytes); break;
    default: _tile_stored(5, out, stride_bytes); break;
  }
}

// 16 rows of 32 pairs (BF16) starting at `rows`, as one B tile: tile row r holds pair r of each
// of the 16 rows (a 16 × 16 transpose of 32-bit pairs); rows at or past `count` read as zeros.
void pack_pairs_b(const bf16* rows, int64_t stride, int64_t count, bf16* tile) {
  __m512i in[16], out[16];
  for (int64_t n = 0; n < 16; ++n) in[n] = n < count ? _mm512_loadu_si512(rows + n * stride) : _mm512_setzero_si512();
  kunlun_cpu::vec::transpose16x16(in, out);
  for (int r = 0; r < 16; ++r) _mm512_storeu_si512(tile + r * 32, out[r]);
}

// K of one KV head, row-major and zero-padded to whole key blocks: the A operand of S = K·Qᵀ.
void pack_keys(const bf16* k, int64_t key_stride, int64_t T, int64_t D, int64_t padded, bf16* out) {
  for (int64_t key = 0; key < padded; ++key) {
    if (key < T) {
      std::memcpy(out + key * D, k + key * key_stride, D * sizeof(bf16));
    } else {
      std::memset(out + key * D, 0, D * sizeof(bf16));
    }
  }
}

// Vᵀ of one KV head as A tiles of Oᵀ = Vᵀ·Pᵀ: for each 16 of D and each 32 keys, tile row r is
// d = 16·slice + r over the chunk's 32 keys. As 32-bit pairs of keys that is the transpose of the
// rows that interleave keys 2p and 2p + 1 element by element.
void pack_values(const bf16* v, int64_t key_stride, int64_t T, int64_t D, int64_t key_chunks, bf16* out) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t slice = 0; slice < D / 16; ++slice) {
    for (int64_t kc = 0; kc < key_chunks; ++kc) {
      __m512i pairs[16], rows[16];
      for (int64_t p = 0; p < 16; ++p) {
        const int64_t even = kc * kTileK + 2 * p, odd = even + 1;
        const __m256i a = even < T ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + even * key_stride + slice * 16))
                                   : _mm256_setzero_si256();
        const __m256i b = odd < T ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + odd * key_stride + slice * 16))
                                  : _mm256_setzero_si256();
        pairs[p] = _mm512_permutexvar_epi16(interleave, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
      }
      kunlun_cpu::vec::transpose16x16(pairs, rows);
      bf16* tile = out + (slice * key_chunks + kc) * kTileElems;
      for (int r = 0; r < 16; ++r) _mm512_storeu_si512(tile + r * kTileK, rows[r]);
    }
  }
}

struct Workspace {
  std::vector<bf16> queries, probabilities;  // Qᵀ and Pᵀ as B tiles
  std::vector<float> scores, products, accumulator;  // Sᵀ [keys][16], (P·V)ᵀ and Oᵀ [D][16]
  explicit Workspace(int64_t D)
      : queries(D / kTileK * kTileElems), probabilities(kKeyBlock / kTileK * kTileElems), scores(kKeyBlock * kRows),
        products(D * kRows), accumulator(D * kRows) {}
};

}  // namespace

namespace kunlun_experiment {

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "prefill_attention: q, k and v must be bfloat16");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
                  q.size(2) == k.size(2),
              "prefill_attention: expected q [T, H, D] and k, v [T, KVH, D]");
  const int64_t T = q.size(0), H = q.size(1), KVH = k.size(1), D = q.size(2);
  TORCH_CHECK(D % kTileK == 0 && H % KVH == 0, "prefill_attention: D must be a multiple of 32 and H of KVH");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && q.stride(1) == D && k.stride(1) == D &&
                  v.stride(1) == D,
              "prefill_attention: each token's heads must be contiguous");
  TORCH_CHECK(kunlun_cpu::amx_available(), "prefill_attention: the AMX tile units are unavailable");
  const int64_t group = H / KVH;
  const int64_t padded = (T + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  const int64_t key_chunks = padded / kTileK;
  const int64_t head_elems = padded * D;
  std::vector<bf16> packed_k(KVH * head_elems), packed_v(KVH * head_elems);
  const bf16* qp = q.const_data_ptr<bf16>();
  const bf16* kp = k.const_data_ptr<bf16>();
  const bf16* vp = v.const_data_ptr<bf16>();
  at::parallel_for(0, 2 * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / 2;
      if (item % 2 == 0) {
        pack_keys(kp + g * D, k.stride(0), T, D, padded, packed_k.data() + g * head_elems);
      } else {
        pack_values(vp + g * D, v.stride(0), T, D, key_chunks, packed_v.data() + g * head_elems);
      }
    }
  });

  at::Tensor out = at::empty({T, H * D}, q.options());
  bf16* op = out.mutable_data_ptr<bf16>();
  const int64_t query_blocks = (T + kRows - 1) / kRows;
  const __m512 scale_v = _mm512_set1_ps(static_cast<float>(scale));
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  // Causal work grows with the block's position: tasks go in the order 0, n-1, 1, n-2, ... so that
  // parallel_for's contiguous halves carry equal work.
  at::parallel_for(0, H * query_blocks, 1, [&](int64_t begin, int64_t end) {
    kunlun_cpu::configure_amx_tiles();
    Workspace ws(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t position = task / H, h = task % H;
      const int64_t qb = position % 2 == 0 ? position / 2 : query_blocks - 1 - position / 2;
      const int64_t q0 = qb * kRows, rows = std::min(kRows, T - q0), last = q0 + rows - 1;
      const int64_t g = h / group;
      const bf16* keys = packed_k.data() + g * head_elems;
      const bf16* values = packed_v.data() + g * head_elems;
      for (int64_t c = 0; c < D / kTileK; ++c) {
        pack_pairs_b(qp + q0 * q.stride(0) + h * D + c * kTileK, q.stride(0), rows, ws.queries.data() + c * kTileElems);
      }
      // One lane per query row from here on: maxima, sums and Oᵀ's columns.
      const __m512i query_index = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(q0)), lanes);
      __m512 maxima = _mm512_set1_ps(-INFINITY), sums = _mm512_setzero_ps();
      std::fill(ws.accumulator.begin(), ws.accumulator.end(), 0.0f);
      for (int64_t k0 = 0; k0 <= last; k0 += kKeyBlock) {
        const int64_t block_keys = std::min(kKeyBlock, last + 1 - k0);  // keys any row of the task sees
        const int64_t padded_keys = (block_keys + kTileK - 1) / kTileK * kTileK;  // whole P·V chunks
        // Sᵀ = K·Qᵀ: 16 keys per accumulator, four accumulators at a time.
        const int64_t key_tiles_here = padded_keys / 16;
        for (int64_t s0 = 0; s0 < key_tiles_here; s0 += 4) {
          const int accumulators = static_cast<int>(std::min<int64_t>(4, key_tiles_here - s0));
          for (int t = 0; t < accumulators; ++t) zero_tile(2 + t);
          int a = 0;
          for (int64_t c = 0; c < D / kTileK; ++c) {
            const int b = 6 + static_cast<int>(c % 2);
            load_tile(b, ws.queries.data() + c * kTileElems, 64);
            for (int t = 0; t < accumulators; ++t, a ^= 1) {
              load_tile(a, keys + (k0 + (s0 + t) * 16) * D + c * kTileK, D * sizeof(bf16));
              dot(2 + t, a, b);
            }
          }
          for (int t = 0; t < accumulators; ++t) store_tile(2 + t, ws.scores.data() + (s0 + t) * 16 * kRows, 64);
        }
        // Online softmax with the queries in lanes: key j is visible to rows q >= k0 + j.
        __m512 block_max = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < block_keys; ++j) {
          const __mmask16 visible = _mm512_cmpge_epi32_mask(query_index, _mm512_set1_epi32(static_cast<int>(k0 + j)));
          block_max = _mm512_mask_max_ps(block_max, visible, block_max, _mm512_loadu_ps(ws.scores.data() + j * kRows));
        }
        const __m512 new_max = _mm512_max_ps(maxima, _mm512_mul_ps(block_max, scale_v));
        // exp(old − new) with an empty history gives exp(−88) ≈ 0 against zero sums and Oᵀ.
        const __m512 correction = exp_nonpositive(_mm512_sub_ps(maxima, new_max));
        __m512 total = _mm512_setzero_ps();
        for (int64_t j = 0; j < padded_keys; j += 2) {
          __m512 pair[2];
          for (int e = 0; e < 2; ++e) {
            const __mmask16 visible =
                _mm512_cmpge_epi32_mask(query_index, _mm512_set1_epi32(static_cast<int>(k0 + j + e)));
            const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(ws.scores.data() + (j + e) * kRows), scale_v, new_max);
            pair[e] = _mm512_maskz_mov_ps(visible, exp_nonpositive(x));
            total = _mm512_add_ps(total, pair[e]);
          }
          // Pᵀ row pair (j, j + 1) as one B tile row: [q0: j, j+1 | q1: j, j+1 | ...], rounded to
          // nearest even in hardware.
          const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(pair[1], pair[0]);
          _mm512_storeu_si512(ws.probabilities.data() + (j / kTileK) * kTileElems + (j % kTileK) / 2 * 32,
                              _mm512_permutexvar_epi16(interleave, packed));
        }
        sums = _mm512_fmadd_ps(sums, correction, total);
        maxima = new_max;
        // (P·V)ᵀ = Vᵀ·Pᵀ, four 16-row slices of D at a time into tiles 2-5, 32 keys per step.
        const int64_t chunks = padded_keys / kTileK;
        for (int64_t d0 = 0; d0 < D / 16; d0 += 4) {
          const int slices = static_cast<int>(std::min<int64_t>(4, D / 16 - d0));
          for (int t = 0; t < slices; ++t) zero_tile(2 + t);
          int a = 0;
          for (int64_t c = 0; c < chunks; ++c) {
            const int b = 6 + static_cast<int>(c % 2);
            load_tile(b, ws.probabilities.data() + c * kTileElems, 64);
            for (int t = 0; t < slices; ++t, a ^= 1) {
              load_tile(a, values + ((d0 + t) * key_chunks + k0 / kTileK + c) * kTileElems, kTileK * sizeof(bf16));
              dot(2 + t, a, b);
            }
          }
          for (int t = 0; t < slices; ++t) store_tile(2 + t, ws.products.data() + (d0 + t) * 16 * kRows, 64);
        }
        for (int64_t d = 0; d < D; ++d) {
          float* acc = ws.accumulator.data() + d * kRows;
          _mm512_storeu_ps(acc, _mm512_fmadd_ps(_mm512_loadu_ps(acc), correction, _mm512_loadu_ps(ws.products.data() + d * kRows)));
        }
      }
      // Oᵀ / sums, transposed back to rows of the output, 16 of D at a time.
      const __m512 inverse = _mm512_div_ps(_mm512_set1_ps(1.0f), sums);
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        __m512i by_d[16], by_row[16];
        for (int64_t r = 0; r < 16; ++r) {
          by_d[r] = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(ws.accumulator.data() + (d0 + r) * kRows), inverse));
        }
        kunlun_cpu::vec::transpose16x16(by_d, by_row);
        for (int64_t n = 0; n < rows; ++n) store_bf16x16(op + (q0 + n) * H * D + h * D + d0, _mm512_castsi512_ps(by_row[n]), 0xFFFF);
      }
    }
    _tile_release();
  });
  return out;
}

}  // namespace kunlun_experiment

TORCH_LIBRARY(kunlun_experiment, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kunlun_experiment, CPU, m) { m.impl("prefill_attention", &kunlun_experiment::prefill_attention); }
