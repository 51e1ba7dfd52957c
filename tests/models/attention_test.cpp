#include "mixprec/models/attention.h"

#include "mixprec/amp/autocast.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>

#include "kernels/isa.h"
#include "models/kernel_builds.h"
#include "models/kernels/attention_softmax.h"
#include "test_util.h"

namespace {

using mixprec::models::AttentionKernel;
using mixprec::models::scaled_dot_product_attention;

// (B, heads, T, head dim) = (2, 2, T, D) views of (B, T, heads, head dim) tensors, as a
// model's attention gets them.
torch::Tensor heads(int64_t T, torch::ScalarType dtype, int64_t D = 16) {
  return torch::randn({2, T, 2, D}).to(dtype).transpose(1, 2);
}

// Query, key and value; the value's head dim Dv.
std::vector<torch::Tensor> qkv(int64_t T, torch::ScalarType dtype, int64_t Tk = -1,
                               int64_t Dv = 16) {
  if (Tk < 0) Tk = T;
  return {heads(T, dtype), heads(Tk, dtype), heads(Tk, dtype, Dv)};
}

bool same(const torch::Tensor& a, const torch::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && torch::equal(a, b);
}

bool kernels_built() { return mixprec::kernels::cpu_isa() != mixprec::kernels::Isa::kNone; }

// Norm-wise relative errors of the output and of the three input gradients (for a fixed random
// output gradient) against fp64 LibTorch.
std::vector<double> errors(const std::vector<torch::Tensor>& inputs, bool causal,
                           AttentionKernel kernel) {
  auto run = [&](torch::ScalarType dtype, bool reference) {
    std::vector<torch::Tensor> in;
    for (const auto& t : inputs) in.push_back(t.to(dtype).detach().requires_grad_());
    auto out = reference ? at::scaled_dot_product_attention(in[0], in[1], in[2], {}, 0.0, causal)
                         : scaled_dot_product_attention(in[0], in[1], in[2], 0.0, causal, kernel);
    EXPECT_EQ(out.scalar_type(), dtype);
    torch::manual_seed(1);
    out.backward(heads(out.size(2), dtype, out.size(3)));  // strided, as a model's
    std::vector<torch::Tensor> r{out.to(torch::kDouble)};
    for (const auto& t : in) r.push_back(t.grad().to(torch::kDouble));
    return r;
  };
  const auto exact = run(torch::kDouble, true);
  const auto got = run(inputs[0].scalar_type(), false);
  std::vector<double> e;
  for (size_t i = 0; i < exact.size(); ++i)
    e.push_back(((got[i] - exact[i]).norm() / exact[i].norm()).item<double>());
  return e;
}

TEST(Attention, Fp32FlashRoundsTheExactResultOnceAndGradientsFlow) {
  torch::manual_seed(0);
  for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
    auto in = qkv(64, dtype);
    for (auto& t : in) t.requires_grad_();
    auto out = scaled_dot_product_attention(in[0], in[1], in[2], 0.0, /*is_causal=*/true,
                                            AttentionKernel::kFlashFp32);
    auto exact =
        at::scaled_dot_product_attention(in[0].to(torch::kDouble), in[1].to(torch::kDouble),
                                         in[2].to(torch::kDouble), {}, 0.0, true);
    ASSERT_EQ(out.scalar_type(), dtype);
    // Within one rounding of the 16-bit result (plus fp32's own error, far below it).
    const double ulp = dtype == torch::kBFloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
    auto err = ((out.to(torch::kDouble) - exact).abs() / exact.abs().clamp_min(1e-3)).max();
    EXPECT_LE(err.item<double>(), ulp) << dtype;
    out.sum().backward();
    for (const auto& t : in) {
      ASSERT_TRUE(t.grad().defined());
      EXPECT_EQ(t.grad().scalar_type(), dtype);
      EXPECT_TRUE(t.grad().isfinite().all().item<bool>());
    }
  }
}

