// Fused decode-step operators for x86 CPUs with AVX2 + FMA (FP32 tensors, FP32 arithmetic).
//
// On these CPUs BF16 arithmetic is emulated, so the AVX2 tier keeps activations, cos/sin and the
// norm weights in FP32, and the reference is plain FP32 math (there are no BF16 roundings to
// reproduce). The KV cache is FP32 or BF16 (`--kv-cache-dtype`): a BF16 cache holds K and V rounded
// to nearest even (as torch's .to(torch.bfloat16)) and is widened to FP32 in registers as attention
// reads it, so attention computes in FP32 over the rounded keys and values. As in the AVX-512 tier, each operator replaces a chain of ATen calls
// (RMSNorm is about eight, rotary a dozen, paged attention a scatter, two gathers and an SDPA call)
// with one pass:
//
//   kunlun_cpu::rms_norm(x [T, H], w [H], eps)                  -> w * (x * 1/sqrt(mean(x²) + eps))
//   kunlun_cpu::add_rms_norm(x [T, H], delta [T, H], w [H], eps) -> (s = x + delta, rms_norm(s))
//   kunlun_cpu::silu_mul(gate_up [T, 2I])                       -> silu(gate) * up
//   kunlun_cpu::decode_attention(q [B, H, D], k [B, KVH, D], v [B, KVH, D], cos [B, D], sin [B, D],
//                                k_blocks, v_blocks [NB, BS, KVH, D], block_tables [B, MB],
//                                context_lens [B], scale, window)  -> [B, H * D]
//     one new token per sequence: rotary on q and k, k and v written (rounded to the cache's
//     dtype) into the paged cache at
//     position context_len - 1, then softmax(scale · q·Kᵀ) · V over the sequence's blocks
//     (GQA: query head h reads KV head h / (H / KVH); window > 0 keeps the last `window` keys).
//   kunlun_cpu::rotary_kv_write(q [T, H, D], k [T, KVH, D], v [T, KVH, D], cos [T, D], sin [T, D],
//                               k_blocks, v_blocks, slot_block_ids [T], slot_offsets [T])
//                                 -> (rotated q [T, H, D], rotated k [T, KVH, D])
//     the same rotary and cache write for any number of tokens (prefill chunks); attention is
//     left to the caller. The slots must be distinct (as a step's metadata makes them): tokens
//     are written in parallel.
//
// Rotary and the residual add give the same bits as the eager PyTorch expressions (each product
// and sum rounded once, see rotate()); the norm, SiLU and attention differ from PyTorch only by
// summation order and our exp (relative error ~2e-7), i.e. by a few FP32 ulps.
//
// Only AVX2, FMA and F16C instructions are used (built with -mavx2 -mfma -mf16c): no AVX-512, even
// on CPUs that have it. Masked loads and stores (VMASKMOVPS) are kept out of inner loops: they are
// slow on AMD Zen 2 (stores especially), so they only handle row tails.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <immintrin.h>

#include "vec_avx2.h"
#include "../kernels.h"
#include "../attention_plan.h"
#include "../paged_cache.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using kunlun_cpu::avx2::hmax;
using kunlun_cpu::avx2::hsum;
using kunlun_cpu::avx2::load_ps;
using kunlun_cpu::avx2::store_ps;
using kunlun_cpu::avx2::tail_mask;
using kunlun_cpu::avx2::bf16;
template <typename T>
using PagedCache = kunlun_cpu::paged::PagedCache<T>;
using kunlun_cpu::paged::gather_slots;

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32 (the AVX2 kernels compute in FP32), got ",
              t.scalar_type());
}

// q, k, v, cos and sin FP32; the caches both FP32 or both BF16 (the KV cache dtype).
void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                  const at::Tensor& sin, const at::Tensor& k_blocks, const at::Tensor& v_blocks) {
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&cos, "cos"}, {&sin, "sin"}}) {
    check_f32(*t, name);
  }
  for (const auto& [t, name] : {std::pair{&k_blocks, "k_blocks"}, {&v_blocks, "v_blocks"}}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16, name,
                " must be float32 or bfloat16 (the AVX2 kernels' KV cache dtypes), got ", t->scalar_type());
  }
  TORCH_CHECK(k_blocks.scalar_type() == v_blocks.scalar_type(), "k_blocks (", k_blocks.scalar_type(),
              ") and v_blocks (", v_blocks.scalar_type(), ") must have one dtype");
  kunlun_cpu::paged::check_rotary_shapes(q, k, v, cos, sin, k_blocks, v_blocks, /*min_head_dim=*/1);
}

