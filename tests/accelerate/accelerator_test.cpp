#include "mixprec/accelerate/accelerator.h"
#include "mixprec/io/checkpoint.h"
#include "mixprec/io/safetensors.h"

#include "mixprec/optim/optimizer_in_backward.h"

#include <ATen/autocast_mode.h>
#include "models/tiny_gpt2.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>

#ifdef __GLIBC__
#include <malloc.h>
#endif

namespace {

using mixprec::testing::error_of;

using mixprec::Accelerator;

// Records the dtype its linear layer computed in.
struct ProbeImpl : torch::nn::Module {
  ProbeImpl() : fc(register_module("fc", torch::nn::Linear(4, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = fc(x);
    seen = y.scalar_type();
    return y;
  }
  mixprec::models::ModelOutput forward(const torch::Tensor& x, const torch::Tensor& labels) {
    auto logits = forward(x);
    return {torch::nn::functional::cross_entropy(logits, labels), logits};
  }
  torch::nn::Linear fc;
  at::ScalarType seen = at::kFloat;
};
TORCH_MODULE(Probe);

TEST(Accelerator, PreparedModelRunsUnderAutocastAndReturnsFp32) {
  for (const auto& [precision, dtype] :
       {std::pair{"no", at::kFloat}, {"bf16", at::kBFloat16}, {"fp16", at::kHalf}}) {
    Accelerator accelerator({.mixed_precision = precision});
    Probe probe;
    auto model = accelerator.prepare(probe);
    auto out = model(torch::randn({2, 4}));
    EXPECT_EQ(probe->seen, dtype) << precision;
    EXPECT_EQ(out.scalar_type(), at::kFloat) << precision;
    auto output = model(torch::randn({2, 4}), torch::tensor({0, 2}));
    EXPECT_EQ(output.logits.scalar_type(), at::kFloat) << precision;
    EXPECT_EQ(output.loss.scalar_type(), at::kFloat) << precision;
    EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));  // restored after forward
    EXPECT_EQ(accelerator.unwrap_model(model).get(), probe.get());
  }
}

// As Accelerate's convert_outputs_to_fp32 (recursive_apply): through nested containers; what
// is not a 16-bit tensor passes as it is.
TEST(Accelerator, PreparedModelConvertsNestedOutputs) {
  Accelerator accelerator({.mixed_precision = "bf16"});
  Probe probe;
  auto model = accelerator.prepare(probe);
  const auto x = torch::randn({2, 4});
  auto out = model.run([&] {
    const auto y = probe->forward(x);
    return std::pair{
        std::map<std::string, std::vector<at::Tensor>>{{"y", {y, y.to(at::kHalf)}}},
        std::optional<std::tuple<at::Tensor, int, at::Tensor>>{{y, 7, torch::tensor({1, 2})}}};
  });
  EXPECT_EQ(probe->seen, at::kBFloat16);
  for (const auto& t : out.first.at("y")) EXPECT_EQ(t.scalar_type(), at::kFloat);
  EXPECT_EQ(std::get<0>(*out.second).scalar_type(), at::kFloat);
  EXPECT_EQ(std::get<1>(*out.second), 7);
  EXPECT_EQ(std::get<2>(*out.second).scalar_type(), at::kLong);
  std::vector<at::Tensor> found;
  mixprec::accelerate::detail::collect_tensors(out, found);
  EXPECT_EQ(found.size(), 4u);  // the two in the map, the two in the tuple
  // What holds no tensor passes as it is, vector<bool> too.
  EXPECT_EQ(model.run([] {
    return std::vector<bool>{true, false};
  }),
            (std::vector<bool>{true, false}));
  // Without mixed precision nothing is converted: a pure bf16 model's outputs stay bf16.
  Accelerator plain({.mixed_precision = "no"});
  Probe bf16;
  bf16->to(at::kBFloat16);
  auto pure = plain.prepare(bf16);
  EXPECT_EQ(pure(x.to(at::kBFloat16)).scalar_type(), at::kBFloat16);
}

// GPT-2 through the prepared model: its outputs are the fp32 cast of what the model returns
// under autocast (logits in autocast's dtype, as HF's), values unchanged.
TEST(Accelerator, PreparedModelGivesFp32Outputs) {
  torch::manual_seed(0);
  mixprec::models::GPT2LMHeadModel gpt2(models_test::tiny_gpt2_config());
  Accelerator accelerator({.mixed_precision = "bf16"});
  auto model = accelerator.prepare(gpt2);
  const auto ids = torch::randint(256, {2, 16});
  const auto out = model.run([&] { return gpt2->forward(ids, ids); });
  EXPECT_EQ(out.logits.scalar_type(), at::kFloat);
  EXPECT_EQ(out.loss.scalar_type(), at::kFloat);
  mixprec::amp::Autocast autocast(torch::kCPU, torch::kBFloat16);
  const auto plain = gpt2->forward(ids, ids);
  EXPECT_EQ(plain.logits.scalar_type(), at::kBFloat16);  // the model itself is as HF's
  EXPECT_TRUE(torch::equal(out.logits, plain.logits.to(at::kFloat)));
  EXPECT_TRUE(torch::equal(out.loss, plain.loss));
}

// A step's freed activations stay in the heap for the next step: glibc must not serve a
// 24 MiB block by mmap (and unmap it on free), as it does by default (threshold 128 KiB), nor
// a 48 MiB one, over the largest threshold glibc allows.
TEST(Accelerator, KeepsFreedMemoryForReuseOnCpu) {
#ifdef __GLIBC__
  for (const char* name :
       {"MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"})
    if (std::getenv(name) != nullptr)
      GTEST_SKIP() << name << " is set: the Accelerator leaves malloc alone";
  mixprec::Accelerator accelerator({.cpu = true});
  for (size_t mib : {24, 48}) {
    const auto mapped = mallinfo2().hblkhd;
    char* volatile block = static_cast<char*>(std::malloc(mib << 20));  // volatile: not elided
    block[0] = 1;
    const auto mapped_with_block = mallinfo2().hblkhd;
    std::free(block);
    EXPECT_EQ(mapped_with_block, mapped) << "the " << mib << " MiB block was mmapped";
  }
#else
  GTEST_SKIP() << "glibc only";
#endif
}

TEST(Accelerator, AutocastGuardFollowsMixedPrecision) {
  Accelerator bf16({.mixed_precision = "bf16"});
  {
    auto guard = bf16.autocast();
    EXPECT_TRUE(at::autocast::is_autocast_enabled(at::kCPU));
    EXPECT_EQ(torch::mm(torch::randn({2, 2}), torch::randn({2, 2})).scalar_type(), at::kBFloat16);
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  Accelerator none;
  {
    auto guard = none.autocast();
    EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  }
  // As Accelerate's nullcontext: "no" leaves the caller's own autocast alone.
  mixprec::amp::Autocast own(at::kCPU, at::kBFloat16);
  auto guard = none.autocast({{.enabled = false}});
  EXPECT_TRUE(at::autocast::is_autocast_enabled(at::kCPU));
}

// Accelerate's AutocastKwargs: for the prepared forwards, and for a region of autocast().
TEST(Accelerator, AutocastKwargsTurnItOffOrItsCacheOff) {
  Accelerator off({.mixed_precision = "bf16", .autocast = {.enabled = false}});
  Probe probe;
  auto model = off.prepare(probe);
  model(torch::randn({2, 4}));
  EXPECT_EQ(probe->seen, at::kFloat);

  Accelerator bf16({.mixed_precision = "bf16"});
  {
    auto guard = bf16.autocast();
    auto inner = bf16.autocast({{.enabled = false}});  // back to fp32 in a region
    EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  }
  struct CacheProbe : torch::nn::Module {
    at::Tensor forward(const at::Tensor& x) {
      cache_enabled = at::autocast::is_autocast_cache_enabled();
      return x;
    }
    bool cache_enabled = true;
  };
  Accelerator no_cache({.mixed_precision = "bf16", .autocast = {.cache_enabled = false}});
  auto cache_probe = std::make_shared<CacheProbe>();
  auto prepared = no_cache.prepare(cache_probe);
  prepared(torch::randn({2}));
  EXPECT_FALSE(cache_probe->cache_enabled);
  EXPECT_TRUE(at::autocast::is_autocast_cache_enabled());  // restored
}

TEST(Accelerator, AccumulateSyncsEveryNStepsAndAtTheEndOfTheData) {
  Accelerator accelerator({.gradient_accumulation_steps = 3});
  std::vector<bool> syncs;
  for (int i = 0; i < 7; ++i) {
    if (i == 4) accelerator.gradient_state().end_of_dataloader = true;
    auto guard = accelerator.accumulate();
    syncs.push_back(accelerator.sync_gradients());
    accelerator.gradient_state().end_of_dataloader = false;
  }
  // Steps 1, 2 accumulate, 3 syncs; 4 accumulates, 5 ends the data and syncs
  // (the window restarts); 6 and 7 accumulate.
  EXPECT_EQ(syncs, (std::vector<bool>{false, false, true, false, true, false, false}));
}

// Accelerate's sync_with_dataloader = false: the end of a prepared loader does not end the
// window, which goes on into the next pass.
TEST(Accelerator, AccumulateWithoutSyncWithDataloaderCountsAcrossPasses) {
  const auto data = std::make_shared<mixprec::data::TensorDataset>(
      std::map<std::string, at::Tensor>{{"x", torch::arange(6)}});
  for (const bool with_loader : {true, false}) {
    Accelerator accelerator(
        {.gradient_accumulation_steps = 2, .sync_with_dataloader = with_loader});
    auto loader = accelerator.prepare_data_loader(data, {.batch_size = 2});
    std::vector<bool> syncs;
    for (int pass = 0; pass < 2; ++pass) {
      for ([[maybe_unused]] const auto& batch : loader) {
        auto guard = accelerator.accumulate();
        syncs.push_back(accelerator.sync_gradients());
      }
    }
    // Three batches a pass: the third ends the window, or the window goes on.
    const auto expected = with_loader ? std::vector<bool>{false, true, true, false, true, true}
                                      : std::vector<bool>{false, true, false, true, false, true};
    EXPECT_EQ(syncs, expected);
  }
}

TEST(Accelerator, AccumulatedGradientsEqualOneBigBatch) {
  torch::manual_seed(0);
  auto x = torch::randn({8, 4});
  auto y = torch::randint(0, 3, {8});
  Probe big, small;
  small->fc->weight.data().copy_(big->fc->weight.data());
  small->fc->bias.data().copy_(big->fc->bias.data());
  torch::nn::functional::cross_entropy(big->forward(x), y).backward();

  Accelerator accelerator({.gradient_accumulation_steps = 2});
  torch::optim::SGD sgd(small->parameters(), 0.0);
  auto [model, optimizer] = accelerator.prepare(small, sgd);
  for (int half = 0; half < 2; ++half) {
    auto guard = accelerator.accumulate();
    accelerator.backward(torch::nn::functional::cross_entropy(
        model(x.slice(0, 4 * half, 4 * half + 4)), y.slice(0, 4 * half, 4 * half + 4)));
    optimizer.step();
    if (half == 0) {
      optimizer.zero_grad();  // an accumulation step: keeps the gradients
      EXPECT_TRUE(small->fc->weight.grad().defined());
    }
  }
  EXPECT_TRUE(torch::allclose(small->fc->weight.grad(), big->fc->weight.grad(), 1e-6, 1e-7));
  optimizer.zero_grad();
  EXPECT_FALSE(small->fc->weight.grad().defined());
}

TEST(Accelerator, Fp16SkipsTheStepAndHoldsTheSchedulerOnInf) {
  Accelerator accelerator({.mixed_precision = "fp16", .scaler = {.init_scale = 256.0}});
  ASSERT_NE(accelerator.scaler(), nullptr);
  Probe probe;
  torch::optim::SGD sgd(probe->parameters(), 0.1);
  auto linear = mixprec::optim::get_scheduler("linear", sgd, {.num_training_steps = 10});
  auto [model, optimizer, scheduler] = accelerator.prepare(probe, sgd, linear);
  auto before = probe->fc->weight.detach().clone();
  auto loss = model(torch::randn({2, 4}), torch::tensor({0, 1})).loss;
  accelerator.backward(loss * std::numeric_limits<float>::infinity());
  optimizer.step();
  scheduler.step();
  EXPECT_TRUE(accelerator.optimizer_step_was_skipped());
  EXPECT_TRUE(optimizer.step_was_skipped());
  EXPECT_TRUE(torch::equal(probe->fc->weight.detach(), before));
  EXPECT_EQ(scheduler.get_last_lr()[0], 0.1);  // still at step 0
  EXPECT_EQ(accelerator.scaler()->get_scale(), 128.0);
  optimizer.zero_grad();

  accelerator.backward(model(torch::randn({2, 4}), torch::tensor({0, 1})).loss);
  optimizer.step();
  scheduler.step();
  EXPECT_FALSE(accelerator.optimizer_step_was_skipped());
  EXPECT_FALSE(torch::equal(probe->fc->weight.detach(), before));
  EXPECT_DOUBLE_EQ(scheduler.get_last_lr()[0], 0.09);
}

// Accelerate's GradScalerKwargs(enabled=False): fp16 autocast without loss scaling. The
// gradients are those of the loss itself, and an inf reaches the optimizer.
TEST(Accelerator, Fp16WithTheScalerDisabledDoesNotScale) {
  Accelerator accelerator({.mixed_precision = "fp16", .scaler = {.enabled = false}});
  EXPECT_EQ(accelerator.scaler(), nullptr);
  Probe probe;
  torch::optim::SGD sgd(probe->parameters(), 0.1);
  auto [model, optimizer] = accelerator.prepare(probe, sgd);
  torch::manual_seed(0);
  const auto x = torch::randn({2, 4});
  const auto labels = torch::tensor({0, 1});
  accelerator.backward(model(x, labels).loss);
  EXPECT_EQ(probe->seen, at::kHalf);
  const auto grad = probe->fc->weight.grad().clone();
  probe->zero_grad();
  at::Tensor loss;
  {
    mixprec::amp::Autocast autocast(at::kCPU, at::kHalf);
    loss = probe->forward(x, labels).loss;
  }
  loss.backward();
  EXPECT_TRUE(torch::equal(grad, probe->fc->weight.grad()));
  optimizer.zero_grad();

  accelerator.backward(model(x, labels).loss * std::numeric_limits<float>::infinity());
  optimizer.step();
  EXPECT_FALSE(accelerator.optimizer_step_was_skipped());
  EXPECT_FALSE(torch::isfinite(probe->fc->weight).all().item<bool>());
}

// Accelerate's backward(loss, **kwargs): retain_graph, create_graph and inputs reach
// Tensor::backward, after the division by the accumulation steps.
TEST(Accelerator, BackwardPassesItsOptionsOn) {
  Accelerator accelerator({.gradient_accumulation_steps = 2});
  Probe probe;
  torch::optim::SGD sgd(probe->parameters(), 0.1);
  auto [model, optimizer] = accelerator.prepare(probe, sgd);
  torch::manual_seed(0);
  const auto loss = model(torch::randn({2, 4}), torch::tensor({0, 1})).loss;
  const auto& weight = probe->fc->weight;
  const auto& bias = probe->fc->bias;
  const auto expected = torch::autograd::grad({loss / 2}, {weight}, {}, /*retain_graph=*/true)[0];
  accelerator.backward(loss, {.retain_graph = true, .inputs = std::vector<at::Tensor>{weight}});
  EXPECT_TRUE(torch::allclose(weight.grad(), expected));
  EXPECT_FALSE(bias.grad().defined());  // not among the inputs
  accelerator.backward(loss);           // the graph is still there
  EXPECT_TRUE(torch::allclose(weight.grad(), 2 * expected));
  EXPECT_NE(error_of([&] { accelerator.backward(loss); }).find("a second time"), std::string::npos);
  EXPECT_NE(error_of([&] {
              accelerator.backward(model(torch::randn({2, 4}), torch::tensor({0, 1})).loss,
                                   {.inputs = std::vector<at::Tensor>{}});
            }).find("cannot be empty"),
            std::string::npos);

  const auto x = torch::randn({2, 4}, torch::requires_grad());
  accelerator.backward(model(x, torch::tensor({0, 1})).loss,
                       {.create_graph = true, .inputs = std::vector<at::Tensor>{x}});
  EXPECT_TRUE(x.grad().requires_grad());  // a graph to differentiate again
  x.mutable_grad().reset();               // that graph holds x: a reference cycle, as torch warns
}

TEST(Accelerator, ClippingUnscalesOncePerStep) {
  Accelerator accelerator({.mixed_precision = "fp16", .scaler = {.init_scale = 1024.0}});
  Probe probe;
  torch::optim::SGD sgd(probe->parameters(), 0.1);
  auto [model, optimizer] = accelerator.prepare(probe, sgd);
  for (int step = 0; step < 2; ++step) {
    accelerator.backward(model(torch::randn({2, 4}), torch::tensor({0, 1})).loss);
    const double scaled_norm = probe->fc->weight.grad().norm().item<double>();
    const double norm = accelerator.clip_grad_norm_(probe->parameters(), 1e9);
    // A second clip in the same step must not unscale (nor error) again.
    EXPECT_EQ(accelerator.clip_grad_norm_(probe->parameters(), 1e9), norm);
    EXPECT_NEAR(probe->fc->weight.grad().norm().item<double>(), scaled_norm / 1024.0,
                1e-6 * scaled_norm);
    optimizer.step();
    optimizer.zero_grad();
  }
}

// clip_grad_value_ in fp16 clips the unscaled gradients (Accelerate unscales first), and the
// step that follows does not unscale them again.
TEST(Accelerator, ClipGradValueClipsTheUnscaledGradients) {
  torch::manual_seed(0);
  Probe plain;
  Probe probe;
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < plain->parameters().size(); ++i)
      probe->parameters()[i].copy_(plain->parameters()[i]);
  }
  const auto x = torch::randn({2, 4}) * 4, y = torch::tensor({0, 1});
  plain->forward(x, y).loss.backward();  // the true gradient
  const auto expected_grad = plain->fc->weight.grad().clamp(-0.05, 0.05);
  const auto expected_weight = plain->fc->weight.detach() - 0.1 * expected_grad;
  ASSERT_GT(plain->fc->weight.grad().abs().max().item<double>(), 0.05);  // some are clipped

