#include "mixprec/optim/adamw.h"

#include "mixprec/optim/stochastic_rounding.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>

#include <cmath>
#include <mutex>

#include "kernels/isa.h"
#include "optim/kernels/adamw_bf16.h"

namespace mixprec::optim {

namespace {

void check_options(const AdamWOptions& o) {
  TORCH_CHECK(o.lr() >= 0, "Invalid learning rate: ", o.lr());
  TORCH_CHECK(o.eps() >= 0, "Invalid epsilon value: ", o.eps());
  const auto [beta1, beta2] = o.betas();
  TORCH_CHECK(0 <= beta1 && beta1 < 1.0, "Invalid beta parameter at index 0: ", beta1);
  TORCH_CHECK(0 <= beta2 && beta2 < 1.0, "Invalid beta parameter at index 1: ", beta2);
  TORCH_CHECK(o.weight_decay() >= 0, "Invalid weight_decay value: ", o.weight_decay());
  TORCH_CHECK(!(o.fused() && o.stochastic_rounding()),
              "mixprec::optim::AdamW: stochastic_rounding is not available with fused=true");
}

using StochasticKernel = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const kernels::AdamWStep&, uint64_t);

StochasticKernel stochastic_kernel() {
#ifdef MIXPREC_HAVE_X86_KERNELS
  return mixprec::kernels::for_this_cpu<StochasticKernel>(
      kernels::avx512::adamw_bf16_stochastic, kernels::avx2::adamw_bf16_stochastic, nullptr);
#else
  return nullptr;
#endif
}

// 64 random bits from LibTorch's default CPU generator (torch::manual_seed repeats them).
uint64_t random_seed() {
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return at::check_generator<at::CPUGeneratorImpl>(generator)->random64();
}

}  // namespace

AdamW::AdamW(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
             AdamWOptions defaults)
    : Optimizer(param_groups, std::make_unique<AdamWOptions>(defaults)) {
  check_options(defaults);
  // LibTorch >= 2.10 merges a group's options with the defaults only for its own
  // optimizer types and gives other types the defaults, dropping a group's own
  // options (a no-decay group would decay); set them again.
  for (size_t i = 0; i < param_groups.size(); ++i)
    if (param_groups[i].has_options())
      param_groups_[i].set_options(param_groups[i].options().clone());
  for (auto& group : param_groups_) {
    auto& options = static_cast<AdamWOptions&>(group.options());
    check_options(options);
    if (!options.fused()) continue;
    for (const auto& p : group.params()) {
      TORCH_CHECK(p.is_floating_point() && (p.is_cpu() || p.is_cuda()),
                  "mixprec::optim::AdamW: `fused=true` requires all the params to be floating "
                  "point Tensors on CPU or CUDA, got ",
                  p.scalar_type(), " on ", p.device());
    }
  }
}

bool AdamW::step_supports_amp_scaling() const {
  for (const auto& group : param_groups_)
    if (!static_cast<const AdamWOptions&>(group.options()).fused()) return false;
  return !param_groups_.empty();
}

AdamWParamState& AdamW::state_for(const at::Tensor& param, bool fused) {
  auto& slot = state_[param.unsafeGetTensorImpl()];
  if (!slot) {
    auto state = std::make_unique<AdamWParamState>();
    // PyTorch keeps `step` on the param's device when fused, on the CPU otherwise.
    state->step(at::zeros({}, at::TensorOptions()
                                  .dtype(at::kFloat)
                                  .device(fused ? param.device() : at::Device(at::kCPU))));
    state->exp_avg(at::zeros_like(param, at::MemoryFormat::Preserve));
    state->exp_avg_sq(at::zeros_like(param, at::MemoryFormat::Preserve));
    slot = std::move(state);
  }
  return static_cast<AdamWParamState&>(*slot);
}

at::Tensor AdamW::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  // Every gradient is checked before any parameter changes, as PyTorch does.
  for (const auto& group : param_groups_) {
    for (const auto& param : group.params()) {
      if (!param.grad().defined()) continue;
      TORCH_CHECK(!param.grad().is_sparse(),
                  "Adam does not support sparse gradients, please consider SparseAdam instead");
      TORCH_CHECK(!param.is_complex(), "mixprec::optim::AdamW: complex parameters (",
                  param.scalar_type(), ") are not supported");
    }
  }
  for (auto& group : param_groups_) {
    if (static_cast<AdamWOptions&>(group.options()).fused())
      fused_step(group);
    else
      single_tensor_step(group);
  }
  return loss;
}

