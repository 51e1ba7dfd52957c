// The GELU (tanh) kernels of models/kernels/gelu_tanh.cpp, one namespace per
// instruction set it is built for. Contiguous tensors of one dtype (float,
// BFloat16 or Half) and shape; outputs allocated by the caller.
#pragma once

#include <ATen/core/Tensor.h>

namespace mixprec::models::kernels {
namespace avx2 {
void gelu_tanh_forward(const at::Tensor& x, const at::Tensor& y);
void gelu_tanh_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& dx);
}  // namespace avx2
namespace avx512 {
void gelu_tanh_forward(const at::Tensor& x, const at::Tensor& y);
void gelu_tanh_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& dx);
}  // namespace avx512
}  // namespace mixprec::models::kernels
