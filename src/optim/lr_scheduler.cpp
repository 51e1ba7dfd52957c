#include "mixprec/optim/lr_scheduler.h"

#include "mixprec/log/logging.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cmath>
#include <numbers>

namespace mixprec::optim {

LRScheduler::LRScheduler(torch::optim::Optimizer& optimizer, LrLambda lr_lambda)
    : optimizer_(&optimizer), lr_lambda_(std::move(lr_lambda)) {
  for (auto& group : optimizer_->param_groups()) base_lrs_.push_back(group.options().get_lr());
  step();
}

void LRScheduler::step() {
  ++last_epoch_;
  apply();
}

void LRScheduler::apply() {
  auto& groups = optimizer_->param_groups();
  TORCH_CHECK(groups.size() == base_lrs_.size(), "LRScheduler: the optimizer has ", groups.size(),
              " param groups, the scheduler was made for ", base_lrs_.size());
  const double factor = lr_lambda_(last_epoch_);
  last_lr_.clear();
  for (size_t i = 0; i < groups.size(); ++i) {
    groups[i].options().set_lr(base_lrs_[i] * factor);
    last_lr_.push_back(base_lrs_[i] * factor);
  }
}

void LRScheduler::load_state_dict(const LRSchedulerState& state) {
  TORCH_CHECK(state.base_lrs.size() == base_lrs_.size(),
              "LRScheduler::load_state_dict: ", state.base_lrs.size(), " base lrs in the state, ",
              base_lrs_.size(), " param groups in the optimizer");
  TORCH_CHECK(state.last_epoch >= 0, "LRScheduler::load_state_dict: invalid last_epoch ",
              state.last_epoch);
  base_lrs_ = state.base_lrs;
  last_epoch_ = state.last_epoch;
  apply();
}

namespace {

double warmup(int64_t step, int64_t warmup_steps) {
  return static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup_steps));
}

// warmup_stable_decay's curves: up from 0 to 1 while warming up, down from 1 to 0 in the decay,
// for the phase's progress p in [0, 1].
double wsd_shape(const std::string& type, double p, bool up, double num_cycles) {
  if (type == "linear") return up ? p : 1.0 - p;
  if (type == "cosine")
    return up ? 0.5 * (1.0 - std::cos(std::numbers::pi * p))
              : 0.5 * (1.0 + std::cos(std::numbers::pi * num_cycles * 2.0 * p));
  return up ? 1.0 - std::sqrt(1.0 - p) : 1.0 - std::sqrt(p);  // "1-sqrt"
}

double progress(int64_t step, int64_t warmup_steps, int64_t training_steps) {
  return static_cast<double>(step - warmup_steps) /
         static_cast<double>(std::max<int64_t>(1, training_steps - warmup_steps));
}

// Each schedule of transformers.get_scheduler with the keywords its function takes (last_epoch
// aside); HF's constant schedules are called without the keywords, so they ignore any.
const std::vector<std::pair<std::string, std::vector<std::string>>>& schedules() {
  static const std::vector<std::pair<std::string, std::vector<std::string>>> all = {
      {"linear", {}},
      {"cosine", {"num_cycles"}},
      {"cosine_with_restarts", {"num_cycles"}},
      {"polynomial", {"lr_end", "power"}},
      {"constant", {}},
      {"constant_with_warmup", {}},
      {"inverse_sqrt", {"timescale"}},
      {"cosine_with_min_lr", {"num_cycles", "min_lr", "min_lr_rate"}},
      {"cosine_warmup_with_min_lr", {"num_cycles", "min_lr", "min_lr_rate", "warmup_lr_rate"}},
      {"warmup_stable_decay",
       {"num_decay_steps", "num_stable_steps", "warmup_type", "decay_type", "min_lr_ratio",
        "num_cycles"}}};
  return all;
}

const std::vector<std::string>& keywords_of(const std::string& name) {
  const auto& all = schedules();
  const auto found =
      std::find_if(all.begin(), all.end(), [&](const auto& s) { return s.first == name; });
  TORCH_CHECK(found != all.end(), "Unknown lr_scheduler_type '", name,
              "'; expected one of: ", c10::Join(", ", scheduler_types()));
  return found->second;
}

// transformers' get_cosine_with_min_lr_schedule_with_warmup(_lr_rate) asks for exactly one of
// the two.
void check_min_lr(const std::string& name, const SchedulerOptions& o) {
  if (name != "cosine_with_min_lr" && name != "cosine_warmup_with_min_lr") return;
  TORCH_CHECK(!(o.min_lr && o.min_lr_rate), "Only one of min_lr or min_lr_rate should be set");
  TORCH_CHECK(o.min_lr || o.min_lr_rate,
              "One of min_lr or min_lr_rate should be set through the `lr_scheduler_kwargs`");
}

