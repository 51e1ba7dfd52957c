// Activation checkpointing gives the gradients of the plain call (dropout and autocast
// included) and keeps less memory between the forward and the backward.
#include "mixprec/models/activation_checkpoint.h"

#include "mixprec/amp/autocast.h"
#include "mixprec/models/gpt2.h"
#include "mixprec/optim/adamw.h"
#include "mixprec/optim/optimizer_in_backward.h"
#include "models/tiny_gpt2.h"
#include "profile.h"  // bench/: activation_bytes
#include "test_util.h"

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <optional>
#include <string>

namespace {

using mixprec::models::activation_checkpoint;
using mixprec::models::GPT2LMHeadModel;

// Loss and gradients of one forward and backward of `model` on `ids`.
struct Grads {
  double loss = 0;
  std::map<std::string, torch::Tensor> grads;
};

Grads loss_and_grads(GPT2LMHeadModel& model, const torch::Tensor& ids,
                     std::optional<c10::ScalarType> autocast_dtype, uint64_t seed = 0) {
  model->zero_grad();
  torch::manual_seed(seed);
  torch::Tensor loss;
  {
    mixprec::amp::Autocast autocast(torch::kCPU, autocast_dtype.value_or(torch::kBFloat16),
                                    /*enabled=*/autocast_dtype.has_value());
    loss = model->forward(ids, ids).loss;
  }
  loss.backward();
  Grads g{loss.item<double>(), {}};
  for (const auto& p : model->named_parameters()) g.grads[p.key()] = p.value().grad().clone();
  return g;
}

void expect_same_grads(const Grads& expected, const Grads& got, double rtol, double atol) {
  EXPECT_NEAR(got.loss, expected.loss, 1e-6 * std::abs(expected.loss));
  ASSERT_EQ(got.grads.size(), expected.grads.size());
  for (const auto& [name, g] : expected.grads) {
    ASSERT_TRUE(got.grads.at(name).defined()) << name;
    EXPECT_TRUE(torch::allclose(got.grads.at(name), g, rtol, atol))
        << name << ": max difference " << (got.grads.at(name) - g).abs().max().item<double>();
  }
}

GPT2LMHeadModel tiny_gpt2(int64_t n_layer, double dropout) {
  auto config = models_test::tiny_gpt2_config();
  config.n_layer = n_layer;
  config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = dropout;
  torch::manual_seed(0);
  return GPT2LMHeadModel(config);
}

TEST(ActivationCheckpoint, Fp32GradientsEqualThePlainModels) {
  auto model = tiny_gpt2(/*n_layer=*/3, /*dropout=*/0.0);
  const auto ids = torch::randint(256, {2, 32});
  const auto plain = loss_and_grads(model, ids, std::nullopt);
  for (int64_t every : {1, 2}) {
    model->activation_checkpointing_enable(every);
    EXPECT_TRUE(model->is_activation_checkpointing());
    expect_same_grads(plain, loss_and_grads(model, ids, std::nullopt), 1e-5, 1e-7);
  }
  model->activation_checkpointing_disable();
  EXPECT_FALSE(model->is_activation_checkpointing());
}

// The recompute draws the forward's dropout masks: without the preserved RNG state it would
// drop other values and the gradients would not be those of the loss.
TEST(ActivationCheckpoint, DropoutDropsTheSameValuesInTheRecompute) {
  auto model = tiny_gpt2(/*n_layer=*/2, /*dropout=*/0.2);
  model->train();
  const auto ids = torch::randint(256, {2, 32});
  const auto plain = loss_and_grads(model, ids, std::nullopt, /*seed=*/7);
  model->activation_checkpointing_enable();
  expect_same_grads(plain, loss_and_grads(model, ids, std::nullopt, /*seed=*/7), 1e-5, 1e-7);
  // The model's preserve_rng_state = false reaches the checkpoint: the same loss, other
  // gradients (the recompute draws masks past the forward's).
  model->activation_checkpointing_enable(1, /*preserve_rng_state=*/false);
  const auto unpreserved = loss_and_grads(model, ids, std::nullopt, /*seed=*/7);
  EXPECT_NEAR(unpreserved.loss, plain.loss, 1e-6 * std::abs(plain.loss));
  EXPECT_FALSE(torch::allclose(unpreserved.grads.at("transformer.h.0.mlp.c_fc.weight"),
                               plain.grads.at("transformer.h.0.mlp.c_fc.weight"), 1e-3, 1e-5));

  // The same without the preserved state: the recompute's masks differ.
  torch::manual_seed(0);
  const auto x = torch::randn({64, 16}, torch::requires_grad());
  const auto w = torch::randn({16, 16}, torch::requires_grad());
  const auto f = [&](const torch::Tensor& t) {
    return torch::dropout(t.matmul(w), 0.5, /*train=*/true);
  };
  const auto grad_of = [&](bool checkpointed, bool preserve) {
    w.mutable_grad() = torch::Tensor();
    torch::manual_seed(3);
    auto y = checkpointed ? activation_checkpoint(f, x, {w}, preserve) : f(x);
    y.pow(2).sum().backward();
    return w.grad().clone();
  };
  const auto expected = grad_of(false, true);
  EXPECT_TRUE(torch::allclose(grad_of(true, true), expected, 1e-5, 1e-6));
  EXPECT_FALSE(torch::allclose(grad_of(true, false), expected, 1e-5, 1e-6));
}

// Under bf16 autocast the recompute runs in bf16 too (the plain model's gradients) and leaves
// the caller's autocast state as it was.
TEST(ActivationCheckpoint, RecomputesUnderTheForwardsAutocast) {
  auto model = tiny_gpt2(/*n_layer=*/2, /*dropout=*/0.0);
  const auto ids = torch::randint(256, {2, 32});
  // fp32 gradients differ from bf16's by bf16 roundings: had the recompute run in fp32, the
  // checkpointed gradients would be these.
  const auto fp32 = loss_and_grads(model, ids, std::nullopt);
  const auto plain = loss_and_grads(model, ids, torch::kBFloat16);
  model->activation_checkpointing_enable();
  const auto checkpointed = loss_and_grads(model, ids, torch::kBFloat16);
  expect_same_grads(plain, checkpointed, 1e-5, 1e-7);
  const auto& w = "transformer.h.0.mlp.c_fc.weight";
  EXPECT_FALSE(torch::allclose(fp32.grads.at(w), checkpointed.grads.at(w), 1e-5, 1e-7));
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));

  // A backward inside an autocast region leaves its state as it was.
  mixprec::amp::Autocast autocast(torch::kCPU, torch::kBFloat16);
  model->forward(ids, ids).loss.backward();
  EXPECT_TRUE(at::autocast::is_autocast_enabled(at::kCPU));
  EXPECT_EQ(at::autocast::get_autocast_dtype(at::kCPU), torch::kBFloat16);
}

