// The operators of the kunlun_cpu library, callable from one another (see each .cpp for details).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace kunlun_cpu {

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias);
bool amx_available();
bool amx_linear_fits(const at::Tensor& x, const at::Tensor& w);  // up to 16 rows, K % 32 == N % 16 == 0
at::Tensor linear_bf16_amx(const at::Tensor& x, const at::Tensor& w, const float* bias);
void configure_amx_tiles();  // this thread's eight tiles, each 16 rows × 64 bytes
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w,
                                                double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                            const at::Tensor& sin, const at::Tensor& k_blocks, const at::Tensor& v_blocks,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            int64_t window);

}  // namespace kunlun_cpu
