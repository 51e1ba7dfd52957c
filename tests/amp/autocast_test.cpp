#include "mixprec/amp/autocast.h"

#include <ATen/autocast_mode.h>
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

using mixprec::amp::Autocast;

class AutocastTest : public ::testing::TestWithParam<c10::ScalarType> {};

TEST_P(AutocastTest, MatmulClassOpsRunInLowPrecision) {
  const auto low = GetParam();
  torch::manual_seed(0);
  auto x = torch::randn({4, 8});
  auto w = torch::randn({16, 8});
  auto image = torch::randn({2, 3, 8, 8});
  auto kernel = torch::randn({4, 3, 3, 3});
  Autocast autocast(torch::kCPU, low);
  EXPECT_EQ(torch::nn::functional::linear(x, w).scalar_type(), low);
  EXPECT_EQ(torch::matmul(x, w.t()).scalar_type(), low);
  EXPECT_EQ(torch::conv2d(image, kernel).scalar_type(), low);
}

TEST_P(AutocastTest, LossesRunInFp32AndCatPromotes) {
  const auto low = GetParam();
  auto logits = torch::randn({4, 10});
  auto target = torch::tensor({1, 2, 3, 4});
  Autocast autocast(torch::kCPU, low);
  auto low_logits = torch::matmul(logits, torch::eye(10));
  ASSERT_EQ(low_logits.scalar_type(), low);
  EXPECT_EQ(torch::nn::functional::cross_entropy(low_logits, target).scalar_type(), torch::kFloat);
  EXPECT_EQ(torch::mse_loss(low_logits, torch::zeros({4, 10})).scalar_type(), torch::kFloat);
  EXPECT_EQ(torch::cat({low_logits, logits}).scalar_type(), torch::kFloat);
}

TEST_P(AutocastTest, BackwardGivesFp32GradsForFp32Params) {
  const auto low = GetParam();
  torch::nn::Linear layer(8, 4);
  auto x = torch::randn({16, 8});
  torch::Tensor loss;
  {
    Autocast autocast(torch::kCPU, low);
    auto y = layer(x);
    ASSERT_EQ(y.scalar_type(), low);
    loss = torch::mse_loss(y, torch::zeros({16, 4}));
  }
  loss.backward();
  EXPECT_EQ(layer->weight.grad().scalar_type(), torch::kFloat);
  EXPECT_EQ(layer->bias.grad().scalar_type(), torch::kFloat);
  EXPECT_GT(layer->weight.grad().abs().sum().item<float>(), 0.0f);
}

INSTANTIATE_TEST_SUITE_P(CPU, AutocastTest, ::testing::Values(torch::kHalf, torch::kBFloat16),
                         [](const auto& info) { return std::string(c10::toString(info.param)); });

TEST(Autocast, RestoresPreviousStateAndNests) {
  ASSERT_FALSE(at::autocast::is_autocast_enabled(torch::kCPU));
  const auto default_dtype = at::autocast::get_autocast_dtype(torch::kCPU);
  EXPECT_EQ(default_dtype, torch::kBFloat16);  // PyTorch's CPU default
  auto x = torch::randn({2, 2});
  {
    Autocast outer(torch::kCPU, torch::kBFloat16);
    EXPECT_TRUE(at::autocast::is_autocast_enabled(torch::kCPU));
    {
      Autocast inner(torch::kCPU, torch::kHalf, /*enabled=*/true, /*cache_enabled=*/false);
      EXPECT_EQ(torch::mm(x, x).scalar_type(), torch::kHalf);
      EXPECT_FALSE(at::autocast::is_autocast_cache_enabled());
    }
    EXPECT_EQ(at::autocast::get_autocast_dtype(torch::kCPU), torch::kBFloat16);
    EXPECT_TRUE(at::autocast::is_autocast_cache_enabled());
    EXPECT_EQ(torch::mm(x, x).scalar_type(), torch::kBFloat16);
    {
      Autocast off(torch::kCPU, std::nullopt, /*enabled=*/false);
      EXPECT_FALSE(at::autocast::is_autocast_enabled(torch::kCPU));
      EXPECT_EQ(torch::mm(x, x).scalar_type(), torch::kFloat);
    }
    EXPECT_TRUE(at::autocast::is_autocast_enabled(torch::kCPU));
    // The default dtype is the current one, as in torch.autocast.
    Autocast same(torch::kCPU);
    EXPECT_EQ(same.dtype(), torch::kBFloat16);
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(torch::kCPU));
  EXPECT_EQ(at::autocast::get_autocast_dtype(torch::kCPU), default_dtype);
  // Every guard gave its nesting level back: the next one starts at 1.
  EXPECT_EQ(at::autocast::increment_nesting(), 1);
  EXPECT_EQ(at::autocast::decrement_nesting(), 0);
}

TEST(Autocast, OutermostExitClearsTheCastCache) {
  // A cached cast of a leaf weight is reused within the region, and dropped
  // with the outermost guard: a later region sees an in-place update.
  auto w = torch::ones({4, 4}, torch::requires_grad());
  auto x = torch::ones({1, 4});
  {
    Autocast outer(torch::kCPU, torch::kBFloat16);
    EXPECT_EQ(torch::mm(x, w).sum().item<float>(), 16.0f);
    {
      torch::NoGradGuard no_grad;
      w.mul_(2);
    }
    { Autocast inner(torch::kCPU, torch::kBFloat16); }
    // Still inside the outer region: the cached bf16 copy of w is used.
    EXPECT_EQ(torch::mm(x, w).sum().item<float>(), 16.0f);
  }
  Autocast again(torch::kCPU, torch::kBFloat16);
  EXPECT_EQ(torch::mm(x, w).sum().item<float>(), 32.0f);
}

TEST(Autocast, UnsupportedDtypeIsAnError) {
  try {
    Autocast autocast(torch::kCPU, torch::kFloat);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("dtype Float is not supported on cpu"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(torch::kCPU));
  // Disabled, any dtype is accepted, as in PyTorch.
  Autocast off(torch::kCPU, torch::kFloat, /*enabled=*/false);
  EXPECT_FALSE(at::autocast::is_autocast_enabled(torch::kCPU));
}

}  // namespace

namespace {

TEST(Autocast, UnsupportedDeviceIsAnError) {
  EXPECT_NE(mixprec::testing::error_of([] {
              mixprec::amp::Autocast guard(c10::DeviceType::FPGA);
            }).find("unsupported autocast device_type 'fpga'"),
            std::string::npos);
}

}  // namespace
