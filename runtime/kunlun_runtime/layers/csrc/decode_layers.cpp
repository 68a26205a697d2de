// The whole decoder-layer stack of a decode step in one call (no Python between operators).
//
//   kunlun_cpu::decode_layers(x [B, hidden], cos [B, D], sin [B, D], weights, k_caches, v_caches,
//                             block_tables, context_lens, num_heads, num_kv_heads, head_dim, eps,
//                             scale, window) -> hidden states after the last layer's residual add
//
// `weights` holds 11 tensors per layer: input_layernorm, qkv (weight, scales, bias),
// o_proj (weight, scales), post_attention_layernorm, gate_up (weight, scales), down (weight,
// scales). A BF16 linear has an empty `scales`; an INT8 one (W8A16) has int8 weights and FP32
// scales; an empty bias means none. Each operator is the one the per-layer Python path calls
// (kernels.h), in the same order, so both paths give bit-identical results; the residual add of
// layer l is fused with the input norm of layer l + 1. With LoRA, each projection's output gains
// its rows' adapter updates (lora_update, which the per-layer path calls too).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t kTensorsPerLayer = 11;
constexpr int64_t kLoRAPerLayer = 8;  // (a, b) of qkv, o, gate_up, down

std::optional<at::Tensor> optional_tensor(const at::Tensor& t) {
  return t.numel() == 0 ? std::nullopt : std::optional<at::Tensor>(t);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                  const at::Tensor& bias = at::Tensor()) {
  const std::optional<at::Tensor> b = bias.defined() ? optional_tensor(bias) : std::nullopt;
  if (w.scalar_type() == at::kChar) return kunlun_cpu::linear_int8(x, w, scales, b);
  return kunlun_cpu::linear_bf16(x, w, b);
}

at::Tensor add(const at::Tensor& x, const at::Tensor& delta) {  // x + delta rounded as the eager add
  at::Tensor out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) {
    const float* xp = x.const_data_ptr<float>();
    const float* dp = delta.const_data_ptr<float>();
    float* op = out.mutable_data_ptr<float>();
    for (int64_t i = 0; i < x.numel(); ++i) op[i] = xp[i] + dp[i];
    return out;
  }
  const auto* xp = x.const_data_ptr<c10::BFloat16>();
  const auto* dp = delta.const_data_ptr<c10::BFloat16>();
  auto* op = out.mutable_data_ptr<c10::BFloat16>();
  for (int64_t i = 0; i < x.numel(); ++i) op[i] = c10::BFloat16(static_cast<float>(xp[i]) + static_cast<float>(dp[i]));
  return out;
}

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

