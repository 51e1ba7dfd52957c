#pragma once

#include "mixprec/amp/grad_scaler.h"

#include <torch/optim/optimizer.h>

#include <tuple>
#include <vector>

namespace mixprec::optim {

/// Options of `AdamW`, with `torch.optim.AdamW`'s defaults.
struct AdamWOptions : public torch::optim::OptimizerCloneableOptions<AdamWOptions> {
  AdamWOptions(double lr = 1e-3) : lr_(lr) {}
  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 1e-2;
  TORCH_ARG(bool, amsgrad) = false;
  TORCH_ARG(bool, maximize) = false;
  /// One `at::_fused_adamw_` kernel per (device, dtype) group, which also
  /// unscales gradients and skips on inf/NaN for a GradScaler.
  TORCH_ARG(bool, fused) = false;
  /// Pure bf16 training (Lightning's "bf16-true"): bf16 parameters and states
  /// are updated in fp32 and rounded back stochastically (stochastic_rounding.h),
  /// so updates below half a bf16 ulp are not lost. Not with `fused`; on the CPU,
  /// dense bf16 tensors (no amsgrad) take one vectorized pass per tensor anyway
  /// (src/optim/kernels/adamw_bf16.cpp, random bits hashed from a seed drawn
  /// from LibTorch's default generator), others LibTorch's ops.
  TORCH_ARG(bool, stochastic_rounding) = false;

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct AdamWParamState : public torch::optim::OptimizerCloneableParamState<AdamWParamState> {
  TORCH_ARG(at::Tensor, step);  // () fp32, as PyTorch keeps it
  TORCH_ARG(at::Tensor, exp_avg);
  TORCH_ARG(at::Tensor, exp_avg_sq);
  TORCH_ARG(at::Tensor, max_exp_avg_sq);
};

/// `torch.optim.AdamW` (decoupled weight decay): the unfused path is the same
/// arithmetic as PyTorch's single-tensor implementation (the CPU default), the
/// fused path calls the same kernel as `AdamW(fused=True)`.
///
/// ```
/// mixprec::optim::AdamW optimizer(model->parameters(),
///                                 mixprec::optim::AdamWOptions(3e-4).fused(true));
/// ```
class AdamW : public torch::optim::Optimizer, public amp::SupportsAmpScaling {
 public:
  explicit AdamW(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                 AdamWOptions defaults = {});
  explicit AdamW(std::vector<at::Tensor> params, AdamWOptions defaults = {})
      : AdamW({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

  at::Tensor step(LossClosure closure = nullptr) override;
  bool step_supports_amp_scaling() const override;

 private:
  AdamWParamState& state_for(const at::Tensor& param, bool fused);
  void single_tensor_step(torch::optim::OptimizerParamGroup& group);
  void fused_step(torch::optim::OptimizerParamGroup& group);
};

}  // namespace mixprec::optim
