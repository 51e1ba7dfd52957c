// The LayerNorm kernels of models/kernels/layer_norm.cpp, one namespace per
// instruction set it is built for. x, mean, rstd, weight, bias and the
// gradients of x, weight and bias are contiguous fp32; y and dy contiguous
// float, BFloat16 or Half; all allocated by the caller.
#pragma once

#include <ATen/core/Tensor.h>

namespace mixprec::models::kernels {
namespace avx2 {
void layer_norm_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                        double eps, const at::Tensor& y, const at::Tensor& mean,
                        const at::Tensor& rstd);
void layer_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                         const at::Tensor& rstd, const at::Tensor& weight, const at::Tensor& dx,
                         const at::Tensor& dweight, const at::Tensor& dbias);
}  // namespace avx2
namespace avx512 {
void layer_norm_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                        double eps, const at::Tensor& y, const at::Tensor& mean,
                        const at::Tensor& rstd);
void layer_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean,
                         const at::Tensor& rstd, const at::Tensor& weight, const at::Tensor& dx,
                         const at::Tensor& dweight, const at::Tensor& dbias);
}  // namespace avx512
}  // namespace mixprec::models::kernels