// LoRA's vector helpers: one vector of FP32 lanes (16 on the AVX-512 tier, 8 on AVX2). BF16
// values widen in registers (a BF16 is the top half of an FP32), so A and B stay half the bytes,
// and narrow back rounding to nearest even, as c10::BFloat16(float).
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using Lanes = __m512;
inline Lanes zero_lanes() { return _mm512_setzero_ps(); }
inline Lanes broadcast(float v) { return _mm512_set1_ps(v); }
inline Lanes fma_lanes(Lanes a, Lanes b, Lanes c) { return _mm512_fmadd_ps(a, b, c); }
inline Lanes add_lanes(Lanes a, Lanes b) { return _mm512_add_ps(a, b); }
inline float sum_lanes(Lanes v) { return _mm512_reduce_add_ps(v); }
inline Lanes load_lanes(const float* p) { return _mm512_loadu_ps(p); }
inline Lanes load_lanes(const c10::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline void store_lanes(float* p, Lanes v) { _mm512_storeu_ps(p, v); }
inline void store_lanes(c10::BFloat16* p, Lanes v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
#else
constexpr int64_t kLanes = 8;
using Lanes = __m256;
inline Lanes zero_lanes() { return _mm256_setzero_ps(); }
inline Lanes broadcast(float v) { return _mm256_set1_ps(v); }
inline Lanes fma_lanes(Lanes a, Lanes b, Lanes c) { return _mm256_fmadd_ps(a, b, c); }
inline Lanes add_lanes(Lanes a, Lanes b) { return _mm256_add_ps(a, b); }
inline float sum_lanes(Lanes v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  float sum = 0.0f;
  for (float lane : lanes) sum += lane;
  return sum;
}
inline Lanes load_lanes(const float* p) { return _mm256_loadu_ps(p); }
inline Lanes load_lanes(const c10::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
inline void store_lanes(float* p, Lanes v) { _mm256_storeu_ps(p, v); }
inline void store_lanes(c10::BFloat16* p, Lanes v) {  // the AVX2 tier computes in FP32; kept for completeness
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  for (int64_t l = 0; l < 8; ++l) p[l] = c10::BFloat16(lanes[l]);
}
#endif

// sum(w[i] · x[i]), n values, in a fixed order: four vectors of running sums (independent FMA
// chains: one chain waits on each FMA's latency), the remainder lane by lane, then the lanes.
template <typename T>
inline float dot(const T* w, const float* x, int64_t n) {
  Lanes a0 = zero_lanes(), a1 = zero_lanes(), a2 = zero_lanes(), a3 = zero_lanes();
  int64_t i = 0;
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
    a0 = fma_lanes(load_lanes(w + i), load_lanes(x + i), a0);
    a1 = fma_lanes(load_lanes(w + i + kLanes), load_lanes(x + i + kLanes), a1);
    a2 = fma_lanes(load_lanes(w + i + 2 * kLanes), load_lanes(x + i + 2 * kLanes), a2);
    a3 = fma_lanes(load_lanes(w + i + 3 * kLanes), load_lanes(x + i + 3 * kLanes), a3);
  }
  for (; i + kLanes <= n; i += kLanes) a0 = fma_lanes(load_lanes(w + i), load_lanes(x + i), a0);
  float sum = sum_lanes(add_lanes(add_lanes(a0, a1), add_lanes(a2, a3)));
  for (; i < n; ++i) sum += to_float(w[i]) * x[i];
  return sum;
}

// Work below this many multiply-adds runs on the calling thread: a decode step's LoRA update
// is a few microseconds, less than waking the other threads costs.
constexpr int64_t kInlineWork = 1 << 17;

// y + each row's update (A_s·x)·B_sᵀ in one pass, with a [S, W, K] and bt [S, W, N] (B transposed,
// so the expand is W vector multiply-adds per output vector with no horizontal sums). The shrink
// and the expand accumulate in FP32 in a fixed order and each output is rounded once when added
// to y, so a row's result depends on neither its batch nor the threads.
template <typename T>
at::Tensor lora_apply(const at::Tensor& x, const at::Tensor& y, const at::Tensor& a, const at::Tensor& bt,
                      const int64_t* slots) {
  const int64_t rows = x.size(0), K = x.size(1), W = a.size(1), N = bt.size(2);
  const T* xp = x.const_data_ptr<T>();
  const T* ap = a.const_data_ptr<T>();
  const T* bp = bt.const_data_ptr<T>();
  std::vector<float> xf(rows * K);
  for (int64_t i = 0; i < rows * K; ++i) xf[i] = to_float(xp[i]);
  std::vector<float> h(rows * W, 0.0f);
  // The slots in use and their rows: each slot's A is read once, for all its rows.
  std::vector<int64_t> used;
  for (int64_t r = 0; r < rows; ++r) {
    if (slots[r] >= 0 && std::find(used.begin(), used.end(), slots[r]) == used.end()) used.push_back(slots[r]);
  }
  const int64_t tasks = static_cast<int64_t>(used.size()) * W;
  at::parallel_for(0, tasks, std::max<int64_t>(1, kInlineWork / (K * rows)), [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t slot = used[task / W], j = task % W;
      const T* arow = ap + (slot * W + j) * K;
      for (int64_t r = 0; r < rows; ++r) {
        if (slots[r] == slot) h[r * W + j] = dot(arow, xf.data() + r * K, K);
      }
    }
  });
  at::Tensor out = at::empty_like(y);
  const T* yp = y.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  // Expand over blocks of kBlock output channels (threads split the blocks): for each row, its
  // slot's B rows j = 0..W-1 are read kBlock channels at a time (contiguous runs the prefetcher
  // follows) and multiply-added into the row's FP32 sums, j in order; then y is added, rounded once.
  constexpr int64_t kBlock = 8 * kLanes;
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  const int64_t grain = std::max<int64_t>(1, kInlineWork / (rows * W * kBlock));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[kBlock];
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n0 = block * kBlock, width = std::min(kBlock, N - n0);
      for (int64_t r = 0; r < rows; ++r) {
        std::fill(acc, acc + width, 0.0f);
        if (slots[r] >= 0) {
          const T* rows_of_b = bp + slots[r] * W * N + n0;
          const float* hr = h.data() + r * W;
          if (width == kBlock) {  // a whole block: its sums stay in registers across j
            Lanes sums[8];
            for (int v = 0; v < 8; ++v) sums[v] = zero_lanes();
            for (int64_t j = 0; j < W; ++j) {
              const T* bj = rows_of_b + j * N;
              const Lanes hj = broadcast(hr[j]);
              for (int v = 0; v < 8; ++v) sums[v] = fma_lanes(hj, load_lanes(bj + v * kLanes), sums[v]);
            }
            for (int v = 0; v < 8; ++v) store_lanes(acc + v * kLanes, sums[v]);
          } else {
            for (int64_t j = 0; j < W; ++j) {
              const T* bj = rows_of_b + j * N;
              const Lanes hj = broadcast(hr[j]);
              int64_t n = 0;
              for (; n + kLanes <= width; n += kLanes) {
                store_lanes(acc + n, fma_lanes(hj, load_lanes(bj + n), load_lanes(acc + n)));
              }
              for (; n < width; ++n) acc[n] += hr[j] * to_float(bj[n]);
            }
          }
        }
        const T* yr = yp + r * N + n0;
        T* outr = op + r * N + n0;
        int64_t n = 0;
        for (; n + kLanes <= width; n += kLanes) store_lanes(outr + n, add_lanes(load_lanes(yr + n), load_lanes(acc + n)));
        for (; n < width; ++n) outr[n] = T(to_float(yr[n]) + acc[n]);
      }
    }
  });
  return out;
}

}  // namespace

