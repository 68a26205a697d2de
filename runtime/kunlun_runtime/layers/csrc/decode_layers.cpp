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
#include <ATen/ops/linear.h>
#include <c10/util/BFloat16.h>

#include <optional>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t kTensorsPerLayer = 11;
constexpr int64_t kLoRAPerLayer = 12;  // (a, b, b_stacked) of qkv, o, gate_up, down

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

at::Tensor lora_linear(const at::Tensor& x, const at::Tensor& w) {
  // BF16 slots (BF16 weights): our kernel; FP32 slots (FP32 activations): ATen's, as the per-layer path.
  if (w.scalar_type() == at::kBFloat16) return kunlun_cpu::linear_bf16(x, w, std::nullopt);
  return at::linear(x, w);
}

template <typename T>
void keep_own_slot(at::Tensor& h, const int64_t* slots, int64_t width) {  // zero the other slots' columns
  T* hp = h.mutable_data_ptr<T>();
  const int64_t rows = h.size(0), cols = h.size(1);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      if (c / width != slots[r]) hp[r * cols + c] = T(0);
    }
  }
}

}  // namespace

namespace kunlun_cpu {

at::Tensor lora_update(const at::Tensor& x, const at::Tensor& y, const at::Tensor& a, const at::Tensor& b,
                       const at::Tensor& b_stacked, const at::Tensor& slots) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && slots.scalar_type() == at::kLong && slots.size(0) == x.size(0),
              "lora_update: expected a [S, W, K], b [S, N, W] and one int64 slot per row");
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  const int64_t rows = x.size(0), width = a.size(1);
  bool single = true;
  for (int64_t r = 1; r < rows; ++r) single = single && sp[r] == sp[0];
  at::Tensor delta;
  if (single && sp[0] >= 0) {
    delta = lora_linear(lora_linear(x, a.select(0, sp[0])), b.select(0, sp[0]));
  } else {
    at::Tensor h = lora_linear(x, a.view({-1, a.size(2)}));
    if (h.scalar_type() == at::kFloat) {
      keep_own_slot<float>(h, sp, width);
    } else {
      keep_own_slot<c10::BFloat16>(h, sp, width);
    }
    delta = lora_linear(h, b_stacked);
  }
  return add(y, delta);
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
    const at::Tensor* t = lora.data() + layer * kLoRAPerLayer + 3 * projection;
    return lora_update(in, out, t[0], t[1], t[2], lora_slots);
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