  Accelerator accelerator({.mixed_precision = "fp16", .scaler = {.init_scale = 1024.0}});
  torch::optim::SGD sgd(probe->parameters(), 0.1);
  auto [model, optimizer] = accelerator.prepare(probe, sgd);
  accelerator.backward(model(x, y).loss);
  accelerator.clip_grad_value_(probe->parameters(), 0.05);
  EXPECT_TRUE(torch::allclose(probe->fc->weight.grad(), expected_grad, 1e-3, 1e-5));
  optimizer.step();
  EXPECT_TRUE(torch::allclose(probe->fc->weight.detach(), expected_weight, 1e-3, 1e-5));
}

// step_scheduler_with_optimizer = false: the prepared scheduler steps at each call, on
// accumulation steps too (Accelerate's AcceleratedScheduler).
TEST(Accelerator, SchedulerStepsAtEveryCallWhenNotWithTheOptimizer) {
  for (const bool with_optimizer : {true, false}) {
    Accelerator accelerator(
        {.gradient_accumulation_steps = 2, .step_scheduler_with_optimizer = with_optimizer});
    Probe probe;
    torch::optim::SGD sgd(probe->parameters(), 0.1);
    auto linear = mixprec::optim::get_scheduler("linear", sgd, {.num_training_steps = 100});
    auto [model, optimizer, scheduler] = accelerator.prepare(probe, sgd, linear);
    for (int micro = 0; micro < 4; ++micro) {
      auto guard = accelerator.accumulate();
      accelerator.backward(model(torch::randn({2, 4}), torch::tensor({0, 1})).loss);
      optimizer.step();
      scheduler.step();
      optimizer.zero_grad();
    }
    EXPECT_DOUBLE_EQ(scheduler.get_last_lr()[0], 0.1 * (with_optimizer ? 98 : 96) / 100.0)
        << with_optimizer;
  }
}

