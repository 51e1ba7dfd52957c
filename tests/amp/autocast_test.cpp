#include "mixprec/amp/autocast.h"
#include "mixprec/amp/custom_function.h"

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

// A custom Function through torch.amp.custom_fwd / custom_bwd, with what its forward and
// backward saw.
struct Seen {
  bool forward_autocast = false;
  c10::ScalarType forward_input = at::kFloat;
  bool backward_autocast = false;
  c10::ScalarType backward_dtype = at::kFloat;
};
Seen seen;
std::optional<c10::ScalarType> cast_inputs;

struct MatMul : torch::autograd::Function<MatMul> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& a,
                            const at::Tensor& b) {
    return mixprec::amp::custom_fwd(
        ctx, at::kCPU, cast_inputs,
        [&](const at::Tensor& a_in, const at::Tensor& b_in) {
          seen.forward_autocast = at::autocast::is_autocast_enabled(at::kCPU);
          seen.forward_input = a_in.scalar_type();
          ctx->save_for_backward({a_in, b_in});
          return a_in.mm(b_in);
        },
        a, b);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return mixprec::amp::custom_bwd(ctx, at::kCPU, [&] {
      seen.backward_autocast = at::autocast::is_autocast_enabled(at::kCPU);
      seen.backward_dtype = at::autocast::get_autocast_dtype(at::kCPU);
      const auto saved = ctx->get_saved_variables();
      return torch::autograd::variable_list{grads[0].mm(saved[1].t()), saved[0].t().mm(grads[0])};
    });
  }
};

// cast_inputs under autocast: the forward runs without it on fp32 inputs (float64 left as it
// is), and so does the backward; the gradients come back in the inputs' dtype.
TEST(CustomFunction, CastInputsRunsTheForwardAndBackwardWithoutAutocast) {
  torch::manual_seed(0);
  const auto a = torch::randn({4, 8}).to(at::kBFloat16).requires_grad_();
  const auto b = torch::randn({8, 3}).to(at::kBFloat16).requires_grad_();
  cast_inputs = at::kFloat;
  seen = {.forward_input = at::kBFloat16};
  at::Tensor out;
  {
    Autocast autocast(at::kCPU, at::kBFloat16);
    out = MatMul::apply(a, b);
  }
  EXPECT_FALSE(seen.forward_autocast);
  EXPECT_EQ(seen.forward_input, at::kFloat);
  EXPECT_EQ(out.scalar_type(), at::kFloat);
  EXPECT_TRUE(torch::equal(out, a.detach().to(at::kFloat).mm(b.detach().to(at::kFloat))));
  {
    Autocast autocast(at::kCPU, at::kBFloat16);  // the caller's state does not count
    out.sum().backward();
  }
  EXPECT_FALSE(seen.backward_autocast);
  EXPECT_EQ(a.grad().scalar_type(), at::kBFloat16);
  EXPECT_TRUE(torch::allclose(a.grad().to(at::kFloat),
                              b.detach().to(at::kFloat).sum(1).expand({4, 8}), 1e-2, 1e-2));

  Autocast autocast(at::kCPU, at::kBFloat16);
  MatMul::apply(torch::randn({2, 2}, at::kDouble), torch::randn({2, 2}, at::kDouble));
  EXPECT_EQ(seen.forward_input, at::kDouble);
}

// Without cast_inputs, the forward runs under the caller's autocast, and the backward under
// the forward's state wherever it is called from; outside autocast, nothing is cast.
TEST(CustomFunction, TheBackwardRunsUnderTheForwardsAutocast) {
  torch::manual_seed(0);
  const auto a = torch::randn({4, 8}, torch::requires_grad());
  const auto b = torch::randn({8, 3}, torch::requires_grad());
  cast_inputs = std::nullopt;
  seen = {};
  at::Tensor out;
  {
    Autocast autocast(at::kCPU, at::kBFloat16);
    out = MatMul::apply(a, b);
  }
  EXPECT_TRUE(seen.forward_autocast);
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  out.to(at::kFloat).sum().backward();
  EXPECT_TRUE(seen.backward_autocast);
  EXPECT_EQ(seen.backward_dtype, at::kBFloat16);
  EXPECT_EQ(a.grad().scalar_type(), at::kFloat);

  cast_inputs = at::kBFloat16;  // autocast is off: the inputs stay fp32
  seen = {.forward_autocast = true, .forward_input = at::kBFloat16};
  out = MatMul::apply(a, b);
  EXPECT_FALSE(seen.forward_autocast);
  EXPECT_EQ(seen.forward_input, at::kFloat);
  {
    Autocast autocast(at::kCPU, at::kBFloat16);
    out.sum().backward();
  }
  EXPECT_FALSE(seen.backward_autocast);
}

// The arguments _cast reaches besides tensors: an optional tensor, a list (as a vector), and a
// number, which passes through.
struct ScaledSum : torch::autograd::Function<ScaledSum> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList parts,
                            const std::optional<at::Tensor>& bias, double scale) {
    return mixprec::amp::custom_fwd(
        ctx, at::kCPU, at::kFloat,
        [](at::TensorList cast_parts, const std::optional<at::Tensor>& cast_bias, double factor) {
          for (const auto& p : cast_parts) EXPECT_EQ(p.scalar_type(), at::kFloat);
          EXPECT_EQ(cast_bias.value_or(cast_parts[0]).scalar_type(), at::kFloat);
          auto sum = factor * (cast_parts[0] + cast_parts[1]);
          return cast_bias ? sum + *cast_bias : sum;
        },
        parts, bias, scale);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list) {
    return {};
  }
};

TEST(CustomFunction, CastsOptionalTensorsAndListsAndPassesTheRest) {
  Autocast autocast(at::kCPU, at::kBFloat16);
  const auto half = torch::ones({2}, at::kBFloat16);
  const std::vector<at::Tensor> parts{half, half};
  const auto out = ScaledSum::apply(parts, std::optional<at::Tensor>(half), 3.0);
  EXPECT_EQ(out.scalar_type(), at::kFloat);
  EXPECT_TRUE(torch::equal(out, torch::full({2}, 7.0)));
  EXPECT_TRUE(
      torch::equal(ScaledSum::apply(parts, std::nullopt, 0.5), torch::ones({2}, at::kFloat)));
}

struct WithoutCustomFwd : torch::autograd::Function<WithoutCustomFwd> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) {
    return x * 2;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return mixprec::amp::custom_bwd(ctx, at::kCPU, [&] { return grads; });
  }
};

TEST(CustomFunction, CustomBwdWithoutCustomFwdIsAnError) {
  const auto x = torch::randn({2}, torch::requires_grad());
  EXPECT_NE(mixprec::testing::error_of([&] {
              WithoutCustomFwd::apply(x).sum().backward();
            }).find("the forward did not run through amp::custom_fwd"),
            std::string::npos);
}

}  // namespace