namespace kunlun_cpu {

at::Tensor lora_update(const at::Tensor& x, const at::Tensor& y, const at::Tensor& a, const at::Tensor& b,
                       const at::Tensor& slots) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(1) == b.size(1),
              "lora_update: expected a [S, W, K] and b [S, W, N] (B transposed)");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.size(1) == a.size(2) &&
                  y.size(1) == b.size(2),
              "lora_update: x [rows, K] and y [rows, N] do not fit a and b");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == x.size(0), "lora_update: one int64 slot per row");
  TORCH_CHECK(x.scalar_type() == a.scalar_type() && y.scalar_type() == a.scalar_type() &&
                  b.scalar_type() == a.scalar_type(),
              "lora_update: x, y, a and b must share one dtype");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && a.is_contiguous() && b.is_contiguous() && slots.is_contiguous(),
              "lora_update: tensors must be contiguous");
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < x.size(0); ++r) {
    TORCH_CHECK(sp[r] >= -1 && sp[r] < a.size(0), "lora_update: slot ", sp[r], " out of range");
  }
  if (a.scalar_type() == at::kFloat) return lora_apply<float>(x, y, a, b, sp);
  TORCH_CHECK(a.scalar_type() == at::kBFloat16, "lora_update: float32 or bfloat16 tensors");
  return lora_apply<c10::BFloat16>(x, y, a, b, sp);
}

at::Tensor decode_layers(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
                         at::TensorList weights, at::TensorList k_caches, at::TensorList v_caches,
                         const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, double eps, double scale, int64_t window,
                         at::TensorList lora, const at::Tensor& lora_slots) {
  const int64_t num_layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kTensorsPerLayer * num_layers &&
                  static_cast<int64_t>(v_caches.size()) == num_layers,
              "decode_layers: expected ", kTensorsPerLayer, " weights and one K and V cache per layer");
  TORCH_CHECK(x_in.dim() == 2 && x_in.is_contiguous(), "decode_layers: x must be contiguous [B, hidden]");
  TORCH_CHECK(lora.empty() || static_cast<int64_t>(lora.size()) == kLoRAPerLayer * num_layers,
              "decode_layers: expected no LoRA tensors or ", kLoRAPerLayer, " per layer");
  // The projection's output plus its rows' adapter updates (none without LoRA).
  const auto with_lora = [&](const at::Tensor& in, const at::Tensor& out, int64_t layer, int64_t projection) {
    if (lora.empty()) return out;
    const at::Tensor* t = lora.data() + layer * kLoRAPerLayer + 2 * projection;
    return lora_update(in.contiguous(), out, t[0], t[1], lora_slots);
  };
  const int64_t B = x_in.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor x = x_in;
  at::Tensor h = rms_norm(x, weights[0], eps);
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor* w = weights.data() + l * kTensorsPerLayer;
    const at::Tensor qkv = with_lora(h, linear(h, w[1], w[2], w[3]), l, 0);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({B, num_heads, head_dim});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({B, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({B, num_kv_heads, head_dim});
    const at::Tensor attention = decode_attention(q, k, v, cos, sin, k_caches[l], v_caches[l],
                                                              block_tables, context_lens, scale, window);
    std::tie(x, h) = add_rms_norm(x, with_lora(attention, linear(attention, w[4], w[5]), l, 1), w[6], eps);
    const at::Tensor activated = silu_mul(with_lora(h, linear(h, w[7], w[8]), l, 2));
    const at::Tensor mlp = with_lora(activated, linear(activated, w[9], w[10]), l, 3);
    if (l + 1 < num_layers) {
      std::tie(x, h) = add_rms_norm(x, mlp, weights[(l + 1) * kTensorsPerLayer], eps);
    } else {
      x = add(x, mlp);
    }
  }
  return x;
}

}  // namespace kunlun_cpu
