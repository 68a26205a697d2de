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
#include <c10/util/BFloat16.h>

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

// sum(w[i] · x[i]) over n values in a fixed order: 16 running sums (one vector register's worth,
// which the compiler keeps in one without reassociating), then the remainder, then the 16 summed.
template <typename T>
inline float dot(const T* w, const float* x, int64_t n) {
  constexpr int64_t kLanes = 16;
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) acc[l] += to_float(w[i + l]) * x[i + l];
  }
  for (int64_t l = 0; i + l < n; ++l) acc[l] += to_float(w[i + l]) * x[i + l];
  float sum = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) sum += acc[l];
  return sum;
}

// y + each row's update B_s·(A_s·x) in one pass, per slot in use: its A and B are read once for
// all its rows. The shrink (W dot products of length K per row) and the expand (N dot products of
// length W per row) accumulate in FP32, and each output is rounded once when added to y: no
// intermediate rounding to BF16, so a row's result does not depend on its batch.
template <typename T>
at::Tensor lora_apply(const at::Tensor& x, const at::Tensor& y, const at::Tensor& a, const at::Tensor& b,
                      const int64_t* slots) {
  const int64_t rows = x.size(0), K = x.size(1), W = a.size(1), N = b.size(1);
  const T* xp = x.const_data_ptr<T>();
  const T* ap = a.const_data_ptr<T>();
  const T* bp = b.const_data_ptr<T>();
  std::vector<float> xf(rows * K);
  for (int64_t i = 0; i < rows * K; ++i) xf[i] = to_float(xp[i]);
  std::vector<float> h(rows * W, 0.0f);
  // Shrink: one task per (row, column of A); each reads one of A's rows.
  at::parallel_for(0, rows * W, 16, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / W, j = task % W;
      if (slots[r] < 0) continue;
      h[r * W + j] = dot(ap + (slots[r] * W + j) * K, xf.data() + r * K, K);
    }
  });
  at::Tensor out = at::empty_like(y);
  const T* yp = y.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  // Expand: output channels split across threads; each reads its row of B once per slot in use.
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t r = 0; r < rows; ++r) {
        const float delta = slots[r] < 0 ? 0.0f : dot(bp + (slots[r] * N + n) * W, h.data() + r * W, W);
        op[r * N + n] = T(to_float(yp[r * N + n]) + delta);
      }
    }
  });
  return out;
}

}  // namespace

namespace kunlun_cpu {

at::Tensor lora_update(const at::Tensor& x, const at::Tensor& y, const at::Tensor& a, const at::Tensor& b,
                       const at::Tensor& slots) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(1) == b.size(2),
              "lora_update: expected a [S, W, K] and b [S, N, W]");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.size(1) == a.size(2) &&
                  y.size(1) == b.size(1),
              "lora_update: x [rows, K] and y [rows, N] do not fit a and b");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == x.size(0), "lora_update: one int64 slot per row");
  TORCH_CHECK(x.scalar_type() == a.scalar_type() && y.scalar_type() == a.scalar_type() &&
                  b.scalar_type() == a.scalar_type(),
              "lora_update: x, y and the slots must share one dtype");
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
