#pragma once

#include <ATen/core/Tensor.h>

namespace mixprec::models {

/// LayerNorm over the last dimension, `at::layer_norm(x, {C}, weight, bias, eps).to(dtype)`,
/// in one op: what a mixed-precision model does where an fp32 residual stream is normalized
/// for a matmul that autocast runs in 16 bits. On CPUs with AVX2 or AVX-512, fp32 `x`,
/// `weight` and `bias` take a fused kernel: it rounds its fp32 result once to `dtype` and,
/// backward, reads the `dtype` gradient as it comes, so neither the fp32 output nor its
/// fp32 gradient is made (the large GPT-2 bf16 step made 12 of each, 2048 x 512). Mean and
/// variance in two fp32 passes over each row; the result is within a rounding of LibTorch's
/// fp32 one, as tested. Elsewhere, LibTorch's op and a cast. Differentiable once.
at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                      double eps, at::ScalarType dtype);

}  // namespace mixprec::models