// Eight lanes of a cache row widened to FP32 (a BF16 row exactly); the _tail forms read only the
// leading lanes `tail` sets (D % 8 of them, an even count), nothing past the row's end.
inline __m256 load_row8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_row8(const bf16* p) { return kunlun_cpu::avx2::widen_bf16x8(p); }
inline __m256 load_row8_tail(const float* p, __m256i tail) { return _mm256_maskload_ps(p, tail); }
inline __m256 load_row8_tail(const bf16* p, __m256i tail) { return kunlun_cpu::avx2::widen_bf16x8_masked(p, tail); }

// A row of D FP32 values into a cache row: copied, or rounded to BF16.
inline void store_row(const float* src, float* dst, int64_t D) { std::copy(src, src + D, dst); }
inline void store_row(const float* src, bf16* dst, int64_t D) { kunlun_cpu::avx2::narrow_bf16(src, dst, D); }

// The value as computed so far, opaque to the optimiser. GCC contracts a product followed by a
// sum into one FMA (-ffp-contract=fast is its default, and it applies to intrinsics too), which
// rounds once where eager PyTorch rounds twice; passing the products through here keeps them
// rounded, so rotary gives apply_rotary's bits.
inline __m256 rounded(__m256 v) {
  __asm__("" : "+x"(v));
  return v;
}

inline __m256 negate(__m256 v) { return _mm256_xor_ps(v, _mm256_set1_ps(-0.0f)); }  // as -x, zeros included

// ---- RMSNorm -------------------------------------------------------------------------------

float inverse_rms(const float* x, int64_t H, float eps) {
  __m256 squares0 = _mm256_setzero_ps(), squares1 = _mm256_setzero_ps();  // two chains: FMA latency
  int64_t i = 0;
  for (; i + 16 <= H; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    squares0 = _mm256_fmadd_ps(a, a, squares0);
    squares1 = _mm256_fmadd_ps(b, b, squares1);
  }
  for (; i < H; i += 8) {
    const __m256 a = load_ps(x + i, H - i);
    squares0 = _mm256_fmadd_ps(a, a, squares0);
  }
  // As HF: variance + eps in FP32, then the reciprocal of its square root (torch.rsqrt).
  return 1.0f / std::sqrt(hsum(_mm256_add_ps(squares0, squares1)) / static_cast<float>(H) + eps);
}

void normalise_row(const float* x, const float* w, float* out, int64_t H, float inverse) {
  const __m256 inv = _mm256_set1_ps(inverse);
  for (int64_t i = 0; i < H; i += 8) {  // w * (x * inv), HF's order of the two products
    const int64_t count = H - i;
    store_ps(out + i, _mm256_mul_ps(load_ps(w + i, count), _mm256_mul_ps(load_ps(x + i, count), inv)), count);
  }
}

// ---- SiLU ----------------------------------------------------------------------------------

// silu(g) · up for 8 lanes: g · sigmoid(g), sigmoid from e = e^-|g| <= 1 (never overflows):
// 1 / (1 + e) for g >= 0, e / (1 + e) for g < 0. e is 2^n · p(r) with p a degree-7 Taylor
// polynomial on |r| <= ln2/2 (relative error ~5e-9) and 2^n applied in two halves, the second
// last of all, so that for g < -87 (e below FP32's normal range) the product g · e is rounded once,
// where it lands, instead of losing e's bits to a subnormal first; g < -110 gives -0 (|silu(g)| is
// below half the smallest subnormal there), as does -inf. NaN stays NaN. Accurate to a few 1e-7
// relative for every g whose SiLU is a normal float (torch's x / (1 + exp(-x)) turns g < -88.7
// into -0 where the true value is still normal down to -91.5).
inline __m256 silu(__m256 g) {
  const __m256 x = _mm256_max_ps(_mm256_set1_ps(-110.0f), _mm256_or_ps(g, _mm256_set1_ps(-0.0f)));  // -|g|; NaN kept
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // [-159, 0]
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // n = n1 + n2 with n1, n2 in [-80, 0]: both 2^n1 and 2^n2 are normal floats.
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1);
  const __m256i n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 scale1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 scale2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  const __m256 partial = _mm256_mul_ps(p, scale1);  // e · 2^-n2, normal
  const __m256 denominator = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_mul_ps(partial, scale2));  // 1 + e in [1, 2]
  // 1 / (1 + e): reciprocal estimate (12 bits) and one Newton step (~1.5e-7 relative), several
  // times cheaper than VDIVPS, which would dominate a prefill-sized call.
  __m256 reciprocal = _mm256_rcp_ps(denominator);
  reciprocal = _mm256_mul_ps(reciprocal, _mm256_fnmadd_ps(denominator, reciprocal, _mm256_set1_ps(2.0f)));
  const __m256 ratio = _mm256_mul_ps(g, reciprocal);
  const __m256 negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 result = _mm256_blendv_ps(ratio, _mm256_mul_ps(_mm256_mul_ps(ratio, partial), scale2), negative);
  const __m256 vanishing = _mm256_cmp_ps(g, _mm256_set1_ps(-110.0f), _CMP_LT_OQ);
  return _mm256_blendv_ps(result, _mm256_set1_ps(-0.0f), vanishing);
}

