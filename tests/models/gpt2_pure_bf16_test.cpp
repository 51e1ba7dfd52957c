// Pure bf16 training (parameters and AdamW states in bf16, stochastic rounding,
// no fp32 master copy) reaches the loss of bf16 mixed precision on GPT-2 with
// half the parameter and optimizer memory.
#include "mixprec/amp/autocast.h"
#include "mixprec/models/gpt2.h"

#include "mixprec/optim/adamw.h"
#include "models/tiny_gpt2.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <numeric>
#include <vector>

namespace {

struct TrainRun {
  std::vector<double> losses;
  int64_t state_bytes = 0;  // parameters + exp_avg + exp_avg_sq
};

constexpr int kSteps = 80;

TrainRun train(bool pure_bf16) {
  torch::manual_seed(0);
  torch::set_num_threads(1);  // a tiny model: threads would only wait for each other
  const auto config = models_test::tiny_gpt2_config();
  mixprec::models::GPT2LMHeadModel model(config);
  if (pure_bf16) model->to(torch::kBFloat16);
  const auto data = torch::randint(config.vocab_size, {4, 4, 32});  // (batches, B, T)
  mixprec::optim::AdamW optimizer(
      model->parameters(), mixprec::optim::AdamWOptions(3e-3).stochastic_rounding(pure_bf16));
  TrainRun run;
  for (int step = 0; step < kSteps; ++step) {
    const auto ids = data[step % data.size(0)];
    torch::Tensor loss;
    {
      mixprec::amp::Autocast autocast(torch::kCPU, torch::kBFloat16, /*enabled=*/!pure_bf16);
      loss = model->forward(ids, /*labels=*/ids).loss;
    }
    loss.backward();
    optimizer.step();
    optimizer.zero_grad();
    run.losses.push_back(loss.item<double>());
  }
  for (const auto& p : model->parameters()) {
    const auto& state = static_cast<const mixprec::optim::AdamWParamState&>(
        *optimizer.state().at(p.unsafeGetTensorImpl()));
    run.state_bytes += p.nbytes() + state.exp_avg().nbytes() + state.exp_avg_sq().nbytes();
  }
  return run;
}

double mean_of_last(const std::vector<double>& v, size_t n) {
  return std::accumulate(v.end() - static_cast<std::ptrdiff_t>(n), v.end(), 0.0) /
         static_cast<double>(n);
}

TEST(GPT2PureBf16, ReachesTheLossOfBf16MixedWithHalfTheMemory) {
  const TrainRun mixed = train(false);
  const TrainRun pure = train(true);
  EXPECT_EQ(pure.state_bytes * 2, mixed.state_bytes);
  for (double loss : pure.losses) ASSERT_TRUE(std::isfinite(loss));
  const double mixed_final = mean_of_last(mixed.losses, 5);
  const double pure_final = mean_of_last(pure.losses, 5);
  // Both learn the 4 batches (from ln 256 = 5.55); pure bf16 ends within 10%
  // of mixed (seen on d7f56c9: 0.497 vs 0.493, 0.8%): the margin stated for pure bf16.
  EXPECT_LT(mixed_final, 0.6 * mixed.losses.front());
  EXPECT_LT(std::abs(pure_final - mixed_final), 0.10 * mixed_final)
      << "pure " << pure_final << ", mixed " << mixed_final;
  std::printf(
      "final loss (mean of last 5 of %d steps): bf16 mixed %.4f, pure bf16 %.4f; "
      "parameter + optimizer bytes %lld vs %lld\n",
      kSteps, mixed_final, pure_final, static_cast<long long>(mixed.state_bytes),
      static_cast<long long>(pure.state_bytes));
}

}  // namespace
