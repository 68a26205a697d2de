// The AMX tile helpers of the AVX-512 tier (amx_linear.cpp), used by its small-batch linear.
#pragma once

#include <ATen/core/Tensor.h>

namespace kunlun_cpu {

bool amx_available();
bool amx_linear_fits(const at::Tensor& x, const at::Tensor& w);  // up to 16 rows, K % 32 == N % 16 == 0
at::Tensor linear_bf16_amx(const at::Tensor& x, const at::Tensor& w, const float* bias);
void configure_amx_tiles();  // this thread's eight tiles, each 16 rows × 64 bytes

}  // namespace kunlun_cpu