// ---- rotary and the paged cache ------------------------------------------------------------

// HF's rotate-half rotary in FP32: x·cos + rotate_half(x)·sin, rotate_half(x) = [-x2, x1], each
// product rounded before the sum as the eager expression rounds it (see rounded()). `scratch`
// (D floats) holds rotate_half(x) where a half is not a whole number of 8-lane vectors.
inline void rotate(const float* x, const float* cos, const float* sin, int64_t D, float* out, float* scratch) {
  const int64_t half = D / 2;
  if (half % 8 == 0) {  // each vector lies in one half
    for (int64_t i = 0; i < D; i += 8) {
      const __m256 rotated = i < half ? negate(_mm256_loadu_ps(x + i + half)) : _mm256_loadu_ps(x + i - half);
      const __m256 a = rounded(_mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(cos + i)));
      const __m256 b = rounded(_mm256_mul_ps(rotated, _mm256_loadu_ps(sin + i)));
      _mm256_storeu_ps(out + i, _mm256_add_ps(a, b));
    }
    return;
  }
  for (int64_t i = 0; i < half; ++i) scratch[i] = -x[i + half];
  for (int64_t i = half; i < D; ++i) scratch[i] = x[i - half];
  for (int64_t i = 0; i < D; i += 8) {
    const int64_t count = D - i;
    const __m256 a = rounded(_mm256_mul_ps(load_ps(x + i, count), load_ps(cos + i, count)));
    const __m256 b = rounded(_mm256_mul_ps(load_ps(scratch + i, count), load_ps(sin + i, count)));
    store_ps(out + i, _mm256_add_ps(a, b), count);
  }
}

// ---- decode attention ----------------------------------------------------------------------

// Keys scored per pass: a chunk's K and V rows stay in L1 while every query head reads them, beside
// the next chunk's rows as they are prefetched. 16 keys of SmolLM2's 3 KV heads × 64 BF16 are
// 12 KiB of K and V, twice that with the next chunk; chunks of 32 overflowed a 32 KiB L1 (a Zen 3's
// attention 1.2-1.3x slower over 2,048 keys), chunks of 8 spent more on each chunk's bookkeeping.
constexpr int64_t kKeyChunk = 16;
constexpr int64_t kMinSplitKeys = 64;  // a sequence's keys are split across threads down to this
// A P·V pass keeps kHeadTile × kStripe accumulators, kStripe value vectors and a weight in
// registers: 13 of AVX2's 16 (4 × 3 spills; 3 × 3, 4 × 2 and 2 × 3 run about the same).
constexpr int kStripe = 3;             // 8-lane vectors of D a P·V pass keeps per query head
constexpr int kHeadTile = 3;           // query heads a P·V pass accumulates at once
constexpr int64_t kPrefetchChunks = 1;  // how far ahead K and V rows are prefetched

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

// The scaled scores of eight key rows (lanes past `count` -inf) for TILE query heads, into
// probs[g * kKeyChunk + j ..] (see attend_split).
template <int TILE, bool TAIL, typename T>
void score8_heads(const float* q, int64_t padded_dim, const T* const rows[8], int64_t count, int64_t full,
                  __m256i tail, float scale, float* probs) {
  __m128 low[TILE], high[TILE];
  dot4_heads<TILE, TAIL, T>(q, padded_dim, rows, full, tail, low);
  dot4_heads<TILE, TAIL, T>(q, padded_dim, rows + 4, full, tail, high);
  for (int g = 0; g < TILE; ++g) {
    __m256 scores = _mm256_mul_ps(_mm256_set_m128(high[g], low[g]), _mm256_set1_ps(scale));
    if (count < 8) scores = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), scores, _mm256_castsi256_ps(tail_mask(count)));
    _mm256_storeu_ps(probs + g * kKeyChunk, scores);  // kKeyChunk is a multiple of 8: whole vectors fit
  }
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
      const __m256 weight = _mm256_broadcast_ss(probs + g * kKeyChunk + j);
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

