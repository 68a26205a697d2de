// Small-batch (decode) linear kernels for x86 CPUs with AVX-512 BF16.
//
// At decode a linear layer multiplies a few activation rows by a weight matrix read from DRAM once
// per step, so it is bound by how fast the weight streams in. oneDNN's BF16 GEMM, built for large
// M, falls well short of the memory bandwidth at M = 1. These kernels
// stream each weight row once for all activation rows (up to 32 in BF16, 8 in INT8), accumulate
// in FP32 and round once; a larger M runs in passes, and 3..16 rows of whole tiles go to the AMX
// kernel (amx_linear.cpp) where the CPU grants AMX (more rows: AMX passes of 16). A block takes 2
// or 4 weight rows (independent accumulators hide the dot products' latency); 9..32 rows run in
// groups of 8 over each block while it is in L1: a decode batch with its speculative drafts still
// reads each weight once (as two passes of 8 it read them twice, 1.5x the step's linear time at
// 12 rows on a 2-core Zen 5):
//
//   kunlun_cpu::linear_bf16(x bf16 [M, K], w bf16 [N, K], bias fp32 [N]?)              -> bf16 [M, N]
//   kunlun_cpu::linear_int8(x bf16 [M, K], w int8 [N, K], scales fp32 [N], bias fp32 [N]?) -> bf16 [M, N]
//
// linear_int8 is weight-only INT8 (W8A16): y = (x · q) * scale per output channel. x is carried
// in INT16 with one scale per block of 256 elements of a row (rounding error at most 2^-16 of the
// block's largest value, far under BF16's own rounding, and an outlier only coarsens its own
// block), so the products and their sums within a block run on VPDPWSSD in exact integer
// arithmetic; blocks are scaled and summed in FP32. Widening INT8 weights to FP32 instead kept the
// kernel compute-bound, below the memory bandwidth. Output channels are split across the intra-op
// threads (at::parallel_for).
//
// The weight streams in kPrefetchBytes ahead of the arithmetic, in one of two orders (the
// WeightPrefetch policy, chosen once per process by CPU vendor; weight_prefetch() says which):
// on Intel each of a block's rows prefetches its own line into L2, as tuned on the Xeon this tier
// was written on; on AMD (and Hygon) the thread's weight is taken as the one contiguous stream it
// is and prefetched in address order into L1, as the AVX2 tier does, which streamed faster on an
// AMD Zen 5 at one to eight rows (benchmarks/bench_weight_prefetch.py compares the two in one
// run; the per-row order was not measured against it on Intel).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <cpuid.h>
#include <immintrin.h>

#include "bf16_vec.h"
#include "amx_linear.h"
#include "../kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kMaxRows = 32;      // BF16 rows per pass
constexpr int64_t kAmxPassRows = 16;  // rows per AMX pass (one tile of rows)
constexpr int64_t kMaxInt8Rows = 8;  // INT8 rows per pass
constexpr int64_t kMinAmxRows = 3;  // from this many rows on, the AMX kernel (amx_linear.cpp)
// Software prefetch distance along the weight stream, in bytes: the hardware prefetcher alone leaves
// each core well below its share of the memory bandwidth; this distance did best on the Xeon (AMX)
// this tier was tuned on, and 4-64 KiB did alike on a Zen 5. Where the lines go depends on the core
// (the policy below): on the Xeon into L2 (_MM_HINT_T1), into L1 being slower there, most for INT8
// at one row; on AMD cores into L1, in stream order.
constexpr int64_t kPrefetchBytes = 16384;

enum class WeightPrefetch { kRowsToL2, kStreamToL1 };

// The process's policy: by vendor at first use; set_weight_prefetch changes it (atomic, as the
// intra-op threads read it while a benchmark may switch it).
// AMD's cores and Hygon's (derived from AMD's Zen) take the stream order.
bool amd_core() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
  char vendor[13] = {};
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  return std::strcmp(vendor, "AuthenticAMD") == 0 || std::strcmp(vendor, "HygonGenuine") == 0;
}

std::atomic<WeightPrefetch>& weight_prefetch_policy() {
  static std::atomic<WeightPrefetch> policy{amd_core() ? WeightPrefetch::kStreamToL1 : WeightPrefetch::kRowsToL2};
  return policy;
}

bool stream_prefetch() {
  return weight_prefetch_policy().load(std::memory_order_relaxed) == WeightPrefetch::kStreamToL1;
}