// What transformers' get_wsd_schedule refuses (num_decay_steps is its required argument).
void check_wsd(const std::string& name, const SchedulerOptions& o) {
  if (name != "warmup_stable_decay") return;
  TORCH_CHECK(o.num_decay_steps,
              "warmup_stable_decay requires `num_decay_steps`; set it through the "
              "`lr_scheduler_kwargs`");
  for (const auto& [phase, type] : {std::pair{"warmup", o.warmup_type}, {"decay", o.decay_type}})
    TORCH_CHECK(type == "linear" || type == "cosine" || type == "1-sqrt", "Unknown ", phase,
                " type: ", type, ", expected 'linear', 'cosine' or '1-sqrt'");
}

// A count given as a number: an integer of at least `least`, and below 2^53 (where doubles stop
// counting one by one), so that the schedules' sums of counts cannot overflow.
int64_t count_of(const std::string& key, double value, int64_t least) {
  const bool fits =
      value >= static_cast<double>(least) && value == std::floor(value) && value < 0x1p53;
  TORCH_CHECK(fits, "lr_scheduler_kwargs: ", key, " must be a ",
              (least > 0 ? "positive" : "non-negative"), " integer below 2^53, got ", value);
  return static_cast<int64_t>(value);
}

}  // namespace

const std::vector<std::string>& scheduler_types() {
  static const std::vector<std::string> types = [] {
    std::vector<std::string> names;
    for (const auto& [name, keywords] : schedules()) names.push_back(name);
    return names;
  }();
  return types;
}

void set_scheduler_kwargs(SchedulerOptions& options, const std::string& name,
                          const SchedulerKwargs& kwargs) {
  const auto& known = keywords_of(name);
  if (name == "constant" || name == "constant_with_warmup") {
    if (!kwargs.empty()) {
      std::vector<std::string> keys;
      for (const auto& [key, value] : kwargs) keys.push_back("'" + key + "'");
      // Once: the arguments are checked when read, and the schedule is made again in train().
      MIXPREC_WARN_ONCE(
          "lr_scheduler_kwargs: the \"", name,
          "\" schedule takes none; ignored, as transformers ignores them: ", c10::Join(", ", keys));
    }
    return;
  }
  for (const auto& [key, value] : kwargs) {
    TORCH_CHECK(std::find(known.begin(), known.end(), key) != known.end(),
                "lr_scheduler_kwargs: the \"", name, "\" schedule takes no '", key, "' (it takes ",
                known.empty() ? std::string("none") : c10::Join(", ", known), ")");
    if (key == "warmup_type" || key == "decay_type") {
      const auto* text = std::get_if<std::string>(&value);
      TORCH_CHECK(text, "lr_scheduler_kwargs: ", key, " must be a string, got ",
                  std::get<double>(value));
      (key == "warmup_type" ? options.warmup_type : options.decay_type) = *text;
      continue;
    }
    const auto* number = std::get_if<double>(&value);
    TORCH_CHECK(number, "lr_scheduler_kwargs: ", key, " must be a number, got \"",
                std::get<std::string>(value), "\"");
    const double v = *number;
    if (key == "num_cycles") options.num_cycles = v;
    if (key == "lr_end") options.lr_end = v;
    if (key == "power") options.power = v;
    if (key == "min_lr") options.min_lr = v;
    if (key == "min_lr_rate") options.min_lr_rate = v;
    if (key == "min_lr_ratio") options.min_lr_ratio = v;
    if (key == "warmup_lr_rate") options.warmup_lr_rate = v;
    if (key == "timescale") options.timescale = count_of(key, v, 1);
    if (key == "num_decay_steps") options.num_decay_steps = count_of(key, v, 0);
    if (key == "num_stable_steps") options.num_stable_steps = count_of(key, v, 0);
  }
  check_min_lr(name, options);
  check_wsd(name, options);
}

