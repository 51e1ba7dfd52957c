// Where a benchmark step's time goes, from LibTorch's profiler: one definition for the
// benchmarks' --profile.
#pragma once

#include <mixprec/train/callbacks.h>

#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace prof = torch::autograd::profiler;

// Starts LibTorch's profiler (CPU events; memory events too if asked) on this thread;
// prof::disableProfiler() stops it and returns the events.
inline void start_profiler(bool memory = false) {
  const prof::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO,
                                    /*report_input_shapes=*/false, /*profile_memory=*/memory);
  const std::set<prof::ActivityType> cpu{prof::ActivityType::CPU};
  prof::prepareProfiler(config, cpu);
  prof::enableProfiler(config, cpu);
}

// Runs f under LibTorch's profiler.
inline std::unique_ptr<prof::ProfilerResult> profiled(const std::function<void()>& f,
                                                      bool memory = false) {
  start_profiler(memory);
  f();
  return prof::disableProfiler();
}

// What `forward` leaves allocated for the backward (activations autograd saved, autocast's
// 16-bit weight copies, the loss), in bytes: the net bytes of LibTorch's profiler's memory
// events over one call. Used by tests/models/activation_checkpoint_test.cpp too.
inline int64_t activation_bytes(const std::function<torch::Tensor()>& forward) {
  torch::Tensor loss;  // alive, with its graph, until the profiler stops
  const auto result = profiled([&] { loss = forward(); }, /*memory=*/true);
  int64_t bytes = 0;
  for (const auto& e : result->events())
    if (e.name() == "[memory]") bytes += e.nBytes();
  return bytes;
}

// Prints each op's self time in a profile of `steps` steps (its time minus that of the ops it
// called), per step and largest first, and their sums by `part_of` the step, to stderr.
inline void print_self_times(const prof::ProfilerResult& result,
                             const std::function<std::string(const std::string&)>& part_of,
                             int64_t steps = 1) {
  std::map<uint64_t, std::vector<const prof::KinetoEvent*>> by_thread;
  for (const auto& e : result.events()) by_thread[e.startThreadId()].push_back(&e);
  std::map<std::string, std::pair<double, int64_t>> self;  // name -> (ms, calls)
  double total = 0;
  for (auto& [thread, events] : by_thread) {
    std::sort(events.begin(), events.end(), [](auto* a, auto* b) {
      return a->startNs() != b->startNs() ? a->startNs() < b->startNs()
                                          : a->durationNs() > b->durationNs();
    });
    std::vector<std::pair<const prof::KinetoEvent*, double>> stack;  // (event, children ns)
    auto close = [&] {
      auto [e, children] = stack.back();
      stack.pop_back();
      auto& [ms, calls] = self[e->name()];
      ms += (static_cast<double>(e->durationNs()) - children) / 1e6 / steps;
      ++calls;
      if (stack.empty())
        total += static_cast<double>(e->durationNs()) / 1e6 / steps;
      else
        stack.back().second += static_cast<double>(e->durationNs());
    };
    for (const auto* e : events) {
      while (!stack.empty() && stack.back().first->endNs() <= e->startNs()) close();
      stack.emplace_back(e, 0.0);
    }
    while (!stack.empty()) close();
  }
  std::vector<std::pair<std::string, std::pair<double, int64_t>>> rows(self.begin(), self.end());
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
  std::unique_ptr<prof::ProfilerResult> result;
  ProfileSteps(int64_t warmup, int64_t steps) : warmup(warmup), steps(steps) {}
  void on_step_begin(const mixprec::TrainingArguments&, mixprec::train::TrainerState& state,
                     mixprec::train::TrainerControl&) override {
    if (state.global_step == warmup) start_profiler();
  }
  void on_step_end(const mixprec::TrainingArguments&, mixprec::train::TrainerState& state,
                   mixprec::train::TrainerControl&) override {
    if (state.global_step == warmup + steps) result = prof::disableProfiler();
  }
};