// The stream policy's prefetches: `lines` lines from `address` on, into L1. (Addresses are
// integers here: the stream runs past the end of the weight at the last blocks, harmlessly for a
// prefetch, but not for pointer arithmetic.)
inline void prefetch_lines_l1(uintptr_t address, int64_t lines) {
  for (int64_t line = 0; line < lines; ++line) {
    _mm_prefetch(reinterpret_cast<const char*>(address + 64 * line), _MM_HINT_T0);
  }
}

// Where the stream policy's prefetches for the block of channels [n0, n0 + R) begin: its first
// byte, kPrefetchBytes ahead (a thread's blocks follow each other in memory).
inline uintptr_t stream_ahead(const void* w, int64_t n0, int64_t row_bytes) {
  return reinterpret_cast<uintptr_t>(w) + n0 * row_bytes + kPrefetchBytes;
}

inline __m512bh load_bf16x32(const c10::BFloat16* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

inline __m512bh load_bf16x32_tail(const c10::BFloat16* p, int64_t count) {  // count < 32
  const __mmask32 mask = static_cast<__mmask32>((1ull << count) - 1);
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, reinterpret_cast<const void*>(p));
}

// Output channels [n0, n0 + R) for all M rows of x.
// Each 32 columns consume one line of each of the R rows: the stream policy prefetches R lines of
// the stream, the rows policy one line of each row. A block that serves its rows in GROUPS calls
// (bf16_groups) prefetches in every GROUPS-th step of 32 columns, from step GROUP on: the calls
// share the prefetches (each issued once) and keep the stream running while they compute.
template <int M, int R, int GROUP = 0, int GROUPS = 1>
inline void bf16_block(const c10::BFloat16* x, const c10::BFloat16* w, const float* bias, c10::BFloat16* out,
                       int64_t K, int64_t N, int64_t n0, bool stream) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const uintptr_t ahead = stream_ahead(w, n0, K * 2);
  auto mine = [](int64_t k) { return GROUPS == 1 || (k / 32) % GROUPS == GROUP; };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[R];
    const bool prefetch = mine(k);
    if (prefetch && stream) prefetch_lines_l1(ahead + (k / 32) * R * 64, R);
    for (int r = 0; r < R; ++r) {
      if (prefetch && !stream) _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + r) * K + k) + kPrefetchBytes, _MM_HINT_T1);
      wv[r] = load_bf16x32(w + (n0 + r) * K + k);
    }
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = load_bf16x32(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  if (k < K) {
    // The block's last K % 32 columns per row: the stream's lines up to the block's end.
    if (mine(k) && stream) prefetch_lines_l1(ahead + (k / 32) * R * 64, (R * (K - k) * 2 + 63) / 64);
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_bf16x32_tail(w + (n0 + r) * K + k, K - k);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = load_bf16x32_tail(x + m * K + k, K - k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  // Each output sums its lanes in one spelled-out order, so a row's result does not depend on the
  // rows beside it (a decode row gives the same bits with or without speculative drafts). From 8
  // outputs on they are summed, biased and rounded sixteen at a time (sum16_halving gives
  // sum_halving's bits; the rounding is c10::BFloat16's): one by one, their shuffles, roundings and
  // scalar stores were a large share of a block's time at K = 576 (18 steps of dot products).
  if constexpr (M * R >= 8) {
    constexpr int kOutputs = M * R, kGroups = (kOutputs + 15) / 16;
    alignas(64) c10::BFloat16 rounded[kGroups * 16];
    for (int g = 0; g < kGroups; ++g) {
      __m512 v[16];
      alignas(64) float bias_lanes[16] = {};
      for (int i = 0; i < 16; ++i) {
        const int o = 16 * g + i;
        v[i] = o < kOutputs ? acc[o / R][o % R] : _mm512_setzero_ps();
        if (bias && o < kOutputs) bias_lanes[i] = bias[n0 + o % R];
      }
      // + 0.0f without a bias, as the one-by-one path adds it (a -0.0 sum would become +0.0).
      const __m512 sums = _mm512_add_ps(kunlun_cpu::vec::sum16_halving(v), _mm512_load_ps(bias_lanes));
      kunlun_cpu::vec::store_bf16x16(rounded + 16 * g, sums, 0xFFFF);
    }
    for (int m = 0; m < M; ++m) std::memcpy(out + m * N + n0, rounded + m * R, R * sizeof(c10::BFloat16));
  } else {
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) {
        const float value = kunlun_cpu::vec::sum_halving(acc[m][r]) + (bias ? bias[n0 + r] : 0.0f);
        out[m * N + n0 + r] = c10::BFloat16(value);
      }
  }
}

// Elements of a row per INT16 activation scale, and per INT32 accumulation: each lane adds 16
// products of |x| <= 32767 and |w| <= 128 per block, far below 2^31.
constexpr int64_t kInt8Block = 256;

// FULL: all 32, loaded plainly (a masked byte load costs more on Intel cores, as the masked word
// loads of kunlun_cpu::vec::load_words32 do).
template <bool FULL>
inline __m512i load_int8x32_as_int16(const int8_t* p, __mmask32 mask) {
  if constexpr (FULL) return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, p));
}

