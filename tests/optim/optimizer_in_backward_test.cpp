// Updates inside the backward are the updates of one step() after it, and free each gradient
// as soon as it is used.
#include "mixprec/optim/optimizer_in_backward.h"

#include "mixprec/amp/grad_scaler.h"
#include "mixprec/optim/adamw.h"
#include "mixprec/optim/clip_grad.h"
#include "mixprec/optim/lr_scheduler.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <optional>

namespace {

using mixprec::optim::AdamW;
using mixprec::optim::AdamWOptions;
using mixprec::optim::OptimizerInBackward;
using mixprec::testing::error_of;

// A two-layer net whose first weight is used twice (one accumulated gradient from two
// contributions) and whose last parameter gets no gradient.
struct Net {
  Net() {
    torch::manual_seed(0);
    for (auto shape : {std::vector<int64_t>{8, 4}, {8}, {3, 8}, {5}})
      params.push_back(torch::randn(shape, torch::requires_grad()));
  }
  torch::Tensor hidden(const torch::Tensor& x) const {
    return torch::tanh(torch::nn::functional::linear(x, params[0], params[1]));
  }
  torch::Tensor loss(const torch::Tensor& x, const torch::Tensor& y) const {
    const auto out = torch::nn::functional::linear(hidden(x), params[2]);
    return (out - y).pow(2).mean() + 0.1 * x.matmul(params[0].t()).pow(2).mean();
  }
  std::vector<torch::Tensor> params;
};

// The parameters after `steps` steps of AdamW with a warm-up-then-linear LR schedule.
std::vector<torch::Tensor> train(bool in_backward, bool fused, int steps = 6) {
  Net net;
  const auto x = torch::randn({16, 4}), y = torch::randn({16, 3});
  AdamW optimizer(net.params, AdamWOptions(0.05).fused(fused));
  auto scheduler = mixprec::optim::get_scheduler(
      "linear", optimizer, {.num_warmup_steps = 2, .num_training_steps = steps});
  std::optional<OptimizerInBackward> updates;
  if (in_backward) updates.emplace(optimizer);
  for (int i = 0; i < steps; ++i) {
    net.loss(x, y).backward();
    if (!in_backward) {
      optimizer.step();
      optimizer.zero_grad();
    }
    scheduler.step();
  }
  for (const auto& p : net.params) EXPECT_FALSE(p.grad().defined());
  return net.params;
}

TEST(OptimizerInBackward, UpdatesAsOneStepAfterTheBackward) {
  for (bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "fused" : "single tensor");
    const auto after_step = train(/*in_backward=*/false, fused);
    const auto in_backward = train(/*in_backward=*/true, fused);
    Net initial;
    ASSERT_FALSE(torch::equal(after_step[0], initial.params[0]));  // it trained
    EXPECT_TRUE(torch::equal(after_step[3], initial.params[3]));   // no gradient, no update
    for (size_t i = 0; i < after_step.size(); ++i)
      EXPECT_TRUE(torch::equal(in_backward[i], after_step[i]))
          << "parameter " << i << ": max difference "
          << (in_backward[i] - after_step[i]).abs().max().item<double>();
  }
}

TEST(OptimizerInBackward, UpdatesEachParameterBeforeTheBackwardGoesOn) {
  Net net;
  const auto x = torch::randn({16, 4}), y = torch::randn({16, 3});
  AdamW optimizer(net.params, AdamWOptions(0.05));
  OptimizerInBackward updates(optimizer);
  const auto last_weight = net.params[2].detach().clone();
  bool seen = false;
  const auto h = net.hidden(x);
  // Runs after the last layer's backward, before the first layer's.
  h.register_hook([&](const torch::Tensor& grad) {
    seen = true;
    EXPECT_FALSE(net.params[2].grad().defined()) << "the gradient was not freed";
    EXPECT_FALSE(torch::equal(net.params[2], last_weight)) << "the weight was not updated";
    EXPECT_EQ(optimizer.state().size(), 1u) << "only the last layer's weight is updated yet";
    return grad;
  });
  const auto out = torch::nn::functional::linear(h, net.params[2]);
  (out - y).pow(2).mean().backward();
  EXPECT_TRUE(seen);
  EXPECT_EQ(optimizer.state().size(), 3u);  // all but the unused parameter
}

TEST(OptimizerInBackward, BadUsesAreClearErrors) {
  Net net;
  const auto x = torch::randn({16, 4}), y = torch::randn({16, 3});
  AdamW optimizer(net.params, AdamWOptions(0.05));
  net.loss(x, y).backward();
  EXPECT_NE(
      error_of([&] { OptimizerInBackward updates(optimizer); }).find("already has a gradient"),
      std::string::npos);
  optimizer.zero_grad();
  const auto elsewhere = torch::zeros({2}, torch::device(torch::kMeta).requires_grad(true));
  AdamW two_devices(std::vector<torch::Tensor>{net.params[0], elsewhere});
  EXPECT_NE(error_of([&] { OptimizerInBackward updates(two_devices); }).find("on one device"),
            std::string::npos);
  {
    OptimizerInBackward updates(optimizer);
    EXPECT_NE(error_of([&] {
                OptimizerInBackward again(optimizer);
              }).find("already has a post-accumulate-grad hook"),
              std::string::npos);
    mixprec::amp::GradScaler scaler;
    scaler.scale(net.loss(x, y)).backward();
    EXPECT_NE(error_of([&] { scaler.step(optimizer); }).find("cannot be used with it"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                mixprec::optim::clip_grad_norm_(net.params, 1.0);
              }).find("clip_grad_norm_: parameter 0 of shape [8, 4] is updated in the backward"),
              std::string::npos);
    optimizer.zero_grad();
  }
  // A frozen parameter's stale gradient would be applied by every hook.
  const auto frozen = torch::randn({3});
  frozen.mutable_grad() = torch::ones({3});
  AdamW with_frozen(std::vector<torch::Tensor>{net.params[0], frozen});
  EXPECT_NE(
      error_of([&] { OptimizerInBackward updates(with_frozen); }).find("already has a gradient"),
      std::string::npos);
  // Destroyed: the backward only accumulates again.
  const auto before = net.params[0].detach().clone();
  net.loss(x, y).backward();
  EXPECT_TRUE(net.params[0].grad().defined());
  EXPECT_TRUE(torch::equal(net.params[0], before));
}

// A parameter frozen when the hooks were set is updated once it thaws; a hook set by someone
// else after ours stays when ours go.
TEST(OptimizerInBackward, FrozenParametersThawAndOthersHooksStay) {
  Net net;
  const auto x = torch::randn({16, 4}), y = torch::randn({16, 3});
  net.params[2].requires_grad_(false);
  AdamW optimizer(net.params, AdamWOptions(0.05));
  std::optional<OptimizerInBackward> updates(optimizer);
  net.params[2].requires_grad_(true);
  const auto before = net.params[2].detach().clone();
  net.loss(x, y).backward();
  EXPECT_FALSE(torch::equal(net.params[2], before));
  EXPECT_FALSE(net.params[2].grad().defined());

  struct Count : torch::autograd::PostAccumulateGradHook {
    explicit Count(int& calls) : calls(calls) {}
    void operator()(const torch::autograd::Variable&) override { ++calls; }
    int& calls;
  };
  int calls = 0;
  torch::autograd::impl::set_post_acc_grad_hooks(net.params[0], std::make_unique<Count>(calls));
  updates.reset();
  net.loss(x, y).backward();
  EXPECT_EQ(calls, 1);
  torch::autograd::impl::set_post_acc_grad_hooks(net.params[0], nullptr);
}

}  // namespace