TEST(Accelerator, ClippingOnAnAccumulationStepIsAnError) {
  Accelerator accelerator({.gradient_accumulation_steps = 2});
  Probe probe;
  auto guard = accelerator.accumulate();
  EXPECT_NE(error_of([&] {
              accelerator.clip_grad_norm_(probe->parameters(), 1.0);
            }).find("gradient accumulation step"),
            std::string::npos);
}

// An optim::OptimizerInBackward trains under the Accelerator as without it when nothing waits
// for the gradients (bf16, no accumulation); accumulation and clipping are clear errors.
TEST(Accelerator, OptimizerInBackwardWhereNothingWaitsForTheGradients) {
  const auto train = [](bool in_backward, int64_t accumulation = 1) {
    torch::manual_seed(0);
    Probe probe;
    torch::optim::AdamW adamw(probe->parameters(), 0.01);
    Accelerator accelerator(
        {.mixed_precision = "bf16", .gradient_accumulation_steps = accumulation});
    auto [model, optimizer] = accelerator.prepare(probe, adamw);
    std::optional<mixprec::optim::OptimizerInBackward> updates;
    if (in_backward) updates.emplace(adamw);
    for (int i = 0; i < 3; ++i) {
      auto guard = accelerator.accumulate();
      accelerator.backward(model(torch::randn({4, 4}), torch::tensor({0, 1, 2, 0})).loss);
      if (in_backward) {  // the backward updated and freed the gradients: nothing left to step
        EXPECT_FALSE(probe->fc->weight.grad().defined());
        continue;
      }
      optimizer.step();
      optimizer.zero_grad();
    }
    return probe->fc->weight.detach().clone();
  };
  EXPECT_TRUE(torch::equal(train(true), train(false)));
  EXPECT_NE(error_of([&] { train(true, 2); })
                .find("Accelerator::backward (a prepared model): parameter 0 of shape [3, 4] "
                      "is updated in the backward"),
            std::string::npos);

  // Found on the model's parameters when the optimizer is not prepared (the hooks step it), and
  // in fp16 before the hooks could apply a scaled gradient.
  for (const auto& options :
       {mixprec::accelerate::AcceleratorOptions{.gradient_accumulation_steps = 2},
        mixprec::accelerate::AcceleratorOptions{.mixed_precision = "fp16"}}) {
    Accelerator accelerator(options);
    Probe probe;
    torch::optim::AdamW adamw(probe->parameters(), 0.01);
    auto model = accelerator.prepare(probe);
    mixprec::optim::OptimizerInBackward updates(adamw);
    const auto before = probe->fc->weight.detach().clone();
    const auto error = error_of([&] {
      auto guard = accelerator.accumulate();
      accelerator.backward(model(torch::randn({2, 4}), torch::tensor({0, 1})).loss);
    });
    EXPECT_NE(error.find(options.mixed_precision == "fp16" ? "before the GradScaler can unscale it"
                                                           : "once per gradient_accumulation"),
              std::string::npos)
        << error;
    EXPECT_TRUE(torch::equal(probe->fc->weight, before));
  }

  Accelerator accelerator({.mixed_precision = "bf16"});
  Probe probe;
  torch::optim::AdamW adamw(probe->parameters(), 0.01);
  auto [model, optimizer] = accelerator.prepare(probe, adamw);
  mixprec::optim::OptimizerInBackward updates(adamw);
  accelerator.backward(model(torch::randn({2, 4}), torch::tensor({0, 1})).loss);
  EXPECT_NE(error_of([&] { accelerator.clip_grad_norm_(probe->parameters(), 1.0); })
                .find("Accelerator::clip_grad_norm_: parameter 0 of shape [3, 4] is updated in the "
                      "backward by its post-accumulate-grad hook"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              accelerator.clip_grad_value_(probe->parameters(), 1.0);
            }).find("Accelerator::clip_grad_value_: parameter 0 of shape [3, 4] is updated"),
            std::string::npos);
}

