#include "mixprec/models/cross_entropy.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cfloat>
#include <cmath>
#include <string>

#include "models/kernel_builds.h"
#include "models/kernels/cross_entropy.h"
#include "test_util.h"

namespace {

using mixprec::models::cross_entropy;
#ifdef MIXPREC_HAVE_X86_KERNELS
namespace kernels = mixprec::models::kernels;
#endif

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

// Logits whose rows test the edges: one far above the rest (a row's max), -inf entries (masked
// classes), large magnitudes of both signs; C not a multiple of any vector width.
torch::Tensor edge_logits(int64_t N, int64_t C) {
  auto x = 4 * torch::randn({N, C});
  x[0][3] = 60;
  x[1].narrow(0, 0, C / 2).fill_(-std::numeric_limits<float>::infinity());
  x[2].mul_(1000);
  return x;
}

// Each kernel this CPU can run, against fp64 on the same (rounded) logits: lse and the per-row
// losses within 1e-6 relative (absolute below 1), the gradient as stated below.
TEST(CrossEntropy, EveryKernelMatchesFp64) {
  using Forward =
      void (*)(const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&, const at::Tensor&);
  using Backward = void (*)(const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&, float,
                            const at::Tensor&);
  std::vector<std::tuple<std::string, Forward, Backward>> runnable;
#ifdef MIXPREC_HAVE_X86_KERNELS
  runnable = mixprec::testing::kernel_builds<Forward, Backward>(
      {kernels::avx512::cross_entropy_forward, kernels::avx512::cross_entropy_backward},
      {kernels::avx2::cross_entropy_forward, kernels::avx2::cross_entropy_backward});
#endif
  if (runnable.empty()) GTEST_SKIP() << "no kernel of mixprec's for this CPU: LibTorch's runs";
  torch::manual_seed(0);
  const float scale = 0.37f;
  for (const auto& [name, forward, backward] : runnable)
    for (int64_t C : {5, 33, 4099})
      for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
        const int64_t N = 6;
        const auto x = edge_logits(N, C).to(dtype);
        auto targets = torch::randint(0, C, {N}, torch::kLong);
        targets[1] = C - 1;  // a class that is not masked
        targets[4] = -100;
        auto lse = torch::empty({N}), loss = torch::empty({N}), grad = torch::empty_like(x);
        forward(x, targets, -100, lse, loss);
        backward(x, targets, -100, lse, scale, grad);
        const auto xd = x.to(torch::kDouble);
        const auto lse_ref = torch::logsumexp(xd, 1);
        const auto loss_ref = (lse_ref - xd.gather(1, targets.clamp_min(0).unsqueeze(1)).squeeze(1))
                                  .index_put_({4}, 0.0);
        const auto probs = (xd - lse_ref.unsqueeze(1)).exp();
        const auto one_hot =
            torch::zeros_like(probs).scatter_(1, targets.clamp_min(0).unsqueeze(1), 1.0);
        auto grad_ref = ((probs - one_hot) * scale).index_put_({4}, 0.0);
        const std::string what =
            name + " " + std::string(c10::toString(dtype)) + " C=" + std::to_string(C);
        auto rel = [](const torch::Tensor& got, const torch::Tensor& want, double floor) {
          return ((got.to(torch::kDouble) - want).abs() / want.abs().clamp_min(floor))
              .max()
              .item<double>();
        };
        EXPECT_LE(rel(lse, lse_ref, 1.0), 1e-6) << what;
        EXPECT_LE(rel(loss, loss_ref, 1.0), 1e-6) << what;
        ASSERT_EQ(grad.scalar_type(), dtype);
        // fp32's error is relative to the terms of softmax minus one-hot (1e-5 of them: both
        // the probability and its difference to 1 carry the exponent's rounding), then one
        // rounding to the dtype (half a unit of the last place; fp16's smallest subnormal, where
        // fp32's error can tip a tie); fp32 flushes what is below its smallest normal.
        const double unit = dtype == torch::kFloat      ? 0.0
                            : dtype == torch::kBFloat16 ? std::ldexp(1.0, -8)
                                                        : std::ldexp(1.0, -11);
        const double subnormal = dtype == torch::kHalf ? std::ldexp(1.0, -24) : 0.0;
        const auto bound = 1e-5 * scale * (probs + (probs - one_hot).abs()) +
                           unit * grad_ref.abs() + subnormal + double{scale} * FLT_MIN;
        const auto excess = (grad.to(torch::kDouble) - grad_ref).abs() - bound;
        EXPECT_LE(excess.max().item<double>(), 0.0) << what;
        EXPECT_EQ(grad[4].abs().max().item<double>(), 0.0) << what;  // the ignored row
        EXPECT_EQ(grad[1].narrow(0, 0, C / 2).abs().max().item<double>(), 0.0) << what;  // -inf
      }
}

