// The fp16 CPU fast path: each covered op, forward and backward, against an fp64
// reference computed from the same fp16 inputs and rounded to fp16.
#include "mixprec/amp/fp16_cpu.h"
#include "mixprec/amp/autocast.h"
#include "mixprec/optim/adamw.h"

#include <ATen/ops/addbmm_cpu_dispatch.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "kernels/onednn_linear.h"
#include "test_util.h"

namespace {

using mixprec::amp::Fp16CpuPath;

// fp32 accumulation of k products adds at most k * 2^-24 * sum|a_i b_i|
// (|ab| the same sum with absolute values, computed in fp64); rounding to fp16
// adds half an ulp, 2^-11 |x|, and the reference's own rounding as much again.
// So |ours - ref16| <= 2^-10 |ref| + k * 2^-24 * |a||b| + fp16's smallest
// subnormal (2^-24) for results near zero.
void expect_within_fp16_bound(const at::Tensor& ours, const at::Tensor& ref64,
                              const at::Tensor& abs_products64, int64_t k, const char* what) {
  ASSERT_EQ(ours.scalar_type(), at::kHalf) << what;
  const auto ref16 = ref64.to(at::kHalf).to(at::kDouble);
  const auto bound = ref64.abs() * std::ldexp(1.0, -10) +
                     abs_products64 * (static_cast<double>(k) * std::ldexp(1.0, -24)) +
                     std::ldexp(1.0, -24);
  const auto excess = (ours.to(at::kDouble) - ref16).abs() - bound;
  EXPECT_LE(excess.max().item<double>(), 0.0) << what;
}

at::Tensor half_randn(at::IntArrayRef shape) { return torch::randn(shape).to(at::kHalf); }
at::Tensor d(const at::Tensor& t) { return t.to(at::kDouble); }

class Fp16CpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(0);
    mixprec::amp::set_fp16_cpu_path(Fp16CpuPath::kAlways);
  }
  void TearDown() override { mixprec::amp::set_fp16_cpu_path(Fp16CpuPath::kAuto); }
  // Runs f and returns how many fast-path calls it made.
  int64_t calls(const std::function<void()>& f) {
    const int64_t before = mixprec::amp::fp16_cpu_fast_path_calls();
    f();
    return mixprec::amp::fp16_cpu_fast_path_calls() - before;
  }
};

TEST_F(Fp16CpuTest, MatmulsMatchFp64ReferenceRoundedToFp16) {
  const int64_t k = 96;
  auto a = half_randn({33, k}), b = half_randn({k, 17}), c = half_randn({33, 17});
  auto ba = half_randn({4, 9, k}), bb = half_randn({4, k, 5}), bc = half_randn({4, 9, 5});
  auto bias = half_randn({17}), a_t = half_randn({k, 33}).t();  // column-major
  at::Tensor mm, mm_t, addmm, addmm_bias, bmm, baddbmm;
  EXPECT_EQ(calls([&] {
              mm = at::mm(a, b);
              mm_t = at::mm(a_t, b);
              addmm = at::addmm(c, a, b, 0.5, 2.0);
              addmm_bias = at::addmm(bias, a, b);  // a linear layer's
              bmm = at::bmm(ba, bb);
              baddbmm = at::baddbmm(bc, ba, bb, 0.5, 2.0);
            }),
            6);
  expect_within_fp16_bound(mm, d(a).mm(d(b)), d(a).abs().mm(d(b).abs()), k, "mm");
  expect_within_fp16_bound(mm_t, d(a_t).mm(d(b)), d(a_t).abs().mm(d(b).abs()), k,
                           "mm, a transposed");
  expect_within_fp16_bound(addmm_bias, d(bias) + d(a).mm(d(b)),
                           d(bias).abs() + d(a).abs().mm(d(b).abs()), k + 1, "addmm with a bias");
  expect_within_fp16_bound(addmm, 0.5 * d(c) + 2.0 * d(a).mm(d(b)),
                           0.5 * d(c).abs() + 2.0 * d(a).abs().mm(d(b).abs()), k + 1, "addmm");
  expect_within_fp16_bound(bmm, d(ba).bmm(d(bb)), d(ba).abs().bmm(d(bb).abs()), k, "bmm");
  expect_within_fp16_bound(baddbmm, 0.5 * d(bc) + 2.0 * d(ba).bmm(d(bb)),
                           0.5 * d(bc).abs() + 2.0 * d(ba).abs().bmm(d(bb).abs()), k + 1,
                           "baddbmm");
}