// What one bf16 forward of `model` leaves for the backward, in bytes.
int64_t bf16_forward_bytes(GPT2LMHeadModel& model, const torch::Tensor& ids) {
  return activation_bytes([&] {
    mixprec::amp::Autocast autocast(torch::kCPU, torch::kBFloat16);
    return model->forward(ids, ids).loss;
  });
}

TEST(ActivationCheckpoint, KeepsOnlyTheBlocksInputs) {
  auto model = tiny_gpt2(/*n_layer=*/4, /*dropout=*/0.0);
  const auto ids = torch::randint(256, {4, 64});
  const auto plain = bf16_forward_bytes(model, ids);
  model->activation_checkpointing_enable();
  const auto checkpointed = bf16_forward_bytes(model, ids);
  // Per block, the plain forward keeps ~20 (B, T, C) tensors and the bf16 weights; the
  // checkpointed one its fp32 input. The logits and the loss's tensors are kept by both.
  const int64_t input_bytes = 4 * 64 * 64 * 4, logits_bytes = 4 * 64 * 256 * 4;
  EXPECT_LT(checkpointed, plain / 2) << plain << " vs " << checkpointed << " bytes";
  EXPECT_LT(checkpointed, 4 * input_bytes + 4 * logits_bytes);
  // Every second block: about half of each plain block's tensors kept.
  model->activation_checkpointing_enable(2);
  const auto every_second = bf16_forward_bytes(model, ids);
  EXPECT_GT(every_second, checkpointed + (plain - checkpointed) / 4);
  EXPECT_LT(every_second, plain - (plain - checkpointed) / 4);
  // Not checkpointed in eval mode.
  model->eval();
  EXPECT_EQ(bf16_forward_bytes(model, ids), plain);
}

