// The timed part of every benchmark loop, one definition for all of them.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <functional>

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