// mm, and a linear layer's addmm (bias (N), beta = alpha = 1), with a row-major first operand
// compute their fp32 product with oneDNN's linear where LibTorch has it (as models::linear
// does); mm with a transposed operand (a weight gradient's) with oneDNN's matmul where it takes
// fp32; other forms with LibTorch's fp32 GEMM (MKL).
TEST_F(Fp16CpuTest, Fp32ProductsTakeOnednnWhereItRuns) {
  auto a = half_randn({33, 64}), b = half_randn({64, 17}), bias = half_randn({17});
  auto calls_of = [](const char* op, const std::function<void()>& f) {
    const auto ops = mixprec::testing::ops_run_by(f);
    return std::count(ops.begin(), ops.end(), op);
  };
  auto linear_calls = [&](const std::function<void()>& f) {
    return calls_of("mkldnn::_linear_pointwise", f);
  };
  auto matmul_calls = [&](const std::function<void()>& f) {
    return calls_of("mixprec::onednn_mm", f);
  };
  const int64_t onednn = at::hasMKLDNN() ? 1 : 0;
  const auto square = torch::randn({2, 2});  // whether it runs here: tests/models/linear_test.cpp
  const int64_t matmul = mixprec::kernels::onednn_mm_takes(square.t(), square) ? 1 : 0;
  at::mm(a, b);  // the first one probes oneDNN, with a call of its own
  EXPECT_EQ(linear_calls([&] { at::mm(a, b); }), onednn);
  EXPECT_EQ(linear_calls([&] { at::addmm(bias, a, b); }), onednn);
  const auto column_major = a.t().contiguous().t();
  EXPECT_EQ(linear_calls([&] { at::mm(column_major, b); }), 0);
  EXPECT_EQ(matmul_calls([&] { at::mm(column_major, b); }), matmul);
  EXPECT_EQ(matmul_calls([&] { at::mm(column_major, b.t().contiguous().t()); }), matmul);
  EXPECT_EQ(linear_calls([&] { at::addmm(bias, a, b, 0.5, 2.0); }), 0);
  EXPECT_EQ(linear_calls([&] { at::addmm(half_randn({33, 17}), a, b); }), 0);
}

// Matrix-vector and vector-vector products: what matmul does with 1-D operands.
TEST_F(Fp16CpuTest, MatrixVectorAndDotMatchFp64ReferenceRoundedToFp16) {
  const int64_t k = 200;
  auto m = half_randn({31, k}), v = half_randn({k}), c = half_randn({31}), w = half_randn({k});
  at::Tensor mv, addmv, dot, vdot, matmul_mv, matmul_dot;
  EXPECT_EQ(calls([&] {
              mv = at::mv(m, v);
              addmv = at::addmv(c, m, v, 0.5, 2.0);
              dot = at::dot(v, w);
              vdot = at::vdot(v, w);
              matmul_mv = at::matmul(m, v);
              matmul_dot = at::matmul(v, w);
            }),
            6);
  expect_within_fp16_bound(mv, d(m).mv(d(v)), d(m).abs().mv(d(v).abs()), k, "mv");
  expect_within_fp16_bound(addmv, 0.5 * d(c) + 2.0 * d(m).mv(d(v)),
                           0.5 * d(c).abs() + 2.0 * d(m).abs().mv(d(v).abs()), k + 1, "addmv");
  expect_within_fp16_bound(dot, d(v).dot(d(w)), d(v).abs().dot(d(w).abs()), k, "dot");
  expect_within_fp16_bound(vdot, d(v).dot(d(w)), d(v).abs().dot(d(w).abs()), k, "vdot");
  EXPECT_TRUE(torch::equal(matmul_mv, mv));
  EXPECT_TRUE(torch::equal(matmul_dot, dot));
}

