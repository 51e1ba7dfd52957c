#include "mixprec/optim/clip_grad.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

namespace {

using mixprec::optim::clip_grad_norm_;

// Parameters whose gradients are `grads` (copied, so each clipping gets its own).
std::vector<torch::Tensor> with_grads(const std::vector<torch::Tensor>& grads) {
  std::vector<torch::Tensor> params;
  for (const auto& g : grads) {
    params.push_back(torch::zeros_like(g).requires_grad_());
    params.back().mutable_grad() = g.clone();
  }
  return params;
}

// Shapes from one element to several of the kernels' 65536-element blocks (run in parallel).
std::vector<torch::Tensor> random_grads(torch::ScalarType dtype = torch::kFloat) {
  torch::manual_seed(0);
  return {torch::randn({1}, dtype), torch::randn({64, 100}, dtype) * 3,
          torch::randn({300001}, dtype) * 1e-3, torch::randn({7, 5}, dtype)};
}

// Runs mixprec's and LibTorch's clipping on the same gradients and checks that both norms and
// all clipped gradients agree (the norm is summed in another order: a few fp32 ulps).
void expect_same_as_libtorch(const std::vector<torch::Tensor>& grads, double max_norm,
                             double norm_type) {
  auto ours = with_grads(grads), theirs = with_grads(grads);
  const double norm = clip_grad_norm_(ours, max_norm, norm_type);
  const double expected = torch::nn::utils::clip_grad_norm_(theirs, max_norm, norm_type);
  EXPECT_NEAR(norm, expected, 1e-6 * expected) << "max_norm " << max_norm << " p " << norm_type;
  for (size_t i = 0; i < grads.size(); ++i) {
    EXPECT_EQ(ours[i].grad().scalar_type(), grads[i].scalar_type());
    EXPECT_TRUE(torch::allclose(ours[i].grad(), theirs[i].grad(), 1e-5, 0))
        << "gradient " << i << ", max_norm " << max_norm << " p " << norm_type;
  }
}

TEST(ClipGradNorm, Fp32GradientsMatchLibTorchClippedOrNot) {
  const auto grads = random_grads();
  for (double max_norm : {0.5, 2.0, 1e9}) expect_same_as_libtorch(grads, max_norm, 2.0);

  // The norm is the exact one rounded to fp32; below max_norm nothing changes, bit for bit.
  double exact = 0;
  for (const auto& g : grads) exact += g.to(torch::kDouble).square().sum().item<double>();
  exact = std::sqrt(exact);
  auto params = with_grads(grads);
  EXPECT_EQ(clip_grad_norm_(params, 1e9), static_cast<double>(static_cast<float>(exact)));
  for (size_t i = 0; i < grads.size(); ++i) EXPECT_TRUE(params[i].grad().equal(grads[i]));

  // Clipped to max_norm: the new norm is max_norm (up to the 1e-6 PyTorch adds).
  clip_grad_norm_(params, 0.5);
  EXPECT_NEAR(clip_grad_norm_(params, 1e9), 0.5, 1e-6);
}

// The one-pass kernels: no LibTorch op runs at all (LibTorch's clipping runs two per tensor).
TEST(ClipGradNorm, Fp32CpuGradientsAreClippedWithoutLibTorchOps) {
  if (at::get_cpu_capability() != "AVX2" && at::get_cpu_capability() != "AVX512")
    GTEST_SKIP() << "no vectorized kernels for CPU capability " << at::get_cpu_capability();
  auto params = with_grads(random_grads());
  using mixprec::testing::ops_run_by;
  EXPECT_TRUE(ops_run_by([&] { clip_grad_norm_(params, 0.5); }).empty());
  EXPECT_FALSE(ops_run_by([&] { params[0].grad().mul_(2); }).empty());  // the callback sees ops
}

TEST(ClipGradNorm, TheNormDoesNotDependOnTheThreadCount) {
  const auto grads = random_grads();
  std::vector<double> norms;
  std::vector<torch::Tensor> clipped;
  for (int threads : {1, 2, 3}) {
    torch::set_num_threads(threads);
    auto params = with_grads(grads);
    norms.push_back(clip_grad_norm_(params, 0.5));
    clipped.push_back(params[2].grad());
  }
  EXPECT_EQ(norms[0], norms[1]);
  EXPECT_EQ(norms[0], norms[2]);
  EXPECT_TRUE(clipped[0].equal(clipped[1]));
  EXPECT_TRUE(clipped[0].equal(clipped[2]));
}

TEST(ClipGradNorm, OtherNormsDtypesAndLayoutsMatchLibTorch) {
  expect_same_as_libtorch(random_grads(), 0.5, 1.0);
  expect_same_as_libtorch(random_grads(), 0.5, std::numeric_limits<double>::infinity());
  expect_same_as_libtorch(random_grads(torch::kDouble), 0.5, 2.0);
  auto grads = random_grads();
  grads[1] = grads[1].t();  // not contiguous
  expect_same_as_libtorch(grads, 0.5, 2.0);

  // bf16: PyTorch rounds each norm and the coefficient to bf16; same ops, same result.
  const auto bf16 = random_grads(torch::kBFloat16);
  auto ours = with_grads(bf16), theirs = with_grads(bf16);
  EXPECT_EQ(clip_grad_norm_(ours, 0.5), torch::nn::utils::clip_grad_norm_(theirs, 0.5));
  for (size_t i = 0; i < bf16.size(); ++i) EXPECT_TRUE(ours[i].grad().equal(theirs[i].grad()));
}

TEST(ClipGradNorm, NonFiniteGradientsScaleAsInPyTorchOrAreAnErrorWhenAsked) {
  for (float bad : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
    auto grads = random_grads();
    grads[1][3][4] = bad;
    auto ours = with_grads(grads), theirs = with_grads(grads);
    const double norm = clip_grad_norm_(ours, 1.0);
    const double expected = torch::nn::utils::clip_grad_norm_(theirs, 1.0);
    EXPECT_TRUE(std::isinf(bad) ? norm == expected : std::isnan(norm) && std::isnan(expected));
    // inf: a coefficient of 0 (inf * 0 is NaN); NaN: NaN everywhere.
    for (size_t i = 0; i < grads.size(); ++i)
      EXPECT_TRUE(torch::allclose(ours[i].grad(), theirs[i].grad(), 0, 0, /*equal_nan=*/true));

    auto untouched = with_grads(grads);
    const auto message = mixprec::testing::error_of(
        [&] { clip_grad_norm_(untouched, 1.0, 2.0, /*error_if_nonfinite=*/true); });
    EXPECT_NE(message.find("The total norm of order 2 for gradients from `parameters` is "
                           "non-finite"),
              std::string::npos)
        << message;
    EXPECT_TRUE(untouched[0].grad().equal(grads[0]));
  }
}

TEST(ClipGradNorm, ParametersWithoutGradientsAreSkipped) {
  EXPECT_EQ(clip_grad_norm_({torch::zeros({3}, torch::requires_grad())}, 1.0), 0.0);
  EXPECT_EQ(clip_grad_norm_({}, 1.0), 0.0);
  auto params = with_grads({torch::full({4}, 3.0)});
  params.push_back(torch::ones({2}, torch::requires_grad()));
  EXPECT_NEAR(clip_grad_norm_(params, 1.0), 6.0, 1e-6);
  EXPECT_NEAR(params[0].grad()[0].item<double>(), 0.5, 1e-6);
  EXPECT_FALSE(params[1].grad().defined());
}

// bf16 gradients and a max_norm that bf16 does not hold: the coefficient as Python computes
// max_norm / (total_norm + 1e-6) (Tensor.__rtruediv__: reciprocal() * max_norm), not as C++'s
// double / Tensor (max_norm rounded to bf16 first, then divided).
TEST(ClipGradNorm, TheCoefficientIsPythonsForAMaxNormBf16DoesNotHold) {
  const auto grads = random_grads(torch::kBFloat16);
  auto params = with_grads(grads);
  clip_grad_norm_(params, 0.3);
  std::vector<at::Tensor> norms;
  for (const auto& g : grads) norms.push_back(at::linalg_vector_norm(g, 2));
  const auto total = at::linalg_vector_norm(at::stack(norms), 2);
  const auto coef = at::clamp_max((total + 1e-6).reciprocal() * 0.3, 1.0);
  const auto cpp_coef = at::clamp_max(0.3 / (total + 1e-6), 1.0);
  ASSERT_FALSE(coef.equal(cpp_coef));  // else this test would not tell them apart
  for (size_t i = 0; i < grads.size(); ++i) EXPECT_TRUE(params[i].grad().equal(grads[i] * coef));
}

// Under no_grad, as PyTorch's: gradients that require grad themselves (a leaf here, as one set
// by hand) are scaled in place without an error, and nothing is recorded.
TEST(ClipGradNorm, GradientsThatRequireGradAreScaledWithoutAGraph) {
  for (const double norm_type : {2.0, 1.0}) {
    auto p = torch::zeros({4}, torch::requires_grad());
    p.mutable_grad() = torch::full({4}, 3.0).requires_grad_();
    EXPECT_NEAR(clip_grad_norm_({p}, 1.0, norm_type), norm_type == 2.0 ? 6.0 : 12.0, 1e-6);
    EXPECT_FALSE(p.grad().grad_fn());
    EXPECT_NEAR(p.grad()[0].item<double>(), norm_type == 2.0 ? 0.5 : 0.25, 1e-6);
  }
}

// A parameter listed twice counts twice and is scaled twice, as LibTorch's clip_grad_norm_
// does (mixprec's kernels, which scale blocks in parallel, leave it to the foreach path).
TEST(ClipGradNorm, ParametersListedTwiceMatchLibTorch) {
  auto ours = with_grads(random_grads()), theirs = with_grads(random_grads());
  ours.push_back(ours[2]);
  theirs.push_back(theirs[2]);
  const double norm = clip_grad_norm_(ours, 0.5);
  const double want = torch::nn::utils::clip_grad_norm_(theirs, 0.5);
  EXPECT_NEAR(norm, want, 1e-6 * want);
  for (size_t i = 0; i < ours.size(); ++i)
    EXPECT_TRUE(torch::allclose(ours[i].grad(), theirs[i].grad(), 1e-6, 0)) << i;
}

}  // namespace