// Output channels [n0, n0 + R) for all M rows: xq = x / x_scale per block of kInt8Block (row m's
// scales at x_scales + m * blocks), so VPDPWSSD multiplies 32 weight/activation pairs per
// instruction in integers; each block's sums are scaled into FP32 lane accumulators.
// Each 64 columns consume one line of each of the R rows, prefetched as in bf16_block.
template <int M, int R>
inline void int8_block(const int16_t* xq, const float* x_scales, int64_t blocks, const int8_t* w, const float* scales,
                       const float* bias, c10::BFloat16* out, int64_t K, int64_t N, int64_t n0, bool stream) {
  const uintptr_t ahead = stream_ahead(w, n0, K);
  __m512 totals[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) totals[m][r] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += kInt8Block) {
    const int64_t k1 = std::min(K, k0 + kInt8Block);
    __m512i acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_si512();
    // 32 columns of the block; where all of them lie inside it (FULL) they load unmasked (see
    // load_int8x32_as_int16, load_words32).
    auto columns = [&](int64_t k, auto full) {
      constexpr bool FULL = decltype(full)::value;
      const __mmask32 mask = FULL ? ~__mmask32(0) : (__mmask32(1) << (k1 - k)) - 1;
      __m512i wv[R];
      if (stream && (k & 63) == 0) prefetch_lines_l1(ahead + (k / 64) * R * 64, R);
      for (int r = 0; r < R; ++r) {
        if (!stream && (k & 63) == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + r) * K + k) + kPrefetchBytes, _MM_HINT_T1);
        }
        wv[r] = load_int8x32_as_int16<FULL>(w + (n0 + r) * K + k, mask);
      }
      for (int m = 0; m < M; ++m) {
        const __m512i xv = kunlun_cpu::vec::load_words32<FULL>(xq + m * K + k, mask);
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpwssd_epi32(acc[m][r], xv, wv[r]);
      }
    };
    int64_t k = k0;
    for (; k + 32 <= k1; k += 32) columns(k, std::true_type{});
    if (k < k1) columns(k, std::false_type{});
    for (int m = 0; m < M; ++m) {
      const __m512 block_scale = _mm512_set1_ps(x_scales[m * blocks + k0 / kInt8Block]);
      for (int r = 0; r < R; ++r) totals[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][r]), block_scale, totals[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      const int64_t n = n0 + r;
      out[m * N + n] = c10::BFloat16(_mm512_reduce_add_ps(totals[m][r]) * scales[n] + (bias ? bias[n] : 0.0f));
    }
}

// Weight rows per block: enough independent accumulators to hide the FMA latency, within 32
// registers.
template <int M>
constexpr int rows_per_block() {
  return M <= 4 ? 4 : 2;
}

// Runs `block<M, R>` over all output channels, R at a time, split across threads; the channels
// left over when N is not a multiple of R go one by one.
template <int M, typename Block, typename Single>
void for_each_block(int64_t N, Block block, Single single) {
  constexpr int R = rows_per_block<M>();
  const int64_t num_blocks = N / R;
  at::parallel_for(0, num_blocks, 8, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) block(b * R);
  });
  for (int64_t n = num_blocks * R; n < N; ++n) single(n);
}

void check_inputs(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "x and w must be 2-D");
  TORCH_CHECK(x.size(1) == w.size(1), "x has ", x.size(1), " columns but w has ", w.size(1));
  TORCH_CHECK(x.size(0) >= 1, "x must have at least one row");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be bfloat16");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "x and w must be contiguous");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == w.size(0),
                "bias must be a contiguous float32 vector of ", w.size(0), " elements");
  }
}

