// The softmax kernels of the matmul attention (models/attention.cpp), one
// namespace per instruction set they are built for. Rows r of the (R, Lk)
// matrices are query positions r % Lq; with causal, columns j > r % Lq are
// masked (PyTorch's is_causal: top-left aligned). n(r) is the number of
// columns a row keeps.
//
// forward: probs[r, j] = softmax_j(scale * scores[r, j]) over the kept
// columns, 0 on masked ones. scores: contiguous fp32, overwritten; probs:
// contiguous float, BFloat16 or Half (float: may be scores itself).
// backward: grad_scores[r, j] = scale * probs[r, j] * (grad_probs[r, j] - D_r)
// with D_r = sum_j probs[r, j] * grad_probs[r, j], computed in fp32 and
// rounded once. grad_probs: contiguous fp32 (overwritten only where it is
// grad_scores); grad_scores: contiguous, probs' dtype (float: may be grad_probs
// itself).
//
// attention_bf16_forward / _backward: the same from contiguous bf16 (.., L, D)
// inputs, with the fp32 products (scores = q kᵀ, grad_probs = grad vᵀ) made by
// oneDNN's brgemm 32 rows at a time and never whole (causal: the kept columns
// only). They need D even and bf16_brgemm_runs().
#pragma once

#include <ATen/core/Tensor.h>

namespace mixprec::models::kernels {
// Whether LibTorch has a bf16 brgemm that runs here (models/attention.cpp).
bool bf16_brgemm_runs();

namespace avx2 {
void attention_bf16_forward(const at::Tensor& q, const at::Tensor& k, bool causal, float scale,
                            const at::Tensor& probs);
void attention_bf16_backward(const at::Tensor& probs, const at::Tensor& grad, const at::Tensor& v,
                             bool causal, float scale, const at::Tensor& grad_scores);
void attention_softmax_forward(const at::Tensor& scores, int64_t Lq, bool causal, float scale,
                               const at::Tensor& probs);
void attention_softmax_backward(const at::Tensor& probs, const at::Tensor& grad_probs, int64_t Lq,
                                bool causal, float scale, const at::Tensor& grad_scores);
}  // namespace avx2
namespace avx512 {
void attention_bf16_forward(const at::Tensor& q, const at::Tensor& k, bool causal, float scale,
                            const at::Tensor& probs);
void attention_bf16_backward(const at::Tensor& probs, const at::Tensor& grad, const at::Tensor& v,
                             bool causal, float scale, const at::Tensor& grad_scores);
void attention_softmax_forward(const at::Tensor& scores, int64_t Lq, bool causal, float scale,
                               const at::Tensor& probs);
void attention_softmax_backward(const at::Tensor& probs, const at::Tensor& grad_probs, int64_t Lq,
                                bool causal, float scale, const at::Tensor& grad_scores);
}  // namespace avx512
}  // namespace mixprec::models::kernels
