#include "mixprec/optim/stochastic_rounding.h"

#include "mixprec/optim/adamw.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

namespace {

using mixprec::optim::stochastic_round_to_bf16;

// x = lo + p * ulp between two bf16 neighbours rounds up with probability p:
// the mean is x and the variance p (1 - p) ulp^2, within 5 standard errors.
TEST(StochasticRounding, ExpectationAndVarianceMatchTheTwoNeighbours) {
  const int64_t n = 400000;
  auto generator = at::detail::createCPUGenerator(7);
  for (double base : {1.0, -3.0, std::ldexp(1.0, -100), 49152.0}) {  // each exact in bf16
    // bf16 keeps 8 significant bits: the ulp is 2^(exponent - 7).
    const double ulp = std::ldexp(1.0, std::ilogb(base) - 7);
    for (double p : {0.1, 0.5, 0.875}) {
      const double x = base + (base > 0 ? p : -p) * ulp;
      const auto xs = torch::full({n}, x, torch::kFloat);
      const auto r = stochastic_round_to_bf16(xs, generator).to(torch::kDouble);
      const double lo = base, hi = base + (base > 0 ? ulp : -ulp);
      EXPECT_TRUE(((r == lo) | (r == hi)).all().item<bool>()) << base << " " << p;
      const double x32 = static_cast<double>(static_cast<float>(x));
      const double q = std::abs(x32 - lo) / ulp;  // the exact probability of rounding away
      const double sd = ulp * std::sqrt(q * (1 - q) / n);
      EXPECT_NEAR(r.mean().item<double>(), x32, 5 * sd) << base << " " << p;
      const double var = r.var().item<double>();
      EXPECT_NEAR(var, q * (1 - q) * ulp * ulp, 0.02 * q * (1 - q) * ulp * ulp) << base << " " << p;
    }
  }
}

TEST(StochasticRounding, ExactValuesAndNonFiniteStayAndOtherDtypesAreAnError) {
  const auto exact = torch::tensor({0.0f, -0.0f, 1.0f, -2.5f, 1.5f * 65536.0f}).repeat({1000});
  EXPECT_TRUE(torch::equal(stochastic_round_to_bf16(exact).to(torch::kFloat), exact));
  const auto special = torch::tensor({INFINITY, -INFINITY, NAN}).repeat({1000});
  const auto r = stochastic_round_to_bf16(special).to(torch::kFloat);
  EXPECT_TRUE(torch::equal(r.isnan(), special.isnan()));  // every NaN stays one
  const auto finite_or_inf = special.isinf();
  EXPECT_TRUE(torch::equal(r.masked_select(finite_or_inf), special.masked_select(finite_or_inf)));
  EXPECT_NE(mixprec::testing::error_of([] {
              stochastic_round_to_bf16(torch::ones({2}, torch::kHalf));
            }).find("expected a float32 tensor, got Half"),
            std::string::npos);
}

// Pure bf16 AdamW: updates far below half an ulp of the parameter are lost
// with round-to-nearest, kept on average with stochastic rounding.
TEST(StochasticRounding, PureBf16AdamWTracksFp32WhereRoundToNearestStalls) {
  auto run = [](torch::Dtype dtype, bool stochastic) {
    torch::manual_seed(0);
    auto param = torch::full({20000}, 1.0, torch::TensorOptions(dtype).requires_grad(true));
    mixprec::optim::AdamW opt(
        {param},
        mixprec::optim::AdamWOptions(1e-4).weight_decay(0).stochastic_rounding(stochastic));
    for (int step = 0; step < 200; ++step) {
      opt.zero_grad();
      param.sum().backward();  // gradient 1: every step moves by lr = 1e-4, ulp(1) = 2^-7
      opt.step();
    }
    return param.detach().to(torch::kDouble).mean().item<double>();
  };
  const double fp32 = run(torch::kFloat, false);  // 1 - 200 * 1e-4 = 0.98
  EXPECT_NEAR(fp32, 0.98, 1e-5);
  EXPECT_EQ(run(torch::kBFloat16, false), 1.0);          // every update rounded away
  EXPECT_NEAR(run(torch::kBFloat16, true), fp32, 2e-4);  // the mean tracks fp32
  EXPECT_NE(mixprec::testing::error_of([] {
              auto p = torch::ones({2}, torch::requires_grad());
              mixprec::optim::AdamW(
                  {p}, mixprec::optim::AdamWOptions().fused(true).stochastic_rounding(true));
            }).find("stochastic_rounding is not available with fused=true"),
            std::string::npos);
}

// One pure-bf16 AdamW step (the one-pass CPU kernel where it runs) against the step computed
// in fp64 from the same bf16 values: every result is one of the two bf16 neighbours of the
// exact value, each tensor's mean is the exact mean (the rounding is unbiased: 5 standard
// errors), the same seed gives the same bits whatever the thread count, NaN stays NaN.
TEST(StochasticRounding, PureBf16AdamWStepRoundsTheExactStepUnbiased) {
  const int64_t n = 1 << 16;
  const double lr = 1e-3, wd = 0.01, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  torch::manual_seed(0);
  const auto p0 = (1 + 0.1 * torch::randn({n})).to(torch::kBFloat16);
  const auto g0 = torch::randn({n}).to(torch::kBFloat16);
  auto run = [&](int threads, uint64_t seed) {
    torch::set_num_threads(threads);
    torch::manual_seed(seed);
    auto param = p0.clone().requires_grad_();
    mixprec::optim::AdamW opt(
        {param}, mixprec::optim::AdamWOptions(lr).weight_decay(wd).stochastic_rounding(true));
    param.mutable_grad() = g0.clone();
    opt.step();
    const auto& state = static_cast<const mixprec::optim::AdamWParamState&>(
        *opt.state().at(param.unsafeGetTensorImpl()));
    return std::vector<torch::Tensor>{param.detach().clone(), state.exp_avg().clone(),
                                      state.exp_avg_sq().clone()};
  };
  const auto got = run(2, 1);
  // fp64 from the same bf16 inputs (step 1: bias corrections 1 - beta).
  const auto p = p0.to(torch::kDouble), g = g0.to(torch::kDouble);
  const auto m = (1 - beta1) * g, v = (1 - beta2) * g * g;
  const auto exact_p =
      p * (1 - lr * wd) - (lr / (1 - beta1)) * m / (v.sqrt() / std::sqrt(1 - beta2) + eps);
  const std::vector<torch::Tensor> exact{exact_p, m, v};
  for (size_t k = 0; k < exact.size(); ++k) {
    SCOPED_TRACE(k);
    const auto r = got[k].to(torch::kDouble), x = exact[k];
    // The bf16 neighbours of x: x rounded toward zero and the next one away from it.
    const auto down = x.to(torch::kFloat)
                          .view(torch::kInt)
                          .bitwise_and(0xFFFF0000)
                          .view(torch::kFloat)
                          .to(torch::kDouble);
    const auto ulp = (down.abs() * std::ldexp(1.0, -7)).clamp_min(1e-40);  // >= a bf16 ulp
    EXPECT_TRUE((r - x).abs().le(ulp * 1.0001).all().item<bool>());
    // Unbiased: mean error in ulps, each error of variance <= 1/4 ulp^2.
    const double mean_ulps = ((r - x) / ulp).mean().item<double>();
    EXPECT_LE(std::abs(mean_ulps), 5 * 0.5 / std::sqrt(static_cast<double>(n))) << mean_ulps;
    // Not round-to-nearest: some values went the far way.
    EXPECT_GT(((r - x).abs() > 0.5 * ulp * 1.0001).sum().item<int64_t>(), n / 20);
  }
  const auto one_thread = run(1, 1);
  for (size_t k = 0; k < got.size(); ++k) EXPECT_TRUE(torch::equal(got[k], one_thread[k])) << k;
  EXPECT_FALSE(torch::equal(got[0], run(2, 2)[0]));  // another seed, other roundings
  torch::set_num_threads(2);

  auto param = torch::ones({40}, torch::kBFloat16).requires_grad_();
  mixprec::optim::AdamW opt({param}, mixprec::optim::AdamWOptions(lr).stochastic_rounding(true));
  param.mutable_grad() = torch::ones({40}, torch::kBFloat16);
  param.mutable_grad()[3] = std::nan("");
  opt.step();
  EXPECT_TRUE(std::isnan(param[3].item<float>()));
  EXPECT_EQ(param.isnan().sum().item<int64_t>(), 1);
}

}  // namespace