// PyTorch's _single_tensor_adam with decoupled weight decay, op for op. With
// stochastic_rounding, bf16 parameters and states are computed in fp32 and
// rounded back stochastically (no fp32 copy is kept).
void AdamW::single_tensor_step(torch::optim::OptimizerParamGroup& group) {
  const auto& o = static_cast<const AdamWOptions&>(group.options());
  const auto [beta1, beta2] = o.betas();
  for (auto& stored : group.params()) {
    if (!stored.grad().defined()) continue;
    auto& state = state_for(stored, /*fused=*/false);
    if (o.amsgrad() && !state.max_exp_avg_sq().defined())
      state.max_exp_avg_sq(at::zeros_like(stored, at::MemoryFormat::Preserve));
    state.step().add_(1);
    const double step = state.step().item<double>();
    const double step_size = o.lr() / (1 - std::pow(beta1, step));
    const double bias_correction2_sqrt = std::sqrt(1 - std::pow(beta2, step));
    const bool rounded = o.stochastic_rounding() && stored.scalar_type() == at::kBFloat16;
    const auto dense_bf16 = [](const at::Tensor& t) {
      return t.is_cpu() && t.scalar_type() == at::kBFloat16 && t.is_contiguous();
    };
    if (rounded && !o.amsgrad() && stochastic_kernel() && dense_bf16(stored) &&
        dense_bf16(stored.grad()) && dense_bf16(state.exp_avg()) &&
        dense_bf16(state.exp_avg_sq())) {
      const kernels::AdamWStep s{.lr = static_cast<float>(o.lr()),
                                 .beta1 = static_cast<float>(beta1),
                                 .beta2 = static_cast<float>(beta2),
                                 .weight_decay = static_cast<float>(o.weight_decay()),
                                 .eps = static_cast<float>(o.eps()),
                                 .step_size = static_cast<float>(step_size),
                                 .bias_correction2_sqrt = static_cast<float>(bias_correction2_sqrt),
                                 .maximize = o.maximize()};
      RECORD_FUNCTION("mixprec::adamw_bf16_stochastic", std::vector<c10::IValue>());
      stochastic_kernel()(stored, stored.grad(), state.exp_avg(), state.exp_avg_sq(), s,
                          random_seed());
      continue;
    }
    auto work = [&](const at::Tensor& t) { return rounded ? t.to(at::kFloat) : t; };
    at::Tensor param = work(stored), exp_avg = work(state.exp_avg()),
               exp_avg_sq = work(state.exp_avg_sq());
    at::Tensor grad = work(o.maximize() ? -stored.grad() : stored.grad());
    if (o.weight_decay() != 0) param.mul_(1 - o.lr() * o.weight_decay());
    exp_avg.lerp_(grad, 1 - beta1);
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
    at::Tensor denom;
    if (o.amsgrad()) {
      at::Tensor max_exp_avg_sq = work(state.max_exp_avg_sq());
      at::maximum_out(max_exp_avg_sq, max_exp_avg_sq, exp_avg_sq);
      denom = (max_exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(o.eps());
      if (rounded) state.max_exp_avg_sq().copy_(stochastic_round_to_bf16(max_exp_avg_sq));
    } else {
      denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(o.eps());
    }
    param.addcdiv_(exp_avg, denom, -step_size);
    if (rounded) {
      stored.copy_(stochastic_round_to_bf16(param));
      state.exp_avg().copy_(stochastic_round_to_bf16(exp_avg));
      state.exp_avg_sq().copy_(stochastic_round_to_bf16(exp_avg_sq));
    }
  }
}

// PyTorch's _fused_adam with decoupled weight decay: one kernel per (device,
// dtype) group; a GradScaler's grad_scale/found_inf go to the kernel, and a
// skipped step takes back its step count.
void AdamW::fused_step(torch::optim::OptimizerParamGroup& group) {
  const auto& o = static_cast<const AdamWOptions&>(group.options());
  const auto [beta1, beta2] = o.betas();
  struct Bucket {
    at::Device device;
    at::ScalarType dtype;
    std::vector<at::Tensor> params{}, grads{}, exp_avgs{}, exp_avg_sqs{}, max_exp_avg_sqs{},
        steps{};
  };
  std::vector<Bucket> buckets;
  for (auto& param : group.params()) {
    if (!param.grad().defined()) continue;
    auto& state = state_for(param, /*fused=*/true);
    if (o.amsgrad() && !state.max_exp_avg_sq().defined())
      state.max_exp_avg_sq(at::zeros_like(param, at::MemoryFormat::Preserve));
    auto it = std::find_if(buckets.begin(), buckets.end(), [&](const Bucket& b) {
      return b.device == param.device() && b.dtype == param.scalar_type();
    });
    if (it == buckets.end())
      it = buckets.insert(buckets.end(), Bucket{param.device(), param.scalar_type()});
    it->params.push_back(param);
    it->grads.push_back(param.grad());
    it->exp_avgs.push_back(state.exp_avg());
    it->exp_avg_sqs.push_back(state.exp_avg_sq());
    if (o.amsgrad()) it->max_exp_avg_sqs.push_back(state.max_exp_avg_sq());
    it->steps.push_back(state.step());
  }
  for (auto& b : buckets) {
    std::optional<at::Tensor> grad_scale, found_inf;
    if (this->grad_scale) grad_scale = this->grad_scale->to(b.device, /*non_blocking=*/true);
    if (this->found_inf) found_inf = this->found_inf->to(b.device, /*non_blocking=*/true);
    at::_foreach_add_(b.steps, 1);
    at::_fused_adamw_(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.max_exp_avg_sqs, b.steps,
                      o.lr(), beta1, beta2, o.weight_decay(), o.eps(), o.amsgrad(), o.maximize(),
                      grad_scale, found_inf);
    if (found_inf) at::_foreach_sub_(b.steps, std::vector<at::Tensor>(b.steps.size(), *found_inf));
    // The fused kernel leaves the parameters' version counters as they were (torch 2.13), as if
    // nothing had written them: what keys on the version (autograd's check of saved tensors,
    // the fp16 up-cast cache) would take the old values. The unfused step's ops bump them.
    for (auto& p : b.params) p.unsafeGetTensorImpl()->bump_version();
  }
}

}  // namespace mixprec::optim
