#include "mixprec/optim/optimizer_in_backward.h"

#include <c10/util/ScopeExit.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <atomic>
#include <memory>

namespace mixprec::optim {

bool updated_in_backward(const at::Tensor& parameter) {
  // A tensor that never required grad has no autograd metadata, and so no hook.
  return parameter.unsafeGetTensorImpl()->autograd_meta() != nullptr &&
         torch::autograd::impl::post_acc_grad_hooks(parameter) != nullptr;
}

namespace {

// LibTorch's C++ form of `register_post_accumulate_grad_hook`: AccumulateGrad calls it right
// after it has written the parameter's `.grad`.
struct StepAndFreeGrad : torch::autograd::PostAccumulateGradHook {
  StepAndFreeGrad(torch::optim::Optimizer& optimizer, const OptimizerInBackward* owner)
      : optimizer(optimizer), owner(owner) {}
  void operator()(const torch::autograd::Variable& parameter) override {
    // Freed even if the step throws: a gradient left behind would be applied by every later hook.
    const auto free_grad = c10::make_scope_exit([&] { parameter.mutable_grad().reset(); });
    optimizer.step();
  }
  torch::optim::Optimizer& optimizer;
  const OptimizerInBackward* owner;
};

// Live OptimizerInBackward objects: while there are none, the checks below, which run every step
// in the Accelerator and the GradScaler, cost one load.
std::atomic<int64_t> live_optimizers_in_backward{0};

void check_one(const at::Tensor& p, size_t index, std::string_view user, std::string_view why) {
  TORCH_CHECK(!updated_in_backward(p), user, ": parameter ", index, " of shape ", p.sizes(),
              " is updated in the backward by its post-accumulate-grad hook (an "
              "optim::OptimizerInBackward), ",
              why);
}

}  // namespace

void check_not_updated_in_backward(const std::vector<at::Tensor>& parameters, std::string_view user,
                                   std::string_view why) {
  if (live_optimizers_in_backward.load(std::memory_order_relaxed) == 0) return;
  for (size_t i = 0; i < parameters.size(); ++i) check_one(parameters[i], i, user, why);
}

void check_not_updated_in_backward(const torch::optim::Optimizer& optimizer, std::string_view user,
                                   std::string_view why) {
  if (live_optimizers_in_backward.load(std::memory_order_relaxed) == 0) return;
  size_t index = 0;  // across the groups, as the OptimizerInBackward's own errors count
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params()) check_one(p, index++, user, why);
}

void check_not_updated_in_backward(const torch::nn::Module& module, std::string_view user,
                                   std::string_view why) {
  // Gated before parameters(), which builds the module's named parameters.
  if (live_optimizers_in_backward.load(std::memory_order_relaxed) == 0) return;
  check_not_updated_in_backward(module.parameters(), user, why);
}

OptimizerInBackward::OptimizerInBackward(torch::optim::Optimizer& optimizer) {
  int64_t index = -1;  // in the optimizer's parameters, for the errors
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params()) {
      ++index;
      const auto name = [&] { return c10::str("parameter ", index, " of shape ", p.sizes()); };
      TORCH_CHECK(p.is_leaf(), "OptimizerInBackward: ", name(), " is not a leaf tensor");
      // Also for frozen parameters: any gradient would be applied by every hook's step.
      TORCH_CHECK(!p.grad().defined(), "OptimizerInBackward: ", name(),
                  " already has a gradient, which every update would apply; call "
                  "optimizer.zero_grad() first");
      TORCH_CHECK(!updated_in_backward(p), "OptimizerInBackward: ", name(),
                  " already has a post-accumulate-grad hook (another OptimizerInBackward?)");
      const auto accumulator = torch::autograd::impl::try_get_grad_accumulator(p);
      TORCH_CHECK(!accumulator || accumulator->post_hooks().empty(),
                  "OptimizerInBackward: ", name(),
                  " has hooks that read its gradient after accumulation (a dist::GradientReducer's "
                  "all-reduce?), which would run after the update");
      // Each hook steps the whole optimizer, which updates whatever has a gradient: hooks on
      // two devices' autograd threads could step one parameter twice.
      TORCH_CHECK(parameters_.empty() || p.device() == parameters_.front().device(),
                  "OptimizerInBackward: ", name(), " is on ", p.device(), ", the first on ",
                  parameters_.front().device(), "; expected all on one device");
      parameters_.push_back(p);
    }
  // Frozen parameters get one too (it creates their autograd metadata), for when they thaw.
  for (const auto& p : parameters_)
    torch::autograd::impl::set_post_acc_grad_hooks(
        p, std::make_unique<StepAndFreeGrad>(optimizer, this));
  ++live_optimizers_in_backward;
}

OptimizerInBackward::~OptimizerInBackward() {
  --live_optimizers_in_backward;
  for (const auto& p : parameters_) {
    auto& hook = torch::autograd::impl::post_acc_grad_hooks(p);
    const auto* ours = dynamic_cast<const StepAndFreeGrad*>(hook.get());
    if (ours != nullptr && ours->owner == this) hook.reset();  // not one set since
  }
}

}  // namespace mixprec::optim
