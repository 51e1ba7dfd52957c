// oneDNN's fp32 (and bf16) GEMMs, through LibTorch's mkldnn::_linear_pointwise and
// at::native::mkldnn_matmul, for mixprec's fp32 linear layers (models/linear.cpp) and the fp16 fast
// path's fp32 products (amp/fp16_cpu.cpp). LibTorch's own fp32 GEMMs are MKL's, which run AVX2 code
// on AMD CPUs; on the AVX-512 Zen 5 of mixprec's benchmarks oneDNN's were faster
// (bench/linear_bench). Not measured elsewhere: it is taken wherever it runs.
#pragma once

#include <ATen/core/Tensor.h>

namespace mixprec::kernels {

// Whether the op runs here in dtype (fp32 or bf16; probed once on a 2x2 product) and oneDNN
// is on (at::globalContext().userEnabledMkldnn(), read at each call).
bool onednn_linear_available(at::ScalarType dtype = at::kFloat);

// Whether onednn_linear runs here and takes these: CPU tensors all fp32 or all bf16, x (..., K)
// not empty, w (N, K) dense and not empty, bias (N) or undefined.
bool onednn_linear_takes(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias);

// y = x w^T + b in x's dtype (fp32 sums): x (M, K), w (N, K) dense in any order (w.t() of an
// (K, N) tensor too), b (N) contiguous or undefined. Call only where onednn_linear_takes() them.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias);

// Whether t is (M, K) row-major: the x oneDNN takes as is (a transposed x costs it a copy,
// and was no faster than MKL here).
inline bool row_major(const at::Tensor& t) {
  return t.dim() == 2 && t.stride(1) == 1 && t.stride(0) == t.size(1);
}

// Whether onednn_mm runs here and takes these: fp32 CPU (M, K) and (K, N), not empty, each
// row-major or the transpose of a row-major tensor (what oneDNN's matmul reads without a copy).
bool onednn_mm_takes(const at::Tensor& a, const at::Tensor& b);

// a b in fp32, into a new row-major (M, N) tensor, seen by LibTorch's profiler as
// "mixprec::onednn_mm". Call only where onednn_mm_takes() them.
at::Tensor onednn_mm(const at::Tensor& a, const at::Tensor& b);

}  // namespace mixprec::kernels
