// Why loss scaling exists: a model whose fp16 activation gradients fall below
// fp16's smallest subnormal (6e-8) gets all-zero gradients and does not learn;
// the same run with a GradScaler keeps them representable and learns.
#include "mixprec/amp/autocast.h"
#include "mixprec/amp/fp16_cpu.h"
#include "mixprec/amp/grad_scaler.h"
#include "mixprec/optim/adamw.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

struct TrainResult {
  double first_loss, last_loss;
  double zero_grad_fraction;  // of the weight's gradient elements, first step
};

TrainResult train(bool use_scaler) {
  torch::manual_seed(0);
  auto x = torch::randn({64, 32});
  auto w_true = torch::randn({32, 1});
  auto y = torch::matmul(x, w_true);
  auto w = torch::zeros({32, 1}, torch::requires_grad());
  mixprec::optim::AdamW opt({w}, mixprec::optim::AdamWOptions(0.05).weight_decay(0.0));
  mixprec::amp::GradScaler scaler({.enabled = use_scaler});
  TrainResult run{};
  for (int step = 0; step < 150; ++step) {
    torch::Tensor loss;
    {
      mixprec::amp::Autocast autocast(torch::kCPU, torch::kHalf);
      // A loss this small (think: a tiny loss weight, or a mean over many
      // tokens) sends gradients of ~1e-9 into the fp16 matmul's backward.
      loss = 1e-8 * torch::mse_loss(torch::matmul(x, w), y);
    }
    scaler.scale(loss).backward();
    if (step == 0) {
      scaler.unscale_(opt);
      run.zero_grad_fraction = (w.grad() == 0).to(torch::kFloat).mean().item<double>();
      run.first_loss = loss.item<double>() * 1e8;
    }
    scaler.step(opt);
    scaler.update();
    opt.zero_grad();
    run.last_loss = loss.item<double>() * 1e8;
  }
  return run;
}

// On LibTorch's fp16 kernels and on mixprec's fp16 CPU fast path alike: the
// fast path keeps fp16's range for activations and gradients.
class LossScaling : public ::testing::TestWithParam<mixprec::amp::Fp16CpuPath> {
 protected:
  void SetUp() override { mixprec::amp::set_fp16_cpu_path(GetParam()); }
  void TearDown() override { mixprec::amp::set_fp16_cpu_path(mixprec::amp::Fp16CpuPath::kAuto); }
};

TEST_P(LossScaling, Fp16GradientsUnderflowWithoutScalingAndLearnWithIt) {
  const TrainResult unscaled = train(/*use_scaler=*/false);
  const TrainResult scaled = train(/*use_scaler=*/true);
  EXPECT_EQ(unscaled.zero_grad_fraction, 1.0);  // every gradient element underflowed
  EXPECT_EQ(scaled.zero_grad_fraction, 0.0);
  EXPECT_EQ(unscaled.last_loss, unscaled.first_loss);  // nothing learnt
  EXPECT_LT(scaled.last_loss, 0.05 * scaled.first_loss);
}

INSTANTIATE_TEST_SUITE_P(Fp16Cpu, LossScaling,
                         ::testing::Values(mixprec::amp::Fp16CpuPath::kNever,
                                           mixprec::amp::Fp16CpuPath::kAlways),
                         [](const auto& info) {
                           return info.param == mixprec::amp::Fp16CpuPath::kNever ? "LibTorch"
                                                                                  : "FastPath";
                         });

}  // namespace
