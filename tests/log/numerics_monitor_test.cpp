#include "mixprec/log/numerics_monitor.h"

#include "mixprec/amp/autocast.h"
#include "mixprec/amp/grad_scaler.h"
#include "mixprec/models/linear.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <optional>

namespace {

using mixprec::log::Fp16Range;
using mixprec::log::NumericsMonitor;

// fp16 by its definition, in doubles, independent of the cast the monitor
// uses: round to nearest even puts |y| <= 2^-25 at zero (the tie goes to 0),
// |y| >= 65520 at inf (the tie goes past 65504), and below 2^-14 - 2^-25 on
// a subnormal (the tie goes up to 2^-14).
Fp16Range direct(const at::Tensor& x, double scale) {
  Fp16Range r;
  const at::Tensor v = x.to(at::kDouble).contiguous();
  const double* p = v.const_data_ptr<double>();
  for (int64_t i = 0; i < v.numel(); ++i) {
    const double a = std::fabs(p[i] * scale);
    ++r.numel;
    if (p[i] == 0) ++r.zeros;
    if (!std::isfinite(p[i])) {
      ++r.overflow;
      continue;
    }
    if (a >= 65520.0) ++r.overflow;
    if (p[i] != 0 && a <= std::ldexp(1.0, -25)) ++r.underflow;
    if (a > std::ldexp(1.0, -25) && a < std::ldexp(1.0, -14) - std::ldexp(1.0, -25)) ++r.subnormal;
    if (p[i] != 0) {
      const double e = std::ilogb(std::fabs(p[i]));
      r.max_exponent = std::fmax(r.max_exponent, e);
      r.min_exponent = std::fmin(r.min_exponent, e);
    }
  }
  return r;
}

void expect_equal(const Fp16Range& got, const Fp16Range& want) {
  EXPECT_EQ(got.numel, want.numel);
  EXPECT_EQ(got.zeros, want.zeros);
  EXPECT_EQ(got.underflow, want.underflow);
  EXPECT_EQ(got.subnormal, want.subnormal);
  EXPECT_EQ(got.overflow, want.overflow);
  if (std::isnan(want.max_exponent)) {
    EXPECT_TRUE(std::isnan(got.max_exponent));
  } else {
    EXPECT_EQ(got.max_exponent, want.max_exponent);
    EXPECT_EQ(got.min_exponent, want.min_exponent);
  }
}

TEST(Fp16Range, KnownValuesAtTheEdges) {
  const double inf = std::numeric_limits<double>::infinity();
  // 2^-26 and 2^-25 flush to zero, 1.5·2^-25 rounds up to 2^-24; 65519 rounds
  // to 65504, 65520 to inf.
  const at::Tensor x =
      torch::tensor({0.0, std::ldexp(1.0, -26), std::ldexp(1.0, -25), 1.5 * std::ldexp(1.0, -25),
                     std::ldexp(1.0, -24), std::ldexp(1.0, -15), std::ldexp(1.0, -14), 1.0, 65504.0,
                     65519.0, 65520.0, 1e6, inf, -inf, std::nan(""), -std::ldexp(1.0, -26)},
                    torch::kFloat);
  const Fp16Range r = mixprec::log::fp16_range(x);
  EXPECT_EQ(r.numel, 16);
  EXPECT_EQ(r.zeros, 1);
  EXPECT_EQ(r.underflow, 3);       // 2^-26, 2^-25, -2^-26
  EXPECT_EQ(r.subnormal, 3);       // 1.5·2^-25, 2^-24, 2^-15
  EXPECT_EQ(r.overflow, 5);        // 65520, 1e6, inf, -inf, NaN
  EXPECT_EQ(r.max_exponent, 19);   // 1e6
  EXPECT_EQ(r.min_exponent, -26);  // 2^-26
  expect_equal(r, direct(x, 1.0));

  // At scale 2^10 the small ones survive, and 64 and up overflow.
  const Fp16Range scaled = mixprec::log::fp16_range(x, 1024.0);
  EXPECT_EQ(scaled.underflow, 0);
  EXPECT_EQ(scaled.overflow, 7);       // 65504, 65519, 65520, 1e6, inf, -inf, NaN
  EXPECT_EQ(scaled.max_exponent, 19);  // exponents stay those of x
  expect_equal(scaled, direct(x, 1024.0));
}

TEST(Fp16Range, RandomTensorsMatchTheDefinition) {
  torch::manual_seed(0);
  // Magnitudes log-uniform over 2^-50 .. 2^20, random signs, some zeros.
  at::Tensor x = torch::exp2(torch::rand({20000}, torch::kDouble) * 70 - 50);
  x = (x * torch::sign(torch::randn({20000}, torch::kDouble))).to(torch::kFloat);
  x.index_put_({torch::randint(20000, {500})}, 0.0);
  for (const double scale : {1.0, 1024.0, 65536.0, 3.0}) {
    SCOPED_TRACE(scale);
    const Fp16Range r = mixprec::log::fp16_range(x, scale);
    expect_equal(r, direct(x, scale));
    EXPECT_GT(r.underflow, 0);
    EXPECT_GT(r.overflow, 0);
  }
  // bf16 input: the same definition on its values.
  const at::Tensor b = x.to(torch::kBFloat16);
  expect_equal(mixprec::log::fp16_range(b, 256.0), direct(b, 256.0));
}

TEST(Fp16Range, MergeAddsCountsAndWidensExponents) {
  Fp16Range a = mixprec::log::fp16_range(torch::tensor({1e-9f, 2.0f}));
  const Fp16Range b = mixprec::log::fp16_range(torch::tensor({0.0f, 1e6f}));
  a.merge(b);
  EXPECT_EQ(a.numel, 4);
  EXPECT_EQ(a.zeros, 1);
  EXPECT_EQ(a.underflow, 1);
  EXPECT_EQ(a.overflow, 1);
  EXPECT_EQ(a.max_exponent, 19);
  EXPECT_EQ(a.min_exponent, -30);
  Fp16Range empty;
  empty.merge(mixprec::log::fp16_range(torch::zeros({3})));
  EXPECT_TRUE(std::isnan(empty.max_exponent));
  EXPECT_EQ(empty.zeros, 3);
}

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

TEST(NumericsMonitor, InspectsStepOneAndEveryNth) {
  auto net = std::make_shared<Net>();
  NumericsMonitor monitor(net->named_parameters().pairs(), {.every_n_steps = 3});
  std::vector<int64_t> inspected;
  for (int step = 1; step <= 7; ++step) {
    net->zero_grad();
    net->forward(torch::randn({4, 8})).sum().backward();
    monitor.record_gradients();
    const auto logs = monitor.end_step();
    EXPECT_EQ(logs.empty(), !monitor.inspects(step)) << step;
  }
  for (const auto& r : monitor.records()) inspected.push_back(r.step);
  EXPECT_EQ(inspected, (std::vector<int64_t>{1, 3, 6}));
  EXPECT_EQ(monitor.scale_history().size(), 7u);
  EXPECT_THROW(NumericsMonitor(net->named_parameters().pairs(), {.every_n_steps = -1}), c10::Error);
}

TEST(NumericsMonitor, GradientFiguresAreThoseOfTheUnscaledGradients) {
  auto net = std::make_shared<Net>();
  NumericsMonitor monitor(net->named_parameters().pairs(), {.every_n_steps = 1});
  torch::manual_seed(1);
  // Known gradients, held scaled by 2^10 as a GradScaler leaves them.
  std::vector<at::Tensor> unscaled;
  for (auto& p : net->parameters()) {
    unscaled.push_back(torch::exp2(torch::rand(p.sizes()) * 50 - 40));
    p.mutable_grad() = unscaled.back() * 1024.0;
  }
  monitor.record_gradients(1024.0);
  const auto logs = monitor.end_step(1024.0, false);
  ASSERT_EQ(monitor.records().size(), 1u);
  const auto& record = monitor.records()[0];
  EXPECT_EQ(record.scale, 1024.0);
  ASSERT_EQ(record.gradients.size(), 4u);
  const auto named = net->named_parameters().pairs();
  Fp16Range all;
  for (size_t i = 0; i < named.size(); ++i) {
    SCOPED_TRACE(named[i].first);
    EXPECT_EQ(record.gradients[i].first, named[i].first);
    const Fp16Range want = direct(unscaled[i], 1024.0);
    expect_equal(record.gradients[i].second, want);
    EXPECT_DOUBLE_EQ(logs.at("numerics/grad_underflow/" + named[i].first),
                     want.underflow_fraction());
    all.merge(want);
  }
  EXPECT_DOUBLE_EQ(logs.at("numerics/grad_underflow"), all.underflow_fraction());
  EXPECT_DOUBLE_EQ(logs.at("numerics/grad_overflow"), all.overflow_fraction());
  EXPECT_EQ(logs.at("numerics/loss_scale"), 1024.0);
  EXPECT_GT(all.underflow, 0);  // the test covers both ends
  EXPECT_GT(all.overflow, 0);
  // Without a scaler, the range is checked at scale_without_scaler.
  NumericsMonitor plain(named, {.every_n_steps = 1, .scale_without_scaler = 8.0});
  plain.record_gradients();
  plain.end_step();
  expect_equal(plain.records()[0].gradients[0].second, direct(named[0].second.grad(), 8.0));
}

TEST(NumericsMonitor, SeesTheForwardMatmulsOfInspectedStepsOnly) {
  auto net = std::make_shared<Net>();
  {
    torch::NoGradGuard no_grad;
    net->fc1->weight.fill_(300.0);  // 8 inputs of 30 → 72,000: past fp16's max
    net->fc1->bias.zero_();
  }
  NumericsMonitor monitor(net->named_parameters().pairs(), {.every_n_steps = 2});
  const at::Tensor x = torch::full({4, 8}, 30.0);
  at::Tensor hidden, out;
  for (int step = 1; step <= 3; ++step) {
    {
      mixprec::amp::Autocast autocast(c10::kCPU, at::kBFloat16);
      hidden = net->fc1(x);
      out = net->fc2(torch::relu(hidden));
    }
    out.to(at::kFloat).sum().backward();  // its matmuls do not count
    {
      torch::NoGradGuard no_grad;  // evaluation does not count either
      net->forward(x);
    }
    monitor.record_gradients();
    monitor.end_step();
  }
  ASSERT_EQ(monitor.records().size(), 2u);  // steps 1 and 2
  for (const auto& record : monitor.records()) {
    ASSERT_EQ(record.activations.size(), 1u);
    const auto& [op, r] = record.activations[0];
    // One op per layer, not both linear and the addmm inside it (LibTorch's
    // RecordFunction sees the addmm of a 2-D linear).
    EXPECT_TRUE(op == "aten::linear" || op == "aten::addmm") << op;
    // Both layers' outputs, once each: 4×16 + 4×4.
    EXPECT_EQ(r.numel, 4 * 16 + 4 * 4);
    EXPECT_EQ(r.overflow, direct(hidden, 1.0).overflow + direct(out, 1.0).overflow);
    EXPECT_GE(r.overflow, 4 * 16);  // every hidden unit
    EXPECT_EQ(r.max_exponent,
              std::fmax(direct(hidden, 1.0).max_exponent, direct(out, 1.0).max_exponent));
  }
}

// mixprec's own linear layers (GPT-2's), whose fp32 path calls oneDNN inside an autograd
// function, not an aten GEMM: seen as one op, in fp32 as under autocast.
TEST(NumericsMonitor, SeesMixprecsLinearLayersInFp32AndUnderAutocast) {
  const auto w = torch::full({8, 16}, 300.0).requires_grad_();  // (in, out)
  NumericsMonitor monitor({{"w", w}}, {.every_n_steps = 1});
  const auto x = torch::full({4, 8}, 30.0);  // 8 inputs of 30 x 300 = 72,000: past fp16's max
  for (bool autocast : {false, true}) {
    at::Tensor y;
    {
      std::optional<mixprec::amp::Autocast> guard;
      if (autocast) guard.emplace(c10::kCPU, at::kBFloat16);
      y = mixprec::models::linear(x, w, {}, mixprec::models::WeightLayout::kInOut);
    }
    y.to(at::kFloat).sum().backward();
    monitor.record_gradients();
    monitor.end_step();
  }
  ASSERT_EQ(monitor.records().size(), 2u);
  for (const auto& record : monitor.records()) {
    ASSERT_EQ(record.activations.size(), 1u);
    const auto& [op, r] = record.activations[0];
    EXPECT_EQ(op, "mixprec::linear");
    EXPECT_EQ(r.numel, 4 * 16);
    EXPECT_EQ(r.overflow, 4 * 16);
  }
}

TEST(NumericsMonitor, AsAGradScalerOption) {
  torch::manual_seed(2);
  auto net = std::make_shared<Net>();
  auto monitor = std::make_shared<NumericsMonitor>(
      net->named_parameters().pairs(), mixprec::log::NumericsMonitorOptions{.every_n_steps = 2});
  mixprec::amp::GradScaler scaler({.monitor = monitor.get()});
  torch::optim::SGD sgd(net->parameters(), 0.01);
  std::vector<double> scales;
  for (int step = 1; step <= 5; ++step) {
    sgd.zero_grad();
    scaler.scale(net->forward(torch::randn({4, 8})).pow(2).mean()).backward();
    if (step == 2) net->fc1->weight.mutable_grad()[0][0] = INFINITY;
    scaler.step(sgd);
    if (step == 5)
      scaler.update(torch::full({}, 1024.0f));  // a set scale ends the step too
    else
      scaler.update();
    scales.push_back(scaler.get_scale());
  }
  EXPECT_EQ(scales.back(), 1024.0);
  ASSERT_EQ(monitor->scale_history().size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(monitor->scale_history()[i].scale, scales[i]);
    EXPECT_EQ(monitor->scale_history()[i].skipped, i == 1);
  }
  ASSERT_EQ(monitor->records().size(), 3u);  // steps 1, 2, 4
  const auto& skipped = monitor->records()[1];
  EXPECT_EQ(skipped.step, 2);
  EXPECT_TRUE(skipped.skipped);
  EXPECT_EQ(skipped.scale, 65536.0);  // the scale its gradients were computed at
  EXPECT_EQ(skipped.gradients[0].first, "fc1.weight");
  EXPECT_EQ(skipped.gradients[0].second.overflow, 1);
  EXPECT_EQ(monitor->records()[2].scale, 32768.0);
  EXPECT_EQ(monitor->records()[2].gradients[0].second.overflow, 0);
  const std::string summary = monitor->summary();
  EXPECT_NE(summary.find("3 of 5 steps inspected"), std::string::npos) << summary;
  EXPECT_NE(summary.find("1 steps skipped"), std::string::npos) << summary;
  EXPECT_NE(summary.find("fc1.weight: 0.8% of elements at scale 2^16 (step 2)"), std::string::npos)
      << summary;
}

}  // namespace