// The matmul kernel against fp64, output and gradients, causal or not, as many keys as queries,
// more or fewer (causal: PyTorch's top-left alignment), lengths that are no multiple of a
// vector or of brgemm's 32-row blocks, odd ones (no VNNI pairs: bf16 keys take LibTorch's
// GEMMs, queries pad a pair), a value head dim other than the query's: as accurate as
// LibTorch's flash kernel in the same dtype (fp32 or bf16), and within fp32's accuracy for fp16
// inputs, which it computes in fp32.
TEST(Attention, MatmulKernelIsAsAccurateAsFlash) {
  if (!kernels_built()) GTEST_SKIP() << "no AVX2/AVX-512 kernels on this CPU";
  torch::manual_seed(0);
  for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf})
    for (bool causal : {true, false})
      for (auto [T, Tk, Dv] : {std::tuple<int64_t, int64_t, int64_t>{37, 37, 16},
                               {64, 64, 16},
                               {23, 70, 16},
                               {33, 66, 8},
                               {70, 40, 24},
                               {600, 600, 16},
                               {300, 1100, 16}}) {
        auto in = qkv(T, dtype, Tk, Dv);
        for (auto& t : in) t.mul_(2);  // scores of a few units: a peaked softmax
        const auto matmul = errors(in, causal, AttentionKernel::kMatmul);
        const auto flash =
            errors(in, causal,
                   dtype == torch::kHalf ? AttentionKernel::kFlashFp32 : AttentionKernel::kFlash);
        for (size_t i = 0; i < matmul.size(); ++i) {
          SCOPED_TRACE(::testing::Message() << dtype << " causal " << causal << " T " << T << " Tk "
                                            << Tk << " Dv " << Dv << " tensor " << i);
          // bf16: its output rounds the normalized probabilities where flash rounds exp(s - max),
          // whose largest entry is exactly 1 (up to 1.3x the error here), and its backward reads
          // them rounded where flash recomputes them in fp32 (up to 1.75x, in the gradients of
          // q and k with Dv 8 and 24; both about one bf16 rounding).
          // fp16 in and out: one fp16 rounding of output and gradients, as kFlashFp32.
          const double factor = i == 0 ? 1.5 : dtype == torch::kBFloat16 ? 2.0 : 1.25;
          const double bound = dtype == torch::kFloat ? 1e-5 : factor * flash[i] + 1e-6;
          EXPECT_LE(matmul[i], bound) << "flash: " << flash[i];
        }
      }
}

// The softmax kernels of every build this CPU runs (the AVX2 one on an AVX-512 CPU too, which
// the model never calls there), on rows that keep 1 to 37 columns (every tail length), into
// each dtype, and in place for fp32 as the kernel calls them: within one rounding of fp64.
TEST(Attention, SoftmaxKernelsOfEveryBuildMatchFp64) {
  namespace kernels = mixprec::models::kernels;
  using Forward = void (*)(const at::Tensor&, int64_t, bool, float, const at::Tensor&);
  using Backward =
      void (*)(const at::Tensor&, const at::Tensor&, int64_t, bool, float, const at::Tensor&);
  std::vector<std::tuple<std::string, Forward, Backward>> builds;
#ifdef MIXPREC_HAVE_X86_KERNELS
  builds = mixprec::testing::kernel_builds<Forward, Backward>(
      {kernels::avx512::attention_softmax_forward, kernels::avx512::attention_softmax_backward},
      {kernels::avx2::attention_softmax_forward, kernels::avx2::attention_softmax_backward});
#endif
  if (builds.empty()) GTEST_SKIP() << "no AVX2/AVX-512 kernels on this CPU";
  torch::manual_seed(3);
  const int64_t L = 37;
  const float scale = 0.5f;
  for (const auto& [name, forward, backward] : builds)
    for (bool causal : {true, false})
      for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf})
        for (bool in_place : {false, true}) {
          if (in_place && dtype != torch::kFloat) continue;
          SCOPED_TRACE(::testing::Message() << name << " causal " << causal << " " << dtype
                                            << (in_place ? " in place" : ""));
          const auto scores = torch::randn({2, L, L}) * 4;
          const auto keep =
              causal ? torch::ones({L, L}, torch::kBool).tril() : torch::ones({L, L}, torch::kBool);
          const auto want = (scores.to(torch::kDouble) * scale)
                                .masked_fill(keep.logical_not(), -INFINITY)
                                .softmax(-1);
          auto s = scores.clone();
          const auto probs = in_place ? s : torch::empty({2, L, L}, dtype);
          forward(s, L, causal, scale, probs);
          const double ulp = dtype == torch::kFloat      ? 1e-6
                             : dtype == torch::kBFloat16 ? std::ldexp(1.0, -8)
                                                         : std::ldexp(1.0, -11);
          EXPECT_LE((probs.to(torch::kDouble) - want).abs().max().item<double>(), ulp);
          EXPECT_TRUE(probs.masked_select(keep.logical_not()).eq(0).all().item<bool>());
          // The backward from these probabilities, as rounded.
          const auto grad = torch::randn({2, L, L});
          const auto p = probs.to(torch::kDouble), g = grad.to(torch::kDouble);
          const auto want_grad = scale * p * (g - (p * g).sum(-1, true));
          auto g_in = grad.clone();
          const auto grad_scores = in_place ? g_in : torch::empty({2, L, L}, dtype);
          backward(probs, g_in, L, causal, scale, grad_scores);
          const double bound = ulp * want_grad.abs().max().item<double>() + 1e-6;
          EXPECT_LE((grad_scores.to(torch::kDouble) - want_grad).abs().max().item<double>(), bound);
          EXPECT_TRUE(grad_scores.masked_select(keep.logical_not()).eq(0).all().item<bool>());
        }
}

