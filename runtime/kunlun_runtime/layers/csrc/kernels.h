// The operators every kernel tier implements, for the activations of its compute dtype: the
// AVX-512 tier (avx512/) takes BF16 activations, the AVX2 tier (avx2/) FP32 ones; weights are BF16
// or INT8 in both. decode_layers.cpp composes them and registration.cpp registers them as torch
// ops in the namespace KUNLUN_OPS that the build defines (kunlun_avx512, kunlun_avx2), so one
// process can load both tiers side by side.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/TensorBody.h>

#include <optional>
#include <string>
#include <tuple>

namespace kunlun_cpu {

// y = x · wᵀ (+ bias), w BF16 [N, K]; bias FP32 [N].
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);
// y = (x · qᵀ) · scales (+ bias), q INT8 [N, K] with one FP32 scale per output channel.
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias);
// How the linears prefetch their weight stream: "stream-l1" (the thread's weight in address order,
// into L1) or "rows-l2" (each row of a block its own line, into L2). Each tier picks for the CPU
// it runs on; the setter exists for side-by-side measurement and rejects what the tier lacks.
std::string weight_prefetch();
void set_weight_prefetch(const std::string& policy);
// How decode attention takes a row with drafts' scores and P · V (many query heads per key):
// "dpbf16" (VDPBF16PS on the BF16 rows) or "fma" (a chunk's K and V rows widened to FP32 once,
// FMAs in VDPBF16PS's order: the same bits). The AVX-512 tier probes the CPU once; the AVX2 tier,
// without VDPBF16PS, widens always ("fma"). The setter exists for side-by-side measurement.
std::string bf16_dot();
void set_bf16_dot(const std::string& method);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w,
                                                double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                            const at::Tensor& sin, const at::Tensor& k_blocks, const at::Tensor& v_blocks,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            int64_t window);
std::tuple<at::Tensor, at::Tensor> rotary_kv_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   const at::Tensor& cos, const at::Tensor& sin,
                                                   const at::Tensor& k_blocks, const at::Tensor& v_blocks,
                                                   const at::Tensor& slot_block_ids, const at::Tensor& slot_offsets);
at::Tensor argmax_rows(const at::Tensor& logits);
// y + each row's LoRA update (layers/lora.py): a [S, W, K] every slot's A, b [S, W, N] every
// slot's B transposed, slots [rows] each row's slot (-1: none); all but slots in one dtype.
at::Tensor lora_update(const at::Tensor& x, const at::Tensor& y, const at::Tensor& a, const at::Tensor& b,
                       const at::Tensor& slots);
// `lora`: empty, or 8 tensors per layer (a, b of qkv, o, gate_up, down) with
// `lora_slots` each sequence's slot.
at::Tensor decode_layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::TensorList weights,
                         at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& block_tables,
                         const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         double eps, double scale, int64_t window, at::TensorList lora, const at::Tensor& lora_slots);

}  // namespace kunlun_cpu