template <typename T>
struct AttentionShape {
  int64_t H, KVH, D, padded_dim;  // padded_dim: D rounded up to whole vectors (q and acc rows)
  const PagedCache<T>* keys;
  const PagedCache<T>* values;
  int64_t block_size;
  float scale;
};

// One split of one sequence: every query head (q: H rows of padded_dim FP32, rotated, zero padded)
// over keys [start, end), as flash-decoding does it: per head the running maximum score, the sum
// of exponentials relative to it, and the unnormalised output (acc, H × padded_dim), merged across
// splits by the caller. Each chunk of kKeyChunk slots is read from memory once for all heads:
// each key vector is loaded and widened once for up to kScoreTile query heads that share its KV
// head (one FMA chain per key and head, one transpose-reduce per 4 keys and head), each value
// vector likewise for up to kHeadTile heads, and the next chunk's K and V rows are prefetched into
// L2 while this one computes (blocks sit in random order, which the hardware prefetcher cannot
// follow), a row per key as its KV head's keys are scored, spread out rather than all at once
// (issued all at once they stall on the line fill buffers, as the AVX-512 kernel found).
// Prefetching helps long contexts a little; prefetching two chunks ahead helps no more.
template <bool TAIL, typename T>
void attend_split(const float* q, const AttentionShape<T>& s, const int64_t* table, int64_t start, int64_t end,
                  float* maxima, float* sums, float* acc) {
  const int64_t H = s.H, KVH = s.KVH, D = s.D, padded_dim = s.padded_dim, group = H / KVH;
  const PagedCache<T>& keys = *s.keys;
  const PagedCache<T>& values = *s.values;
  const int64_t full = D / 8, vectors = padded_dim / 8;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  const __m256i tail = tail_mask(D % 8);
  std::vector<float> probs_storage(kKeyChunk * group), corrections(group);  // probs: [head in group][key]
  float* probs = probs_storage.data();
  // Slots (KV head 0) of this chunk, and of the chunk kPrefetchChunks ahead, whose rows are prefetched.
  const T* key_slots[kKeyChunk];
  const T* value_slots[kKeyChunk];
  const T* ahead_key_slots[kKeyChunk];
  const T* ahead_value_slots[kKeyChunk];
  for (int64_t h = 0; h < H; ++h) maxima[h] = -INFINITY, sums[h] = 0.0f;
  std::fill(acc, acc + H * padded_dim, 0.0f);
  // The first kPrefetchChunks + 1 chunks' rows up front: a decode step's keys are cold (the weights
  // streamed through the caches since this layer last ran), and nothing prefetched them; from
  // then on each chunk prefetches the one kPrefetchChunks ahead while it computes.
  kunlun_cpu::paged::prefetch_slots(keys, values, table, s.block_size, start,
                                    std::min(end, start + (kPrefetchChunks + 1) * kKeyChunk));
  for (int64_t c0 = start; c0 < end; c0 += kKeyChunk) {
    const int64_t n = std::min(kKeyChunk, end - c0);
    gather_slots(keys, table, s.block_size, c0, c0 + n, key_slots);
    gather_slots(values, table, s.block_size, c0, c0 + n, value_slots);
    const int64_t ahead_start = c0 + kPrefetchChunks * kKeyChunk;
    const int64_t ahead = std::clamp<int64_t>(end - ahead_start, 0, kKeyChunk);  // <= n
    gather_slots(keys, table, s.block_size, ahead_start, ahead_start + ahead, ahead_key_slots);
    gather_slots(values, table, s.block_size, ahead_start, ahead_start + ahead, ahead_value_slots);
    for (int64_t kv = 0; kv < KVH; ++kv) {
      for (int64_t j = 0; j < n; j += 8) {
        const int64_t count = std::min<int64_t>(8, n - j);
        const T* rows[8];
        for (int64_t i = 0; i < 8; ++i) {  // lanes past the chunk re-read its first key, masked off
          rows[i] = key_slots[j + (i < count ? i : 0)] + kv * keys.head_stride;
        }
        for (int64_t i = j; i < std::min(j + 8, ahead); ++i) {  // a later chunk's rows of this KV head, into L2
          const char* key = reinterpret_cast<const char*>(ahead_key_slots[i] + kv * keys.head_stride);
          const char* value = reinterpret_cast<const char*>(ahead_value_slots[i] + kv * values.head_stride);
          for (int64_t offset = 0; offset < row_bytes; offset += 64) {
            _mm_prefetch(key + offset, _MM_HINT_T1);
            _mm_prefetch(value + offset, _MM_HINT_T1);
          }
        }
        for (int64_t g0 = 0; g0 < group; g0 += kScoreTile) {
          const int tile = static_cast<int>(std::min<int64_t>(kScoreTile, group - g0));
          pick_score<TAIL, T>(tile)(q + (kv * group + g0) * padded_dim, padded_dim, rows, count, full, tail, s.scale,
                                    probs + g0 * kKeyChunk + j);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = kv * group + g;
        float* p = probs + g * kKeyChunk;
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
      // P · V for this KV head's query heads, in stripes of D and tiles of heads so the
      // accumulators stay in registers; the earlier chunks' sums are rescaled on the way.
      for (int64_t g0 = 0; g0 < group; g0 += kHeadTile) {
        const int tile = static_cast<int>(std::min<int64_t>(kHeadTile, group - g0));
        for (int64_t first = 0; first < vectors; first += kStripe) {
          const int width = static_cast<int>(std::min<int64_t>(kStripe, vectors - first));
          pick_accumulate<T>(tile, width, TAIL && first + width == vectors)(
              value_slots, kv * values.head_stride, n, probs + g0 * kKeyChunk, corrections.data() + g0,
              acc + (kv * group + g0) * padded_dim, padded_dim, first, tail);
        }
      }
    }
  }
}

}  // namespace

namespace kunlun_cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_f32(x, "x");
  check_f32(w, "w");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(1),
              "rms_norm: x must be contiguous [T, H] and w [H]");
  const int64_t T = x.size(0), H = x.size(1);
  at::Tensor out = at::empty_like(x);
  const float* xp = x.const_data_ptr<float>();
  const float* wp = w.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      normalise_row(xp + t * H, wp, op + t * H, H, inverse_rms(xp + t * H, H, static_cast<float>(eps)));
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w,
                                                double eps) {
  check_f32(x, "x");
  check_f32(delta, "delta");
  check_f32(w, "w");
  TORCH_CHECK(x.dim() == 2 && x.sizes() == delta.sizes() && x.is_contiguous() && delta.is_contiguous() &&
                  w.is_contiguous() && w.numel() == x.size(1),
              "add_rms_norm: x and delta must be contiguous [T, H] and w [H]");
  const int64_t T = x.size(0), H = x.size(1);
  at::Tensor sum = at::empty_like(x);
  at::Tensor out = at::empty_like(x);
  const float* xp = x.const_data_ptr<float>();
  const float* dp = delta.const_data_ptr<float>();
  const float* wp = w.const_data_ptr<float>();
  float* sp = sum.mutable_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* s = sp + t * H;
      for (int64_t i = 0; i < H; i += 8) {  // s = x + delta, as the eager add (one rounding)
        const int64_t count = H - i;
        store_ps(s + i, _mm256_add_ps(load_ps(xp + t * H + i, count), load_ps(dp + t * H + i, count)), count);
      }
      normalise_row(s, wp, op + t * H, H, inverse_rms(s, H, static_cast<float>(eps)));
    }
  });
  return {sum, out};
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_f32(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be contiguous [T, 2 * I]");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor out = at::empty({T, I}, gate_up.options());
  const float* gp = gate_up.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* gate = gp + t * 2 * I;
      const float* up = gate + I;
      float* o = op + t * I;
      int64_t i = 0;
      for (; i + 8 <= I; i += 8) {
        _mm256_storeu_ps(o + i, _mm256_mul_ps(silu(_mm256_loadu_ps(gate + i)), _mm256_loadu_ps(up + i)));
      }
      if (i < I) store_ps(o + i, _mm256_mul_ps(silu(load_ps(gate + i, I - i)), load_ps(up + i, I - i)), I - i);
    }
  });
  return out;
}

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
                                                          at::get_num_threads(), kMinSplitKeys);
  std::vector<float> maxima(plan.heads), sums(plan.heads), partial(plan.heads * padded_dim);
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
      AttentionShape<T> task_shape = shape;
      task_shape.H = task.rows * H;
      (D % 8 == 0 ? attend_split<false, T> : attend_split<true, T>)(
          queries.data(), task_shape, tables + task.first_row * max_blocks, task.key_begin, task.key_end,
          maxima.data() + task.head_offset, sums.data() + task.head_offset,
          partial.data() + task.head_offset * padded_dim);
    }
  });
  at::parallel_for(0, B * H, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / H, h = item % H;
      const paged::TaskPart* first = plan.parts.data() + plan.first_part[b];
      const paged::TaskPart* last = plan.parts.data() + plan.first_part[b + 1];
      float largest = -INFINITY;
      for (const paged::TaskPart* part = first; part != last; ++part) {
        largest = std::max(largest, maxima[plan.head_index(*part, h, group)]);
      }
      float total = 0.0f;
      for (const paged::TaskPart* part = first; part != last; ++part) {
        const int64_t i = plan.head_index(*part, h, group);
        total += sums[i] * std::exp(maxima[i] - largest);
      }
      for (int64_t d = 0; d < D; d += 8) {
        __m256 merged = _mm256_setzero_ps();
        for (const paged::TaskPart* part = first; part != last; ++part) {
          const int64_t i = plan.head_index(*part, h, group);
          const __m256 weight = _mm256_set1_ps(std::exp(maxima[i] - largest) / total);
          merged = _mm256_fmadd_ps(weight, _mm256_loadu_ps(partial.data() + i * padded_dim + d), merged);
        }
        store_ps(op + b * H * D + h * D + d, merged, D - d);  // masked only for a row tail
      }
    }
  });
  return out;
}

