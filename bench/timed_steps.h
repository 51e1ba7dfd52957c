// The timed part of every benchmark loop, one definition for all of them.
#pragma once

#include <mixprec/train/trainer.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

// Seconds one call of f takes.
inline double seconds(const std::function<void()>& f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The median of v (the upper one of an even count).
inline double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

// Median seconds of `reps` timed calls of f, after one untimed warm-up call.
inline double median_seconds(const std::function<void()>& f, int reps) {
  f();
  std::vector<double> times;
  for (int i = 0; i < reps; ++i) times.push_back(seconds(f));
  return median(times);
}

struct TimedSteps {
  double final_loss;
  double seconds;
};

// Runs step(first), ..., step(first + steps - 1) and times them; reading the
// last loss also waits for the last step.
inline TimedSteps time_steps(const std::function<torch::Tensor(int64_t)>& step, int64_t first,
                             int64_t steps) {
  const auto start = std::chrono::steady_clock::now();
  torch::Tensor loss;
  for (int64_t i = 0; i < steps; ++i) loss = step(first + i);
  const double final_loss = loss.item<double>();
  return {final_loss,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()};
}

// The Trainer's steps after `warmup`, timed by a callback (its own runtime includes its setup
// and the warm-up): `args` says the precision, batch size, optimizer and schedule; this sets
// the step count and turns off logging, saving and the progress bar, as the twins do;
// `callbacks` run too.
inline TimedSteps time_trainer(
    std::shared_ptr<torch::nn::Module> module, mixprec::train::BatchForward forward,
    mixprec::data::DatasetPtr dataset, mixprec::TrainingArguments args, int64_t warmup,
    int64_t steps, std::vector<std::shared_ptr<mixprec::train::TrainerCallback>> callbacks = {}) {
  struct Clock : mixprec::train::TrainerCallback {
    int64_t warmup = 0;
    std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
    void on_step_end(const mixprec::TrainingArguments&, mixprec::train::TrainerState& state,
                     mixprec::train::TrainerControl&) override {
      if (state.global_step == warmup) start = std::chrono::steady_clock::now();
    }
  };
  auto clock = std::make_shared<Clock>();
  clock->warmup = warmup;
  args.output_dir =
      (std::filesystem::temp_directory_path() / ("mixprec_bench_" + std::to_string(getpid())))
          .string();
  args.overwrite_output_dir = true;
  args.max_steps = warmup + steps;
  args.logging_strategy = "no";
  args.save_strategy = "no";
  args.disable_tqdm = true;
  args.use_cpu = true;
  callbacks.push_back(clock);
  mixprec::Trainer trainer(std::move(module), std::move(forward), args, std::move(dataset), nullptr,
                           {}, std::move(callbacks), {});
  const auto output = trainer.train();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - clock->start).count();
  std::filesystem::remove_all(args.output_dir);
  return {output.training_loss, seconds};
}