// linear and matmul decompose into the covered ops, forward and backward.
TEST_F(Fp16CpuTest, LinearForwardAndBackward) {
  const int64_t in = 64, out = 24, batch = 10;
  auto x = half_randn({batch, in}).requires_grad_();
  auto w = half_randn({out, in}).requires_grad_();
  auto bias = half_randn({out}).requires_grad_();
  auto g = half_randn({batch, out});
  at::Tensor y;
  EXPECT_GE(calls([&] {
              y = torch::nn::functional::linear(x, w, bias);
              y.backward(g);
            }),
            3);  // forward, grad of x, grad of w
  auto xd = d(x.detach()), wd = d(w.detach()), gd = d(g);
  expect_within_fp16_bound(y.detach(), xd.mm(wd.t()) + d(bias.detach()),
                           xd.abs().mm(wd.abs().t()) + d(bias.detach()).abs(), in + 1, "linear");
  expect_within_fp16_bound(x.grad(), gd.mm(wd), gd.abs().mm(wd.abs()), out, "linear grad x");
  expect_within_fp16_bound(w.grad(), gd.t().mm(xd), gd.abs().t().mm(xd.abs()), batch,
                           "linear grad w");
}

TEST_F(Fp16CpuTest, Conv2dForwardAndBackward) {
  namespace F = torch::nn::functional;
  auto x = half_randn({2, 3, 9, 9}).requires_grad_();
  auto w = half_randn({5, 3, 3, 3}).requires_grad_();
  auto conv = F::Conv2dFuncOptions().padding(1);
  at::Tensor y;
  EXPECT_EQ(calls([&] { y = F::conv2d(x, w, conv); }), 1);
  auto xd = d(x.detach()), wd = d(w.detach());
  const int64_t k = 3 * 3 * 3;
  expect_within_fp16_bound(y.detach(), F::conv2d(xd, wd, conv), F::conv2d(xd.abs(), wd.abs(), conv),
                           k, "conv2d");
  auto g = half_randn(y.sizes());
  EXPECT_EQ(calls([&] { y.backward(g); }), 1);
  auto xr = xd.clone().requires_grad_(), wr = wd.clone().requires_grad_();
  F::conv2d(xr, wr, conv).backward(d(g));
  auto xa = xd.abs().requires_grad_(), wa = wd.abs().requires_grad_();
  F::conv2d(xa, wa, conv).backward(d(g).abs());
  expect_within_fp16_bound(x.grad(), xr.grad(), xa.grad(), 5 * 9, "conv2d grad x");
  expect_within_fp16_bound(w.grad(), wr.grad(), wa.grad(), 2 * 81, "conv2d grad w");
}

TEST_F(Fp16CpuTest, Conv1dUnderAutocast) {
  namespace F = torch::nn::functional;
  auto x = torch::randn({2, 4, 16});
  auto w = torch::randn({6, 4, 5}, torch::requires_grad());
  at::Tensor y;
  EXPECT_GE(calls([&] {
              mixprec::amp::Autocast autocast(torch::kCPU, torch::kHalf);
              y = F::conv1d(x, w);
            }),
            1);
  ASSERT_EQ(y.scalar_type(), at::kHalf);
  auto x16 = d(x.to(at::kHalf)), w16 = d(w.detach().to(at::kHalf));
  expect_within_fp16_bound(y.detach(), F::conv1d(x16, w16), F::conv1d(x16.abs(), w16.abs()), 4 * 5,
                           "conv1d");
  y.sum().backward();
  EXPECT_EQ(w.grad().scalar_type(), at::kFloat);  // fp32 master weights get fp32 grads
}