TEST(Accelerator, BadOptionsAreClearErrors) {
  EXPECT_NE(error_of([] {
              Accelerator({.mixed_precision = "fp8"});
            }).find("unknown mixed_precision 'fp8'; expected \"no\", \"fp16\" or \"bf16\""),
            std::string::npos);
  EXPECT_NE(error_of([] {
              Accelerator({.gradient_accumulation_steps = 0});
            }).find("gradient_accumulation_steps must be >= 1, got 0"),
            std::string::npos);
  EXPECT_EQ(error_of([] {
              Accelerator({.rng_types = {"torch", "numpy"}});
            }),
            "Accelerator: rng_types' 'numpy' is not one of \"torch\", \"cuda\", \"generator\"");
  if (!torch::cuda::is_available()) {
    EXPECT_EQ(error_of([] { Accelerator({.rng_types = {"cuda"}}); }),
              "Accelerator: can't synchronize CUDA seeds (rng_types' \"cuda\") without CUDA");
  }
  Accelerator accelerator;
  EXPECT_NE(error_of([&] {
              accelerator.reduce(torch::ones({1}), "min");
            }).find("unknown reduction 'min'; expected \"sum\", \"mean\", \"max\" or \"none\""),
            std::string::npos);
}

// What `accelerate launch` sets (ACCELERATE_MIXED_PRECISION, ..._GRADIENT_ACCUMULATION_STEPS,
// ..._USE_CPU) fills what the code leaves unset, as Accelerate reads them; a value given wins.
TEST(Accelerator, LauncherEnvironmentFillsWhatIsUnset) {
  using mixprec::testing::ScopedEnv;
  ScopedEnv mixed("ACCELERATE_MIXED_PRECISION", "bf16"),
      steps("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4"), cpu("ACCELERATE_USE_CPU", "on");
  Accelerator launched;
  EXPECT_EQ(launched.mixed_precision(), "bf16");
  EXPECT_EQ(launched.gradient_accumulation_steps(), 4);
  EXPECT_TRUE(launched.device().is_cpu());
  Accelerator given({.mixed_precision = "no", .gradient_accumulation_steps = 1});
  EXPECT_EQ(given.mixed_precision(), "no");
  EXPECT_EQ(given.gradient_accumulation_steps(), 1);
  setenv("ACCELERATE_MIXED_PRECISION", "fp8", 1);
  EXPECT_EQ(error_of([] { Accelerator(); }),
            "Accelerator: unknown mixed_precision 'fp8' in ACCELERATE_MIXED_PRECISION; expected "
            "\"no\", \"fp16\" or \"bf16\"");
  unsetenv("ACCELERATE_MIXED_PRECISION");
  for (const char* bad : {"4x", "0"}) {
    setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", bad, 1);
    EXPECT_EQ(error_of([] { Accelerator(); }),
              std::string("Accelerator: ACCELERATE_GRADIENT_ACCUMULATION_STEPS is '") + bad +
                  "', expected an integer >= 1");
  }
  unsetenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS");
  setenv("ACCELERATE_USE_CPU", "maybe", 1);
  EXPECT_EQ(error_of([] { Accelerator(); }),
            "Accelerator: ACCELERATE_USE_CPU is 'maybe', expected a truth value (y, yes, t, true, "
            "on, 1 or n, no, f, false, off, 0)");
}

