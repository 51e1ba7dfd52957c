#include "mixprec/train/callbacks.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cmath>

namespace mixprec::train {

namespace {

using json = nlohmann::json;

template <typename T>
json optional_json(const std::optional<T>& v) {
  return v ? json(*v) : json(nullptr);
}

// Logs hold doubles; HF writes step counts as integers.
json log_entry(const Metrics& entry) {
  json out = json::object();
  for (const auto& [key, value] : entry) {
    if (key == "step" || key.ends_with("_steps") || key == "total_flos")
      out[key] = static_cast<int64_t>(value);
    else if (std::isfinite(value))
      out[key] = value;
    else
      out[key] = std::isnan(value) ? "NaN" : (value > 0 ? "Infinity" : "-Infinity");
  }
  return out;
}

}  // namespace

std::string TrainerState::to_json() const {
  json history = json::array();
  for (const auto& entry : log_history) history.push_back(log_entry(entry));
  json out = {{"best_global_step", optional_json(best_global_step)},
              {"best_metric", optional_json(best_metric)},
              {"best_model_checkpoint", optional_json(best_model_checkpoint)},
              {"epoch", epoch},
              {"eval_steps", eval_steps},
              {"global_step", global_step},
              {"is_hyper_param_search", false},
              {"is_local_process_zero", is_local_process_zero},
              {"is_world_process_zero", is_world_process_zero},
              {"log_history", history},
              {"logging_steps", logging_steps},
              {"max_steps", max_steps},
              {"num_input_tokens_seen", num_input_tokens_seen},
              {"num_train_epochs", num_train_epochs},
              {"save_steps", save_steps},
              {"stateful_callbacks", json::object()},
              {"total_flos", total_flos},
              {"train_batch_size", optional_json(train_batch_size)},
              {"trial_name", nullptr},
              {"trial_params", nullptr}};
  return out.dump(2);
}

TrainerState TrainerState::from_json(const std::string& text, const std::string& source) {
  TrainerState s;
  try {
    const json j = json::parse(text);
    s.epoch = j.at("epoch").get<double>();
    s.global_step = j.at("global_step").get<int64_t>();
    s.max_steps = j.value("max_steps", int64_t{0});
    s.logging_steps = j.value("logging_steps", int64_t{500});
    s.eval_steps = j.value("eval_steps", int64_t{500});
    s.save_steps = j.value("save_steps", int64_t{500});
    if (!j.value("train_batch_size", json()).is_null())
      s.train_batch_size = j.at("train_batch_size").get<int64_t>();
    s.num_train_epochs = j.value("num_train_epochs", int64_t{0});
    s.num_input_tokens_seen = j.value("num_input_tokens_seen", int64_t{0});
    s.total_flos = j.value("total_flos", 0.0);
    for (const auto& entry : j.at("log_history")) {
      Metrics m;
      for (const auto& [key, value] : entry.items())
        if (value.is_number()) m[key] = value.get<double>();
      s.log_history.push_back(m);
    }
    if (!j.value("best_metric", json()).is_null())
      s.best_metric = j.at("best_metric").get<double>();
    if (!j.value("best_global_step", json()).is_null())
      s.best_global_step = j.at("best_global_step").get<int64_t>();
    if (!j.value("best_model_checkpoint", json()).is_null())
      s.best_model_checkpoint = j.at("best_model_checkpoint").get<std::string>();
  } catch (const json::exception& e) {
    TORCH_CHECK(false, source, ": not a trainer state: ", e.what());
  }
  return s;
}

void EarlyStoppingCallback::on_train_begin(const TrainingArguments& args, TrainerState&,
                                           TrainerControl&) {
  TORCH_CHECK(args.metric_for_best_model.has_value(),
              "EarlyStoppingCallback requires metric_for_best_model to be defined");
  TORCH_CHECK(args.eval_strategy != "no",
              "EarlyStoppingCallback requires an eval_strategy other than \"no\"");
}

void EarlyStoppingCallback::on_evaluate(const TrainingArguments& args, TrainerState& state,
                                        TrainerControl& control, const Metrics& metrics) {
  std::string name = *args.metric_for_best_model;
  if (!name.starts_with("eval_")) name = "eval_" + name;
  auto it = metrics.find(name);
  if (it == metrics.end()) return;  // HF warns and does nothing
  const double value = it->second;
  const bool greater = args.greater_is_better.value_or(true);
  const bool improved =
      !state.best_metric || ((greater ? value > *state.best_metric : value < *state.best_metric) &&
                             std::abs(value - *state.best_metric) > threshold_);
  counter_ = improved ? 0 : counter_ + 1;
  if (counter_ >= patience_) control.should_training_stop = true;
}

}  // namespace mixprec::train
