#include "mixprec/models/layer_norm.h"

#include <ATen/Version.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "mixprec/amp/autocast.h"
#include "models/kernel_builds.h"
#include "models/kernels/layer_norm.h"
#include "test_util.h"
#include "tiny_gpt2.h"

namespace {

using mixprec::models::layer_norm;

constexpr double kEps = 1e-5;

// x: rows of C values far from 0 relative to their spread, the case a one-pass variance
// gets wrong.
torch::Tensor inputs(int64_t rows, int64_t C) { return 100 + torch::randn({rows, C}); }

// max |got - want| within tol of max |want| (and of 1e-9: some gradients are 0).
void expect_close(const torch::Tensor& got, const torch::Tensor& want, double tol,
                  const std::string& what) {
  const double err = (got.to(torch::kDouble) - want).abs().max().item<double>();
  const double scale = want.abs().max().item<double>();
  EXPECT_LE(err, tol * scale + 1e-9) << what << ": max error " << err << " of max " << scale;
}

// One rounding in dtype, relative (fp32: its own error too).
double rounding(torch::ScalarType dtype) {
  return dtype == torch::kFloat      ? 1e-5
         : dtype == torch::kBFloat16 ? std::ldexp(1.0, -8)
                                     : std::ldexp(1.0, -11);
}

// The output within one rounding of want, elementwise, beyond twice the error of LibTorch's
// fp32 layer_norm (x near 100 costs fp32 ~1e-5 in the mean).
void expect_output_close(const torch::Tensor& got, const torch::Tensor& want,
                         const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                         const std::string& what) {
  const double fp32 = (torch::layer_norm(x, {x.size(-1)}, w, b, kEps).to(torch::kDouble) - want)
                          .abs()
                          .max()
                          .item<double>();
  const auto err = (got.to(torch::kDouble) - want).abs();
  EXPECT_TRUE(
      (err <= rounding(got.scalar_type()) * want.abs() + 2 * fp32 + 1e-7).all().item<bool>())
      << what << ": max error " << err.max().item<double>() << " (LibTorch's fp32: " << fp32 << ")";
}

// dx within 1e-4 of its largest value, and of rstd |dy w| (rounding in g - mean(g), which
// rstd scales up where the variance is ~0).
void expect_dx_close(const torch::Tensor& dx, const torch::Tensor& want, const torch::Tensor& rstd,
                     const torch::Tensor& dy, const torch::Tensor& w, const std::string& what) {
  const double floor = 1e-6 * rstd.abs().max().item<double>() *
                       (dy.to(torch::kFloat) * w).abs().max().item<double>();
  const double err = (dx.to(torch::kDouble) - want).abs().max().item<double>();
  EXPECT_LE(err, 1e-4 * want.abs().max().item<double>() + floor) << what << " dx";
}

// LibTorch's LayerNorm in fp64 and its gradients for the upstream gradient dy.
struct Reference {
  torch::Tensor y, dx, dweight, dbias;
};
Reference reference(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                    const torch::Tensor& dy) {
  auto xd = x.to(torch::kDouble).requires_grad_(), wd = w.to(torch::kDouble).requires_grad_(),
       bd = b.to(torch::kDouble).requires_grad_();
  auto y = torch::layer_norm(xd, {x.size(-1)}, wd, bd, kEps);
  y.backward(dy.to(torch::kDouble));
  return {y.detach(), xd.grad(), wd.grad(), bd.grad()};
}

// Whether layer_norm runs mixprec's kernel here (not LibTorch's op and a cast).
bool fused_runs() {
  const auto ops = mixprec::testing::ops_run_by([] {
    layer_norm(torch::randn({2, 8}), torch::ones({8}), torch::zeros({8}), kEps, torch::kFloat);
  });
  return std::count(ops.begin(), ops.end(), "mixprec::layer_norm") == 1;
}

// Each kernel this CPU can run, on every tail length of both vector widths: the output one
// rounding from fp64's, the gradients (from a 16-bit dy as it comes) within fp32's error.
TEST(LayerNorm, EveryKernelMatchesFp64) {
  using Forward = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                           const at::Tensor&, const at::Tensor&, const at::Tensor&);
  using Backward =
      void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
               const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
  std::vector<std::tuple<std::string, Forward, Backward>> runnable;
#ifdef MIXPREC_HAVE_X86_KERNELS
  namespace kernels = mixprec::models::kernels;
  runnable = mixprec::testing::kernel_builds<Forward, Backward>(
      {kernels::avx512::layer_norm_forward, kernels::avx512::layer_norm_backward},
      {kernels::avx2::layer_norm_forward, kernels::avx2::layer_norm_backward});
#endif
  if (runnable.empty()) GTEST_SKIP() << "no kernel of mixprec's for this CPU: LibTorch's runs";
  torch::manual_seed(0);
  for (const auto& [name, forward, backward] : runnable)
    for (int64_t C : {1, 7, 16, 33, 130})
      for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
        const int64_t rows = 37;
        const auto x = inputs(rows, C), w = 1 + torch::randn({C}), b = torch::randn({C});
        const auto dy = torch::randn({rows, C}).to(dtype);
        auto y = torch::empty({rows, C}, dtype), mean = torch::empty({rows}),
             rstd = torch::empty({rows});
        forward(x, w, b, kEps, y, mean, rstd);
        auto dx = torch::empty_like(x), dw = torch::empty({C}), db = torch::empty({C});
        backward(dy, x, mean, rstd, w, dx, dw, db);
        const auto ref = reference(x, w, b, dy);
        const std::string what =
            name + " " + std::string(c10::toString(dtype)) + " C=" + std::to_string(C);
        expect_output_close(y, ref.y, x, w, b, what + " forward");
        expect_close(mean, x.to(torch::kDouble).mean(-1), 1e-6, what + " mean");
        expect_dx_close(dx, ref.dx, rstd, dy, w, what);
        expect_close(dw, ref.dweight, 1e-4, what + " dweight");  // xhat's error, as dx's
        expect_close(db, ref.dbias, 1e-5, what + " dbias");
      }
}

