// Where a benchmark step's time goes, from LibTorch's profiler: one definition for the
// benchmarks' --profile.
#pragma once

#include <mixprec/accelerate/profiler.h>
#include <mixprec/train/callbacks.h>

#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

using mixprec::accelerate::ProfileKwargs;
using mixprec::accelerate::Profiler;

// Runs f under LibTorch's profiler (memory events too if asked) and stops it.
inline Profiler profiled(const std::function<void()>& f, bool memory = false) {
  Profiler profiler({.activities = {"cpu"}, .profile_memory = memory});
  f();
  profiler.stop();
  return profiler;
}

// What `forward` leaves allocated for the backward (activations autograd saved, autocast's
// 16-bit weight copies, the loss), in bytes: the net bytes of LibTorch's profiler's memory
// events over one call. Used by tests/models/activation_checkpoint_test.cpp too.
inline int64_t activation_bytes(const std::function<torch::Tensor()>& forward) {
  torch::Tensor loss;  // alive, with its graph, until the profiler stops
  const auto profiler = profiled([&] { loss = forward(); }, /*memory=*/true);
  int64_t bytes = 0;
  for (const auto& e : profiler.result()->events())
    if (e.name() == "[memory]") bytes += e.nBytes();
  return bytes;
}

// Prints each op's self time in a profile of `steps` steps (its time minus that of the ops it
// called), per step and largest first, and their sums by `part_of` the step, to stderr.
inline void print_self_times(const Profiler& profiler,
                             const std::function<std::string(const std::string&)>& part_of,
                             int64_t steps = 1) {
  std::vector<std::pair<std::string, std::pair<double, int64_t>>> rows;  // name, (ms, calls)
  double total = 0;
  for (const auto& row : profiler.key_averages()) {
    const double ms = row.self_cpu_time_total / 1e3 / static_cast<double>(steps);
    rows.push_back({row.key, {ms, row.count}});
    total += ms;
  }
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
  std::fprintf(stderr, "| op | self ms a step | share | calls a step |\n|---|---|---|---|\n");
  for (const auto& [name, v] : rows)
    if (v.first >= 0.001 * total)
      std::fprintf(stderr, "| %s | %.3f | %.1f%% | %.1f |\n", name.c_str(), v.first,
                   100 * v.first / total, static_cast<double>(v.second) / steps);
  std::fprintf(stderr, "total of top-level events: %.3f ms a step\n", total);
  std::map<std::string, double> parts;
  for (const auto& [name, v] : rows) parts[part_of(name)] += v.first;
  std::vector<std::pair<std::string, double>> by_part(parts.begin(), parts.end());
  std::sort(by_part.begin(), by_part.end(),
            [](const auto& a, const auto& b) { return a.second > b.second; });
  std::fprintf(stderr, "\n| part of the step | self ms a step | share |\n|---|---|---|\n");
  for (const auto& [part, ms] : by_part)
    std::fprintf(stderr, "| %s | %.3f | %.1f%% |\n", part.c_str(), ms, 100 * ms / total);
}

// Profiles the Trainer's steps warmup + 1 ... warmup + steps.
struct ProfileSteps : mixprec::train::TrainerCallback {
  int64_t warmup = 0, steps = 1;
  std::optional<Profiler> profiler;
  ProfileSteps(int64_t warmup, int64_t steps) : warmup(warmup), steps(steps) {}
  void on_step_begin(const mixprec::TrainingArguments&, mixprec::train::TrainerState& state,
                     mixprec::train::TrainerControl&) override {
    if (state.global_step == warmup) profiler.emplace(ProfileKwargs{.activities = {"cpu"}});
  }
  void on_step_end(const mixprec::TrainingArguments&, mixprec::train::TrainerState& state,
                   mixprec::train::TrainerControl&) override {
    if (state.global_step == warmup + steps) profiler->stop();
  }
};
