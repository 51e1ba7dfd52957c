#include "mixprec/optim/adamw.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

using mixprec::optim::AdamW;
using mixprec::optim::AdamWOptions;

// Trains a quadratic for `steps` steps and returns the final parameters.
std::vector<torch::Tensor> train(
    const std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>& make,
    int steps = 20) {
  torch::manual_seed(0);
  std::vector<torch::Tensor> params = {torch::randn({7, 5}, torch::requires_grad()),
                                       torch::randn({5}, torch::requires_grad())};
  auto target = torch::randn({7, 5});
  auto opt = make(params);
  for (int i = 0; i < steps; ++i) {
    opt->zero_grad();
    auto loss = (params[0] - target).pow(2).sum() + params[1].pow(4).sum();
    loss.backward();
    opt->step();
  }
  return params;
}

void expect_close(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b,
                  double rtol, double atol) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(torch::allclose(a[i], b[i], rtol, atol))
        << "param " << i << ": max diff " << (a[i] - b[i]).abs().max().item<double>();
}

TEST(AdamW, FusedMatchesUnfused) {
  for (bool amsgrad : {false, true}) {
    SCOPED_TRACE(amsgrad ? "amsgrad" : "adamw");
    auto unfused = train(
        [&](auto p) { return std::make_unique<AdamW>(p, AdamWOptions(0.05).amsgrad(amsgrad)); });
    auto fused = train([&](auto p) {
      return std::make_unique<AdamW>(p, AdamWOptions(0.05).amsgrad(amsgrad).fused(true));
    });
    // Same formula, different op order inside the kernel: fp32 rounding only.
    expect_close(unfused, fused, 1e-5, 1e-6);
  }
}

TEST(AdamW, MatchesLibTorchAdamW) {
  auto ours = train([](auto p) { return std::make_unique<AdamW>(p, AdamWOptions(0.05)); });
  auto libtorch = train([](auto p) {
    return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(0.05));
  });
  // LibTorch computes the first moment with mul_/add_, PyTorch with lerp_.
  expect_close(ours, libtorch, 1e-5, 1e-6);
}

// A group's own options hold (LibTorch 2.13 gives unknown optimizer types the
// defaults in every group): a no-decay group with zero gradients stays put.
TEST(AdamW, EachParamGroupKeepsItsOptions) {
  for (bool fused : {false, true}) {
    auto decayed = torch::ones({4}, torch::requires_grad());
    auto kept = torch::ones({4}, torch::requires_grad());
    const auto defaults = AdamWOptions(0.1).weight_decay(0.5).fused(fused);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<torch::Tensor>{decayed});
    groups.emplace_back(std::vector<torch::Tensor>{kept},
                        std::make_unique<AdamWOptions>(AdamWOptions(defaults).weight_decay(0.0)));
    AdamW opt(groups, defaults);
    ASSERT_EQ(static_cast<AdamWOptions&>(opt.param_groups()[1].options()).weight_decay(), 0.0);
    decayed.mutable_grad() = torch::zeros({4});
    kept.mutable_grad() = torch::zeros({4});
    opt.step();
    EXPECT_TRUE(torch::equal(kept, torch::ones({4}))) << "fused=" << fused;
    EXPECT_TRUE(torch::allclose(decayed, torch::full({4}, 1 - 0.1 * 0.5))) << "fused=" << fused;
  }
}

TEST(AdamW, MaximizeClimbs) {
  auto p = torch::zeros({1}, torch::requires_grad());
  AdamW opt({p}, AdamWOptions(0.1).weight_decay(0).maximize(true));
  for (int i = 0; i < 3; ++i) {
    opt.zero_grad();
    p.sum().backward();  // gradient +1: maximizing moves p up by lr each step
    opt.step();
  }
  EXPECT_NEAR(p.item<float>(), 0.3f, 1e-5);
}

TEST(AdamW, SupportsAmpScalingOnlyWhenFused) {
  auto p = torch::zeros({1}, torch::requires_grad());
  EXPECT_FALSE(AdamW({p}, AdamWOptions()).step_supports_amp_scaling());
  EXPECT_TRUE(AdamW({p}, AdamWOptions().fused(true)).step_supports_amp_scaling());
}

TEST(AdamW, InvalidOptionsAreClearErrors) {
  auto p = torch::zeros({1}, torch::requires_grad());
  EXPECT_THROW(AdamW({p}, AdamWOptions(-1.0)), c10::Error);
  try {
    AdamW({p}, AdamWOptions().betas({0.9, 1.0}));
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("Invalid beta parameter at index 1: 1"),
              std::string::npos);
  }
  auto ints = torch::zeros({1}, torch::kLong);
  try {
    AdamW({ints}, AdamWOptions().fused(true));
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("requires all the params to be floating point"),
              std::string::npos);
  }
}

}  // namespace

namespace {

TEST(AdamW, BadGradientsAreRejectedBeforeAnyUpdate) {
  auto dense = torch::ones({2}, torch::requires_grad());
  auto complex = torch::ones({2}, torch::dtype(torch::kComplexFloat).requires_grad(true));
  mixprec::optim::AdamW adamw({dense, complex});
  dense.mutable_grad() = torch::ones({2});
  complex.mutable_grad() = torch::ones({2}, torch::kComplexFloat);
  EXPECT_NE(mixprec::testing::error_of([&] {
              adamw.step();
            }).find("complex parameters (ComplexFloat) are not supported"),
            std::string::npos);
  EXPECT_TRUE(torch::equal(dense.detach(), torch::ones({2})));  // untouched
}

}  // namespace
