#include "mixprec/models/mlp_classifier.h"
#include "mixprec/amp/autocast.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

using mixprec::models::MLPClassifier;

TEST(MLPClassifier, LossAndLogitsFollowTheContract) {
  torch::manual_seed(0);
  MLPClassifier model(
      mixprec::models::MLPClassifierOptions{.in_features = 8, .hidden = 16, .num_labels = 3});
  auto x = torch::randn({5, 8});
  auto y = torch::tensor({0, 2, 1, 1, 0});
  auto out = model->forward({{"pixels", x}, {"labels", y}});
  EXPECT_EQ(out.logits.sizes(), (std::vector<int64_t>{5, 3}));
  // Two hidden ReLU layers and a linear head, from the module's own weights; the loss is
  // cross-entropy on those logits.
  const auto params = model->named_parameters();
  const auto layer = [&](const std::string& name, const at::Tensor& in) {
    return torch::nn::functional::linear(in, params[name + ".weight"], params[name + ".bias"]);
  };
  const auto expected = layer("out", torch::relu(layer("fc2", torch::relu(layer("fc1", x)))));
  EXPECT_TRUE(torch::allclose(out.logits, expected));
  EXPECT_TRUE(torch::allclose(out.loss, torch::nn::functional::cross_entropy(expected, y)));
  EXPECT_FALSE(model->forward({{"inputs", x}}).loss.defined());  // no labels, no loss
  {
    mixprec::amp::Autocast autocast(torch::kCPU, torch::kBFloat16);
    auto low = model->forward({{"pixels", x}, {"labels", y}});
    EXPECT_EQ(low.logits.scalar_type(), torch::kBFloat16);
    EXPECT_EQ(low.loss.scalar_type(), torch::kFloat);  // losses stay fp32 under autocast
  }
}

TEST(MLPClassifier, BadInputIsAClearError) {
  MLPClassifier model(
      mixprec::models::MLPClassifierOptions{.in_features = 8, .hidden = 16, .num_labels = 3});
  EXPECT_NE(mixprec::testing::error_of([&] {
              model->forward(torch::randn({2, 7}));
            }).find("expected inputs of shape (B, 8), got [2, 7]"),
            std::string::npos);
  EXPECT_NE(mixprec::testing::error_of([&] {
              model->forward({{"x", torch::randn({2, 8})}});
            }).find("no \"pixels\" or \"inputs\""),
            std::string::npos);
}

}  // namespace