// rotary_kv_write into a cache of C (float or BF16), its inputs checked.
template <typename C>
std::tuple<at::Tensor, at::Tensor> rotary_kv_write_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                        const at::Tensor& cos, const at::Tensor& sin,
                                                        const at::Tensor& k_blocks, const at::Tensor& v_blocks,
                                                        const at::Tensor& slot_block_ids,
                                                        const at::Tensor& slot_offsets) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  const PagedCache<C> keys = paged::cache<C>(k_blocks), values = paged::cache<C>(v_blocks);
  const int64_t* blocks = slot_block_ids.const_data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.const_data_ptr<int64_t>();
  at::Tensor q_out = at::empty({T, H, D}, q.options());
  at::Tensor k_out = at::empty({T, KVH, D}, k.options());
  const float* cp = cos.const_data_ptr<float>();
  const float* sp = sin.const_data_ptr<float>();
  float* qo = q_out.mutable_data_ptr<float>();
  float* ko = k_out.mutable_data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(D);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        rotate(q.const_data_ptr<float>() + t * q.stride(0) + h * q.stride(1), cp + t * D, sp + t * D, D,
               qo + (t * H + h) * D, scratch.data());
      }
      for (int64_t h = 0; h < KVH; ++h) {
        float* rotated = ko + (t * KVH + h) * D;
        rotate(k.const_data_ptr<float>() + t * k.stride(0) + h * k.stride(1), cp + t * D, sp + t * D, D, rotated,
               scratch.data());
        store_row(rotated, keys.at(blocks[t], offsets[t], h), D);
        store_row(v.const_data_ptr<float>() + t * v.stride(0) + h * v.stride(1), values.at(blocks[t], offsets[t], h), D);
      }
    }
  });
  return {q_out, k_out};
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                            const at::Tensor& sin, const at::Tensor& k_blocks, const at::Tensor& v_blocks,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            int64_t window) {
  check_inputs(q, k, v, cos, sin, k_blocks, v_blocks);
  const auto over = k_blocks.scalar_type() == at::kBFloat16 ? &decode_attention_over<bf16> : &decode_attention_over<float>;
  return over(q, k, v, cos, sin, k_blocks, v_blocks, block_tables, context_lens, scale, window);
}

std::tuple<at::Tensor, at::Tensor> rotary_kv_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   const at::Tensor& cos, const at::Tensor& sin,
                                                   const at::Tensor& k_blocks, const at::Tensor& v_blocks,
                                                   const at::Tensor& slot_block_ids, const at::Tensor& slot_offsets) {
  check_inputs(q, k, v, cos, sin, k_blocks, v_blocks);
  paged::check_slots(slot_block_ids, slot_offsets, q.size(0), k_blocks);
  const auto into = k_blocks.scalar_type() == at::kBFloat16 ? &rotary_kv_write_into<bf16> : &rotary_kv_write_into<float>;
  return into(q, k, v, cos, sin, k_blocks, v_blocks, slot_block_ids, slot_offsets);
}

}  // namespace kunlun_cpu