// Accelerate's process predicates and on_* decorators, on one process: it is the main, local
// main and last process, and process 0.
TEST(Accelerator, OnProcessRunsOnThatProcessOnly) {
  Accelerator accelerator;
  EXPECT_TRUE(accelerator.is_last_process());
  std::vector<std::string> ran;
  accelerator.on_main_process([&] { ran.push_back("main"); });
  accelerator.on_local_main_process([&] { ran.push_back("local main"); });
  accelerator.on_last_process([&] { ran.push_back("last"); });
  accelerator.on_process(0, [&] { ran.push_back("0"); });
  accelerator.on_process(1, [&] { ran.push_back("1"); });
  accelerator.on_local_process(0, [&] { ran.push_back("local 0"); });
  accelerator.on_local_process(1, [&] { ran.push_back("local 1"); });
  EXPECT_EQ(ran, (std::vector<std::string>{"main", "local main", "last", "0", "local 0"}));
  // One process: every reduction is the tensor itself.
  const auto t = torch::arange(3, torch::kFloat);
  for (const char* reduction : {"sum", "mean", "max", "none"})
    EXPECT_TRUE(torch::equal(accelerator.reduce(t, reduction), t)) << reduction;
}

// Accelerate's unscale_gradients(optimizer): that optimizer's gradients only, once a step.
TEST(Accelerator, UnscaleGradientsOfOneOptimizer) {
  Accelerator accelerator({.mixed_precision = "fp16", .scaler = {.init_scale = 1024.0}});
  torch::nn::Linear a(3, 1), b(3, 1);
  torch::optim::SGD sgd_a(a->parameters(), 0.1), sgd_b(b->parameters(), 0.1);
  auto [optimizer_a, optimizer_b] = accelerator.prepare(sgd_a, sgd_b);
  const auto x = torch::ones({2, 3});
  accelerator.backward((a(x) + b(x)).sum());  // d/dw = 2 per weight, times the scale
  accelerator.unscale_gradients(optimizer_a);
  accelerator.unscale_gradients(sgd_a);  // already unscaled this step: nothing
  EXPECT_TRUE(torch::equal(a->weight.grad(), torch::full({1, 3}, 2.0)));
  EXPECT_TRUE(torch::equal(b->weight.grad(), torch::full({1, 3}, 2048.0)));
  accelerator.unscale_gradients();  // the rest
  EXPECT_TRUE(torch::equal(b->weight.grad(), torch::full({1, 3}, 2.0)));
  torch::optim::SGD other(a->parameters(), 0.1);
  EXPECT_NE(error_of([&] {
              accelerator.unscale_gradients(other);
            }).find("the optimizer was not prepared by this accelerator"),
            std::string::npos);
  Accelerator fp32;  // nothing to unscale: any optimizer, as Accelerate's
  EXPECT_NO_THROW(fp32.unscale_gradients(other));
}

TEST(Accelerator, GatherForMetricsDropsThePaddingOfTheLastBatch) {
  Accelerator accelerator;
  auto predictions = torch::arange(8);
  EXPECT_TRUE(torch::equal(accelerator.gather_for_metrics(predictions), predictions));
  accelerator.gradient_state().end_of_dataloader = true;
  accelerator.gradient_state().num_padding_samples = 3;
  EXPECT_TRUE(torch::equal(accelerator.gather_for_metrics(predictions), torch::arange(5)));
  const auto scalar = torch::tensor(1.5);  // a value, not samples: nothing to drop
  EXPECT_TRUE(torch::equal(accelerator.gather_for_metrics(scalar), scalar));
  EXPECT_TRUE(torch::equal(accelerator.reduce(predictions, "sum"), predictions));
  // As Accelerate's in one process: the tensor as it is, an integer mean too.
  EXPECT_TRUE(torch::equal(accelerator.reduce(predictions, "mean"), predictions));
  EXPECT_EQ(accelerator.reduce(predictions, "mean").scalar_type(), at::kLong);
}

TEST(Accelerator, ProcessInfoAndPrint) {
  Accelerator accelerator;
  EXPECT_EQ(accelerator.num_processes(), 1);
  EXPECT_TRUE(accelerator.is_main_process());
  EXPECT_EQ(accelerator.device(), c10::Device(c10::kCPU));
  testing::internal::CaptureStdout();
  accelerator.print("step ", 3, " loss ", 0.5);
  EXPECT_EQ(testing::internal::GetCapturedStdout(), "step 3 loss 0.5\n");
}

TEST(Accelerator, LogsToItsTrackers) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("mixprec_acc_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  // One's own tracker (Accelerate's GeneralTracker instance in log_with) beside the named ones.
  struct Recording : mixprec::log::Tracker {
    void log(const std::map<std::string, double>& values, int64_t step) override {
      logged.emplace_back(values, step);
    }
    void flush() override { ++flushes; }
    std::vector<std::pair<std::map<std::string, double>, int64_t>> logged;
    int flushes = 0;
  };
  auto recording = std::make_shared<Recording>();
  Accelerator accelerator({.log_with = {"jsonl", "tensorboard"},
                           .custom_trackers = {recording},
                           .project_dir = dir.string()});
  accelerator.log({{"loss", 1.0}}, 1);  // before init_trackers: nowhere, as Accelerate's
  accelerator.init_trackers("run1");
  accelerator.log({{"loss", 0.25}}, 7);
  accelerator.end_training();
  ASSERT_EQ(recording->logged.size(), 1u);
  EXPECT_EQ(recording->logged[0].first, (std::map<std::string, double>{{"loss", 0.25}}));
  EXPECT_EQ(recording->logged[0].second, 7);
  EXPECT_EQ(recording->flushes, 1);
  std::ifstream in(dir / "run1" / "log.jsonl");
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  EXPECT_NE(line.find("\"loss\":0.25"), std::string::npos) << line;
  EXPECT_NE(line.find("\"step\":7"), std::string::npos) << line;
  bool has_events = false;
  for (const auto& entry : std::filesystem::directory_iterator(dir / "run1"))
    has_events |= entry.path().filename().string().starts_with("events.out.tfevents.");
  EXPECT_TRUE(has_events);
  std::filesystem::remove_all(dir);
}