// The lambdas are transformers.optimization's, term for term.
LRScheduler get_scheduler(const std::string& name, torch::optim::Optimizer& optimizer,
                          const SchedulerOptions& o) {
  keywords_of(name);  // an unknown name is an error listing the known ones
  check_min_lr(name, o);
  check_wsd(name, o);
  const int64_t w = o.num_warmup_steps;
  TORCH_CHECK(w >= 0, "num_warmup_steps must be >= 0, got ", w);
  if (name == "constant") return LRScheduler(optimizer, [](int64_t) { return 1.0; });
  if (name == "constant_with_warmup")
    return LRScheduler(optimizer, [w](int64_t s) { return s < w ? warmup(s, w) : 1.0; });
  if (name == "inverse_sqrt") {
    const int64_t timescale = o.timescale.value_or(w > 0 ? w : 10000);
    return LRScheduler(optimizer, [w, timescale](int64_t s) {
      if (s < w) return warmup(s, w);
      const auto shift = static_cast<double>(timescale - w);
      return 1.0 / std::sqrt((static_cast<double>(s) + shift) / static_cast<double>(timescale));
    });
  }
  if (name == "warmup_stable_decay") {
    TORCH_CHECK(o.num_training_steps || o.num_stable_steps,
                "Either num_training_steps or num_stable_steps must be specified.");
    if (o.num_training_steps && o.num_stable_steps)
      MIXPREC_WARN(
          "Both num_training_steps and num_stable_steps are specified. num_stable_steps "
          "will be used.");
    const int64_t decay = *o.num_decay_steps;
    const int64_t stable = o.num_stable_steps.value_or(*o.num_training_steps - w - decay);
    return LRScheduler(optimizer, [w, stable, decay, o](int64_t s) {
      double factor = 0;
      if (s < w) {
        factor = wsd_shape(o.warmup_type, warmup(s, w), true, 0);
      } else if (s < w + stable) {
        return 1.0;
      } else if (s < w + stable + decay) {
        const double p = warmup(s - w - stable, decay);  // the decay's progress
        factor = wsd_shape(o.decay_type, p, false, o.num_cycles.value_or(0.5));
      } else {
        return o.min_lr_ratio;
      }
      return std::max(0.0, factor * (1.0 - o.min_lr_ratio) + o.min_lr_ratio);
    });
  }
  TORCH_CHECK(o.num_training_steps.has_value(), name,
              " requires `num_training_steps`, please provide that argument.");
  const int64_t t = *o.num_training_steps;
  if (name == "linear") {
    return LRScheduler(optimizer, [w, t](int64_t s) {
      if (s < w) return warmup(s, w);
      return std::max(
          0.0, static_cast<double>(t - s) / static_cast<double>(std::max<int64_t>(1, t - w)));
    });
  }
  if (name == "cosine" || name == "cosine_with_min_lr") {
    const double cycles = o.num_cycles.value_or(0.5);
    double min_lr_rate = 0;  // cosine: the wave goes down to 0
    if (name == "cosine_with_min_lr")
      min_lr_rate = o.min_lr ? *o.min_lr / optimizer.defaults().get_lr() : *o.min_lr_rate;
    return LRScheduler(optimizer, [w, t, cycles, min_lr_rate](int64_t s) {
      if (s < w) return warmup(s, w);
      const double factor =
          0.5 * (1.0 + std::cos(std::numbers::pi * cycles * 2.0 * progress(s, w, t)));
      return std::max(0.0, factor * (1.0 - min_lr_rate) + min_lr_rate);
    });
  }
  if (name == "cosine_warmup_with_min_lr") {
    // Unlike cosine_with_min_lr, the warmup's first step is above 0 and the wave starts a step
    // later: each phase counts the step being taken.
    const double cycles = o.num_cycles.value_or(0.5);
    const double min_lr_rate =
        o.min_lr ? *o.min_lr / optimizer.defaults().get_lr() : *o.min_lr_rate;
    return LRScheduler(optimizer, [w, t, cycles, min_lr_rate, start = o.warmup_lr_rate](int64_t s) {
      if (s < w) {
        if (!start) return warmup(s + 1, w);
        return *start + (1.0 - *start) * static_cast<double>(s) /
                            static_cast<double>(std::max<int64_t>(1, w - 1));
      }
      const double factor =
          0.5 * (1.0 + std::cos(std::numbers::pi * cycles * 2.0 * progress(s + 1, w, t)));
      return std::max(0.0, factor * (1.0 - min_lr_rate) + min_lr_rate);
    });
  }
  if (name == "cosine_with_restarts") {
    const double cycles = o.num_cycles.value_or(1.0);
    return LRScheduler(optimizer, [w, t, cycles](int64_t s) {
      if (s < w) return warmup(s, w);
      const double p = progress(s, w, t);
      if (p >= 1.0) return 0.0;
      return std::max(0.0, 0.5 * (1.0 + std::cos(std::numbers::pi * std::fmod(cycles * p, 1.0))));
    });
  }
  // polynomial: decays from the optimizer's default lr to lr_end.
  const double lr_init = optimizer.defaults().get_lr();
  TORCH_CHECK(lr_init > o.lr_end, "lr_end (", o.lr_end, ") must be smaller than initial lr (",
              lr_init, ")");
  // Else 0 / 0 at step t (transformers raises ZeroDivisionError there).
  TORCH_CHECK(t != w, "polynomial: num_training_steps (", t, ") equals num_warmup_steps (", w,
              "): no step is left to decay in");
  return LRScheduler(optimizer, [w, t, lr_init, lr_end = o.lr_end, power = o.power](int64_t s) {
    if (s < w) return warmup(s, w);
    if (s > t) return lr_end / lr_init;
    const double remaining = 1.0 - static_cast<double>(s - w) / static_cast<double>(t - w);
    return ((lr_init - lr_end) * std::pow(remaining, power) + lr_end) / lr_init;
  });
}

}  // namespace mixprec::optim