// 16-bit logits: HF's loss, `cross_entropy(logits.float())`, with its gradient cast back.
TEST(CrossEntropy, HalfLogitsGiveTheLossOfTheirFp32CastAndAGradientOfTheirDtype) {
  torch::manual_seed(1);
  for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
    const auto logits = (4 * torch::randn({37, 501})).to(dtype);
    auto targets = torch::randint(0, 501, {37}, torch::kLong);
    targets.index_put_({torch::tensor({0, 5})}, -100);
    auto [loss, grad] = loss_and_grad(
        [](const torch::Tensor& x, const torch::Tensor& t) { return cross_entropy(x, t); }, logits,
        targets);
    auto [ref_loss, ref_grad] =
        loss_and_grad([](const torch::Tensor& x,
                         const torch::Tensor& t) { return libtorch(x.to(torch::kFloat), t); },
                      logits, targets);
    EXPECT_EQ(loss.scalar_type(), torch::kFloat);
    EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 1e-5);
    ASSERT_EQ(grad.scalar_type(), dtype);
    ASSERT_EQ(ref_grad.scalar_type(), dtype);
    // Both are one rounding of nearly the same fp32 value: at most one unit of the last place
    // apart.
    const double ulp = dtype == torch::kBFloat16 ? std::ldexp(1.0, -7) : std::ldexp(1.0, -10);
    auto diff = (grad.to(torch::kDouble) - ref_grad.to(torch::kDouble)).abs();
    EXPECT_TRUE((diff <= ulp * ref_grad.to(torch::kDouble).abs() + 1e-7).all().item<bool>())
        << c10::toString(dtype) << " " << diff.max();
  }
}

TEST(CrossEntropy, NonContiguousLogits) {
  torch::manual_seed(2);
  const auto logits = torch::randn({50, 9}).t();  // (9, 50), column-major; clone keeps that
  const auto targets = torch::randint(0, 50, {9}, torch::kLong);
  ASSERT_FALSE(logits.clone().is_contiguous());
  auto [loss, grad] = loss_and_grad(
      [](const torch::Tensor& x, const torch::Tensor& t) { return cross_entropy(x, t); }, logits,
      targets);
  auto [ref_loss, ref_grad] = loss_and_grad(libtorch, logits, targets);
  EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 1e-5);
  EXPECT_TRUE(torch::allclose(grad, ref_grad, 1e-5, 1e-7));
}

// The kernels' backward records no graph: a gradient of the gradient is an error, not a
// silent zero (LibTorch's ops, elsewhere, give one).
TEST(CrossEntropy, KernelsAreDifferentiableOnce) {
  auto logits = torch::randn({4, 7}).requires_grad_();
  const auto loss = cross_entropy(logits, torch::tensor({3, 0, 6, 3}, torch::kLong));
  const auto error = mixprec::testing::error_of([&] {
    torch::autograd::grad({loss}, {logits}, {}, /*retain_graph=*/true, /*create_graph=*/true);
  });
  if (mixprec::kernels::cpu_isa() != mixprec::kernels::Isa::kNone) {
    EXPECT_NE(error.find("cross_entropy is differentiable once"), std::string::npos) << error;
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
  // Every row ignored: a NaN loss and a zero gradient, as PyTorch's, on LibTorch's ops (fp64)
  // and the fused kernel (fp32).
  const auto ignored = torch::full({4}, -100, torch::kLong);
  EXPECT_TRUE(std::isnan(libtorch(logits, ignored).item<double>()));
  for (const auto& x : {logits, logits.to(torch::kFloat)}) {
    auto [all_ignored, zero] = loss_and_grad(
        [](const torch::Tensor& x, const torch::Tensor& t) { return cross_entropy(x, t); }, x,
        ignored);
    EXPECT_TRUE(std::isnan(all_ignored.item<double>())) << x.scalar_type();
    EXPECT_EQ(zero.abs().max().item<double>(), 0.0) << x.scalar_type();
  }
  // An ignored row may hold -inf (a masked vocabulary): it adds nothing, not inf * 0.
  auto masked = logits.clone();
  masked[1][0] = -INFINITY;
  const auto some_ignored = torch::tensor({2, -100, 4, 5}, torch::kLong);
  for (const auto& x : {masked, masked.to(torch::kFloat)})
    EXPECT_NEAR(cross_entropy(x, some_ignored).item<double>(),
                libtorch(masked, some_ignored).item<double>(), 1e-6)
        << x.scalar_type();
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
  EXPECT_NE(mixprec::testing::error_of([&] {
              cross_entropy(logits, torch::tensor({0, 7, -100, 1}, torch::kLong));
            }).find("target 7 of row 1 is out of range [0, 7)"),
            std::string::npos);
}

}  // namespace