// Accelerate's init_trackers(name, config), log of text values and get_tracker.
TEST(Accelerator, TrackersStoreTheConfigTakeTextAndAreFoundByName) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("mixprec_acc_config_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  struct Recording : mixprec::log::Tracker {
    std::string name() const override { return "mine"; }
    void log(const std::map<std::string, double>&, int64_t) override {}
    void log_text(const std::map<std::string, std::string>& values, int64_t step) override {
      texts.emplace_back(values, step);
    }
    void store_init_configuration(const mixprec::log::Config& config) override {
      configs.push_back(config);
    }
    void flush() override {}
    std::vector<std::pair<std::map<std::string, std::string>, int64_t>> texts;
    std::vector<mixprec::log::Config> configs;
  };
  auto recording = std::make_shared<Recording>();
  Accelerator accelerator({.log_with = {"jsonl", "tensorboard"},
                           .custom_trackers = {recording},
                           .project_dir = dir.string()});
  EXPECT_EQ(accelerator.get_tracker("jsonl"), nullptr);  // none before init_trackers
  const mixprec::log::Config config = {{"learning_rate", 1e-3}, {"batch_size", int64_t{32}}};
  accelerator.init_trackers("run", config);
  ASSERT_EQ(recording->configs.size(), 1u);
  EXPECT_EQ(recording->configs[0], config);
  accelerator.log_text({{"note", "hello"}}, 3);
  ASSERT_EQ(recording->texts.size(), 1u);
  EXPECT_EQ(recording->texts[0].first.at("note"), "hello");
  EXPECT_EQ(recording->texts[0].second, 3);
  EXPECT_EQ(accelerator.get_tracker("mine"), recording.get());
  ASSERT_NE(accelerator.get_tracker("tensorboard"), nullptr);
  EXPECT_EQ(accelerator.get_tracker("tensorboard")->name(), "tensorboard");
  EXPECT_NE(error_of([&] { accelerator.get_tracker("wandb"); })
                .find("wandb is not an available tracker stored inside the Accelerator (open: "
                      "jsonl, tensorboard, mine)"),
            std::string::npos);
  accelerator.end_training();
  std::ifstream in(dir / "run" / "log.jsonl");
  std::string config_line, text_line;
  ASSERT_TRUE(std::getline(in, config_line) && std::getline(in, text_line));
  EXPECT_NE(config_line.find(R"("config":{"batch_size":32,"learning_rate":0.001})"),
            std::string::npos)
      << config_line;
  EXPECT_NE(text_line.find(R"("note":"hello")"), std::string::npos) << text_line;
  // Without a config, nothing is stored (Accelerate's config=None).
  Accelerator again({.custom_trackers = {recording}, .project_dir = dir.string()});
  again.init_trackers("run2");
  EXPECT_EQ(recording->configs.size(), 1u);
  // As Accelerate's, a second call adds trackers to those open, and the config goes to all.
  Accelerator twice({.log_with = {"jsonl"}, .project_dir = dir.string()});
  twice.init_trackers("first");
  twice.init_trackers("second", config);
  twice.log({{"loss", 0.5}}, 1);
  twice.end_training();
  for (const char* run : {"first", "second"}) {
    std::ifstream log(dir / run / "log.jsonl");
    std::string stored, logged;
    ASSERT_TRUE(std::getline(log, stored) && std::getline(log, logged)) << run;
    EXPECT_NE(stored.find(R"("config":)"), std::string::npos) << run << ": " << stored;
    EXPECT_NE(logged.find(R"("loss":0.5)"), std::string::npos) << run << ": " << logged;
  }
  std::filesystem::remove_all(dir);
}

TEST(Accelerator, NumericsMonitorWatchesTheModelAndLogsItsFigures) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("mixprec_acc_numerics_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  Accelerator accelerator(
      {.mixed_precision = "fp16",
       .gradient_accumulation_steps = 2,
       .scaler = {.init_scale = 256.0},
       .log_with = {"jsonl"},
       .project_dir = dir.string(),
       .numerics_monitor = mixprec::log::NumericsMonitorOptions{.every_n_steps = 2}});
  accelerator.init_trackers("run");
  Probe probe;
  torch::optim::SGD sgd(probe->parameters(), 0.1);
  auto [model, optimizer] = accelerator.prepare(probe, sgd);
  ASSERT_NE(accelerator.numerics_monitor(), nullptr);
  for (int micro = 0; micro < 6; ++micro) {  // 3 optimizer steps
    auto guard = accelerator.accumulate();
    at::Tensor loss = model(torch::randn({2, 4}), torch::tensor({0, 1})).loss;
    if (micro == 3) loss = loss * std::numeric_limits<float>::infinity();  // step 2 overflows
    accelerator.backward(loss);
    optimizer.step();
    optimizer.zero_grad();
  }
  accelerator.end_training();
  const auto* monitor = accelerator.numerics_monitor();
  ASSERT_EQ(monitor->scale_history().size(), 3u);  // optimizer steps, not micro-steps
  EXPECT_EQ(monitor->scale_history()[1].scale, 128.0);
  ASSERT_EQ(monitor->records().size(), 2u);  // steps 1 and 2
  const auto& step2 = monitor->records()[1];
  EXPECT_TRUE(step2.skipped);
  EXPECT_EQ(step2.scale, 256.0);
  ASSERT_EQ(step2.gradients.size(), 2u);
  EXPECT_EQ(step2.gradients[0].first, "fc.weight");
  EXPECT_GT(step2.gradients[0].second.overflow, 0);
  // Both micro-batches' forwards, under fp16 autocast: 2 × (2×3) outputs.
  ASSERT_EQ(step2.activations.size(), 1u);
  EXPECT_EQ(step2.activations[0].second.numel, 12);
  std::ifstream in(dir / "run" / "log.jsonl");
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_NE(lines[0].find("\"step\":1"), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find("\"numerics/grad_overflow/fc.weight\""), std::string::npos) << lines[1];
  EXPECT_NE(lines[1].find("\"numerics/loss_scale\":256"), std::string::npos) << lines[1];
  std::filesystem::remove_all(dir);
}

TEST(Accelerator, SetSeedReproduces) {
  mixprec::accelerate::set_seed(7);
  auto a = torch::randn({3});
  mixprec::accelerate::set_seed(7);
  EXPECT_TRUE(torch::equal(a, torch::randn({3})));
}

}  // namespace

