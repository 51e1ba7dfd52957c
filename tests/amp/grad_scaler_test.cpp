#include "mixprec/amp/grad_scaler.h"

#include "mixprec/optim/adamw.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>

namespace {

using mixprec::testing::error_of;

using mixprec::amp::GradScaler;
using mixprec::amp::GradScalerOptions;

constexpr float kInf = std::numeric_limits<float>::infinity();

// A parameter whose gradient is `grad_value` times the scale after
// scaler.scale(loss).backward().
struct Toy {
  torch::Tensor w = torch::ones({3}, torch::requires_grad());
  void backward(GradScaler& scaler, float grad_value = 1.0f) {
    scaler.scale((w * grad_value).sum()).backward();
  }
};

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(GradScaler, DefaultsAreTorchs) {
  GradScaler scaler;
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  EXPECT_EQ(scaler.get_growth_factor(), 2.0);
  EXPECT_EQ(scaler.get_backoff_factor(), 0.5);
  EXPECT_EQ(scaler.get_growth_interval(), 2000);
  EXPECT_TRUE(scaler.is_enabled());
  EXPECT_EQ(scaler.get_growth_tracker(), 0);
}

TEST(GradScaler, ScalesTensorsAndVectors) {
  GradScaler scaler({.init_scale = 8.0});
  auto t = torch::tensor({1.0f, 2.0f});
  EXPECT_TRUE(torch::equal(scaler.scale(t), torch::tensor({8.0f, 16.0f})));
  auto scaled = scaler.scale(std::vector<torch::Tensor>{t, torch::tensor(3.0f)});
  ASSERT_EQ(scaled.size(), 2u);
  EXPECT_TRUE(torch::equal(scaled[1], torch::tensor(24.0f)));
  EXPECT_EQ(scaler.scale_tensor().scalar_type(), torch::kFloat);
  // As PyTorch's list path: the scale is copied, so a new scale set before the backward does
  // not change what the backward sees.
  auto w = torch::tensor(1.0f, torch::requires_grad());
  auto loss = scaler.scale(std::vector<torch::Tensor>{w * 2})[0];
  scaler.update(1024.0);
  loss.backward();
  EXPECT_EQ(w.grad().item<float>(), 16.0f);
}

TEST(GradScaler, UnscalesAndSteps) {
  GradScaler scaler({.init_scale = 1024.0});
  Toy toy;
  torch::optim::SGD sgd({toy.w}, 0.5);
  toy.backward(scaler, 2.0f);
  EXPECT_TRUE(torch::equal(toy.w.grad(), torch::full({3}, 2048.0f)));
  scaler.unscale_(sgd);
  EXPECT_TRUE(torch::equal(toy.w.grad(), torch::full({3}, 2.0f)));
  EXPECT_TRUE(scaler.step(sgd));
  EXPECT_TRUE(torch::equal(toy.w.detach(), torch::zeros({3})));
  scaler.update();
  EXPECT_EQ(scaler.get_growth_tracker(), 1);
}

TEST(GradScaler, SkippedStepLeavesParamsAndOptimizerStateBitwiseUnchanged) {
  for (bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "fused" : "unfused");
    GradScaler scaler({.init_scale = 4.0});
    auto w = torch::randn({5}, torch::requires_grad());
    mixprec::optim::AdamW adam({w}, mixprec::optim::AdamWOptions(0.1).fused(fused));
    (w * w).sum().backward();  // one clean step to create the optimizer state
    adam.step();
    adam.zero_grad();
    auto w_before = w.detach().clone();
    auto& state = static_cast<mixprec::optim::AdamWParamState&>(*adam.state().begin()->second);
    auto m_before = state.exp_avg().clone();
    auto v_before = state.exp_avg_sq().clone();
    auto step_before = state.step().clone();

    scaler.scale((w * w).sum()).backward();
    {
      torch::NoGradGuard no_grad;
      w.grad()[2] = kInf;
    }
    EXPECT_FALSE(scaler.step(adam));
    scaler.update();
    EXPECT_TRUE(torch::equal(w.detach(), w_before));
    EXPECT_TRUE(torch::equal(state.exp_avg(), m_before));
    EXPECT_TRUE(torch::equal(state.exp_avg_sq(), v_before));
    EXPECT_TRUE(torch::equal(state.step(), step_before));
    EXPECT_EQ(scaler.get_scale(), 2.0);
    EXPECT_EQ(scaler.get_growth_tracker(), 0);
  }
}

