// oneDNN's fp32 GEMM through LibTorch's mkldnn::_linear_pointwise, for mixprec's fp32 linear
// layers (models/linear.cpp) and the fp16 fast path's fp32 products (amp/fp16_cpu.cpp).
// LibTorch's own fp32 GEMMs are MKL's, which run AVX2 code on AMD CPUs.
#pragma once

#include <ATen/core/Tensor.h>

namespace mixprec::kernels {

// Whether the op runs here (probed once on a 2x2 product) and oneDNN is on
// (at::globalContext().userEnabledMkldnn(), read at each call).
bool onednn_linear_available();

// y = x w^T + b in fp32: x (M, K), w (N, K) of any strides, b (N) or undefined.
// Call only where onednn_linear_available().
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias);

// Whether t is (M, K) row-major, the x for which oneDNN beats MKL here: a transposed x costs
// oneDNN a copy.
inline bool row_major(const at::Tensor& t) {
  return t.dim() == 2 && t.stride(1) == 1 && t.stride(0) == t.size(1);
}

}  // namespace mixprec::kernels