// The bf16 brgemm kernels of every build this CPU runs (the AVX2 one too, which the model never
// calls on an AVX-512 CPU), called directly: probabilities, output and the three gradients
// against fp64, causal or not, an odd number of queries, fewer keys than queries or keys no
// query sees (causal), another head dim and a value head dim other than the query's, within
// about two bf16 roundings norm-wise.
TEST(Attention, Bf16BrgemmKernelsOfEveryBuildMatchFp64) {
  namespace kernels = mixprec::models::kernels;
  using Forward = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool, float,
                           const at::Tensor&, const at::Tensor&);
  using Backward = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, bool, float, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&);
  std::vector<std::tuple<std::string, Forward, Backward>> builds;
#ifdef MIXPREC_HAVE_X86_KERNELS
  builds = mixprec::testing::kernel_builds<Forward, Backward>(
      {kernels::avx512::attention_bf16_forward, kernels::avx512::attention_bf16_backward},
      {kernels::avx2::attention_bf16_forward, kernels::avx2::attention_bf16_backward});
#endif
  if (builds.empty() || !kernels::bf16_brgemm_runs())
    GTEST_SKIP() << "no AVX2/AVX-512 kernels or no bf16 brgemm on this CPU";
  torch::manual_seed(4);
  const double tolerance = std::ldexp(1.0, -7);
  for (const auto& [name, forward, backward] : builds)
    for (bool causal : {true, false})
      for (bool strided : {false, true})
        for (auto [Lq, Lk, D, Dv] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{65, 96, 16, 16},
                                     {96, 40, 24, 8},
                                     {33, 96, 16, 16}}) {
          SCOPED_TRACE(::testing::Message()
                       << name << " causal " << causal << " strided " << strided << " Lq " << Lq
                       << " Lk " << Lk << " D " << D);
          // Strided: columns [1, 1 + cols) of rows cols + 6 wide (rows at odd element offsets:
          // no 4-byte alignment), the rest of the row NaN.
          const auto make = [&](int64_t rows, int64_t cols, double fill) {
            auto t =
                torch::full({3, rows, strided ? cols + 6 : cols}, std::nan(""), torch::kBFloat16);
            auto view = strided ? t.narrow(2, 1, cols) : t;
            if (!std::isnan(fill)) view.copy_(torch::randn({3, rows, cols}) * fill);
            return view;
          };
          const auto q = make(Lq, D, 1), k = make(Lk, D, 1), v = make(Lk, Dv, 1);
          const auto grad = make(Lq, Dv, 1);
          const float scale = 0.25f;
          // NaN where a kernel leaves something unwritten.
          const auto unwritten = [&](const torch::Tensor& like) {
            return make(like.size(1), like.size(2), std::nan(""));
          };
          auto probs = torch::full({3, Lq, Lk}, std::nan(""), torch::kBFloat16);
          auto out = unwritten(grad);
          forward(q, k, v, causal, scale, probs, out);
          std::vector<torch::Tensor> got{probs, out, unwritten(q), unwritten(k), unwritten(v)};
          backward(q, k, v, probs, grad, causal, scale, got[2], got[3], got[4]);
          // Nothing written outside the views.
          for (size_t i = 1; i < got.size(); ++i) {
            const auto base = got[i].as_strided({3, got[i].size(1), got[i].stride(1)},
                                                {got[i].stride(0), got[i].stride(1), 1}, 0);
            EXPECT_EQ(base.isnan().sum().item<int64_t>(), (base.numel() - got[i].numel()))
                << "tensor " << i;
          }

          std::vector<torch::Tensor> in;
          for (const auto& t : {q, k, v}) in.push_back(t.to(torch::kDouble).requires_grad_());
          const auto keep = causal ? torch::ones({Lq, Lk}, torch::kBool).tril()
                                   : torch::ones({Lq, Lk}, torch::kBool);
          const auto want_probs = (torch::matmul(in[0], in[1].transpose(1, 2)) * scale)
                                      .masked_fill(keep.logical_not(), -INFINITY)
                                      .softmax(-1);
          const auto want_out = torch::matmul(want_probs, in[2]);
          want_out.backward(grad.to(torch::kDouble));
          const std::vector<torch::Tensor> want{want_probs, want_out, in[0].grad(), in[1].grad(),
                                                in[2].grad()};
          for (size_t i = 0; i < want.size(); ++i) {
            const auto error = (got[i].to(torch::kDouble) - want[i]).norm() / want[i].norm();
            EXPECT_LE(error.item<double>(), tolerance) << "tensor " << i;
          }
          EXPECT_TRUE(probs.masked_select(keep.logical_not()).eq(0).all().item<bool>());
        }
}

