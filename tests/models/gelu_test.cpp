#include "mixprec/models/gelu.h"

#include <ATen/Version.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>

#include "models/kernel_builds.h"
#include "models/kernels/gelu_tanh.h"
#include "test_util.h"

namespace {

using mixprec::models::gelu_tanh;
#ifdef MIXPREC_HAVE_X86_KERNELS
namespace kernels = mixprec::models::kernels;
#endif

constexpr double kBeta = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kKappa = 0.044715;

// GPT-2's gelu_new and its derivative, in fp64.
torch::Tensor gelu_ref(const torch::Tensor& x) {
  return 0.5 * x * (1 + torch::tanh(kBeta * (x + kKappa * x.pow(3))));
}
torch::Tensor gelu_grad_ref(const torch::Tensor& x) {
  auto t = torch::tanh(kBeta * (x + kKappa * x.pow(3)));
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * kBeta * (1 + 3 * kKappa * x * x);
}

// Random values plus the edges: zero, tiny, large of both signs; n not a multiple of any
// vector width, so every kernel also runs its tail.
torch::Tensor inputs(int64_t n) {
  auto x = 4 * torch::randn({n});
  x.narrow(0, 0, 7).copy_(torch::tensor({0.0, 1e-3, -1e-3, 10.0, -10.0, 30.0, -30.0}));
  return x;
}

// |got - want| within `rel` of |want| (at least of `floor`), elementwise.
void expect_close(const torch::Tensor& got, const torch::Tensor& want, double rel, double floor,
                  const std::string& what) {
  auto err = (got.to(torch::kDouble) - want).abs() / want.abs().clamp_min(floor);
  EXPECT_LE(err.max().item<double>(), rel) << what;
}

// Each kernel this CPU can run: the result of the fp64 formula on the same (rounded) inputs,
// rounded once to the dtype; in fp32, within 1e-5 relative, absolute below 1 (the gradient
// has a zero near x = -0.75, where no fp32 evaluation is relatively close; LibTorch's own
// kernel is 3.5e-6 off there).
TEST(GeluTanh, EveryKernelMatchesFp64WithinOneRounding) {
  using Forward = void (*)(const at::Tensor&, const at::Tensor&);
  using Backward = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&);
  std::vector<std::tuple<std::string, Forward, Backward>> runnable;
#ifdef MIXPREC_HAVE_X86_KERNELS
  runnable = mixprec::testing::kernel_builds<Forward, Backward>(
      {kernels::avx512::gelu_tanh_forward, kernels::avx512::gelu_tanh_backward},
      {kernels::avx2::gelu_tanh_forward, kernels::avx2::gelu_tanh_backward});
#endif
  if (runnable.empty()) GTEST_SKIP() << "no kernel of mixprec's for this CPU: LibTorch's runs";
  torch::manual_seed(0);
  for (const auto& [name, forward, backward] : runnable)
    for (int64_t n : {7, 33, 4099})
      for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
        const auto x = inputs(n).to(dtype), dy = torch::randn({n}).to(dtype);
        auto y = torch::empty_like(x), dx = torch::empty_like(x);
        forward(x, y);
        backward(dy, x, dx);
        const auto xd = x.to(torch::kDouble);
        const double rel = dtype == torch::kFloat      ? 1e-5
                           : dtype == torch::kBFloat16 ? std::ldexp(1.0, -8)
                                                       : std::ldexp(1.0, -11);
        const double floor = dtype == torch::kFloat ? 1.0 : 1e-3;
        const std::string what =
            name + " " + std::string(c10::toString(dtype)) + " n=" + std::to_string(n);
        ASSERT_EQ(y.scalar_type(), dtype);
        expect_close(y, gelu_ref(xd), rel, floor, what + " forward");
        expect_close(dx, dy.to(torch::kDouble) * gelu_grad_ref(xd), rel, floor, what + " backward");
      }
}

TEST(GeluTanh, GradientsMatchLibTorchsOnStridedInputs) {
  torch::manual_seed(1);
  for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf, torch::kDouble}) {
    const auto base = (3 * torch::randn({37, 64})).to(dtype);
    auto x = base.t().detach().requires_grad_();  // not contiguous
    auto ref = base.t().detach().requires_grad_();
    const auto dy = torch::randn({64, 37}).to(dtype);
    auto y = gelu_tanh(x);
    auto want = at::gelu(ref, "tanh");
    ASSERT_EQ(y.sizes(), want.sizes());
    ASSERT_EQ(y.scalar_type(), dtype);
    y.backward(dy);
    want.backward(dy);
    const std::string what = c10::toString(dtype);
    if (dtype == torch::kDouble) {  // LibTorch's kernel itself
      EXPECT_TRUE(torch::equal(y, want));
      EXPECT_TRUE(torch::equal(x.grad(), ref.grad()));
      continue;
    }
    // Both round a value within fp32's error of the exact one: at most one 16-bit step apart.
    const double tol = dtype == torch::kFloat ? 1e-5 : dtype == torch::kBFloat16 ? 1e-2 : 1e-3;
    EXPECT_TRUE(torch::allclose(y.to(torch::kDouble), want.to(torch::kDouble), tol, tol)) << what;
    EXPECT_TRUE(
        torch::allclose(x.grad().to(torch::kDouble), ref.grad().to(torch::kDouble), tol, 4 * tol))
        << what;
  }
  // Its kernel's backward records no graph: a gradient of the gradient is an error, not a
  // silent zero.
  if (std::string(mixprec::models::gelu_tanh_cpu_kernel()) != "libtorch") {
    auto leaf = torch::randn({4, 8}).requires_grad_();
    const auto y = gelu_tanh(leaf).sum();
    EXPECT_NE(mixprec::testing::error_of([&] {
                torch::autograd::grad({y}, {leaf}, {}, /*retain_graph=*/true,
                                      /*create_graph=*/true);
              }).find("gelu_tanh is differentiable once"),
              std::string::npos);
  }
  // A broadcast gradient (of a sum) is not contiguous either.
  auto x = torch::randn({5, 3}).requires_grad_();
  gelu_tanh(x).sum().backward();
  EXPECT_TRUE(torch::allclose(
      x.grad(), gelu_grad_ref(x.detach().to(torch::kDouble)).to(torch::kFloat), 1e-5, 1e-6));
}

TEST(GeluTanh, RunsTheKernelOfLibTorchsCpuCapability) {
  const std::string capability = at::get_cpu_capability();
  const std::string expected = capability == "AVX512" ? "avx512"
                               : capability == "AVX2" ? "avx2"
                                                      : "libtorch";
  EXPECT_EQ(mixprec::models::gelu_tanh_cpu_kernel(), expected);
}

}  // namespace