// 9..32 rows: each block of weight rows serves the rows in groups of 8 (the last one the rest)
// while it is still in L1, so the weights stream from memory once. (One block of all the rows would
// need more accumulators than there are registers, and a block of one weight row loads an
// activation vector per dot product: measured 1.4x slower at 16 rows.) Every row goes through the
// same block code whatever its group, so its result does not depend on the rows beside it. The
// groups take turns at prefetching the weight stream, each every GROUPS-th step of 32 columns:
// when the first group prefetched all of it, the stream stood still while the later groups
// computed (16 rows took 1.3-1.4x the linear time of 8, where 16 rows' arithmetic with the weights in
// cache takes less than 8 rows' streaming); taking turns, a step's linears ran 1.03-1.10x faster at
// 12-32 rows on a 2-core Zen 5. Taking turns into L2 instead was as fast in some runs and 0.8-0.9x
// in others. (Issuing the same prefetches in every group cost ~5 % at 16-24 rows.)
template <int M, int R, int G = 0>
inline void bf16_groups(const c10::BFloat16* x, const c10::BFloat16* w, const float* bias, c10::BFloat16* out,
                        int64_t K, int64_t N, int64_t n0, bool stream) {
  static_assert(M > 8, "1..8 rows run as one block");
  constexpr int kGroups = (M + 7) / 8;
  if constexpr (8 * (G + 1) <= M) {
    bf16_block<8, R, G, kGroups>(x + 8 * G * K, w, bias, out + 8 * G * N, K, N, n0, stream);
    if constexpr (G + 1 < kGroups) bf16_groups<M, R, G + 1>(x, w, bias, out, K, N, n0, stream);
  } else {
    bf16_block<M % 8, R, G, kGroups>(x + 8 * G * K, w, bias, out + 8 * G * N, K, N, n0, stream);
  }
}

template <int M>
void linear_bf16_rows(const c10::BFloat16* xp, const at::Tensor& w, const float* bias, c10::BFloat16* op) {
  const auto* wp = w.const_data_ptr<c10::BFloat16>();
  const int64_t K = w.size(1), N = w.size(0);
  const bool stream = stream_prefetch();
  if constexpr (M <= 8) {
    for_each_block<M>(
        N, [&](int64_t n0) { bf16_block<M, rows_per_block<M>()>(xp, wp, bias, op, K, N, n0, stream); },
        [&](int64_t n) { bf16_block<M, 1>(xp, wp, bias, op, K, N, n, stream); });
  } else {
    for_each_block<8>(
        N, [&](int64_t n0) { bf16_groups<M, rows_per_block<8>()>(xp, wp, bias, op, K, N, n0, stream); },
        [&](int64_t n) { bf16_groups<M, 1>(xp, wp, bias, op, K, N, n, stream); });
  }
}

template <int M>
void linear_int8_rows(const int16_t* xq, const float* x_scales, int64_t blocks, const at::Tensor& w,
                      const float* scales, const float* bias, c10::BFloat16* op) {
  const auto* wp = w.const_data_ptr<int8_t>();
  const int64_t K = w.size(1), N = w.size(0);
  const bool stream = stream_prefetch();
  for_each_block<M>(
      N,
      [&](int64_t n0) {
        int8_block<M, rows_per_block<M>()>(xq, x_scales, blocks, wp, scales, bias, op, K, N, n0, stream);
      },
      [&](int64_t n) { int8_block<M, 1>(xq, x_scales, blocks, wp, scales, bias, op, K, N, n, stream); });
}

// Calls fn(std::integral_constant<int, rows>) for 1 <= rows <= MAX.
template <int MAX, int R = 1, typename Fn>
void dispatch_rows(int64_t rows, Fn fn) {
  if constexpr (R < MAX) {
    if (rows != R) return dispatch_rows<MAX, R + 1>(rows, fn);
  }
  fn(std::integral_constant<int, R>{});
}

// Calls fn(rows, first_row) for the rows of x in passes of up to MAX rows: each pass streams the
// weight once, so a batch of 2 * MAX reads it twice (still cheaper than a GEMM built for large M).
template <int MAX, typename Fn>
void for_each_pass(int64_t M, Fn fn) {
  for (int64_t m0 = 0; m0 < M; m0 += MAX) {
    auto call = [&](auto r) { fn(r, m0); };
    dispatch_rows<MAX>(std::min<int64_t>(MAX, M - m0), call);
  }
}

}  // namespace