TEST(GradScaler, StateMachineErrorsAreTorchs) {
  GradScaler scaler;
  Toy toy;
  torch::optim::SGD sgd({toy.w}, 0.1);
  EXPECT_TRUE(has(error_of([&] { scaler.step(sgd); }),
                  "Attempted step but _scale is None.  This may indicate your script did not use "
                  "scaler.scale(loss or outputs) earlier in the iteration."));
  EXPECT_TRUE(has(error_of([&] { scaler.update(); }), "Attempted update but _scale is None."));
  toy.backward(scaler);
  EXPECT_TRUE(
      has(error_of([&] { scaler.update(); }), "No inf checks were recorded prior to update."));
  scaler.unscale_(sgd);
  EXPECT_TRUE(has(error_of([&] { scaler.unscale_(sgd); }),
                  "unscale_() has already been called on this optimizer since the last update()."));
  scaler.step(sgd);
  EXPECT_TRUE(has(error_of([&] { scaler.step(sgd); }),
                  "step() has already been called since the last update()."));
  EXPECT_TRUE(
      has(error_of([&] { scaler.unscale_(sgd); }), "unscale_() is being called after step()."));
  scaler.update();
  // A new iteration starts clean.
  sgd.zero_grad();
  toy.backward(scaler);
  EXPECT_TRUE(scaler.step(sgd));
  scaler.update();
}

TEST(GradScaler, Fp16GradientsAreRejected) {
  GradScaler scaler;
  auto w = torch::ones({2}, torch::dtype(torch::kHalf).requires_grad(true));
  torch::optim::SGD sgd({w}, 0.1);
  scaler.scale((w * 1).sum()).backward();
  EXPECT_TRUE(has(error_of([&] { scaler.step(sgd); }), "Attempting to unscale FP16 gradients."));
}

TEST(GradScaler, InvalidOptionsAreClearErrors) {
  EXPECT_TRUE(has(error_of([] { GradScaler s({.growth_factor = 1.0}); }),
                  "The growth factor must be > 1.0."));
  EXPECT_TRUE(has(error_of([] { GradScaler s({.backoff_factor = 1.0}); }),
                  "The backoff factor must be < 1.0."));
  EXPECT_TRUE(
      has(error_of([] { GradScaler s({.growth_interval = 0}); }), "Invalid growth_interval: 0"));
  EXPECT_TRUE(has(error_of([] { GradScaler s({.min_scale = 8.0, .max_scale = 4.0}); }),
                  "Invalid min_scale 8 > max_scale 4"));
  // Disabled, nothing is validated (PyTorch's order).
  GradScaler disabled({.growth_factor = 0.5, .enabled = false});
  EXPECT_FALSE(disabled.is_enabled());
}

TEST(GradScaler, DisabledIsAPassThrough) {
  GradScaler scaler({.enabled = false});
  Toy toy;
  torch::optim::SGD sgd({toy.w}, 1.0);
  auto loss = (toy.w * 3).sum();
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  loss.backward();
  scaler.unscale_(sgd);
  EXPECT_TRUE(scaler.step(sgd));
  scaler.update();
  EXPECT_TRUE(torch::equal(toy.w.detach(), torch::full({3}, -2.0f)));
  EXPECT_EQ(scaler.get_scale(), 1.0);
  EXPECT_TRUE(scaler.state_dict().empty());
}

