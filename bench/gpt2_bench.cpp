// Tokens/s of the level-1 loop (or the same through the Accelerator or the
// Trainer, --level accelerator|trainer) on GPT-2 (mixprec::models::GPT2LMHeadModel, fresh init,
// synthetic tokens) in one configuration, for bench/run.py --workload
// gpt2-small|gpt2-large. One JSON line on stdout. Its Python twin is
// bench/gpt2_bench.py (transformers' GPT2LMHeadModel, HF Accelerate, HF Trainer); keep the
// two doing the same work: autocast + GradScaler (fp16) + fused AdamW, dropout
// off, 2 threads.
//
//   build/bench/gpt2_bench --size small --precision fp16 --fast-path on --steps 20
#include <mixprec/accelerate/accelerator.h>
#include <mixprec/amp/autocast.h>
#include <mixprec/amp/fp16_cpu.h>
#include <mixprec/amp/grad_scaler.h>
#include <mixprec/models/gpt2.h>
#include <mixprec/optim/adamw.h>
#include <mixprec/optim/optimizer_in_backward.h>
#include <mixprec/train/trainer.h>

#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include "gpt2_config.h"
#include "profile.h"
#include "timed_steps.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <vector>

#include <sys/resource.h>
#include <unistd.h>

namespace {

// The part of a training step an op's self time counts toward.
std::string part_of(const std::string& op) {
  const auto is = [&](std::initializer_list<const char*> names) {
    return std::any_of(names.begin(), names.end(), [&](const char* n) { return op == n; });
  };
  const auto has = [&](const char* s) { return op.find(s) != std::string::npos; };
  if (is({"aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", "mixprec::onednn_mm"}))
    return "GEMMs (linear layers, LM head)";
  // GPT-2's only batched GEMMs are those of mixprec's matmul attention.
  if (is({"aten::bmm", "aten::baddbmm"})) return "attention GEMMs (matmul kernel)";
  if (has("attention")) return "attention";
  if (is({"aten::copy_", "aten::_to_copy", "aten::to", "aten::cat", "aten::clone"}))
    return "casts and copies";
  if (has("softmax") || has("nll_loss") || has("cross_entropy") ||
      is({"aten::exp", "aten::gather", "aten::scatter_add_", "aten::full"}))
    return "loss (log-softmax, cross-entropy)";
  if (has("gelu")) return "GELU";
  if (has("layer_norm")) return "LayerNorm";
  if (has("adam") || has("_foreach") || has("_amp_")) return "optimizer and scaler";
  return "other (residual adds, bias sums, fills, embeddings, dispatch)";
}

double activation_mb(const std::function<torch::Tensor()>& forward) {
  return static_cast<double>(activation_bytes(forward)) / (1024.0 * 1024.0);
}

// Peak bytes of the tensors one step allocates, above what lives before it (parameters,
// AdamW's moments), from LibTorch's profiler's memory events: what the step needs, without the
// allocator's free-but-resident memory that peak RSS also counts.
double step_peak_mb(const std::function<void()>& step) {
  const auto profiler = profiled(step, /*memory=*/true);
  std::vector<std::pair<int64_t, int64_t>> events;  // (time, bytes allocated or freed)
  for (const auto& e : profiler.result()->events())
    if (e.name() == "[memory]") events.emplace_back(e.startNs(), e.nBytes());
  std::sort(events.begin(), events.end());
  int64_t live = 0, peak = 0;
  for (const auto& [time, bytes] : events) peak = std::max(peak, live += bytes);
  return static_cast<double>(peak) / (1024.0 * 1024.0);
}

// The Trainer on the same batches, with HF's defaults where the loop has none
// (clipping at 1, shuffling).
TimedSteps time_gpt2_trainer(
    mixprec::models::GPT2LMHeadModel model, const torch::Tensor& data, const std::string& precision,
    int64_t warmup, int64_t steps,
    std::vector<std::shared_ptr<mixprec::train::TrainerCallback>> callbacks = {}) {
  const auto ids = data.reshape({-1, data.size(2)});  // (batches·B, T)
  auto dataset = std::make_shared<mixprec::data::TensorDataset>(
      std::map<std::string, at::Tensor>{{"input_ids", ids}, {"labels", ids}});
  mixprec::TrainingArguments args;
  args.fp16 = precision == "fp16";
  args.bf16 = precision == "bf16";
  args.per_device_train_batch_size = data.size(1);
  args.learning_rate = 3e-4;
  args.lr_scheduler_type = "constant";
  return time_trainer(model.ptr(), mixprec::train::forward_on_batches(model), dataset, args, warmup,
                      steps, std::move(callbacks));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tokens/s of the level-1 loop on GPT-2 in one configuration"};
  std::string size = "small", precision = "fp32", fast_path = "auto", level = "loop";
  int steps = 20, warmup = 2, threads = 2;
  bool profile = false, memory = false, checkpointing = false, in_backward = false;
  app.add_option("--size", size, "small: 2 x 128, T 128; large: 6 x 512, T 256 (B 8, V 4096)")
      ->check(CLI::IsMember({"small", "large"}));
  app.add_option("--precision", precision,
                 "bf16-pure: the model in bf16, no autocast, AdamW with stochastic rounding "
                 "(loop only)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16", "bf16-pure"}));
  app.add_option("--fast-path", fast_path, "mixprec's fp16 CPU fast path")
      ->check(CLI::IsMember({"auto", "on", "off"}));
  app.add_option("--level", level,
                 "loop: autocast + GradScaler by hand; accelerator: the same through "
                 "mixprec::Accelerator; trainer: mixprec::Trainer (HF's defaults: clipping at 1)")
      ->check(CLI::IsMember({"loop", "accelerator", "trainer"}));
  app.add_option("--steps", steps)->check(CLI::PositiveNumber);
  auto* warmup_option =
      app.add_option("--warmup", warmup, "untimed steps first (default 2; 10 with --profile)")
          ->check(CLI::NonNegativeNumber);
  app.add_option("--threads", threads)->check(CLI::PositiveNumber);
  app.add_flag("--profile", profile,
               "after the warm-up, print each op's self time in one step, at any --level "
               "(LibTorch's profiler)");
  app.add_flag("--memory", memory,
               "after the warm-up, print the peak of one step's tensors and the tensors held "
               "between steps (LibTorch's profiler), and peak RSS");
  app.add_flag("--activation-checkpointing", checkpointing,
               "recompute each block's activations in the backward (HF's gradient_checkpointing)");
  app.add_flag("--optimizer-in-backward", in_backward,
               "update each parameter and free its gradient as soon as the backward has it "
               "(optim::OptimizerInBackward; --level loop, not fp16)");
  CLI11_PARSE(app, argc, argv);
  // The first steps page-fault in the memory glibc then keeps for reuse: with 2 warm-up steps, the
  // profiled step's large bf16 cross-entropy backward took 24 ms writing its fresh 16 MB gradient,
  // 1.8 ms from the fifth step on (fp32: ~40 ms up to the ninth step, then 3 ms). A profile shows
  // the steady state.
  if (profile && warmup_option->count() == 0) warmup = 10;
  const bool pure = precision == "bf16-pure";
  if (memory && level == "trainer") {
    std::fprintf(stderr,
                 "--memory measures the loop's or the Accelerator's step, not the Trainer's\n");
    return 2;
  }
  if (in_backward && (level != "loop" || precision == "fp16")) {
    std::fprintf(stderr,
                 "--optimizer-in-backward runs at --level loop, without fp16's GradScaler\n");
    return 2;
  }
  if (pure && level != "loop") {
    std::fprintf(stderr, "--precision bf16-pure runs at --level loop only, got --level %s\n",
                 level.c_str());
    return 2;
  }

  using mixprec::amp::Fp16CpuPath;
  mixprec::amp::set_fp16_cpu_path(fast_path == "on"    ? Fp16CpuPath::kAlways
                                  : fast_path == "off" ? Fp16CpuPath::kNever
                                                       : Fp16CpuPath::kAuto);
  torch::set_num_threads(threads);
  const bool large = size == "large";
  const auto config = bench_gpt2_config(large);
  const int64_t batch = 8, seq = config.n_positions;
  torch::manual_seed(0);
  mixprec::models::GPT2LMHeadModel model(config);
  if (checkpointing) model->activation_checkpointing_enable();
  const auto data = torch::randint(config.vocab_size, {4, batch, seq});  // (batches, B, T)
  if (pure) model->to(torch::kBFloat16);
  // Stochastic rounding has no fused kernel.
  mixprec::optim::AdamW optimizer(
      model->parameters(),
      mixprec::optim::AdamWOptions(3e-4).fused(!pure).stochastic_rounding(pure));
  mixprec::amp::GradScaler scaler({.enabled = precision == "fp16"});
  const bool autocast = precision == "bf16" || precision == "fp16";
  const auto dtype = precision == "fp16" ? torch::kHalf : torch::kBFloat16;

  const auto forward = [&](int64_t i) {
    const auto ids = data[i % data.size(0)];
    mixprec::amp::Autocast guard(torch::kCPU, dtype, autocast);
    return model->forward(ids, /*labels=*/ids).loss;
  };
  std::function<torch::Tensor(int64_t)> step = [&](int64_t i) {
    const auto loss = forward(i);
    scaler.scale(loss).backward();
    scaler.step(optimizer);
    scaler.update();
    optimizer.zero_grad();
    return loss;
  };
  std::optional<mixprec::optim::OptimizerInBackward> updates_in_backward;
  if (in_backward) {
    updates_in_backward.emplace(optimizer);
    step = [&](int64_t i) {
      const auto loss = forward(i);
      loss.backward();
      return loss;
    };
  }
  std::optional<mixprec::Accelerator> accelerator;
  if (level == "accelerator") {
    accelerator.emplace(mixprec::AcceleratorOptions{
        .mixed_precision = precision == "fp32" ? "no" : precision, .cpu = true});
    step = [&, prepared = accelerator->prepare(model),
            accelerated = accelerator->prepare(optimizer)](int64_t i) mutable {
      const auto ids = data[i % data.size(0)];
      const auto loss = prepared.run([&] { return model->forward(ids, /*labels=*/ids); }).loss;
      accelerator->backward(loss);
      accelerated.step();
      accelerated.zero_grad();
      return loss;
    };
  }
  for (int i = 0; i < warmup && level != "trainer"; ++i) step(i);
  if (profile && level == "trainer") {
    auto profiler = std::make_shared<ProfileSteps>(warmup, 1);
    time_gpt2_trainer(model, data, precision, warmup, 1, {profiler});
    print_self_times(*profiler->profiler, part_of);
    return 0;
  }
  if (profile) {
    print_self_times(profiled([&] { step(warmup).item<double>(); }), part_of);
    return 0;
  }
  if (memory) {
    const double peak = step_peak_mb([&] { step(warmup).item<double>(); });
    double params = 0;
    for (const auto& p : model->parameters()) params += static_cast<double>(p.nbytes());
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    std::fprintf(stderr,
                 "one step's tensors: peak %.1f MB above what lives between steps (parameters "
                 "%.1f MB, AdamW's two moments as much again each); peak RSS %.1f MB\n",
                 peak, params / (1024.0 * 1024.0), usage.ru_maxrss / 1024.0);
    return 0;
  }
  const int64_t calls_before = mixprec::amp::fp16_cpu_fast_path_calls();
  auto [final_loss, seconds] = level == "trainer"
                                   ? time_gpt2_trainer(model, data, precision, warmup, steps)
                                   : time_steps(step, warmup, steps);
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);  // before activation_mb's extra forward
  const double activations = level == "loop" ? activation_mb([&] { return forward(0); }) : 0.0;
  std::printf(
      "{\"impl\": \"mixprec\", \"level\": \"%s\", \"size\": \"%s\", \"precision\": \"%s\", "
      "\"fast_path\": \"%s\", \"activation_checkpointing\": %s, \"optimizer_in_backward\": %s, "
      "\"fast_path_active\": %s, \"fast_path_calls\": %lld, \"tokens_per_s\": %.1f, "
      "\"final_loss\": %.6f, \"peak_rss_mb\": %.1f, \"activation_mb\": %.1f}\n",
      level.c_str(), size.c_str(), precision.c_str(), fast_path.c_str(),
      checkpointing ? "true" : "false", in_backward ? "true" : "false",
      mixprec::amp::fp16_cpu_fast_path_active() ? "true" : "false",
      static_cast<long long>(mixprec::amp::fp16_cpu_fast_path_calls() - calls_before),
      static_cast<double>(steps * batch * seq) / seconds, final_loss, usage.ru_maxrss / 1024.0,
      activations);
  return 0;
}
