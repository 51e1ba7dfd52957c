// The cross-entropy kernels of models/kernels/cross_entropy.cpp, one namespace
// per instruction set it is built for. logits: contiguous (N, C) float,
// BFloat16 or Half; targets: contiguous (N) int64, each in [0, C) or
// ignore_index (the caller checks); outputs allocated by the caller.
//
// forward: lse[i] = log sum_j exp(logits[i, j]) and loss[i] = lse[i] -
// logits[i, targets[i]] (0 on ignored rows), in fp32 (N floats each).
// backward: grad[i, j] = (exp(logits[i, j] - lse[i]) - [j == targets[i]]) *
// scale in fp32, rounded once to grad's dtype (that of logits); 0 on ignored rows.
#pragma once

#include <ATen/core/Tensor.h>

namespace mixprec::models::kernels {
namespace avx2 {
void cross_entropy_forward(const at::Tensor& logits, const at::Tensor& targets,
                           int64_t ignore_index, const at::Tensor& lse, const at::Tensor& loss);
void cross_entropy_backward(const at::Tensor& logits, const at::Tensor& targets,
                            int64_t ignore_index, const at::Tensor& lse, float scale,
                            const at::Tensor& grad);
}  // namespace avx2
namespace avx512 {
void cross_entropy_forward(const at::Tensor& logits, const at::Tensor& targets,
                           int64_t ignore_index, const at::Tensor& lse, const at::Tensor& loss);
void cross_entropy_backward(const at::Tensor& logits, const at::Tensor& targets,
                            int64_t ignore_index, const at::Tensor& lse, float scale,
                            const at::Tensor& grad);
}  // namespace avx512
}  // namespace mixprec::models::kernels
