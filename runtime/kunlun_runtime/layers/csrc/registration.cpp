// Registers kernels.h as torch ops in the namespace KUNLUN_OPS (set per tier by the build), so
// each tier's library is its own op namespace: torch.ops.kunlun_avx512, torch.ops.kunlun_avx2.

#include <torch/library.h>

#include "kernels.h"

#ifndef KUNLUN_OPS
#error "build with -DKUNLUN_OPS=<op namespace>"
#endif

// One level of indirection, so KUNLUN_OPS is expanded before TORCH_LIBRARY pastes it into names.
#define KUNLUN_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define KUNLUN_LIBRARY_IMPL(ns, m) TORCH_LIBRARY_IMPL(ns, CPU, m)

KUNLUN_LIBRARY(KUNLUN_OPS, m) {
  // No tensor to dispatch on: one implementation for every backend.
  m.def("weight_prefetch() -> str", &kunlun_cpu::weight_prefetch);
  m.def("set_weight_prefetch(str policy) -> ()", &kunlun_cpu::set_weight_prefetch);
  m.def("bf16_dot() -> str", &kunlun_cpu::bf16_dot);
  m.def("set_bf16_dot(str method) -> ()", &kunlun_cpu::set_bf16_dot);
  m.def("linear_bf16(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("linear_int8(Tensor x, Tensor w, Tensor scales, Tensor? bias) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def(
      "decode_attention(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_blocks, "
      "Tensor(b!) v_blocks, Tensor block_tables, Tensor context_lens, float scale, int window) -> Tensor");
  m.def(
      "rotary_kv_write(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_blocks, Tensor(b!) v_blocks, "
      "Tensor slot_block_ids, Tensor slot_offsets) -> (Tensor, Tensor)");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def(
      "decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor[] weights, Tensor(a!)[] k_caches, "
      "Tensor(b!)[] v_caches, Tensor block_tables, Tensor context_lens, int num_heads, int num_kv_heads, "
      "int head_dim, float eps, float scale, int window, Tensor[] lora, Tensor lora_slots) -> Tensor");
  m.def("lora_update(Tensor x, Tensor y, Tensor a, Tensor b, Tensor slots) -> Tensor");
}

KUNLUN_LIBRARY_IMPL(KUNLUN_OPS, m) {
  m.impl("linear_bf16", &kunlun_cpu::linear_bf16);
  m.impl("linear_int8", &kunlun_cpu::linear_int8);
  m.impl("rms_norm", &kunlun_cpu::rms_norm);
  m.impl("add_rms_norm", &kunlun_cpu::add_rms_norm);
  m.impl("silu_mul", &kunlun_cpu::silu_mul);
  m.impl("decode_attention", &kunlun_cpu::decode_attention);
  m.impl("rotary_kv_write", &kunlun_cpu::rotary_kv_write);
  m.impl("argmax_rows", &kunlun_cpu::argmax_rows);
  m.impl("decode_layers", &kunlun_cpu::decode_layers);
  m.impl("lora_update", &kunlun_cpu::lora_update);
}