// Where oneDNN's bf16 brgemm runs, the matmul kernel runs all six bf16 GEMMs on it; fp32, fp16,
// an odd head dim or number of keys (no VNNI pairs) take LibTorch's GEMMs for all six. (The
// test above checks the results.)
TEST(Attention, MatmulKernelRunsBf16GemmsOnBrgemm) {
  if (!kernels_built()) GTEST_SKIP() << "no AVX2/AVX-512 kernels on this CPU";
  auto count = [](torch::ScalarType dtype, int64_t keys, int64_t head_dim, int64_t value_dim) {
    std::vector<torch::Tensor> in{torch::randn({2, 2, 40, head_dim}, dtype),
                                  torch::randn({2, 2, keys, head_dim}, dtype),
                                  torch::randn({2, 2, keys, value_dim}, dtype)};
    for (auto& t : in) t.requires_grad_();
    const auto ops = mixprec::testing::ops_run_by([&] {
      scaled_dot_product_attention(in[0], in[1], in[2], 0.0, true, AttentionKernel::kMatmul)
          .sum()
          .backward();
    });
    return std::count_if(ops.begin(), ops.end(), [](const std::string& op) {
      return op == "aten::bmm" || op == "aten::mm";
    });
  };
  const bool brgemm = mixprec::models::kernels::bf16_brgemm_runs();
  EXPECT_EQ(count(torch::kBFloat16, 40, 16, 16), brgemm ? 0 : 6);
  EXPECT_EQ(count(torch::kBFloat16, 40, 16, 8), brgemm ? 0 : 6);
  EXPECT_EQ(count(torch::kBFloat16, 40, 15, 16), 6);
  EXPECT_EQ(count(torch::kBFloat16, 40, 16, 15), 6);
  EXPECT_EQ(count(torch::kBFloat16, 41, 16, 16), 6);
  EXPECT_EQ(count(torch::kFloat, 40, 16, 16), 6);
  EXPECT_EQ(count(torch::kHalf, 40, 16, 16), 6);
}