namespace {

std::shared_ptr<mixprec::data::TensorDataset> numbers(int64_t n) {
  return std::make_shared<mixprec::data::TensorDataset>(
      std::map<std::string, at::Tensor>{{"x", torch::arange(n)}});
}

// As Accelerate's GradientState, which follows the active loader: an evaluation pass run on the
// training loader's last batch, before its accumulate(), leaves that batch's end of data (and
// sync step) in place.
TEST(Accelerator, AnInnerLoaderPassLeavesTheOuterLoadersEndOfData) {
  Accelerator accelerator({.gradient_accumulation_steps = 4});
  auto train = accelerator.prepare_data_loader(numbers(6), {.batch_size = 2});
  auto eval = accelerator.prepare_data_loader(numbers(3), {.batch_size = 2});
  std::vector<bool> syncs, ends_in_eval;
  for (const auto& batch : train) {
    (void)batch;
    for (const auto& eval_batch : eval) {
      (void)eval_batch;
      ends_in_eval.push_back(accelerator.gradient_state().end_of_dataloader);
    }
    auto guard = accelerator.accumulate();
    syncs.push_back(accelerator.sync_gradients());
  }
  EXPECT_EQ(syncs, (std::vector<bool>{false, false, true}));
  EXPECT_EQ(ends_in_eval, (std::vector<bool>{false, true, false, true, false, true}));
  EXPECT_FALSE(accelerator.gradient_state().end_of_dataloader);  // no loader in a pass
  // A loader left early stays the active one, as in Accelerate, until its next pass ends.
  for (const auto& batch : eval) {
    (void)batch;
    break;
  }
  std::vector<bool> ends;
  for (const auto& batch : train) {
    (void)batch;
    ends.push_back(accelerator.gradient_state().end_of_dataloader);
    for (const auto& eval_batch : eval) (void)eval_batch;
    ends.push_back(accelerator.gradient_state().end_of_dataloader);
  }
  EXPECT_EQ(ends, (std::vector<bool>{false, false, false, false, true, true}));
}

TEST(Accelerator, PreparedDataLoaderEndsAccumulationAndResumesFromAState) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("mixprec_dl_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  Accelerator accelerator({.gradient_accumulation_steps = 2});
  auto loader = accelerator.prepare_data_loader(numbers(10), {.batch_size = 4});
  EXPECT_EQ(loader.size(), 3u);
  std::vector<bool> syncs, ends;
  std::vector<int64_t> firsts;
  for (const auto& batch : loader) {
    auto guard = accelerator.accumulate();
    syncs.push_back(accelerator.sync_gradients());
    ends.push_back(accelerator.gradient_state().end_of_dataloader);
    firsts.push_back(batch.at("x")[0].item<int64_t>());
    if (firsts.size() == 1) accelerator.save_state(dir.string());  // after the first batch
  }
  // The third batch ends the data: it syncs although the window holds one batch.
  EXPECT_EQ(syncs, (std::vector<bool>{false, true, true}));
  EXPECT_EQ(ends, (std::vector<bool>{false, false, true}));
  EXPECT_EQ(firsts, (std::vector<int64_t>{0, 4, 8}));

  Accelerator resumed({.gradient_accumulation_steps = 2});
  auto again = resumed.prepare_data_loader(numbers(10), {.batch_size = 4});
  resumed.load_state(dir.string());
  std::vector<int64_t> rest;
  for (const auto& batch : again) rest.push_back(batch.at("x")[0].item<int64_t>());
  EXPECT_EQ(rest, (std::vector<int64_t>{4, 8}));

  // The same checkpoint as if two processes had written it: the batch done was another one, and
  // load_state says so.
  const auto two = dir.string() + "_two";
  {
    mixprec::io::CheckpointWriter writer(two);
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      const auto name = entry.path().filename().string();
      if (name == "checksums.json") continue;
      auto text = mixprec::io::read_file(entry.path());
      if (name == "accelerator.json") {
        auto state = nlohmann::json::parse(text);
        state["num_processes"] = 2;
        text = state.dump();
      }
      writer.write_text(name, text);
    }
    writer.commit();
  }
  std::vector<std::string> messages;
  {
    mixprec::testing::CapturedWarnings capture;
    Accelerator one({.gradient_accumulation_steps = 2});
    auto loader_again = one.prepare_data_loader(numbers(10), {.batch_size = 4});
    one.load_state(two);
    accelerator.load_state(dir.string());  // its own: no warning
    messages = capture.messages;
  }
  ASSERT_EQ(messages.size(), 1u);
  EXPECT_NE(messages[0].find("dataloader.json stopped mid-epoch with batches of 4 on each "
                             "of 2 process(es), sharded as batch_sampler_shard; this run "
                             "has batches of 4 on each of 1,"),
            std::string::npos)
      << messages[0];
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(two);
}

at::Tensor pass(mixprec::accelerate::PreparedDataLoader& loader) {
  std::vector<at::Tensor> xs;
  for (const auto& batch : loader) xs.push_back(batch.at("x"));
  return torch::cat(xs);
}

// As Accelerate's prepared loaders: without a seed the shuffle follows set_seed, each pass
// has a new order, a pass left early is not continued by the next one, and after a loop the
// gradient state is no longer at the end of a loader.
TEST(Accelerator, PreparedLoaderShufflesBySetSeedAndEpoch) {
  const mixprec::data::DataLoaderOptions shuffled{.batch_size = 4, .shuffle = true};
  mixprec::accelerate::set_seed(1);
  Accelerator accelerator;
  auto loader = accelerator.prepare_data_loader(numbers(16), shuffled);
  const auto first = pass(loader), second = pass(loader);
  EXPECT_TRUE(torch::equal(std::get<0>(first.sort()), torch::arange(16)));
  EXPECT_TRUE(torch::equal(std::get<0>(second.sort()), torch::arange(16)));
  EXPECT_FALSE(torch::equal(first, second)) << "the second epoch in the first one's order";
  EXPECT_FALSE(accelerator.gradient_state().end_of_dataloader);
  EXPECT_EQ(accelerator.gradient_state().num_padding_samples, 0);

  for (const auto& batch : loader) {
    (void)batch;
    break;
  }
  EXPECT_EQ(pass(loader).size(0), 16) << "a new pass after one left early is a whole epoch";

  mixprec::accelerate::set_seed(1);
  Accelerator same_seed;
  auto again = same_seed.prepare_data_loader(numbers(16), shuffled);
  EXPECT_TRUE(torch::equal(pass(again), first));
  mixprec::accelerate::set_seed(2);
  auto other = same_seed.prepare_data_loader(numbers(16), shuffled);
  EXPECT_FALSE(torch::equal(pass(other), first));

  // A seed given is the sampler's, as for a plain DataLoader.
  auto seeded_options = shuffled;
  seeded_options.seed = 7;
  auto seeded = accelerator.prepare_data_loader(numbers(16), seeded_options);
  mixprec::data::DataLoader plain(numbers(16), seeded_options);
  std::vector<at::Tensor> plain_pass;
  for (const auto& batch : plain) plain_pass.push_back(batch.at("x"));
  EXPECT_TRUE(torch::equal(pass(seeded), torch::cat(plain_pass)));
}

// Accelerate's default prepared loader (RandomSampler) in one process: the reference cases'
// orders and draws from torch's generator, pass after pass. (Several processes: the
// two-process tests.)
TEST(Accelerator, PreparedLoaderShufflesAsAcceleratesDefault) {
  const auto cases = mixprec::testing::load_reference("data_loader_order.json");
  int64_t checked = 0;
  for (const auto& c : cases["accelerate_random_sampler"]) {
    if (c["num_replicas"] != 1) continue;
    SCOPED_TRACE(c.dump().substr(0, 120));
    mixprec::accelerate::set_seed(c["seed"].get<uint64_t>());
    Accelerator accelerator;
    auto loader =
        accelerator.prepare_data_loader(numbers(c["n"]), {.batch_size = c["batch_size"],
                                                          .shuffle = c["shuffle"],
                                                          .drop_last = c["drop_last"],
                                                          .num_workers = c["num_workers"]});
    const auto got = mixprec::testing::random_sampler_passes(loader, "x");
    EXPECT_EQ(got["passes"], c["ranks"][0]["passes"]);
    EXPECT_EQ(got["draws"], c["ranks"][0]["draws"]);
    ++checked;
  }
  EXPECT_GE(checked, 4);
}

