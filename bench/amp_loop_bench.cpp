// Times the level-1 loop (examples/amp_loop.cpp), the same loop through the
// Accelerator (--loop accelerator) or the Trainer on the same data (--loop trainer, HF's
// defaults where the loop has none: clipping at 1, shuffling, no weight decay; --max-grad-norm 0
// --sampling sequential take the first two out) for bench/run.py: one configuration per run,
// one JSON line on stdout. Its Python twin is bench/amp_loop_bench.py; keep the two doing the
// same work. --profile prints where the time of `--steps` steps goes instead (LibTorch's
// profiler).
//
// --interleave N times the Accelerator or the Trainer against the plain loop in one process
// (C++ only): N steps of one, then N of the other, on two copies of the model. Runs in separate
// processes differ by up to a third here; blocks in one process see the same machine.
// --trainer-work gives that plain loop the work HF's Trainer adds to a step (the gradient norm,
// which it computes every step, clipping or not; its two parameter groups without weight decay;
// the model's outputs in fp32 as Accelerate returns them; a read of the loss), so that what is
// left is the Trainer's own.
#include <mixprec/accelerate/accelerator.h>
#include <mixprec/amp/autocast.h>
#include <mixprec/amp/flush_denormal.h>
#include <mixprec/amp/grad_scaler.h>
#include <mixprec/data/dataset.h>
#include <mixprec/optim/adamw.h>
#include <mixprec/optim/clip_grad.h>

#include "digits.h"
#include "profile.h"
#include "timed_steps.h"