// LibTorch's fp16 flash kernel takes fp16 and fp32 masks only; up-cast, a bool mask would be
// added as 0/1 and mask nothing. The fast path leaves the others to LibTorch's error.
TEST_F(Fp16CpuTest, FlashAttentionTakesTheMasksLibTorchTakes) {
  const auto q = half_randn({1, 2, 4, 8});
  for (const auto mask_dtype : {at::kBool, at::kBFloat16}) {
    const auto mask = torch::ones({4, 4}).to(mask_dtype);
    const std::string error = mixprec::testing::error_of(
        [&] { at::_scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0, false, mask); });
    EXPECT_NE(error.find("Attention mask is the same data type as query"), std::string::npos)
        << error;
  }
  const auto mask = torch::zeros({4, 4});
  mask[0].fill_(-INFINITY).index_put_({0}, 0.0f);  // query 0 sees key 0 only
  at::Tensor out;
  EXPECT_EQ(calls([&] {
              out = std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(
                  q, q, q, 0.0, false, mask.to(at::kHalf)));
            }),
            1);
  EXPECT_TRUE(torch::allclose(out[0][0][0].to(at::kFloat), q[0][0][0].to(at::kFloat)));
}

TEST_F(Fp16CpuTest, ScaledDotProductAttentionForwardAndBackward) {
  auto q = half_randn({2, 3, 16, 8}).requires_grad_();
  auto k = half_randn({2, 3, 16, 8}).requires_grad_();
  auto v = half_randn({2, 3, 16, 8}).requires_grad_();
  at::Tensor out;
  EXPECT_EQ(
      calls([&] { out = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true); }),
      1);
  auto qd = d(q.detach()).requires_grad_(), kd = d(k.detach()).requires_grad_(),
       vd = d(v.detach()).requires_grad_();
  auto ref = at::scaled_dot_product_attention(qd, kd, vd, {}, 0.0, true);
  // Softmax and its exp run in fp32 inside the kernel: allow fp32's error on
  // top of the rounding (outputs are averages of |v| <= ~4).
  auto abs_v =
      at::scaled_dot_product_attention(qd.detach(), kd.detach(), vd.detach().abs(), {}, 0.0, true);
  expect_within_fp16_bound(out.detach(), ref.detach(), abs_v * 64, 16, "sdpa");
  auto g = half_randn(out.sizes());
  EXPECT_EQ(calls([&] { out.backward(g); }), 1);
  ref.backward(d(g));
  for (auto [ours, theirs, name] :
       {std::tuple{q.grad(), qd.grad(), "q"}, std::tuple{k.grad(), kd.grad(), "k"},
        std::tuple{v.grad(), vd.grad(), "v"}}) {
    ASSERT_EQ(ours.scalar_type(), at::kHalf) << name;
    // Gradients go through the softmax's derivative: compare to fp16 resolution
    // of the largest gradient, plus fp32 softmax error.
    const double scale = theirs.abs().max().item<double>();
    EXPECT_LE((d(ours) - theirs).abs().max().item<double>(), scale * std::ldexp(1.0, -9)) << name;
  }
}

