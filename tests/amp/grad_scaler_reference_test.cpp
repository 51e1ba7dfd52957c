// Replays the runs of tests/reference/grad_scaler_traces.py (Python
// torch.amp.GradScaler + torch.autocast + torch.optim, torch 2.13) with
// mixprec's Autocast, GradScaler and AdamW and LibTorch's SGD.
//
// Scales, growth trackers and skip decisions must match exactly. Losses and
// parameters come from the same ATen kernels fed the same tensors, so they
// agree to the last bit in practice; the tolerance (rtol 1e-6, atol 1e-7) only
// allows for a reduction order that differs between thread counts.
#include "mixprec/amp/autocast.h"
#include "mixprec/amp/grad_scaler.h"
#include "mixprec/optim/adamw.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

namespace {

using json = nlohmann::json;
using mixprec::amp::GradScaler;
using mixprec::amp::GradScalerOptions;

const json& traces() {
  static const json data = mixprec::testing::load_reference("grad_scaler_traces.json");
  return data;
}

torch::Tensor tensor_from(const json& values, std::vector<int64_t> shape) {
  std::vector<float> flat;
  for (const auto& v : values) flat.push_back(v.get<float>());
  return torch::tensor(flat).reshape(shape);
}

std::vector<int64_t> shape_of(const std::string& name) {
  return traces()["shapes"][name].get<std::vector<int64_t>>();
}

GradScalerOptions scaler_options(const json& cfg) {
  GradScalerOptions o;
  o.init_scale = cfg.value("init_scale", o.init_scale);
  o.growth_factor = cfg.value("growth_factor", o.growth_factor);
  o.backoff_factor = cfg.value("backoff_factor", o.backoff_factor);
  o.growth_interval = cfg.value("growth_interval", o.growth_interval);
  return o;
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(
    const json& cfg, std::map<std::string, torch::Tensor>& params) {
  std::vector<torch::Tensor> group;
  for (const auto& name : cfg["params"]) group.push_back(params.at(name.get<std::string>()));
  if (cfg["type"] == "sgd") {
    return std::make_unique<torch::optim::SGD>(
        group,
        torch::optim::SGDOptions(cfg["lr"].get<double>()).momentum(cfg.value("momentum", 0.0)));
  }
  return std::make_unique<mixprec::optim::AdamW>(
      group, mixprec::optim::AdamWOptions(cfg["lr"].get<double>())
                 .weight_decay(cfg.value("weight_decay", 0.01))
                 .fused(cfg.value("fused", false)));
}

float injected(const std::string& v) {
  if (v == "inf") return std::numeric_limits<float>::infinity();
  if (v == "-inf") return -std::numeric_limits<float>::infinity();
  return std::numeric_limits<float>::quiet_NaN();
}

void expect_close(const torch::Tensor& actual, const torch::Tensor& expected,
                  const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  EXPECT_TRUE(torch::allclose(actual, expected, /*rtol=*/1e-6, /*atol=*/1e-7))
      << what << ": max abs diff " << (actual - expected).abs().max().item<double>();
}

class GradScalerReference : public ::testing::TestWithParam<std::string> {};

TEST_P(GradScalerReference, ReplaysPyTorchTrace) {
  const json* found = nullptr;
  for (const auto& s : traces()["scenarios"])
    if (s["name"] == GetParam()) found = &s;
  ASSERT_NE(found, nullptr);
  const json& sc = *found;
  torch::set_num_threads(1);  // as the script

  std::map<std::string, torch::Tensor> params;
  for (const auto& [name, values] : sc["init"].items())
    params[name] = tensor_from(values, shape_of(name)).requires_grad_(true);
  std::vector<std::unique_ptr<torch::optim::Optimizer>> optimizers;
  for (const auto& cfg : sc["optimizers"]) optimizers.push_back(make_optimizer(cfg, params));
  auto scaler = std::make_unique<GradScaler>(scaler_options(sc["scaler"]));
  const int64_t batch = traces()["batch"];

  for (size_t step = 0; step < sc["data"].size(); ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const auto& d = sc["data"][step];
    auto x = tensor_from(d["x"], {batch, 8});
    auto y = tensor_from(d["y"], {batch, 4});
    torch::Tensor loss;
    {
      mixprec::amp::Autocast autocast(torch::kCPU, torch::kHalf);
      auto h = torch::tanh(torch::nn::functional::linear(x, params["w1"], params["b1"]));
      auto out = torch::nn::functional::linear(h, params["w2"], params["b2"]);
      loss = torch::mse_loss(out, y);
    }
    scaler->scale(loss).backward();
    for (const auto& inj : sc["inject"]) {
      if (inj["step"].get<size_t>() != step) continue;
      torch::NoGradGuard no_grad;
      params[inj["param"].get<std::string>()].grad().view({-1})[0] = injected(inj["value"]);
    }
    const double scale_used = scaler->get_scale();
    if (sc.contains("clip_max_norm")) {
      for (auto& opt : optimizers) scaler->unscale_(*opt);
      std::vector<torch::Tensor> all;
      for (auto& [name, p] : params) all.push_back(p);
      torch::nn::utils::clip_grad_norm_(all, sc["clip_max_norm"].get<double>());
    }
    std::vector<bool> stepped;
    for (auto& opt : optimizers) stepped.push_back(scaler->step(*opt));
    const auto& ns = sc.value("new_scale", json());
    if (!ns.is_null() && ns["step"].get<size_t>() == step)
      scaler->update(ns["value"].get<double>());
    else
      scaler->update();
    for (auto& opt : optimizers) opt->zero_grad();

    const auto& expected = sc["trace"][step];
    EXPECT_NEAR(loss.item<double>(), expected["loss"].get<double>(),
                1e-6 * std::abs(expected["loss"].get<double>()));
    EXPECT_EQ(scale_used, expected["scale_used"].get<double>());
    EXPECT_EQ(stepped, expected["stepped"].get<std::vector<bool>>());
    EXPECT_EQ(scaler->get_scale(), expected["scale"].get<double>());
    EXPECT_EQ(scaler->get_growth_tracker(), expected["growth_tracker"].get<int64_t>());

    if (sc.contains("set_after") && sc["set_after"]["step"].get<size_t>() == step) {
      scaler->set_growth_factor(sc["set_after"]["growth_factor"].get<double>());
      scaler->set_backoff_factor(sc["set_after"]["backoff_factor"].get<double>());
      scaler->set_growth_interval(sc["set_after"]["growth_interval"].get<int64_t>());
    }
    if (sc.contains("roundtrip_after") && sc["roundtrip_after"].get<size_t>() == step) {
      auto state = scaler->state_dict();
      scaler =
          std::make_unique<GradScaler>(GradScalerOptions{.init_scale = 1.0, .growth_interval = 7});
      scaler->load_state_dict(state);
    }
  }
  for (const auto& [name, values] : sc["final"].items())
    expect_close(params[name].detach(), tensor_from(values, shape_of(name)), "final " + name);
  EXPECT_EQ(scaler->state_dict(), (sc["final_state_dict"].get<std::map<std::string, double>>()));
}

std::vector<std::string> scenario_names() {
  std::vector<std::string> names;
  for (const auto& s : traces()["scenarios"]) names.push_back(s["name"]);
  return names;
}

INSTANTIATE_TEST_SUITE_P(Torch213, GradScalerReference, ::testing::ValuesIn(scenario_names()),
                         [](const auto& info) { return info.param; });

}  // namespace
