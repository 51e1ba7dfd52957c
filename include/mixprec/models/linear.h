#pragma once

#include <ATen/core/Tensor.h>

namespace mixprec::models {

/// How a linear layer stores its weight.
enum class WeightLayout {
  kOutIn,  ///< (out, in): torch::nn::Linear, a tied LM head (`at::linear`)
  kInOut,  ///< (in, out): HF's Conv1D in GPT-2 (`at::addmm(bias, x, weight)`)
};

/// A linear layer, (..., in) -> (..., out): `at::linear(x, weight, bias)` for kOutIn,
/// `at::addmm(bias, x, weight)` on the flattened x for kInOut; `bias` may be undefined.
///
/// fp32 CPU tensors outside autocast take oneDNN's fp32 GEMMs where oneDNN is on: LibTorch's
/// `mkldnn::_linear_pointwise` (bias fused) for the output and the input gradient, and its
/// matmul (`at::native::mkldnn_matmul`, which reads the transposed operands without a copy) for
/// the weight gradient where that LibTorch's takes fp32, else `at::mm`. Same fp32 math in another
/// summation order (with LibTorch's default fp32 precision: where oneDNN's fp32 matmuls are set
/// to bf16 or tf32, this matmul follows the setting at every size, `at::mm` only above its size
/// threshold). LibTorch's own fp32 GEMMs are MKL's, which run AVX2 code on AMD CPUs: on the
/// AVX-512 Zen 5 where mixprec is benchmarked, a GPT-2 layer's forward ran up to 1.2x faster with
/// oneDNN's and its backward up to 1.2x (`bench/linear_bench`), GPT-2's fp32 step 1.12x (small)
/// and 1.15x (large) (not measured on other CPUs).
///
/// bf16 CPU tensors, and under CPU autocast to bf16 fp32 ones after autocast's own casts
/// (`cached_cast`: a weight's once per autocast region, as for LibTorch's op), take the same
/// `_linear_pointwise` in bf16 where it runs (oneDNN's bf16 needs AVX-512 or AVX-NE-CONVERT), and
/// `at::mm` for the weight gradient. LibTorch's bf16 `addmm` first copies the broadcast bias into
/// the whole output for its GEMM to add to; oneDNN adds it in the GEMM (the same sums). On an
/// Intel Xeon with AMX-BF16, the large GPT-2 bf16 step gained 4% (5 interleaved pairs of
/// `bench/gpt2_bench`).
///
/// Everything else (other dtypes and devices, fp16 autocast, 1-D or empty x, a bias that is not
/// (out), a LibTorch without oneDNN or with it switched off) calls the LibTorch op above, so
/// autocast and mixprec's fp16 CPU path see it (under bf16 autocast with the operands already
/// cast: the same result). Either way the call is one op, "mixprec::linear", for LibTorch's
/// profiler and the numerics monitor. Differentiable twice and more (with create_graph, the
/// backward runs LibTorch's ops).
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = {},
                  WeightLayout layout = WeightLayout::kOutIn);

/// Whether `linear` computes fp32 CPU tensors with oneDNN here (and now: it follows
/// `at::globalContext().userEnabledMkldnn()`).
bool linear_uses_onednn();

}  // namespace mixprec::models