// The fast path keeps the fp32 copies of its last up-casts for a matmul backward's second use
// of its gradient. A copy may serve only the same elements at the same version: a transposed
// view of them, but not after an in-place change, not another tensor at a reused address, not
// other elements of the same storage.
TEST_F(Fp16CpuTest, UpcastCopiesNeverServeStaleValues) {
  auto fast = [](const at::Tensor& x, const at::Tensor& y) {
    return at::cpu::mm(x.to(at::kFloat), y.to(at::kFloat)).to(at::kHalf);
  };
  auto w = half_randn({24, 16}), v = half_randn({40, 8});
  auto g = half_randn({40, 24});
  EXPECT_TRUE(torch::equal(at::mm(g, w), fast(g, w)));
  EXPECT_TRUE(torch::equal(at::mm(g.t(), v), fast(g.t(), v))) << "transposed view";
  at::mm(g, w);
  g.mul_(-2);
  EXPECT_TRUE(torch::equal(at::mm(g, w), fast(g, w))) << "changed in place";
  at::mm(g, w);
  g.detach().add_(1);
  EXPECT_TRUE(torch::equal(at::mm(g, w), fast(g, w))) << "changed through a detached view";
  for (int i = 0; i < 3; ++i) {  // freed and allocated again, likely at the same address
    auto a = half_randn({40, 24});
    EXPECT_TRUE(torch::equal(at::mm(a, w), fast(a, w))) << "new tensor " << i;
  }
  auto big = half_randn({80, 24});
  at::mm(big.narrow(0, 0, 40), w);
  EXPECT_TRUE(torch::equal(at::mm(big.narrow(0, 40, 40), w), fast(big.narrow(0, 40, 40), w)))
      << "other rows";
  EXPECT_TRUE(torch::equal(at::mm(big.narrow(0, 0, 20), w), fast(big.narrow(0, 0, 20), w)))
      << "fewer rows at the same offset";
}

TEST_F(Fp16CpuTest, UpcastCopiesSeeAFusedAdamWStep) {
  auto w = half_randn({24, 16}).requires_grad_();
  auto x = half_randn({40, 24});
  mixprec::optim::AdamW optimizer({w}, mixprec::optim::AdamWOptions(0.1).fused(true));
  const auto before = at::mm(x, w).detach();  // leaves fp32 copies of x and w behind
  w.mutable_grad() = torch::ones_like(w);
  optimizer.step();
  at::NoGradGuard no_grad;
  const auto after = at::mm(x, w);
  EXPECT_TRUE(torch::equal(after, at::cpu::mm(x.to(at::kFloat), w.to(at::kFloat)).to(at::kHalf)));
  EXPECT_FALSE(torch::equal(after, before));
}

TEST_F(Fp16CpuTest, OtherDtypesAreUntouched) {
  auto a = torch::randn({32, 48}), b = torch::randn({48, 16});
  at::Tensor f32, bf16;
  EXPECT_EQ(calls([&] {
              f32 = at::mm(a, b);
              bf16 = at::mm(a.to(at::kBFloat16), b.to(at::kBFloat16));
            }),
            0);
  EXPECT_TRUE(torch::equal(f32, at::cpu::mm(a, b)));
  EXPECT_TRUE(torch::equal(bf16, at::cpu::mm(a.to(at::kBFloat16), b.to(at::kBFloat16))));
}

TEST_F(Fp16CpuTest, NeverUsesLibTorchsFp16Kernels) {
  auto a = half_randn({8, 40}), b = half_randn({40, 8});
  mixprec::amp::set_fp16_cpu_path(Fp16CpuPath::kNever);
  EXPECT_FALSE(mixprec::amp::fp16_cpu_fast_path_active());
  at::Tensor libtorch;
  EXPECT_EQ(calls([&] { libtorch = at::mm(a, b); }), 0);
  EXPECT_TRUE(torch::equal(libtorch, at::cpu::mm(a, b)));
  mixprec::amp::set_fp16_cpu_path(Fp16CpuPath::kAlways);
  EXPECT_TRUE(mixprec::amp::fp16_cpu_fast_path_active());
  // Both accumulate in fp32: they may differ by the order of summation only.
  expect_within_fp16_bound(at::mm(a, b), d(a).mm(d(b)), d(a).abs().mm(d(b).abs()), 40, "mm");
}

