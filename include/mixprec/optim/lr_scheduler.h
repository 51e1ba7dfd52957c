#pragma once

#include "mixprec/optim/scheduler_kwargs.h"

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace mixprec::optim {

/// What a scheduler keeps across a checkpoint (torch's LambdaLR state_dict
/// without the lambda, which is code).
struct LRSchedulerState {
  int64_t last_epoch = 0;
  std::vector<double> base_lrs;
};

/// `torch.optim.lr_scheduler.LambdaLR`: the lr of each param group is its
/// initial lr times `lr_lambda(step)`. As in PyTorch, construction applies
/// step 0 and each `step()` advances by one.
///
/// ```
/// mixprec::optim::LRScheduler scheduler(optimizer, [](int64_t step) { return 0.95; });
/// optimizer.step();
/// scheduler.step();
/// ```
class LRScheduler {
 public:
  using LrLambda = std::function<double(int64_t step)>;
  LRScheduler(torch::optim::Optimizer& optimizer, LrLambda lr_lambda);

  void step();
  /// The lr of each param group set by the last step.
  const std::vector<double>& get_last_lr() const { return last_lr_; }
  int64_t last_epoch() const { return last_epoch_; }
  torch::optim::Optimizer& optimizer() const { return *optimizer_; }

  LRSchedulerState state_dict() const { return {last_epoch_, base_lrs_}; }
  /// Restores the position and sets the optimizer's lrs to what they were.
  void load_state_dict(const LRSchedulerState& state);

 private:
  void apply();

  torch::optim::Optimizer* optimizer_;
  LrLambda lr_lambda_;
  std::vector<double> base_lrs_;
  std::vector<double> last_lr_;
  int64_t last_epoch_ = -1;
};

/// Options of `get_scheduler` beyond the step counts, with transformers'
/// defaults (`scheduler_specific_kwargs`).
struct SchedulerOptions {
  int64_t num_warmup_steps = 0;
  std::optional<int64_t> num_training_steps = std::nullopt;
  /// cosine, cosine_with_min_lr, cosine_warmup_with_min_lr, warmup_stable_decay: 0.5 (half a
  /// wave); cosine_with_restarts:
  /// 1 when unset.
  std::optional<double> num_cycles = std::nullopt;
  double lr_end = 1e-7;  // polynomial
  double power = 1.0;    // polynomial
  /// inverse_sqrt: num_warmup_steps, or 10000 without warmup, when unset.
  std::optional<int64_t> timescale = std::nullopt;
  /// cosine_with_min_lr, cosine_warmup_with_min_lr: the lr it ends at, or that as a ratio of the
  /// optimizer's default lr;
  /// one of the two is required.
  std::optional<double> min_lr = std::nullopt;
  std::optional<double> min_lr_rate = std::nullopt;
  /// cosine_warmup_with_min_lr: the warmup's first lr as a ratio of the initial lr; unset, the
  /// warmup goes 1/num_warmup_steps, 2/num_warmup_steps, ... 1.
  std::optional<double> warmup_lr_rate = std::nullopt;
  /// warmup_stable_decay (transformers' get_wsd_schedule): the decay's length is required; the
  /// stable phase fills what warmup and decay leave of num_training_steps when unset. Warmup and
  /// decay go between min_lr_ratio and 1 along "linear", "cosine" or "1-sqrt".
  std::optional<int64_t> num_decay_steps = std::nullopt;
  std::optional<int64_t> num_stable_steps = std::nullopt;
  std::string warmup_type = "linear";
  std::string decay_type = "cosine";
  double min_lr_ratio = 0.0;
};

/// The scheduler types of `transformers.get_scheduler`: "linear", "cosine",
/// "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
/// "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay".
const std::vector<std::string>& scheduler_types();

/// Sets the options named in `kwargs` (HF's `scheduler_specific_kwargs`, TrainingArguments'
/// `lr_scheduler_kwargs`) for the schedule `name`: one that schedule does not take is an error
/// naming those it takes, as HF's schedule functions refuse an unexpected keyword, and so is a
/// value of the wrong kind. The constant schedules ignore them, with one warning per process.
void set_scheduler_kwargs(SchedulerOptions& options, const std::string& name,
                          const SchedulerKwargs& kwargs);

/// `transformers.get_scheduler(name, optimizer, num_warmup_steps,
/// num_training_steps)`: the same lr at every step. An unknown name or a
/// missing `num_training_steps` is an error that says which.
LRScheduler get_scheduler(const std::string& name, torch::optim::Optimizer& optimizer,
                          const SchedulerOptions& options = {});

}  // namespace mixprec::optim
