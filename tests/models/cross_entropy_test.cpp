#include "mixprec/models/cross_entropy.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

using mixprec::models::cross_entropy;

// Loss and gradient (of 3 x loss, so the upstream gradient is not 1) of `f` on leaf copies.
template <typename F>
std::pair<torch::Tensor, torch::Tensor> loss_and_grad(F&& f, const torch::Tensor& logits,
                                                      const torch::Tensor& targets) {
  auto x = logits.detach().clone().requires_grad_();
  auto loss = f(x, targets);
  (3 * loss).backward();
  return {loss.detach(), x.grad()};
}

torch::Tensor libtorch(const torch::Tensor& x, const torch::Tensor& t) {
  return torch::nn::functional::cross_entropy(x, t);  // mean, ignore_index -100
}

TEST(CrossEntropy, MatchesLibTorchsValueAndGradientWithIgnoredRows) {
  torch::manual_seed(0);
  for (auto dtype : {torch::kDouble, torch::kFloat}) {
    auto logits = 4 * torch::randn({37, 501}, dtype);
    auto targets = torch::randint(0, 501, {37}, torch::kLong);
    targets.index_put_({torch::tensor({0, 5, 6, 36})}, -100);
    auto [loss, grad] = loss_and_grad(
        [](const torch::Tensor& x, const torch::Tensor& t) { return cross_entropy(x, t); }, logits,
        targets);
    auto [ref_loss, ref_grad] = loss_and_grad(libtorch, logits, targets);
    const double tol = dtype == torch::kDouble ? 1e-12 : 1e-5;
    EXPECT_EQ(loss.scalar_type(), dtype);
    EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), tol);
    EXPECT_TRUE(torch::allclose(grad, ref_grad, tol, tol * 1e-2)) << (grad - ref_grad).abs().max();
    // Ignored rows get no gradient; the others' rows sum to zero (softmax minus one-hot).
    EXPECT_EQ(grad[5].abs().max().item<double>(), 0.0);
    EXPECT_NEAR(grad[1].sum().item<double>(), 0.0, tol);
  }
}

TEST(CrossEntropy, AnotherIgnoreIndexAndAllIgnored) {
  auto logits = torch::randn({4, 7}, torch::kDouble);
  auto targets = torch::tensor({3, 0, 6, 3}, torch::kLong);
  auto [loss, grad] = loss_and_grad(
      [](const torch::Tensor& x, const torch::Tensor& t) { return cross_entropy(x, t, 3); }, logits,
      targets);
  auto ref = torch::nn::functional::cross_entropy(
      logits, targets, torch::nn::functional::CrossEntropyFuncOptions().ignore_index(3));
  EXPECT_NEAR(loss.item<double>(), ref.item<double>(), 1e-12);
  EXPECT_EQ(grad[0].abs().max().item<double>(), 0.0);
  EXPECT_TRUE(
      std::isnan(cross_entropy(logits, torch::full({4}, -100, torch::kLong)).item<double>()));
  EXPECT_TRUE(std::isnan(libtorch(logits, torch::full({4}, -100, torch::kLong)).item<double>()));
}

TEST(CrossEntropy, BadInputIsAClearError) {
  auto logits = torch::randn({4, 7});
  EXPECT_NE(mixprec::testing::error_of([&] {
              cross_entropy(logits, torch::zeros({5}, torch::kLong));
            }).find("targets must be int64 (N) with N = 4, got Long of shape [5]"),
            std::string::npos);
  EXPECT_NE(mixprec::testing::error_of([&] {
              cross_entropy(logits.view({-1}), torch::zeros({4}, torch::kLong));
            }).find("logits must be floating (N, C), got Float of shape [28]"),
            std::string::npos);
}

}  // namespace