namespace kunlun_cpu {

std::string weight_prefetch() { return stream_prefetch() ? "stream-l1" : "rows-l2"; }

void set_weight_prefetch(const std::string& policy) {
  TORCH_CHECK(policy == "stream-l1" || policy == "rows-l2",
              "weight prefetch policy must be 'stream-l1' or 'rows-l2', not '", policy, "'");
  weight_prefetch_policy().store(policy == "stream-l1" ? WeightPrefetch::kStreamToL1 : WeightPrefetch::kRowsToL2);
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  check_inputs(x, w, bias);
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "w must be bfloat16");
  const float* bias_ptr = bias.has_value() ? bias->const_data_ptr<float>() : nullptr;
  if (x.size(0) >= kMinAmxRows && amx_linear_fits(x.narrow(0, 0, std::min<int64_t>(x.size(0), kAmxPassRows)), w)) {
    if (x.size(0) <= kAmxPassRows) return linear_bf16_amx(x, w, bias_ptr);
    std::vector<at::Tensor> passes;  // AMX computes a tile of 16 rows at a time: passes of 16
    for (int64_t m0 = 0; m0 < x.size(0); m0 += kAmxPassRows) {
      passes.push_back(linear_bf16_amx(x.narrow(0, m0, std::min(kAmxPassRows, x.size(0) - m0)), w, bias_ptr));
    }
    return at::cat(passes);
  }
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  const auto* xp = x.const_data_ptr<c10::BFloat16>();
  auto* op = out.mutable_data_ptr<c10::BFloat16>();
  const int64_t K = w.size(1), N = w.size(0);
  for_each_pass<kMaxRows>(x.size(0), [&](auto rows, int64_t m0) {
    linear_bf16_rows<decltype(rows)::value>(xp + m0 * K, w, bias_ptr, op + m0 * N);
  });
  return out;
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  check_inputs(x, w, bias);
  TORCH_CHECK(w.scalar_type() == at::kChar, "w must be int8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == w.size(0),
              "scales must be a contiguous float32 vector of ", w.size(0), " elements");
  const int64_t M = x.size(0), K = x.size(1);
  // The activations in INT16 with one scale per block of a row (the block's max |x| / 32767): a
  // few KiB, quantized once per call. A row with a NaN or infinity gives NaN outputs, as a float
  // matmul would; a block whose largest value is below 1e-30 counts as zeros (its scale would be
  // denormal and its reciprocal infinite).
  const int64_t blocks = (K + kInt8Block - 1) / kInt8Block;
  std::vector<int16_t> xq(M * K);
  std::vector<float> x_scales(M * blocks);
  const auto* xs = x.const_data_ptr<c10::BFloat16>();
  for (int64_t m = 0; m < M; ++m) {
    const c10::BFloat16* row = xs + m * K;
    __mmask16 non_finite = 0;
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 v = kunlun_cpu::vec::load_bf16x16(row + k, kunlun_cpu::vec::tail_mask(K - k));
      non_finite |= _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), _mm512_setzero_ps(), _CMP_NEQ_UQ);  // inf - inf, NaN
    }
    for (int64_t block = 0; block < blocks; ++block) {
      const int64_t k0 = block * kInt8Block, k1 = std::min(K, k0 + kInt8Block);
      __m512 largest_lanes = _mm512_setzero_ps();
      for (int64_t k = k0; k < k1; k += 16) {
        const __m512 v = kunlun_cpu::vec::load_bf16x16(row + k, kunlun_cpu::vec::tail_mask(k1 - k));
        largest_lanes = _mm512_max_ps(largest_lanes, _mm512_abs_ps(v));
      }
      const float largest = _mm512_reduce_max_ps(largest_lanes);
      float& scale = x_scales[m * blocks + block];
      if (non_finite || largest < 1e-30f) {
        scale = non_finite ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
        std::fill(xq.begin() + m * K + k0, xq.begin() + m * K + k1, int16_t(0));
        continue;
      }
      scale = largest / 32767.0f;
      const __m512 inverse = _mm512_set1_ps(1.0f / scale);
      for (int64_t k = k0; k < k1; k += 16) {  // round to nearest even, saturate to INT16
        const __mmask16 mask = kunlun_cpu::vec::tail_mask(k1 - k);
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(kunlun_cpu::vec::load_bf16x16(row + k, mask), inverse));
        _mm256_mask_storeu_epi16(xq.data() + m * K + k, mask, _mm512_cvtsepi32_epi16(q));
      }
    }
  }
  at::Tensor out = at::empty({M, w.size(0)}, x.options());
  const float* bias_ptr = bias.has_value() ? bias->const_data_ptr<float>() : nullptr;
  auto* op = out.mutable_data_ptr<c10::BFloat16>();
  const int64_t N = w.size(0);
  for_each_pass<kMaxInt8Rows>(M, [&](auto rows, int64_t m0) {
    linear_int8_rows<decltype(rows)::value>(xq.data() + m0 * K, x_scales.data() + m0 * blocks, blocks, w,
                                            scales.const_data_ptr<float>(), bias_ptr, op + m0 * N);
  });
  return out;
}

}  // namespace kunlun_cpu