// The op itself: as LibTorch's layer_norm and a cast, on a strided view, with its gradients
// through autograd, in every output dtype; fp64 (no kernel) takes LibTorch's path.
TEST(LayerNorm, MatchesLibTorchsLayerNormAndCast) {
  torch::manual_seed(1);
  const int64_t C = 48;
  const auto base = inputs(3 * 5, C).view({5, 3, C});
  for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    auto x = base.transpose(0, 1).requires_grad_();  // (3, 5, C), strided
    auto w = (1 + torch::randn({C})).requires_grad_(), b = torch::randn({C}).requires_grad_();
    const auto y = layer_norm(x, w, b, kEps, dtype);
    ASSERT_EQ(y.scalar_type(), dtype);
    ASSERT_EQ(y.sizes(), x.sizes());
    const auto dy = torch::randn(x.sizes()).to(dtype);
    y.backward(dy);
    const auto ref = reference(x.detach(), w.detach(), b.detach(), dy);
    const std::string what = c10::toString(dtype);
    expect_output_close(y, ref.y, x.detach(), w.detach(), b.detach(), what);
    expect_close(x.grad(), ref.dx, 1e-4, what + " dx");
    expect_close(w.grad(), ref.dweight, 1e-4, what + " dweight");
    expect_close(b.grad(), ref.dbias, 1e-5, what + " dbias");
  }
  // fp64, and fp32 without parameters: LibTorch's op, then the cast.
  const auto xd = inputs(4, C).to(torch::kDouble), wd = torch::randn({C}, torch::kDouble),
             bd = torch::randn({C}, torch::kDouble);
  EXPECT_TRUE(torch::equal(layer_norm(xd, wd, bd, kEps, torch::kFloat),
                           torch::layer_norm(xd, {C}, wd, bd, kEps).to(torch::kFloat)));
  const auto xf = xd.to(torch::kFloat);
  torch::Tensor plain;
  const auto ops =
      mixprec::testing::ops_run_by([&] { plain = layer_norm(xf, {}, {}, kEps, torch::kBFloat16); });
  EXPECT_EQ(std::count(ops.begin(), ops.end(), "mixprec::layer_norm"), 0);
  EXPECT_TRUE(torch::equal(plain, torch::layer_norm(xf, {C}, {}, {}, kEps).to(torch::kBFloat16)));
}