TEST(GradScaler, GrowsAfterIntervalAndBacksOffOnInf) {
  GradScaler scaler({.init_scale = 16.0, .growth_interval = 3});
  Toy toy;
  torch::optim::SGD sgd({toy.w}, 0.0);
  std::vector<double> scales;
  for (float g : {1.0f, 1.0f, 1.0f, kInf, 1.0f}) {
    toy.backward(scaler, g);
    scaler.step(sgd);
    scaler.update();
    sgd.zero_grad();
    scales.push_back(scaler.get_scale());
  }
  EXPECT_EQ(scales, (std::vector<double>{16, 16, 32, 16, 16}));
  // The tracker stands at 1: with an interval of 2 the next clean step grows.
  // (PyTorch grows only when the tracker reaches the interval exactly, so an
  // interval set below the tracker never grows; the reference traces check that.)
  scaler.set_growth_factor(3.0);
  scaler.set_backoff_factor(0.25);
  scaler.set_growth_interval(2);
  for (float g : {1.0f, kInf}) {
    toy.backward(scaler, g);
    scaler.step(sgd);
    scaler.update();
    sgd.zero_grad();
    scales.push_back(scaler.get_scale());
  }
  EXPECT_EQ(scales, (std::vector<double>{16, 16, 32, 16, 16, 48, 12}));
}

TEST(GradScaler, SeveralOptimizersShareOneScaler) {
  GradScaler scaler({.init_scale = 8.0});
  auto a = torch::ones({2}, torch::requires_grad());
  auto b = torch::ones({2}, torch::requires_grad());
  torch::optim::SGD opt_a({a}, 1.0);
  torch::optim::Adam opt_b({b}, torch::optim::AdamOptions(0.1));
  scaler.scale((a + b).sum()).backward();
  {
    torch::NoGradGuard no_grad;
    b.grad()[0] = kInf;
  }
  EXPECT_TRUE(scaler.step(opt_a));   // a's gradients are finite: it steps
  EXPECT_FALSE(scaler.step(opt_b));  // b's are not: it skips
  scaler.update();                   // any inf backs off the shared scale
  EXPECT_TRUE(torch::equal(a.detach(), torch::zeros({2})));
  EXPECT_TRUE(torch::equal(b.detach(), torch::ones({2})));
  EXPECT_EQ(scaler.get_scale(), 4.0);
}

TEST(GradScaler, UpdateWithNewScale) {
  GradScaler scaler;
  Toy toy;
  toy.backward(scaler);
  scaler.update(torch::tensor({128.0f}));
  EXPECT_EQ(scaler.get_scale(), 128.0);
  scaler.update(2.0);
  EXPECT_EQ(scaler.get_scale(), 2.0);
  EXPECT_TRUE(has(error_of([&] { scaler.update(torch::ones({2})); }),
                  "new_scale should be a float or a 1-element"));
  EXPECT_TRUE(has(error_of([&] { scaler.update(torch::ones({1}, torch::requires_grad())); }),
                  "with requires_grad=False"));
}

TEST(GradScaler, StateDictHasTorchsKeysAndRoundTrips) {
  GradScaler scaler({.init_scale = 32.0, .growth_interval = 5});
  Toy toy;
  torch::optim::SGD sgd({toy.w}, 0.0);
  for (int i = 0; i < 2; ++i) {
    toy.backward(scaler);
    scaler.step(sgd);
    scaler.update();
  }
  auto state = scaler.state_dict();
  EXPECT_EQ(state, (std::map<std::string, double>{{"scale", 32.0},
                                                  {"growth_factor", 2.0},
                                                  {"backoff_factor", 0.5},
                                                  {"growth_interval", 5.0},
                                                  {"_growth_tracker", 2.0}}));
  GradScaler restored;
  restored.load_state_dict(state);  // before the first scale(): applied lazily
  EXPECT_EQ(restored.state_dict(), state);
  EXPECT_TRUE(
      has(error_of([&] { restored.load_state_dict({}); }), "The source state dict is empty"));
  EXPECT_TRUE(has(error_of([&] {
                    restored.load_state_dict({{"scale", 1.0}});
                  }),
                  "missing key 'growth_factor'"));
}

// An optimizer that unscales and skips by itself: what the scaler hands it.
struct RecordingOptimizer : torch::optim::SGD, mixprec::amp::SupportsAmpScaling {
  using torch::optim::SGD::SGD;
  bool step_supports_amp_scaling() const override { return true; }
  torch::Tensor step(LossClosure) override {
    seen_scale = grad_scale ? grad_scale->item<double>() : -1.0;
    seen_found_inf = found_inf->item<double>();
    seen_grad = param_groups()[0].params()[0].grad().clone();
    return {};
  }
  double seen_scale = 0, seen_found_inf = 0;
  torch::Tensor seen_grad;
};