// The heads of a packed (B, T, 3 * C) projection, as GPT-2's attention makes them: the bf16
// kernels read them where they are and give the output and the gradients in (B, T, heads, head
// dim) order, so that neither the heads, the merge, the output's gradient nor the inputs' make
// a copy; the same bits as from dense copies of the heads.
TEST(Attention, Bf16KernelsReadAndWriteAPackedProjectionsHeadsInPlace) {
  if (!kernels_built() || !mixprec::models::kernels::bf16_brgemm_runs())
    GTEST_SKIP() << "no AVX2/AVX-512 kernels or no bf16 brgemm on this CPU";
  torch::manual_seed(6);
  const int64_t B = 2, T = 40, H = 2, D = 16, C = H * D;
  const auto packed = torch::randn({B, T, 3 * C}, torch::kBFloat16);
  const auto grad = torch::randn({B, T, C}, torch::kBFloat16);
  auto run = [&](bool dense) {
    const auto qkv = packed.clone().requires_grad_();
    torch::Tensor out;
    const auto ops = mixprec::testing::ops_run_by([&] {
      std::vector<torch::Tensor> in;
      for (const auto& t : qkv.split(C, 2)) {
        const auto head = t.view({B, T, H, D}).transpose(1, 2);
        in.push_back(dense ? head.contiguous() : head);
      }
      out = scaled_dot_product_attention(in[0], in[1], in[2], 0.0, true, AttentionKernel::kMatmul)
                .transpose(1, 2)
                .reshape({B, T, C});
      out.backward(grad);
    });
    return std::tuple{out, qkv.grad(),
                      std::count(ops.begin(), ops.end(), std::string("aten::copy_"))};
  };
  const auto [out, grad_qkv, copies] = run(false);
  const auto [out_dense, grad_dense, copies_dense] = run(true);
  EXPECT_TRUE(torch::equal(out, out_dense));
  EXPECT_TRUE(torch::equal(grad_qkv, grad_dense));
  EXPECT_EQ(copies, 0);  // (the split's backward is a cat)
  EXPECT_GT(copies_dense, 0);
}

// Keys and values shared by all heads as views (expanded, stride 0 along the heads, as
// multi-query attention makes them): the bf16 brgemm kernels read them where they are, and
// autograd sums the heads' gradients; the same as LibTorch's SDPA in fp64, within bf16's error.
TEST(Attention, Bf16KernelsReadKeysExpandedAcrossHeads) {
  if (!kernels_built() || !mixprec::models::kernels::bf16_brgemm_runs())
    GTEST_SKIP() << "no AVX2/AVX-512 kernels or no bf16 brgemm on this CPU";
  torch::manual_seed(8);
  const auto q0 = torch::randn({2, 4, 40, 16}), k0 = torch::randn({2, 1, 40, 16}),
             v0 = torch::randn({2, 1, 40, 16});
  const auto grad = torch::randn({2, 4, 40, 16});
  auto run = [&](torch::ScalarType dtype, bool ours) {
    std::vector<torch::Tensor> leaves;
    for (const auto& t : {q0, k0, v0}) leaves.push_back(t.to(dtype).requires_grad_());
    const auto k = leaves[1].expand({2, 4, 40, 16}), v = leaves[2].expand({2, 4, 40, 16});
    const auto grad_out = grad.to(dtype);
    torch::Tensor out;
    const auto ops = mixprec::testing::ops_run_by([&] {
      out = ours
                ? scaled_dot_product_attention(leaves[0], k, v, 0.0, true, AttentionKernel::kMatmul)
                : at::scaled_dot_product_attention(leaves[0], k, v, {}, 0.0, true);
      out.backward(grad_out);
    });
    if (ours) {
      EXPECT_EQ(std::count(ops.begin(), ops.end(), std::string("aten::bmm")), 0);
      EXPECT_EQ(std::count(ops.begin(), ops.end(), std::string("aten::copy_")), 0);
    }
    std::vector<torch::Tensor> r{out.to(torch::kDouble)};
    for (const auto& t : leaves) r.push_back(t.grad().to(torch::kDouble));
    return r;
  };
  const auto got = run(torch::kBFloat16, true);
  const auto want = run(torch::kDouble, false);
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].sizes(), want[i].sizes()) << "tensor " << i;
    EXPECT_LE(((got[i] - want[i]).norm() / want[i].norm()).item<double>(), 2e-2) << "tensor " << i;
  }
}