// On LibTorch's threads (rows enough for several chunks): the same fp64 checks, and the same
// bits on one thread and on two (each chunk of rows sums its weight and bias gradients apart,
// then the chunks add in order). A wide row (4096) runs under the bound of 64 chunks on the
// buffer (61 here, the last one short), where 16384 / C rows a chunk would make 258. Double
// backward is refused, not silently wrong.
TEST(LayerNorm, ParallelRowsMatchFp64AndOneThreadsBits) {
  torch::manual_seed(3);
  for (const auto& [rows, C] : {std::pair<int64_t, int64_t>{4099, 130}, {1030, 4096}}) {
    SCOPED_TRACE(C);
    const auto x = inputs(rows, C), w = 1 + torch::randn({C}), b = torch::randn({C});
    const auto dy = torch::randn({rows, C}).to(torch::kBFloat16);
    const auto ref = reference(x, w, b, dy);
    const int threads = at::get_num_threads();
    std::vector<std::vector<torch::Tensor>> results;
    for (int n : {1, 2}) {
      at::set_num_threads(n);
      auto xg = x.clone().requires_grad_(), wg = w.clone().requires_grad_(),
           bg = b.clone().requires_grad_();
      auto y = layer_norm(xg, wg, bg, kEps, torch::kBFloat16);
      y.backward(dy);
      results.push_back({y, xg.grad(), wg.grad(), bg.grad()});
    }
    at::set_num_threads(threads);
    const auto& r = results[1];
    expect_output_close(r[0], ref.y, x, w, b, "forward");
    expect_close(r[1], ref.dx, 1e-4, "dx");
    expect_close(r[2], ref.dweight, 1e-4, "dweight");
    expect_close(r[3], ref.dbias, 1e-5, "dbias");
    if (fused_runs()) {  // (LibTorch's own sums per thread)
      for (size_t i = 0; i < r.size(); ++i) EXPECT_TRUE(torch::equal(results[0][i], r[i])) << i;
    }
  }

  const auto x = inputs(4, 130), w = 1 + torch::randn({130}), b = torch::randn({130});
  auto xg = x.clone().requires_grad_();
  const auto y = layer_norm(xg, w, b, kEps, torch::kBFloat16);
  const auto grads = [&] {
    return torch::autograd::grad({y}, {xg}, {torch::ones_like(y)}, /*retain_graph=*/true,
                                 /*create_graph=*/true);
  };
  if (fused_runs()) {
    EXPECT_THROW(grads(), c10::Error);
  }
}

// GPT-2's blocks normalize into the autocast dtype through it (ln_f, whose output the model
// returns, keeps LibTorch's fp32 op); without autocast, LibTorch's op everywhere.
TEST(LayerNorm, Gpt2BlocksTakeItUnderAutocast) {
  torch::manual_seed(2);
  mixprec::models::GPT2LMHeadModel model(models_test::tiny_gpt2_config());
  const auto ids = torch::randint(0, 256, {2, 16}, torch::kLong);
  auto ops_of = [&](std::optional<torch::ScalarType> autocast) {
    return mixprec::testing::ops_run_by([&] {
      std::optional<mixprec::amp::Autocast> guard;
      if (autocast) guard.emplace(torch::kCPU, *autocast);
      const auto out = model->forward(ids, ids);
      guard.reset();
      out.loss.backward();
    });
  };
  const bool kernel = fused_runs();
#ifdef MIXPREC_HAVE_X86_KERNELS
  const std::string capability = at::get_cpu_capability();
  EXPECT_EQ(kernel, capability == "AVX512" || capability == "AVX2");
#endif
  for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
    const auto ops = ops_of(dtype);
    EXPECT_EQ(std::count(ops.begin(), ops.end(), "mixprec::layer_norm"), kernel ? 4 : 0);
    EXPECT_EQ(std::count(ops.begin(), ops.end(), "mixprec::layer_norm_backward"), kernel ? 4 : 0);
  }
  const auto fp32 = ops_of(std::nullopt);
  EXPECT_EQ(std::count(fp32.begin(), fp32.end(), "mixprec::layer_norm"), 0);
}

}  // namespace
