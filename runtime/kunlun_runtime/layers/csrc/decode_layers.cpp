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
// layer l is fused with the input norm of layer l + 1.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>

#include <optional>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t kTensorsPerLayer = 11;

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

}  // namespace

namespace kunlun_cpu {

at::Tensor decode_layers(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
                         at::TensorList weights, at::TensorList k_caches, at::TensorList v_caches,
                         const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, double eps, double scale, int64_t window) {
  const int64_t num_layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kTensorsPerLayer * num_layers &&
                  static_cast<int64_t>(v_caches.size()) == num_layers,
              "decode_layers: expected ", kTensorsPerLayer, " weights and one K and V cache per layer");
  TORCH_CHECK(x_in.dim() == 2 && x_in.is_contiguous(), "decode_layers: x must be contiguous [B, hidden]");
  const int64_t B = x_in.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor x = x_in;
  at::Tensor h = rms_norm(x, weights[0], eps);
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor* w = weights.data() + l * kTensorsPerLayer;
    const at::Tensor qkv = linear(h, w[1], w[2], w[3]);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({B, num_heads, head_dim});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({B, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({B, num_kv_heads, head_dim});
    const at::Tensor attention = decode_attention(q, k, v, cos, sin, k_caches[l], v_caches[l],
                                                              block_tables, context_lens, scale, window);
    std::tie(x, h) = add_rms_norm(x, linear(attention, w[4], w[5]), w[6], eps);
    const at::Tensor mlp = linear(silu_mul(linear(h, w[7], w[8])), w[9], w[10]);
    if (l + 1 < num_layers) {
      std::tie(x, h) = add_rms_norm(x, mlp, weights[(l + 1) * kTensorsPerLayer], eps);
    } else {
      x = add(x, mlp);
    }
  }
  return x;
}

}  // namespace kunlun_cpu