// A function of parameters only (an input without grad), a parameter listed twice (tied
// weights): each gets its gradient once, the plain call's.
TEST(ActivationCheckpoint, ParametersGetTheirGradientsOnce) {
  torch::manual_seed(0);
  const auto x = torch::randn({8, 16});  // needs no gradient
  const auto w = torch::randn({16, 16}, torch::requires_grad());
  const auto b = torch::randn({16}, torch::requires_grad());
  const auto f = [&](const torch::Tensor& t) { return torch::tanh(t.matmul(w) + b).matmul(w); };
  const auto grads_of = [&](bool checkpointed) {
    w.mutable_grad() = torch::Tensor();
    b.mutable_grad() = torch::Tensor();
    auto y = checkpointed ? activation_checkpoint(f, x, {w, b, w}) : f(x);
    EXPECT_TRUE(y.requires_grad());
    y.pow(2).sum().backward();
    return std::pair{w.grad().clone(), b.grad().clone()};
  };
  const auto [plain_w, plain_b] = grads_of(false);
  const auto [w_grad, b_grad] = grads_of(true);
  EXPECT_TRUE(torch::allclose(w_grad, plain_w, 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(b_grad, plain_b, 1e-5, 1e-6));
}

// With the updates in the backward too (bf16, dropout): what lowers a step's peak memory most
// trains as the plain loop does.
TEST(ActivationCheckpoint, TrainsTheSameWithTheOptimizerInTheBackward) {
  const auto ids = torch::randint(256, {2, 32});
  const auto train = [&](bool memory_saving) {
    auto model = tiny_gpt2(/*n_layer=*/2, /*dropout=*/0.1);
    if (memory_saving) model->activation_checkpointing_enable();
    mixprec::optim::AdamW optimizer(model->parameters(),
                                    mixprec::optim::AdamWOptions(1e-3).fused(true));
    std::optional<mixprec::optim::OptimizerInBackward> updates;
    if (memory_saving) updates.emplace(optimizer);
    for (uint64_t step = 1; step <= 3; ++step) {
      torch::manual_seed(step);
      torch::Tensor loss;
      {
        mixprec::amp::Autocast autocast(torch::kCPU, torch::kBFloat16);
        loss = model->forward(ids, ids).loss;
      }
      loss.backward();
      if (!memory_saving) {
        optimizer.step();
        optimizer.zero_grad();
      }
    }
    return model;
  };
  const auto plain = train(false)->named_parameters();
  const auto saving = train(true)->named_parameters();
  for (const auto& p : plain) {
    EXPECT_TRUE(torch::allclose(saving[p.key()], p.value(), 1e-6, 1e-7))
        << p.key() << ": max difference "
        << (saving[p.key()] - p.value()).abs().max().item<double>();
    EXPECT_FALSE(saving[p.key()].grad().defined()) << p.key();
  }
}

TEST(ActivationCheckpoint, BadInputsAreClearErrors) {
  auto model = tiny_gpt2(/*n_layer=*/1, /*dropout=*/0.0);
  using mixprec::testing::error_of;
  EXPECT_NE(error_of([&] {
              model->activation_checkpointing_enable(0);
            }).find("every_n_layers is 0, expected >= 1"),
            std::string::npos);
  EXPECT_NE(
      error_of([] { activation_checkpoint({}, torch::ones({1}), {}); }).find("no function given"),
      std::string::npos);
  EXPECT_NE(error_of([] {
              activation_checkpoint([](const torch::Tensor& t) { return t; }, torch::Tensor(), {});
            }).find("the input is an undefined tensor"),
            std::string::npos);
  const auto x = torch::randn({4}, torch::requires_grad());
  const auto y = activation_checkpoint([](const torch::Tensor& t) { return t.pow(3); }, x, {});
  EXPECT_NE(error_of([&] {
              torch::autograd::grad({y.sum()}, {x}, {}, true, /*create_graph=*/true);
            }).find("no double backward"),
            std::string::npos);
  // A function that uses neither its input nor its parameters.
  const auto unused = activation_checkpoint(
      [](const torch::Tensor& t) { return torch::ones_like(t.detach()); }, x, {});
  EXPECT_NE(error_of([&] { unused.sum().backward(); }).find("does not require grad"),
            std::string::npos);
}

}  // namespace
