// Replays the runs of tests/reference/accelerate_traces.py (HF Accelerate
// 1.16 for "no" and "bf16"; Accelerate's GPU fp16 loop, by hand, for "fp16")
// with mixprec's Accelerator, AdamW and get_scheduler("linear").
//
// Sync steps, skipped steps and learning rates must match exactly. Losses,
// grad norms and parameters come from the same ATen kernels fed the same
// tensors (fp16 with mixprec's CPU fast path off, so that both use LibTorch's
// fp16 kernels), so they agree to the last bit in practice; the tolerance
// (rtol 1e-5) allows only for a different summation order in a kernel.
#include "mixprec/accelerate/accelerator.h"
#include "mixprec/amp/fp16_cpu.h"
#include "mixprec/optim/adamw.h"
#include "mixprec/optim/lr_scheduler.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

namespace {

using json = nlohmann::json;

const json& traces() {
  static const json data = mixprec::testing::load_reference("accelerate_traces.json");
  return data;
}

const json& find_case(const std::string& name) {
  for (const auto& c : traces()["cases"])
    if (c["name"] == name) return c;
  throw std::runtime_error("no case " + name);
}

torch::Tensor floats(const json& values) { return torch::tensor(values.get<std::vector<float>>()); }

// Non-finite values are stored as strings ("inf", "nan"): JSON has none.
double number(const json& v) {
  return v.is_string() ? std::stod(v.get<std::string>()) : v.get<double>();
}

void expect_close(double got, double want, const std::string& what) {
  if (std::isnan(want)) {
    EXPECT_TRUE(std::isnan(got)) << what << ": " << got << " vs nan";
    return;
  }
  if (std::isinf(want)) {
    EXPECT_EQ(got, want) << what;
    return;
  }
  EXPECT_NEAR(got, want, 1e-5 * std::abs(want) + 1e-7) << what;
}

class AcceleratorReference : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    torch::set_num_threads(1);  // as the reference script
    mixprec::amp::set_fp16_cpu_path(mixprec::amp::Fp16CpuPath::kNever);
  }
  void TearDown() override { mixprec::amp::set_fp16_cpu_path(mixprec::amp::Fp16CpuPath::kAuto); }
};

TEST_P(AcceleratorReference, ReplaysAccelerateTrace) {
  const json& c = find_case(GetParam());
  const int64_t batch = 8, n = 64, features = 16;
  const auto x_all = floats(c["data"]["x"]).reshape({n, features});
  const auto y_all = torch::tensor(c["data"]["y"].get<std::vector<int64_t>>());

  torch::nn::Sequential net(torch::nn::Linear(16, 32), torch::nn::ReLU(), torch::nn::Linear(32, 4));
  {
    torch::NoGradGuard no_grad;
    for (auto& item : net->named_parameters())
      item.value().copy_(floats(c["init"][item.key()]).reshape(item.value().sizes()));
  }
  mixprec::optim::AdamW adamw(net->parameters(),
                              mixprec::optim::AdamWOptions(1e-2).weight_decay(0.01));
  const int64_t accumulation = c["accumulation"].get<int64_t>();
  const int64_t micro_steps = static_cast<int64_t>(c["losses"].size());
  auto linear = mixprec::optim::get_scheduler(
      "linear", adamw, {.num_warmup_steps = 2, .num_training_steps = micro_steps / accumulation});

  mixprec::Accelerator accelerator({.mixed_precision = c["mixed_precision"].get<std::string>(),
                                    .gradient_accumulation_steps = accumulation,
                                    .scaler = {.init_scale = 1024.0, .growth_interval = 3}});
  auto [model, optimizer, scheduler] = accelerator.prepare(net, adamw, linear);

  const auto inject = c["inject"].get<std::vector<int64_t>>();
  size_t sync_index = 0;
  for (int64_t i = 0; i < micro_steps; ++i) {
    const int64_t b = i % (n / batch);
    auto x = x_all.slice(0, b * batch, (b + 1) * batch);
    auto y = y_all.slice(0, b * batch, (b + 1) * batch);
    auto guard = accelerator.accumulate();
    auto loss = torch::nn::functional::cross_entropy(model(x), y);
    if (std::find(inject.begin(), inject.end(), i) != inject.end())
      loss = loss * std::numeric_limits<float>::infinity();
    accelerator.backward(loss);
    const bool sync = accelerator.sync_gradients();
    ASSERT_EQ(sync, c["syncs"][i].get<bool>()) << "micro-step " << i;
    double norm = 0;
    if (sync) norm = accelerator.clip_grad_norm_(net->parameters(), 1.0);
    optimizer.step();
    scheduler.step();
    optimizer.zero_grad();
    const std::string at = GetParam() + " micro-step " + std::to_string(i);
    expect_close(loss.item<double>(), number(c["losses"][i]), at + " loss");
    if (sync) {
      expect_close(norm, number(c["grad_norms"][sync_index]), at + " grad norm");
      EXPECT_EQ(accelerator.optimizer_step_was_skipped(), c["skipped"][sync_index].get<bool>())
          << at;
      EXPECT_EQ(scheduler.get_last_lr()[0], c["lrs"][sync_index].get<double>()) << at;
      ++sync_index;
    }
  }
  EXPECT_EQ(sync_index, c["lrs"].size());
  for (auto& item : accelerator.unwrap_model(model)->named_parameters()) {
    const std::string& name = item.key();
    const at::Tensor& param = item.value();
    const auto want = floats(c["params"][name]).reshape(param.sizes());
    EXPECT_TRUE(torch::allclose(param.detach(), want, 1e-5, 1e-6))
        << GetParam() << " " << name << " max diff "
        << (param.detach() - want).abs().max().item<double>();
  }
}

INSTANTIATE_TEST_SUITE_P(Accelerate116, AcceleratorReference,
                         ::testing::Values("fp32", "fp32_accumulate", "bf16", "bf16_accumulate",
                                           "fp16", "fp16_accumulate"));

}  // namespace
