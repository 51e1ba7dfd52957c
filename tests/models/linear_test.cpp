#include "mixprec/models/linear.h"

#include <gtest/gtest.h>
#include <mixprec/amp/autocast.h>
#include <mixprec/amp/fp16_cpu.h>
#include <torch/torch.h>

#include <c10/util/ScopeExit.h>

#include <algorithm>
#include <string>

#include "kernels/onednn_linear.h"
#include "test_util.h"

namespace {

using mixprec::models::linear;
using mixprec::models::WeightLayout;

// Forward and backward of linear(x, w, b) against the same layer in fp64 (at::linear on the
// weight as (out, in)): within 1e-5 of each result's largest entry.
void expect_matches_fp64(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                         WeightLayout layout) {
  const bool in_out = layout == WeightLayout::kInOut;
  auto leaf = [](const torch::Tensor& t) { return t.defined() ? t.detach().requires_grad_() : t; };
  auto x1 = leaf(x), w1 = leaf(w), b1 = leaf(b);
  auto x2 = leaf(x.to(torch::kDouble)), w2 = leaf(w.to(torch::kDouble));
  auto b2 = b.defined() ? leaf(b.to(torch::kDouble)) : torch::Tensor();
  const auto y1 = linear(x1, w1, b1, layout);
  const auto y2 =
      at::linear(x2, in_out ? w2.t() : w2, b2.defined() ? std::optional(b2) : std::nullopt);
  ASSERT_EQ(y1.sizes(), y2.sizes());
  ASSERT_EQ(y1.scalar_type(), torch::kFloat);
  const auto dy = torch::randn_like(y2);
  y1.backward(dy.to(torch::kFloat));
  y2.backward(dy);
  auto expect_close = [](const torch::Tensor& got, const torch::Tensor& want, const char* what) {
    ASSERT_TRUE(got.defined()) << what;
    ASSERT_EQ(got.sizes(), want.sizes()) << what;
    EXPECT_LE((got.to(torch::kDouble) - want).abs().max().item<double>(),
              1e-5 * want.abs().max().item<double>())
        << what;
  };
  expect_close(y1, y2, "output");
  expect_close(x1.grad(), x2.grad(), "input gradient");
  expect_close(w1.grad(), w2.grad(), "weight gradient");
  if (b.defined()) expect_close(b1.grad(), b2.grad(), "bias gradient");
}

TEST(Linear, MatchesFp64InBothLayoutsWithAndWithoutBias) {
  torch::manual_seed(0);
  for (auto layout : {WeightLayout::kOutIn, WeightLayout::kInOut}) {
    for (bool with_bias : {true, false}) {
      SCOPED_TRACE(std::string(layout == WeightLayout::kInOut ? "(in, out)" : "(out, in)") +
                   (with_bias ? ", bias" : ", no bias"));
      const int64_t in = 48, out = 80;
      const auto w =
          layout == WeightLayout::kInOut ? torch::randn({in, out}) : torch::randn({out, in});
      const auto b = with_bias ? torch::randn({out}) : torch::Tensor();
      expect_matches_fp64(torch::randn({3, 17, in}), w, b, layout);  // (B, T, in)
      expect_matches_fp64(torch::randn({33, in}), w, b, layout);
      // Strided: the transposed view a model hands over after attention's heads.
      expect_matches_fp64(torch::randn({17, 3, in}).transpose(0, 1), w, b, layout);
    }
  }
}

// fp32 CPU tensors outside autocast, and bf16 ones in or out of bf16 autocast (which casts fp32
// ones), go to oneDNN (output and input gradient; the weight gradient where its matmul takes
// fp32) wherever LibTorch has it on and runs it in that dtype; everything else to LibTorch's op,
// which autocast and mixprec's fp16 path see.
TEST(Linear, TakesOnednnForFp32AndBf16) {
  EXPECT_EQ(mixprec::models::linear_uses_onednn(), at::hasMKLDNN());
  const auto square = torch::randn({2, 2});
  const bool onednn_mm = mixprec::kernels::onednn_mm_takes(square.t(), square);
  const bool onednn_bf16 = mixprec::kernels::onednn_linear_available(torch::kBFloat16);
#if (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)) && \
    defined(__x86_64__)
  // Found by its mangled name, and takes fp32 where the CPU passes its check (bf16 too).
  if (__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq")) {
    EXPECT_EQ(onednn_mm, at::hasMKLDNN());
    EXPECT_EQ(onednn_bf16, at::hasMKLDNN());
  }
#endif
  auto ops_of = [](torch::ScalarType dtype, std::optional<torch::ScalarType> autocast) {
    const auto x = torch::randn({4, 8, 16}, dtype).requires_grad_();
    const auto w = torch::randn({16, 24}, dtype).requires_grad_();
    const auto b = torch::zeros({24}, dtype).requires_grad_();
    return mixprec::testing::ops_run_by([&] {
      torch::Tensor y;
      {
        std::optional<mixprec::amp::Autocast> guard;
        if (autocast) guard.emplace(torch::kCPU, *autocast);
        y = linear(x, w, b, WeightLayout::kInOut);
        EXPECT_EQ(y.scalar_type(), autocast.value_or(dtype));
      }
      y.to(torch::kFloat).sum().backward();
      EXPECT_EQ(w.grad().scalar_type(), dtype);
    });
  };
  auto count = [](const std::vector<std::string>& ops, const std::string& name) {
    return std::count(ops.begin(), ops.end(), name);
  };
  const auto fp32 = ops_of(torch::kFloat, std::nullopt);
  EXPECT_EQ(count(fp32, "mkldnn::_linear_pointwise"), at::hasMKLDNN() ? 2 : 0);
  EXPECT_EQ(count(fp32, "mixprec::onednn_mm"), onednn_mm ? 1 : 0);
  EXPECT_EQ(count(fp32, "aten::addmm"), at::hasMKLDNN() ? 0 : 1);
  for (auto [dtype, autocast] : {std::pair{torch::kFloat, std::optional(torch::kBFloat16)},
                                 {torch::kBFloat16, std::optional(torch::kBFloat16)},
                                 {torch::kBFloat16, std::nullopt}}) {
    SCOPED_TRACE(::testing::Message() << dtype << (autocast ? " autocast" : ""));
    const auto ops = ops_of(dtype, autocast);
    EXPECT_EQ(count(ops, "mkldnn::_linear_pointwise"), onednn_bf16 ? 2 : 0);
    EXPECT_EQ(count(ops, "mixprec::onednn_mm"), 0);  // the bf16 weight gradient: at::mm
    // (Under autocast, LibTorch's op records aten::addmm twice: autocast's wrapper calls it.)
    EXPECT_EQ(count(ops, "aten::addmm") == 0, onednn_bf16);
  }
  // fp16 autocast with LibTorch's fp16 kernels (mixprec's fast path, where it runs, computes
  // LibTorch's addmm on oneDNN's fp32 GEMMs itself: amp/fp16_cpu.h).
  const auto path = mixprec::amp::fp16_cpu_path();
  mixprec::amp::set_fp16_cpu_path(mixprec::amp::Fp16CpuPath::kNever);
  const auto restore_path = c10::make_scope_exit([&] { mixprec::amp::set_fp16_cpu_path(path); });
  for (auto [dtype, autocast] :
       {std::pair{torch::kFloat, std::optional(torch::kHalf)}, {torch::kDouble, std::nullopt}}) {
    SCOPED_TRACE(::testing::Message() << dtype << (autocast ? " fp16 autocast" : ""));
    const auto ops = ops_of(dtype, autocast);
    EXPECT_EQ(count(ops, "mkldnn::_linear_pointwise"), 0);
    EXPECT_EQ(count(ops, "mixprec::onednn_mm"), 0);
    EXPECT_GE(count(ops, "aten::addmm"), 1);
  }
  // A bias LibTorch broadcasts but that is not (out): LibTorch's op.
  const auto x = torch::randn({4, 16}), w = torch::randn({16, 24}), b = torch::randn({1});
  const auto broadcast = mixprec::testing::ops_run_by([&] {
    EXPECT_TRUE(torch::allclose(linear(x, w, b, WeightLayout::kInOut), at::addmm(b, x, w)));
  });
  EXPECT_EQ(count(broadcast, "mkldnn::_linear_pointwise"), 0);
  // Switched off as LibTorch's own oneDNN paths are (torch.backends.mkldnn.enabled = False).
  const bool was_enabled = at::globalContext().userEnabledMkldnn();
  at::globalContext().setUserEnabledMkldnn(false);
  const auto restore =
      c10::make_scope_exit([&] { at::globalContext().setUserEnabledMkldnn(was_enabled); });
  EXPECT_FALSE(mixprec::models::linear_uses_onednn());
  const auto off = ops_of(torch::kFloat, std::nullopt);
  EXPECT_EQ(count(off, "mkldnn::_linear_pointwise"), 0);
  EXPECT_EQ(count(off, "mixprec::onednn_mm"), 0);
  EXPECT_FALSE(mixprec::kernels::onednn_mm_takes(square.t(), square));
  EXPECT_EQ(count(off, "aten::addmm"), 1);
  const auto bf16_off = ops_of(torch::kFloat, torch::kBFloat16);
  EXPECT_EQ(count(bf16_off, "mkldnn::_linear_pointwise"), 0);
  EXPECT_GE(count(bf16_off, "aten::addmm"), 1);
}

// Under bf16 autocast: LibTorch's autocast op's result (within a bf16 rounding of its largest
// entry: the same products, the bias added in the GEMM rather than before it) and gradients
// (within two); autocast's casts, a weight's cast once per region.
TEST(Linear, Bf16AutocastMatchesLibTorchsAutocastOp) {
  mixprec::kernels::onednn_linear_available(torch::kBFloat16);  // its probe's ops not counted
  torch::manual_seed(2);
  for (auto layout : {WeightLayout::kOutIn, WeightLayout::kInOut})
    for (bool with_bias : {true, false}) {
      const bool in_out = layout == WeightLayout::kInOut;
      SCOPED_TRACE(std::string(in_out ? "(in, out)" : "(out, in)") +
                   (with_bias ? ", bias" : ", no bias"));
      const int64_t in = 48, out = 80;
      const auto x0 = torch::randn({3, 17, in});
      const auto w0 = in_out ? torch::randn({in, out}) : torch::randn({out, in});
      const auto b0 = with_bias ? torch::randn({out}) : torch::Tensor();
      const auto dy = torch::randn({3, 17, out});
      auto run = [&](bool ours) {
        auto x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_();
        auto b = with_bias ? b0.clone().requires_grad_() : torch::Tensor();
        torch::Tensor y, y2;
        const auto ops = mixprec::testing::ops_run_by([&] {
          mixprec::amp::Autocast guard(torch::kCPU, torch::kBFloat16);
          const auto layer = [&](const torch::Tensor& input) {
            if (ours) return linear(input, w, b, layout);
            const auto bias = with_bias ? std::optional(b) : std::nullopt;
            if (!in_out) return at::linear(input, w, bias);
            const auto flat = input.reshape({-1, in});
            return (with_bias ? at::addmm(b, flat, w) : at::mm(flat, w)).view({3, 17, out});
          };
          y = layer(x);
          y2 = layer(x0);  // the weight's cast from autocast's cache
        });
        EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
        y.backward(dy.to(torch::kBFloat16));
        return std::tuple{y.to(torch::kFloat),
                          std::vector{x.grad(), w.grad(), b.defined() ? b.grad() : torch::Tensor()},
                          std::count(ops.begin(), ops.end(), std::string("aten::_to_copy"))};
      };
      const auto [y, grads, casts] = run(true);
      const auto [y_ref, grads_ref, casts_ref] = run(false);
      const auto close = [](const torch::Tensor& got, const torch::Tensor& want, double ulps) {
        return (got - want).abs().max().item<double>() <=
               ulps * std::ldexp(1.0, -8) * want.abs().max().item<double>();
      };
      EXPECT_TRUE(close(y, y_ref, 1));
      for (size_t i = 0; i < grads.size(); ++i) {
        ASSERT_EQ(grads[i].defined(), grads_ref[i].defined()) << i;
        if (!grads[i].defined()) continue;
        EXPECT_EQ(grads[i].scalar_type(), torch::kFloat) << i;
        EXPECT_TRUE(close(grads[i], grads_ref[i], 2)) << i;
      }
      EXPECT_EQ(casts, casts_ref);
      EXPECT_EQ(casts, with_bias ? 4 : 3);  // x, w, b, then x0 only
    }
}

// Each of x, weight and bias with or without requires_grad; the output modified in place, as
// LibTorch's allows; a gradient of a gradient (create_graph).
TEST(Linear, BehavesAsLibTorchsLinearInAutograd) {
  torch::manual_seed(1);
  const auto x0 = torch::randn({5, 12}), w0 = torch::randn({12, 7}), b0 = torch::randn({7});
  for (int mask = 0; mask < 8; ++mask) {
    SCOPED_TRACE("requires_grad mask " + std::to_string(mask));
    auto leaves = [&] {
      return std::vector<torch::Tensor>{x0.clone().requires_grad_(mask & 1),
                                        w0.clone().requires_grad_((mask & 2) != 0),
                                        b0.clone().requires_grad_((mask & 4) != 0)};
    };
    auto ours = leaves(), ref = leaves();
    auto y = linear(ours[0], ours[1], ours[2], WeightLayout::kInOut);
    auto y_ref = at::addmm(ref[2], ref[0], ref[1]);
    ASSERT_EQ(y.requires_grad(), mask != 0);
    if (mask == 0) continue;
    y.relu_();
    y_ref.relu_();
    y.pow(2).sum().backward();
    y_ref.pow(2).sum().backward();
    for (int i = 0; i < 3; ++i) {
      ASSERT_EQ(ours[i].grad().defined(), ref[i].grad().defined()) << i;
      if (ours[i].grad().defined()) {
        EXPECT_TRUE(torch::allclose(ours[i].grad(), ref[i].grad(), 1e-4, 1e-5)) << i;
      }
    }
  }
  // d/dw of |d loss/dx|^2, through the backward.
  auto second = [&](auto layer) {
    const auto x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_();
    const auto gx = torch::autograd::grad({layer(x, w).pow(2).sum()}, {x}, {},
                                          /*retain_graph=*/true, /*create_graph=*/true)[0];
    return torch::autograd::grad({gx.pow(2).sum()}, {w})[0];
  };
  EXPECT_TRUE(torch::allclose(
      second([&](auto x, auto w) { return linear(x, w, b0, WeightLayout::kInOut); }),
      second([&](auto x, auto w) { return at::addmm(b0, x, w); }), 1e-4, 1e-5));
}

// The weight gradient's GEMM takes fp32 operands that are row-major or the transpose of one
// (storage offsets and single rows too), and computes a b; anything else is left to at::mm.
TEST(Linear, OnednnMatmulTakesPlainAndTransposedFp32Only) {
  using mixprec::kernels::onednn_mm;
  using mixprec::kernels::onednn_mm_takes;
  torch::manual_seed(2);
  const auto square = torch::randn({2, 2});
  const bool runs = onednn_mm_takes(square.t(), square);
  const auto a = torch::randn({5, 4}), b = torch::randn({4, 3});
  const auto rows = torch::randn({7, 4}).narrow(0, 2, 5);  // row-major at an offset
  for (const auto& [x, y] :
       std::vector<std::pair<torch::Tensor, torch::Tensor>>{{a, b},
                                                            {a.t().contiguous().t(), b},
                                                            {a, b.t().contiguous().t()},
                                                            {rows, b},
                                                            {a.narrow(0, 0, 1), b}}) {
    ASSERT_EQ(onednn_mm_takes(x, y), runs) << x.strides() << " " << y.strides();
    if (runs) {
      EXPECT_TRUE(torch::allclose(onednn_mm(x, y), x.mm(y), 1e-5, 1e-6));
    }
  }
  EXPECT_FALSE(onednn_mm_takes(torch::randn({5, 6}).narrow(1, 0, 4), b));  // strided
  EXPECT_FALSE(onednn_mm_takes(torch::randn({1, 4}).expand({5, 4}), b));   // zero stride
  EXPECT_FALSE(onednn_mm_takes(a.to(torch::kBFloat16), b.to(torch::kBFloat16)));
  EXPECT_FALSE(onednn_mm_takes(a.to(torch::kDouble), b.to(torch::kDouble)));
  EXPECT_FALSE(onednn_mm_takes(torch::randn({0, 4}), b));
  EXPECT_FALSE(onednn_mm_takes(a, torch::randn({5, 3})));  // sizes do not fit
}

TEST(Linear, EmptyRowsOrColumnsGiveEmptyOutputsAndZeroGradients) {
  for (auto [rows, out] : {std::pair<int64_t, int64_t>{0, 24}, {4, 0}}) {
    const auto x = torch::randn({rows, 16}).requires_grad_();
    const auto w = torch::randn({16, out}).requires_grad_();
    const auto y = linear(x, w, {}, WeightLayout::kInOut);
    EXPECT_EQ(y.sizes(), (std::vector<int64_t>{rows, out}));
    y.sum().backward();
    EXPECT_TRUE(x.grad().defined() && x.grad().eq(0).all().item<bool>());
    EXPECT_TRUE(w.grad().defined() && w.grad().eq(0).all().item<bool>());
  }
}

TEST(Linear, RejectsAWeightThatDoesNotFit) {
  const auto x = torch::randn({4, 16});
  try {
    linear(x, torch::randn({24, 16}), {}, WeightLayout::kInOut);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(
        std::string(e.what()).find("does not fit a weight of shape [24, 16] stored (in, out)"),
        std::string::npos)
        << e.what();
  }
}

}  // namespace
