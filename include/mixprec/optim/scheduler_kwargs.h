// The values of lr_scheduler_kwargs, apart from the schedules (TrainingArguments holds them
// without LibTorch's headers).
#pragma once

#include <map>
#include <string>
#include <type_traits>
#include <variant>

namespace mixprec::optim {

// Any number but a bool, which a Python dict would not hold as a number here.
template <typename T>
concept SchedulerNumber = std::is_arithmetic_v<T> && !std::is_same_v<T, bool>;

/// A value of HF's `scheduler_specific_kwargs`: a number, or a text (warmup_stable_decay's
/// warmup_type and decay_type). Made implicitly, so that
/// `{{"num_decay_steps", 10}, {"decay_type", "linear"}}` reads as the Python dict.
struct SchedulerKwarg : std::variant<double, std::string> {
  template <SchedulerNumber T>
  SchedulerKwarg(T v) : variant(static_cast<double>(v)) {}
  SchedulerKwarg(std::string v) : variant(std::move(v)) {}
  SchedulerKwarg(const char* v) : variant(std::string(v)) {}
};
using SchedulerKwargs = std::map<std::string, SchedulerKwarg>;

}  // namespace mixprec::optim
