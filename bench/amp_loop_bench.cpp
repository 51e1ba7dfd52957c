// Times the level-1 loop (examples/amp_loop.cpp), the same loop through the
// Accelerator (--loop accelerator) or the Trainer on the same data (--loop trainer, HF's
// defaults where the loop has none: clipping at 1, shuffling, no weight decay) for
// bench/run.py: one configuration per run, one JSON line on stdout. Its Python twin is
// bench/amp_loop_bench.py; keep the two doing the same work. --profile prints where the
// time of `--steps` steps goes instead (LibTorch's profiler).
#include <mixprec/accelerate/accelerator.h>
#include <mixprec/amp/autocast.h>
#include <mixprec/amp/flush_denormal.h>
#include <mixprec/amp/grad_scaler.h>
#include <mixprec/data/dataset.h>
#include <mixprec/optim/adamw.h>

#include "digits.h"
#include "profile.h"
#include "timed_steps.h"

#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <cstdio>

namespace {

// The part of a training step an op's self time counts toward.
std::string part_of(const std::string& op) {
  const auto has = [&](const char* s) { return op.find(s) != std::string::npos; };
  if (op == "aten::mm" || op == "aten::addmm" || op == "mkldnn::_linear_pointwise" ||
      op == "mixprec::onednn_mm")
    return "GEMMs";
  if (has("softmax") || has("nll_loss")) return "loss (log-softmax, NLL)";
  if (has("adam") || has("_amp_")) return "optimizer and scaler";
  if (has("relu") || has("threshold") || has("clamp_min")) return "ReLU";
  return "other (bias sums, casts, fills, dispatch)";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"steps/s of the level-1 loop in one configuration"};
  std::string precision = "fp32", optimizer_kind = "fused", data = "data/digits.csv";
  std::string loop = "plain";
  bool scaler_on = false, profile = false, flush_denormal = false;
  int steps = 300, warmup = 30, threads = 2;
  int64_t batch_size = 64, hidden = 256;
  app.add_option("--precision", precision)->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_option("--optimizer", optimizer_kind)->check(CLI::IsMember({"fused", "unfused"}));
  app.add_flag("--scaler", scaler_on, "use a GradScaler (fp16; always on with the accelerator)");
  app.add_option("--loop", loop)->check(CLI::IsMember({"plain", "accelerator", "trainer"}));
  app.add_option("--data", data);
  app.add_option("--steps", steps)->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup)->check(CLI::NonNegativeNumber);
  app.add_option("--threads", threads)->check(CLI::PositiveNumber);
  app.add_option("--batch-size", batch_size)->check(CLI::PositiveNumber);
  app.add_option("--hidden", hidden)->check(CLI::PositiveNumber);
  app.add_flag("--profile", profile, "print each op's self time a step, to stderr");
  app.add_flag("--flush-denormal", flush_denormal,
               "treat subnormal floats as 0 on every thread (amp::set_flush_denormal)");
  CLI11_PARSE(app, argc, argv);

  torch::set_num_threads(threads);
  if (flush_denormal) TORCH_CHECK(mixprec::amp::set_flush_denormal(true), "no FTZ/DAZ here");
  const auto [train_set, val_set] = digits::split(digits::load_csv(data), 0);
  torch::manual_seed(0);
  digits::MLP model(hidden);
  mixprec::optim::AdamW optimizer(
      model->parameters(), mixprec::optim::AdamWOptions(3e-3).fused(optimizer_kind == "fused"));
  mixprec::amp::GradScaler scaler({.enabled = scaler_on});
  const bool autocast = precision != "fp32";
  const auto dtype = precision == "fp16" ? torch::kHalf : torch::kBFloat16;

  const int64_t n_batches = train_set.images.size(0) / batch_size;
  auto batch = [&](int64_t i) {
    const int64_t b = i % n_batches;
    return std::pair{train_set.images.slice(0, b * batch_size, (b + 1) * batch_size),
                     train_set.labels.slice(0, b * batch_size, (b + 1) * batch_size)};
  };
  mixprec::Accelerator accelerator(
      {.mixed_precision = precision == "fp32" ? "no" : precision, .cpu = true});
  auto [prepared, accelerated] = accelerator.prepare(model, optimizer);
  std::function<torch::Tensor(int64_t)> step = [&](int64_t i) {
    auto [x, y] = batch(i);
    auto loss = torch::nn::functional::cross_entropy(prepared(x), y);
    accelerator.backward(loss);
    accelerated.step();
    accelerated.zero_grad();
    return loss;
  };
  if (loop == "plain")
    step = [&](int64_t i) {
      auto [x, y] = batch(i);
      torch::Tensor loss;
      {
        mixprec::amp::Autocast guard(torch::kCPU, dtype, autocast);
        loss = torch::nn::functional::cross_entropy(model(x), y);
      }
      scaler.scale(loss).backward();
      scaler.step(optimizer);
      scaler.update();
      optimizer.zero_grad();
      return loss;
    };
  TimedSteps timed;
  if (loop == "trainer") {
    mixprec::TrainingArguments args;
    args.fp16 = precision == "fp16";
    args.bf16 = precision == "bf16";
    args.optim = optimizer_kind == "fused" ? "adamw_torch_fused" : "adamw_torch";
    args.per_device_train_batch_size = batch_size;
    args.dataloader_drop_last = true;  // full batches only, as the loops take
    args.learning_rate = 3e-3;
    args.lr_scheduler_type = "constant";
    auto dataset = std::make_shared<mixprec::data::TensorDataset>(std::map<std::string, at::Tensor>{
        {"pixels", train_set.images}, {"labels", train_set.labels}});
    auto forward = [model](const mixprec::data::Batch& b) mutable {
      mixprec::models::ModelOutput out;
      out.logits = model(b.at("pixels"));
      out.loss = torch::nn::functional::cross_entropy(out.logits, b.at("labels"));
      return out;
    };
    if (profile) {
      auto profiler = std::make_shared<ProfileSteps>(warmup, steps);
      time_trainer(model.ptr(), forward, dataset, args, warmup, steps, {profiler});
      print_self_times(*profiler->profiler, part_of, steps);
      return 0;
    }
    timed = time_trainer(model.ptr(), forward, dataset, args, warmup, steps);
  } else {
    for (int i = 0; i < warmup; ++i) step(i);
    if (profile) {
      print_self_times(profiled([&] { time_steps(step, warmup, steps); }), part_of, steps);
      return 0;
    }
    timed = time_steps(step, warmup, steps);
  }
  const auto [final_loss, seconds] = timed;
  std::printf(
      "{\"impl\": \"mixprec\", \"loop\": \"%s\", \"precision\": \"%s\", \"optimizer\": "
      "\"%s\", \"scaler\": %s, \"steps_per_s\": %.2f, \"final_loss\": %.6f}\n",
      loop.c_str(), precision.c_str(), optimizer_kind.c_str(), scaler_on ? "true" : "false",
      steps / seconds, final_loss);
  return 0;
}
