// AdamW on bf16 parameters and states with stochastic rounding, in one pass
// (optim/adamw.cpp calls it for `stochastic_rounding` on the CPU), one
// namespace per instruction set it is built for.
//
// Element i is computed in fp32 as PyTorch's _single_tensor_adamw computes it
// (weight decay, lerp of exp_avg, exp_avg_sq, the bias-corrected update) and
// parameter, exp_avg and exp_avg_sq are rounded to bf16 stochastically, with
// 48 random bits from a hash of (seed, i): the same result for any number of
// threads. inf and NaN are rounded to nearest (they stay what they are).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace mixprec::optim::kernels {

struct AdamWStep {
  float lr, beta1, beta2, weight_decay, eps;
  float step_size;              // lr / bias_correction1
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  bool maximize;
};

namespace avx2 {
void adamw_bf16_stochastic(const at::Tensor& param, const at::Tensor& grad,
                           const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                           const AdamWStep& step, uint64_t seed);
}  // namespace avx2
namespace avx512 {
void adamw_bf16_stochastic(const at::Tensor& param, const at::Tensor& grad,
                           const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                           const AdamWStep& step, uint64_t seed);
}  // namespace avx512
}  // namespace mixprec::optim::kernels