// Collects the text of every warning raised on this thread while alive.
class CapturedWarnings : public c10::WarningHandler {
 public:
  CapturedWarnings() : guard_(this) {}
  void process(const c10::Warning& warning) override { messages_.push_back(warning.msg()); }
  // How many warnings name `aten::<op> ` (the op, not a longer name).
  int64_t naming(const std::string& op) const {
    return std::count_if(messages_.begin(), messages_.end(), [&](const std::string& m) {
      return m.find("aten::" + op + " has no mixprec fast path") != std::string::npos;
    });
  }

 private:
  std::vector<std::string> messages_;
  c10::WarningUtils::WarningHandlerGuard guard_;
};

// Ops the fast path does not cover keep LibTorch's fp16 kernels, bit for bit
// (no fp32 computation in disguise), and say so once per op while the fast
// path is on. The warned-once flags live for the process: each test runs in a
// process of its own (gtest_discover_tests).
TEST_F(Fp16CpuTest, UncoveredOpsWarnOnceAndRunLibTorchsKernel) {
  auto self = half_randn({6, 5}), b1 = half_randn({3, 6, 7}), b2 = half_randn({3, 7, 5});
  auto a = half_randn({6, 7}), b = half_randn({7, 5});
  CapturedWarnings warnings;

  // Off: LibTorch's fp16 kernels are what the user asked for; nothing to say.
  mixprec::amp::set_fp16_cpu_path(Fp16CpuPath::kNever);
  at::addbmm(self, b1, b2);
  EXPECT_EQ(warnings.naming("addbmm"), 0);
  mixprec::amp::set_fp16_cpu_path(Fp16CpuPath::kAlways);

  // Other dtypes: no warning either.
  at::addbmm(self.to(at::kFloat), b1.to(at::kFloat), b2.to(at::kFloat));
  EXPECT_EQ(warnings.naming("addbmm"), 0);

  const auto libtorch_addbmm = at::cpu::addbmm(self, b1, b2, 0.5, 2.0);
  const auto libtorch_addmm = at::cpu::addmm(self, a, b, 0.5, 2.0);
  const auto libtorch_mm = at::cpu::mm(a, b);
  for (int repeat = 0; repeat < 3; ++repeat) {
    at::Tensor addbmm, inplace = self.clone(), out = at::empty({0}, at::kHalf);
    EXPECT_EQ(calls([&] {
                addbmm = at::addbmm(self, b1, b2, 0.5, 2.0);
                inplace.addmm_(a, b, 0.5, 2.0);
                at::mm_out(out, a, b);
              }),
              0)
        << "an uncovered op took the fast path";
    ASSERT_EQ(addbmm.scalar_type(), at::kHalf);
    EXPECT_TRUE(torch::equal(addbmm, libtorch_addbmm));
    EXPECT_TRUE(torch::equal(inplace, libtorch_addmm));
    EXPECT_TRUE(torch::equal(out, libtorch_mm));
  }
  EXPECT_EQ(warnings.naming("addbmm"), 1);
  EXPECT_EQ(warnings.naming("addmm_"), 1);  // also what LibTorch's addbmm runs inside
  EXPECT_EQ(warnings.naming("mm.out"), 1);
  EXPECT_EQ(warnings.naming("bmm.out"), 0);  // not called
}

// Each test runs in a process of its own (gtest_discover_tests), so this one
// sees the first installation.
TEST(Fp16CpuInstall, OverrideWarningIsNotShownAndAutoFollowsTheCpu) {
  testing::internal::CaptureStderr();
  mixprec::amp::set_fp16_cpu_path(Fp16CpuPath::kAlways);
  const std::string printed = testing::internal::GetCapturedStderr();
  EXPECT_EQ(printed.find("Overriding"), std::string::npos) << printed;
  EXPECT_TRUE(mixprec::amp::fp16_cpu_fast_path_active());
  mixprec::amp::set_fp16_cpu_path(Fp16CpuPath::kAuto);
  EXPECT_EQ(mixprec::amp::fp16_cpu_fast_path_active(), !mixprec::amp::cpu_has_native_fp16());
}

}  // namespace