// GPT-2's attention on its packed projection: the same bits as the split, the heads, kAuto's
// kernel and the merge, and, where that is the bf16 matmul kernel on brgemm, without a copy or
// a cat. A qkv that does not split is a clear error.
TEST(Attention, PackedSelfAttentionIsTheSplitHeadsAndMerge) {
  torch::manual_seed(7);
  const int64_t B = 2, H = 2, C = 32;
  // T 41: an odd number of keys, which the brgemm kernels do not take. A strided gradient (as a
  // sum of slices gives) is copied.
  for (auto [dtype, T, strided] : {std::tuple{torch::kBFloat16, int64_t{40}, false},
                                   {torch::kBFloat16, int64_t{40}, true},
                                   {torch::kBFloat16, int64_t{41}, true},
                                   {torch::kFloat, int64_t{40}, true}}) {
    SCOPED_TRACE(::testing::Message() << dtype << " T " << T << " strided " << strided);
    const auto packed = torch::randn({B, T, 3 * C}).to(dtype);
    const auto wide = torch::randn({B, T, 2 * C}).to(dtype);
    const auto grad = strided ? wide.narrow(2, 1, C) : wide.narrow(2, 0, C).contiguous();
    auto run = [&](bool ours) {
      const auto qkv = packed.clone().requires_grad_();
      torch::Tensor out;
      const auto ops = mixprec::testing::ops_run_by([&] {
        if (ours) {
          out = mixprec::models::packed_self_attention(qkv, H, 0.0, true);
        } else {
          std::vector<torch::Tensor> in;
          for (const auto& t : qkv.split(C, 2))
            in.push_back(t.view({B, T, H, C / H}).transpose(1, 2));
          out = scaled_dot_product_attention(in[0], in[1], in[2], 0.0, true)
                    .transpose(1, 2)
                    .reshape({B, T, C});
        }
        out.backward(grad);
      });
      return std::tuple{out, qkv.grad(), ops};
    };
    const auto [out, grad_qkv, ops] = run(true);
    const auto [out_ref, grad_ref, ops_ref] = run(false);
    EXPECT_TRUE(same(out, out_ref));
    EXPECT_TRUE(same(grad_qkv, grad_ref));
    const auto count = [](const std::vector<std::string>& ops, const char* name) {
      return std::count(ops.begin(), ops.end(), std::string(name));
    };
    if (dtype == torch::kBFloat16 && T % 2 == 0 && !strided && kernels_built() &&
        mixprec::models::kernels::bf16_brgemm_runs()) {
      EXPECT_EQ(count(ops, "aten::cat") + count(ops, "aten::copy_"), 0);
      EXPECT_EQ(count(ops_ref, "aten::cat"), 1);
    }
  }
  const auto odd = torch::randn({2, 5, 3 * 32 + 1});
  try {
    mixprec::models::packed_self_attention(odd, 2, 0.0, true);
    FAIL() << "a qkv of 97 columns was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("(B, T, 3 * C)"), std::string::npos)
        << e.what_without_backtrace();
  }
}

