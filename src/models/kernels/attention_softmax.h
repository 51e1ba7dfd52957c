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
// attention_bf16_forward / _backward: all of the attention from bf16
// q (.., Lq, D), k (.., Lk, D), v (.., Lk, Dv) with the same leading dims:
// forward, the contiguous probabilities and out = probs v; backward, from them
// and grad (.., Lq, Dv), the three input gradients. q, k, v, out, grad and the
// gradients may have any strides but a last one of 1 (the heads of a packed
// projection are read and written where they are); the outputs' rows must not
// overlap. Every GEMM is oneDNN's brgemm
// with fp32 sums, by blocks of 32 rows, never whole (causal: only the blocks
// the mask keeps). The scores and the probabilities' gradient stay fp32; the
// probabilities, the scores' gradient and the products are rounded once to
// bf16. They need D, Dv and Lk even, no empty dim and bf16_brgemm_runs().
#pragma once

#include <ATen/core/Tensor.h>

namespace mixprec::models::kernels {
// Whether LibTorch has a bf16 brgemm that runs here (models/attention.cpp).
bool bf16_brgemm_runs();

namespace avx2 {
void attention_bf16_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            bool causal, float scale, const at::Tensor& probs,
                            const at::Tensor& out);
void attention_bf16_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& probs, const at::Tensor& grad, bool causal,
                             float scale, const at::Tensor& grad_q, const at::Tensor& grad_k,
                             const at::Tensor& grad_v);
void attention_softmax_forward(const at::Tensor& scores, int64_t Lq, bool causal, float scale,
                               const at::Tensor& probs);
void attention_softmax_backward(const at::Tensor& probs, const at::Tensor& grad_probs, int64_t Lq,
                                bool causal, float scale, const at::Tensor& grad_scores);
}  // namespace avx2
namespace avx512 {
void attention_bf16_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            bool causal, float scale, const at::Tensor& probs,
                            const at::Tensor& out);
void attention_bf16_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& probs, const at::Tensor& grad, bool causal,
                             float scale, const at::Tensor& grad_q, const at::Tensor& grad_k,
                             const at::Tensor& grad_v);
void attention_softmax_forward(const at::Tensor& scores, int64_t Lq, bool causal, float scale,
                               const at::Tensor& probs);
void attention_softmax_backward(const at::Tensor& probs, const at::Tensor& grad_probs, int64_t Lq,
                                bool causal, float scale, const at::Tensor& grad_scores);
}  // namespace avx512
}  // namespace mixprec::models::kernels
