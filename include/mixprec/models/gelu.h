#pragma once

#include <ATen/core/Tensor.h>

namespace mixprec::models {

/// GELU with the tanh approximation, `at::gelu(x, "tanh")` (GPT-2's gelu_new), with a
/// faster CPU kernel: it computes 0.5 x (1 + tanh(u)) as x sigmoid(2u) with one fast exp,
/// in fp32 for fp32/bf16/fp16 inputs, rounded once. On a 2048 x 2048 activation (2 threads,
/// AVX-512; build/bench/gelu_bench, docs/speed.md) forward 1.0-1.2 ms and backward 1.3-1.5 ms
/// across the three dtypes, against LibTorch 2.13's 3.5-4.0 and 3.9-4.3 ms, which spend their
/// time in tanh. In fp32 the result
/// is within 1e-5 (relative, absolute below 1) of fp64's, as tested; in 16 bits it is one
/// rounding of it. Other devices, fp64, and CPUs without AVX2 run LibTorch's kernel.
/// Differentiable once (the backward is not itself differentiable).
at::Tensor gelu_tanh(const at::Tensor& x);

/// The kernel gelu_tanh runs on CPU tensors here: "avx512", "avx2" or "libtorch"
/// (LibTorch's CPU capability decides, so ATEN_CPU_CAPABILITY lowers it too).
const char* gelu_tanh_cpu_kernel();

}  // namespace mixprec::models