TEST(Attention, MatmulKernelRejectsWhatItCannotRun) {
  if (!kernels_built()) GTEST_SKIP() << "no AVX2/AVX-512 kernels on this CPU";
  auto in = qkv(8, torch::kFloat);
  try {
    scaled_dot_product_attention(in[0], in[1], in[2], 0.1, true, AttentionKernel::kMatmul);
    FAIL() << "dropout was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("dropout_p 0.1"), std::string::npos)
        << e.what_without_backtrace();
  }
  EXPECT_THROW(
      scaled_dot_product_attention(in[0].to(torch::kDouble), in[1].to(torch::kDouble),
                                   in[2].to(torch::kDouble), 0.0, true, AttentionKernel::kMatmul),
      c10::Error);
  // Differentiable once: a gradient of a gradient through it would miss its second-order terms.
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    const auto q = in[0].to(dtype).detach().requires_grad_();
    const auto out = scaled_dot_product_attention(q, in[1].to(dtype), in[2].to(dtype), 0.0, true,
                                                  AttentionKernel::kMatmul);
    try {
      torch::autograd::grad({out.sum()}, {q}, {}, /*retain_graph=*/true, /*create_graph=*/true);
      FAIL() << "create_graph was accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find("differentiable once"),
                std::string::npos)
          << e.what_without_backtrace();
    }
  }
  // kAuto falls back to a LibTorch kernel where the matmul one cannot run (dropout).
  EXPECT_NE(mixprec::models::choose_attention_kernel(in[0], in[1], in[2], 0.1),
            AttentionKernel::kMatmul);
}

// Mixed dtypes: an error whatever kernel would run (as LibTorch's), except under autocast,
// which casts them alike.
TEST(Attention, MixedDtypesAreAnErrorOutsideAutocast) {
  for (int64_t T : {3, 300}) {
    auto in = qkv(T, torch::kFloat);
    const auto q = in[0].to(torch::kBFloat16);
    EXPECT_EQ(mixprec::testing::error_of(
                  [&] { scaled_dot_product_attention(q, in[1], in[2], 0.0, true); }),
              "Expected query, key, and value to have the same dtype, but got query.dtype: "
              "BFloat16 key.dtype: Float and value.dtype: Float instead.")
        << T;
    mixprec::amp::Autocast autocast(torch::kCPU, torch::kBFloat16);
    EXPECT_EQ(scaled_dot_product_attention(q, in[1], in[2], 0.0, true).sizes(), q.sizes());
  }
}

// Keys and values shared across the batch (broadcast, as SDPA allows): the matmul kernel runs
// them on LibTorch's GEMMs, which broadcast (the brgemm kernels index the three alike), and
// autograd sums the shared inputs' gradients: the same as LibTorch's SDPA, in fp32 and bf16.
TEST(Attention, MatmulKernelBroadcastsSharedKeysOnLibTorchsGemms) {
  if (!kernels_built()) GTEST_SKIP() << "no AVX2/AVX-512 kernels on this CPU";
  torch::manual_seed(5);
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    SCOPED_TRACE(::testing::Message() << dtype);
    auto run = [&](bool ours) {
      std::vector<torch::Tensor> in{torch::randn({2, 2, 40, 16}), torch::randn({1, 2, 40, 16}),
                                    torch::randn({1, 2, 40, 16})};
      for (auto& t : in) t = t.to(dtype).requires_grad_();
      torch::Tensor out;
      const auto ops = mixprec::testing::ops_run_by([&] {
        out = ours ? scaled_dot_product_attention(in[0], in[1], in[2], 0.0, true,
                                                  AttentionKernel::kMatmul)
                   : at::scaled_dot_product_attention(in[0].to(torch::kDouble),
                                                      in[1].to(torch::kDouble),
                                                      in[2].to(torch::kDouble), {}, 0.0, true);
        out.backward(torch::ones_like(out));
      });
      std::vector<torch::Tensor> r{out.to(torch::kDouble)};
      for (const auto& t : in) r.push_back(t.grad().to(torch::kDouble));
      if (ours) {
        EXPECT_EQ(std::count(ops.begin(), ops.end(), std::string("aten::bmm")) +
                      std::count(ops.begin(), ops.end(), std::string("aten::mm")),
                  6);
      }
      return r;
    };
    torch::manual_seed(6);
    const auto got = run(true);
    torch::manual_seed(6);
    const auto want = run(false);
    const double tolerance = dtype == torch::kFloat ? 1e-5 : 2e-2;
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(got[i].sizes(), want[i].sizes()) << "tensor " << i;
      EXPECT_LE(((got[i] - want[i]).norm() / want[i].norm()).item<double>(), tolerance)
          << "tensor " << i;
    }
  }
}

