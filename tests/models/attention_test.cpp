#include "mixprec/models/attention.h"

#include "mixprec/amp/autocast.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

using mixprec::models::AttentionPrecision;
using mixprec::models::scaled_dot_product_attention;

std::vector<torch::Tensor> qkv(int64_t T, torch::ScalarType dtype) {
  std::vector<torch::Tensor> t;
  for (int i = 0; i < 3; ++i) t.push_back(torch::randn({2, 2, T, 16}).to(dtype));
  return t;
}

bool same(const torch::Tensor& a, const torch::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && torch::equal(a, b);
}

TEST(Attention, Fp32PrecisionRoundsTheExactResultOnceAndGradientsFlow) {
  torch::manual_seed(0);
  for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
    auto in = qkv(64, dtype);
    for (auto& t : in) t.requires_grad_();
    auto out = scaled_dot_product_attention(in[0], in[1], in[2], 0.0, /*is_causal=*/true,
                                            AttentionPrecision::kFp32);
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

TEST(Attention, AutoFollowsTheRuleAndAutocastDoesNotRecastTheFp32Call) {
  torch::manual_seed(0);
  auto run = [](const std::vector<torch::Tensor>& in, AttentionPrecision p) {
    return scaled_dot_product_attention(in[0], in[1], in[2], 0.0, true, p);
  };
  auto short_bf16 = qkv(128, torch::kBFloat16), long_bf16 = qkv(160, torch::kBFloat16);
  auto long_fp16 = qkv(160, torch::kHalf), fp32 = qkv(64, torch::kFloat);
  auto short_fp32 = run(short_bf16, AttentionPrecision::kFp32);
  ASSERT_FALSE(same(short_fp32, run(short_bf16, AttentionPrecision::kNative)));  // they differ
  EXPECT_TRUE(same(run(short_bf16, AttentionPrecision::kAuto), short_fp32));
  EXPECT_TRUE(
      same(run(long_bf16, AttentionPrecision::kAuto), run(long_bf16, AttentionPrecision::kNative)));
  EXPECT_TRUE(
      same(run(long_fp16, AttentionPrecision::kAuto), run(long_fp16, AttentionPrecision::kFp32)));
  EXPECT_TRUE(same(run(fp32, AttentionPrecision::kFp32), run(fp32, AttentionPrecision::kNative)));
  // Under bf16 autocast, fp32 compute is still fp32 compute (same bits as outside it).
  mixprec::amp::Autocast autocast(torch::kCPU, torch::kBFloat16);
  EXPECT_TRUE(same(run(short_bf16, AttentionPrecision::kFp32), short_fp32));
}

}  // namespace