TEST(GradScaler, AmpAwareOptimizerGetsScaleAndFoundInfWithoutUnscalePass) {
  GradScaler scaler({.init_scale = 64.0});
  Toy toy;
  RecordingOptimizer opt({toy.w}, torch::optim::SGDOptions(0.1));
  toy.backward(scaler);
  EXPECT_TRUE(scaler.step(opt));
  EXPECT_EQ(opt.seen_scale, 64.0);
  EXPECT_EQ(opt.seen_found_inf, 0.0);
  EXPECT_TRUE(torch::equal(opt.seen_grad, torch::full({3}, 64.0f)));  // still scaled
  EXPECT_FALSE(opt.grad_scale.has_value());  // handed over for one step only
  scaler.update();

  // After an explicit unscale_, grads are unscaled and no grad_scale is passed.
  opt.zero_grad();
  toy.backward(scaler, kInf);
  scaler.unscale_(opt);
  EXPECT_FALSE(scaler.step(opt));
  EXPECT_EQ(opt.seen_scale, -1.0);
  EXPECT_EQ(opt.seen_found_inf, 1.0);
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 32.0);
}

TEST(GradScalerExtensions, MinAndMaxScaleBoundTheScale) {
  GradScaler scaler({.init_scale = 4.0, .growth_interval = 1, .min_scale = 1.0, .max_scale = 8.0});
  Toy toy;
  torch::optim::SGD sgd({toy.w}, 0.0);
  std::vector<double> scales;
  for (float g : {1.0f, 1.0f, 1.0f, kInf, kInf, kInf, kInf}) {
    toy.backward(scaler, g);
    scaler.step(sgd);
    if (scales.size() == 6) {
      // At min_scale with infs still coming: a clear error, not endless skipping.
      EXPECT_TRUE(has(error_of([&] { scaler.update(); }),
                      "inf/NaN gradients with the loss scale already at min_scale (1)"));
      break;
    }
    scaler.update();
    sgd.zero_grad();
    scales.push_back(scaler.get_scale());
  }
  EXPECT_EQ(scales, (std::vector<double>{8, 8, 8, 4, 2, 1}));
}

// The scale is fp32, where 0.1 rounds up: a scale clamped at min_scale 0.1 is at it.
TEST(GradScalerExtensions, MinScaleIsComparedInTheScalesFloat) {
  GradScaler scaler({.init_scale = 0.2, .min_scale = 0.1});
  Toy toy;
  torch::optim::SGD sgd({toy.w}, 0.0);
  toy.backward(scaler, kInf);
  scaler.step(sgd);
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), static_cast<double>(0.1f));
  toy.backward(scaler, kInf);
  scaler.step(sgd);
  EXPECT_TRUE(has(error_of([&] { scaler.update(); }),
                  "inf/NaN gradients with the loss scale already at min_scale (0.1)"));
}

TEST(GradScalerExtensions, HysteresisToleratesOverflowsBeforeBackingOff) {
  GradScaler scaler({.init_scale = 16.0, .growth_interval = 2, .hysteresis = 2});
  Toy toy;
  torch::optim::SGD sgd({toy.w}, 0.0);
  std::vector<double> scales;
  std::vector<bool> stepped;
  for (float g : {kInf, kInf, 1.0f, 1.0f, kInf, kInf, kInf}) {
    toy.backward(scaler, g);
    stepped.push_back(scaler.step(sgd));
    scaler.update();
    sgd.zero_grad();
    scales.push_back(scaler.get_scale());
  }
  // 1st inf tolerated, 2nd backs off; two clean steps grow and refill the
  // hysteresis; then again one tolerated, and every later inf backs off.
  EXPECT_EQ(scales, (std::vector<double>{16, 8, 8, 16, 16, 8, 4}));
  EXPECT_EQ(stepped, (std::vector<bool>{false, false, true, true, false, false, false}));
  EXPECT_EQ(scaler.state_dict().at("_hysteresis_left"), 1.0);
}

}  // namespace