#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdio>
#include <limits>

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
  std::string loop = "plain", sampling = "random";
  double max_grad_norm = 1.0;  // HF's TrainingArguments default
  bool scaler_on = false, profile = false, flush_denormal = false, trainer_work = false;
  int steps = 300, warmup = 30, threads = 2, interleave = 0;
  int64_t batch_size = 64, hidden = 256;
  app.add_option("--precision", precision)->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_option("--optimizer", optimizer_kind)->check(CLI::IsMember({"fused", "unfused"}));
  app.add_flag("--scaler", scaler_on, "use a GradScaler (fp16; always on with the accelerator)");
  app.add_option("--loop", loop)->check(CLI::IsMember({"plain", "accelerator", "trainer"}));
  app.add_option("--data", data);
  app.add_option("--max-grad-norm", max_grad_norm,
                 "the Trainer's clipping, and --trainer-work's (0: none)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--sampling", sampling, "the Trainer's train_sampling_strategy")
      ->check(CLI::IsMember({"random", "sequential"}));
  app.add_option("--steps", steps)->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup)->check(CLI::NonNegativeNumber);
  app.add_option("--threads", threads)->check(CLI::PositiveNumber);
  app.add_option("--batch-size", batch_size)->check(CLI::PositiveNumber);
  app.add_option("--hidden", hidden)->check(CLI::PositiveNumber);
  app.add_flag("--profile", profile, "print each op's self time a step, to stderr");
  app.add_flag("--flush-denormal", flush_denormal,
               "treat subnormal floats as 0 on every thread (amp::set_flush_denormal)");
  app.add_option("--interleave", interleave,
                 "with --loop accelerator|trainer: time it against the plain loop in this "
                 "process, this many steps of each in turn")
      ->check(CLI::PositiveNumber);
  app.add_flag("--trainer-work", trainer_work,
               "with --interleave: the plain loop also does the work HF's Trainer adds");
  CLI11_PARSE(app, argc, argv);
  const char* bad = nullptr;
  if (interleave && (loop == "plain" || interleave >= steps || profile))
    bad =
        "--interleave times --loop accelerator or trainer against plain, in blocks fewer than "
        "--steps, without --profile";
  else if (interleave && precision == "fp16" && !scaler_on)
    bad =
        "--interleave with fp16 needs --scaler: the Accelerator and the Trainer scale fp16 losses";
  else if (trainer_work && (!interleave || loop != "trainer"))
    bad = "--trainer-work is for --loop trainer --interleave N";
  if (bad) {
    std::fprintf(stderr, "%s\n", bad);
    return 2;
  }

  torch::set_num_threads(threads);
  if (flush_denormal) TORCH_CHECK(mixprec::amp::set_flush_denormal(true), "no FTZ/DAZ here");
  const auto [train_set, val_set] = digits::split(digits::load_csv(data), 0);
  const bool autocast = precision != "fp32";
  const auto dtype = precision == "fp16" ? torch::kHalf : torch::kBFloat16;
  const auto optimizer_options =
      mixprec::optim::AdamWOptions(3e-3).fused(optimizer_kind == "fused");

  const int64_t n_batches = train_set.images.size(0) / batch_size;
  auto batch = [&](int64_t i) {
    const int64_t b = i % n_batches;
    return std::pair{train_set.images.slice(0, b * batch_size, (b + 1) * batch_size),
                     train_set.labels.slice(0, b * batch_size, (b + 1) * batch_size)};
  };
  // The level-1 loop on one copy of the model; with hf_work, as HF's Trainer would run it.
  struct Plain {
    digits::MLP model;
    mixprec::optim::AdamW optimizer;
    mixprec::amp::GradScaler scaler;
  };
  const auto make_plain = [&](bool hf_work) {
    torch::manual_seed(0);
    digits::MLP model(hidden);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    if (hf_work) {  // HF's: weights and biases apart, both without weight decay (its default)
      std::vector<at::Tensor> weights, biases;
      for (const auto& p : model->named_parameters())
        (p.key().ends_with("bias") ? biases : weights).push_back(p.value());
      for (auto* group : {&weights, &biases})
        groups.emplace_back(*group,
                            std::make_unique<mixprec::optim::AdamWOptions>(
                                mixprec::optim::AdamWOptions(optimizer_options).weight_decay(0)));
    } else {
      groups.emplace_back(model->parameters());
    }
    return std::unique_ptr<Plain>(new Plain{model, mixprec::optim::AdamW(groups, optimizer_options),
                                            mixprec::amp::GradScaler({.enabled = scaler_on})});
  };
  const auto plain_step = [&](Plain& p, bool hf_work) {
    return [&p, &batch, hf_work, autocast, dtype, max_grad_norm](int64_t i) {
      auto [x, y] = batch(i);
      torch::Tensor loss;
      {
        mixprec::amp::Autocast guard(torch::kCPU, dtype, autocast);
        auto logits = p.model(x);
        loss = torch::nn::functional::cross_entropy(logits, y);
        if (hf_work) logits = logits.to(torch::kFloat);
      }
      if (hf_work) TORCH_CHECK(std::isfinite(loss.item<double>()), "the loss is not finite");
      p.scaler.scale(loss).backward();
      if (hf_work) {
        p.scaler.unscale_(p.optimizer);
        mixprec::optim::clip_grad_norm_(
            p.model->parameters(),
            max_grad_norm > 0 ? max_grad_norm : std::numeric_limits<double>::infinity());
      }
      p.scaler.step(p.optimizer);
      p.scaler.update();
      p.optimizer.zero_grad();
      return loss;
    };
  };
  const auto plain = make_plain(false);
  auto& model = plain->model;
  mixprec::Accelerator accelerator(
      {.mixed_precision = precision == "fp32" ? "no" : precision, .cpu = true});
  auto [prepared, accelerated] = accelerator.prepare(model, plain->optimizer);
  std::function<torch::Tensor(int64_t)> step = [&](int64_t i) {
    auto [x, y] = batch(i);
    auto loss = torch::nn::functional::cross_entropy(prepared(x), y);
    accelerator.backward(loss);
    accelerated.step();
    accelerated.zero_grad();
    return loss;
  };
  if (loop == "plain") step = plain_step(*plain, false);
  // With --interleave, the plain loop on a second copy, a block between each two of the other's
  // (so one block fewer: the two are compared by their steps/s).
  std::unique_ptr<Plain> other;
  std::function<torch::Tensor(int64_t)> other_step;
  int64_t other_steps = 0;
  double other_seconds = 0;
  auto other_block = [&] {
    other_seconds += time_steps(other_step, warmup + other_steps, interleave).seconds;
    other_steps += interleave;
  };
  if (interleave) {
    other = make_plain(trainer_work);
    other_step = plain_step(*other, trainer_work);
    for (int i = 0; i < warmup; ++i) other_step(i);
  }
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
    args.max_grad_norm = max_grad_norm;
    args.train_sampling_strategy = sampling;
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
    std::vector<std::shared_ptr<mixprec::train::TrainerCallback>> callbacks;
    if (interleave) {
      // Before each block of `interleave` timed steps but the first, one block of the other.
      struct Interleave : mixprec::train::TrainerCallback {
        int64_t first = 0, last = 0, every = 0;
        std::function<void()> block;
        void on_step_end(const mixprec::TrainingArguments&, mixprec::train::TrainerState& state,
                         mixprec::train::TrainerControl&) override {
          const int64_t s = state.global_step;
          if (s > first && s < last && (s - first) % every == 0) block();
        }
      };
      auto interleaved = std::make_shared<Interleave>();
      interleaved->first = warmup;
      interleaved->last = warmup + steps;
      interleaved->every = interleave;
      interleaved->block = other_block;
      callbacks.push_back(interleaved);
    }
    timed = time_trainer(model.ptr(), forward, dataset, args, warmup, steps, callbacks);
    timed.seconds -= other_seconds;
  } else {
    for (int i = 0; i < warmup; ++i) step(i);
    if (profile) {
      print_self_times(profiled([&] { time_steps(step, warmup, steps); }), part_of, steps);
      return 0;
    }
    if (!interleave) {
      timed = time_steps(step, warmup, steps);
    } else {
      timed = {0, 0};
      for (int64_t done = 0; done < steps; done += interleave) {
        if (done) other_block();
        const auto block =
            time_steps(step, warmup + done, std::min<int64_t>(interleave, steps - done));
        timed = {block.final_loss, timed.seconds + block.seconds};
      }
    }
  }
  const auto [final_loss, seconds] = timed;
  std::printf(
      "{\"impl\": \"mixprec\", \"loop\": \"%s\", \"precision\": \"%s\", \"optimizer\": "
      "\"%s\", \"scaler\": %s, \"steps_per_s\": %.2f, \"final_loss\": %.6f",
      loop.c_str(), precision.c_str(), optimizer_kind.c_str(), scaler_on ? "true" : "false",
      steps / seconds, final_loss);
  if (interleave) {
    const double plain_rate = static_cast<double>(other_steps) / other_seconds;
    std::printf(
        ", \"interleave\": %d, \"trainer_work\": %s, \"plain_steps_per_s\": %.2f, "
        "\"overhead\": %.4f",
        interleave, trainer_work ? "true" : "false", plain_rate,
        plain_rate / (steps / seconds) - 1);
  }
  std::printf("}\n");
  return 0;
}