TEST(Attention, AutoRunsTheKernelTheRuleNamesAndAutocastDoesNotRecastFp32Work) {
  torch::manual_seed(0);
  using mixprec::models::choose_attention_kernel;
  const bool amx = mixprec::kernels::cpu_has_amx_bf16();
  const bool matmul = kernels_built();
  const bool brgemm = matmul && mixprec::models::kernels::bf16_brgemm_runs();
  auto short_bf16 = qkv(128, torch::kBFloat16), mid_bf16 = qkv(160, torch::kBFloat16);
  auto long_bf16 = qkv(320, torch::kBFloat16), longer_bf16 = qkv(600, torch::kBFloat16);
  auto mid_fp16 = qkv(160, torch::kHalf);
  auto short_fp32 = qkv(64, torch::kFloat), mid_fp32 = qkv(160, torch::kFloat);
  auto rule = [&](const std::vector<torch::Tensor>& in) {
    return choose_attention_kernel(in[0], in[1], in[2], 0.0);
  };
  // The tables in attention.h.
  EXPECT_EQ(rule(short_bf16), matmul ? AttentionKernel::kMatmul : AttentionKernel::kFlashFp32);
  EXPECT_EQ(rule(mid_bf16), matmul ? AttentionKernel::kMatmul
                            : amx  ? AttentionKernel::kFlash
                                   : AttentionKernel::kFlashFp32);
  // With dropout, which kMatmul does not take: bf16 in fp32 up to T = 256, or 128 with AMX.
  EXPECT_EQ(choose_attention_kernel(mid_bf16[0], mid_bf16[1], mid_bf16[2], 0.1),
            amx ? AttentionKernel::kFlash : AttentionKernel::kFlashFp32);
  EXPECT_EQ(rule(long_bf16), brgemm ? AttentionKernel::kMatmul : AttentionKernel::kFlash);
  EXPECT_EQ(rule(longer_bf16), AttentionKernel::kFlash);
  EXPECT_EQ(rule(mid_fp16), AttentionKernel::kFlashFp32);
  EXPECT_EQ(rule(short_fp32), matmul ? AttentionKernel::kMatmul : AttentionKernel::kFlash);
  EXPECT_EQ(rule(mid_fp32), AttentionKernel::kFlash);

  auto run = [](const std::vector<torch::Tensor>& in, AttentionKernel k) {
    return scaled_dot_product_attention(in[0], in[1], in[2], 0.0, true, k);
  };
  for (const auto* in : {&short_bf16, &mid_bf16, &long_bf16, &longer_bf16, &mid_fp16, &short_fp32})
    EXPECT_TRUE(same(run(*in, AttentionKernel::kAuto), run(*in, rule(*in))));
  // The kernels do differ (else the checks above could not fail).
  ASSERT_FALSE(
      same(run(short_bf16, AttentionKernel::kFlashFp32), run(short_bf16, AttentionKernel::kFlash)));
  if (matmul) {
    ASSERT_FALSE(same(run(short_bf16, AttentionKernel::kMatmul),
                      run(short_bf16, AttentionKernel::kFlashFp32)));
  }
  // Under bf16 autocast, fp32 compute is still fp32 compute (same bits as outside it).
  const auto flash_fp32 = run(short_bf16, AttentionKernel::kFlashFp32);
  const auto matmul_out = matmul ? run(short_bf16, AttentionKernel::kMatmul) : torch::Tensor();
  const auto fp32_out = run(short_fp32, AttentionKernel::kAuto);
  mixprec::amp::Autocast autocast(torch::kCPU, torch::kBFloat16);
  EXPECT_TRUE(same(run(short_bf16, AttentionKernel::kFlashFp32), flash_fp32));
  if (matmul) {
    EXPECT_TRUE(same(run(short_bf16, AttentionKernel::kMatmul), matmul_out));
  }
  EXPECT_TRUE(same(run(short_fp32, rule(short_fp32)), fp32_out));
}

}  // namespace