// use_seedable_sampler: randperm(seed + epoch), the seed being data_seed or torch's initial seed.
TEST(Accelerator, SeedableSamplerShufflesBySeedPlusEpoch) {
  const mixprec::data::DataLoaderOptions shuffled{.batch_size = 4, .shuffle = true};
  for (const std::optional<uint64_t> data_seed :
       {std::optional<uint64_t>(), std::optional<uint64_t>(11)}) {
    mixprec::accelerate::set_seed(3);
    Accelerator accelerator({.use_seedable_sampler = true, .data_seed = data_seed});
    auto loader = accelerator.prepare_data_loader(numbers(10), shuffled);
    for (int64_t epoch = 0; epoch < 2; ++epoch) {
      const auto order = mixprec::data::batch_sampler_shard_indices(
          10, 4, 1, 0, true, data_seed.value_or(3), epoch, false);
      const auto got = pass(loader);
      EXPECT_EQ(
          std::vector<int64_t>(got.data_ptr<int64_t>(), got.data_ptr<int64_t>() + got.numel()),
          std::vector<int64_t>(order.begin(), order.end()));
    }
  }
}

// The seed a shuffled pass drew is saved with the state: a resumed run whose generator would
// draw another one still gets the rest of the saved pass.
TEST(Accelerator, PreparedLoaderResumesItsDrawnShuffle) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("mixprec_seed_" + std::to_string(getpid()));
  const mixprec::data::DataLoaderOptions shuffled{.batch_size = 4, .shuffle = true};
  mixprec::accelerate::set_seed(1);
  Accelerator accelerator;
  auto loader = accelerator.prepare_data_loader(numbers(16), shuffled);
  std::vector<at::Tensor> batches;
  for (const auto& batch : loader) {
    if (batches.empty()) accelerator.save_state(dir.string());  // in the first batch's step
    batches.push_back(batch.at("x"));
  }
  mixprec::accelerate::set_seed(2);
  Accelerator resumed;
  auto again = resumed.prepare_data_loader(numbers(16), shuffled);
  resumed.load_state(dir.string());
  EXPECT_TRUE(
      torch::equal(pass(again), torch::cat(std::vector(batches.begin() + 1, batches.end()))));
  std::filesystem::remove_all(dir);
}

// A scheduler waits for its own optimizer's skipped step only (Accelerate links each prepared
// scheduler to its optimizer): a GAN's generator schedule goes on when the critic overflows.
TEST(Accelerator, SchedulerWaitsOnlyForItsOwnOptimizersSkippedStep) {
  // A scale whose fp16 gradients stay finite: only the inf put into net_a's skips a step.
  Accelerator accelerator({.mixed_precision = "fp16", .scaler = {.init_scale = 16}});
  auto net_a = torch::nn::Linear(3, 2), net_b = torch::nn::Linear(3, 2);
  torch::optim::SGD sgd_a(net_a->parameters(), 0.1), sgd_b(net_b->parameters(), 0.1);
  auto schedule_a = mixprec::optim::get_scheduler("linear", sgd_a, {.num_training_steps = 10});
  auto schedule_b = mixprec::optim::get_scheduler("linear", sgd_b, {.num_training_steps = 10});
  auto [model_a, optimizer_a, scheduler_a] = accelerator.prepare(net_a, sgd_a, schedule_a);
  auto [model_b, optimizer_b, scheduler_b] = accelerator.prepare(net_b, sgd_b, schedule_b);
  const auto x = torch::randn({4, 3});
  accelerator.backward(model_a(x).sum() + model_b(x).sum());
  net_a->weight.mutable_grad().fill_(std::numeric_limits<float>::infinity());
  optimizer_a.step();
  optimizer_b.step();
  EXPECT_TRUE(optimizer_a.step_was_skipped());
  EXPECT_FALSE(optimizer_b.step_was_skipped());
  scheduler_a.step();
  scheduler_b.step();
  EXPECT_EQ(schedule_a.last_epoch(), 0);
  EXPECT_EQ(schedule_b.last_epoch(), 1);
}

struct Counter : mixprec::accelerate::Checkpointable {
  int value = 0;
  std::string state_dict() const override { return std::to_string(value); }
  void load_state_dict(const std::string& text) override { value = std::stoi(text); }
};

// free_memory() forgets what was prepared; registered objects stay, as in Accelerate.
TEST(Accelerator, FreeMemoryKeepsRegisteredObjects) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("mixprec_free_" + std::to_string(getpid()));
  Accelerator accelerator;
  auto net = torch::nn::Linear(3, 2);
  auto model = accelerator.prepare(net);
  Counter counter;
  counter.value = 5;
  accelerator.register_for_checkpointing(counter);
  accelerator.free_memory();
  accelerator.save_state(dir.string());
  EXPECT_FALSE(std::filesystem::exists(dir / "model.safetensors"));
  counter.value = 0;
  accelerator.load_state(dir.string());
  EXPECT_EQ(counter.value, 5);
  std::filesystem::remove_all(dir);
}

// After free_memory(), the numerics monitor watches the next prepared model, not the forgotten.
TEST(Accelerator, FreeMemoryMovesTheNumericsMonitorToTheNextModel) {
  Accelerator accelerator(
      {.numerics_monitor = mixprec::log::NumericsMonitorOptions{.every_n_steps = 1}});
  auto first = accelerator.prepare(torch::nn::Linear(3, 2));
  (void)first;
  accelerator.free_memory();
  torch::nn::Sequential net(torch::nn::Linear(3, 4), torch::nn::Linear(4, 2));
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = accelerator.prepare(net, sgd);
  accelerator.backward(model->forward(torch::randn({2, 3})).sum());
  optimizer.step();
  ASSERT_NE(accelerator.numerics_monitor(), nullptr);
  ASSERT_EQ(accelerator.numerics_monitor()->records().size(), 1u);
  const auto& gradients = accelerator.numerics_monitor()->records()[0].gradients;
  ASSERT_EQ(gradients.size(), 4u);
  EXPECT_EQ(gradients[2].first, "1.weight");
}

// What a registered object rejects on load is an error naming its file.
TEST(Accelerator, ARegisteredObjectsLoadErrorNamesItsFile) {
  struct Rejecting : mixprec::accelerate::Checkpointable {
    std::string state_dict() const override { return "{}"; }
    void load_state_dict(const std::string&) override { throw std::invalid_argument("not mine"); }
  };
  const auto dir =
      std::filesystem::temp_directory_path() / ("mixprec_rejecting_" + std::to_string(getpid()));
  Accelerator accelerator;
  Rejecting rejecting;
  accelerator.register_for_checkpointing(rejecting);
  accelerator.save_state(dir.string());
  const std::string error = error_of([&] { accelerator.load_state(dir.string()); });
  EXPECT_NE(error.find((dir / "custom_checkpoint.json").string() + ": not mine"), std::string::npos)
      << error;
  std::filesystem::remove_all(dir);
}

}  // namespace
