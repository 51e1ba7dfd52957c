#include "mixprec/data/synthetic.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

using namespace mixprec::data;

TEST(MakeRegression, ExactLinearAnswersReproducibleBySeed) {
  auto task = make_regression({.n_samples = 50, .n_features = 4, .n_targets = 2, .seed = 3});
  EXPECT_EQ(task.x.sizes(), (std::vector<int64_t>{50, 4}));
  EXPECT_EQ(task.y.sizes(), (std::vector<int64_t>{50, 2}));
  EXPECT_TRUE(torch::allclose(task.y, task.x.mm(task.weight) + task.bias));
  auto again = make_regression({.n_samples = 50, .n_features = 4, .n_targets = 2, .seed = 3});
  EXPECT_TRUE(torch::equal(again.x, task.x));
  EXPECT_TRUE(torch::equal(again.y, task.y));
  auto other = make_regression({.n_samples = 50, .n_features = 4, .n_targets = 2, .seed = 4});
  EXPECT_FALSE(torch::equal(other.x, task.x));
  auto noisy =
      make_regression({.n_samples = 50, .n_features = 4, .n_targets = 2, .noise = 0.1, .seed = 3});
  EXPECT_TRUE(torch::equal(noisy.x, task.x));
  // noise * N(0, 1) on the same answers: 100 draws of standard deviation 0.1.
  const auto residual = noisy.y - (noisy.x.mm(noisy.weight) + noisy.bias);
  EXPECT_NEAR(residual.std().item<double>(), 0.1, 0.025);
  EXPECT_NEAR(residual.mean().item<double>(), 0.0, 0.05);
  // The least-squares fit recovers the weights exactly (to fp32 rounding).
  auto ones = torch::ones({50, 1});
  auto solution = std::get<0>(torch::linalg_lstsq(torch::cat({task.x, ones}, 1), task.y));
  EXPECT_TRUE(torch::allclose(solution.slice(0, 0, 4), task.weight, 1e-4, 1e-4));
}

TEST(MakeClassification, BalancedSeparableReproducible) {
  auto task = make_classification({.n_samples = 90,
                                   .n_features = 5,
                                   .n_classes = 3,
                                   .class_sep = 10.0,
                                   .noise = 0.5,
                                   .seed = 1});
  EXPECT_EQ(task.x.sizes(), (std::vector<int64_t>{90, 5}));
  EXPECT_EQ(task.labels.scalar_type(), torch::kLong);
  EXPECT_TRUE(torch::equal(torch::bincount(task.labels), torch::tensor({30, 30, 30})));
  // With centers far apart, the nearest center is the label.
  auto nearest = torch::cdist(task.x, task.centers).argmin(1);
  EXPECT_TRUE(torch::equal(nearest, task.labels));
  auto again = make_classification({.n_samples = 90,
                                    .n_features = 5,
                                    .n_classes = 3,
                                    .class_sep = 10.0,
                                    .noise = 0.5,
                                    .seed = 1});
  EXPECT_TRUE(torch::equal(again.x, task.x));
  EXPECT_TRUE(torch::equal(again.labels, task.labels));
}

}  // namespace
