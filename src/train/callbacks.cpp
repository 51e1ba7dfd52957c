#include "mixprec/train/callbacks.h"

#include "mixprec/log/logging.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace mixprec::train {

namespace {

using json = nlohmann::json;

template <typename T>
json optional_json(const std::optional<T>& v) {
  return v ? json(*v) : json(nullptr);
}

// Whether a double holds an integer that an int64 can hold.
bool is_int64(double value) {
  return std::isfinite(value) && std::floor(value) == value && value >= -0x1p63 && value < 0x1p63;
}

// Logs hold doubles; HF writes step and token counts as integers.
json log_entry(const Metrics& entry) {
  json out = json::object();
  for (const auto& [key, value] : entry) {
    if ((key == "step" || key.ends_with("_steps") || key == "total_flos" ||
         key == "num_input_tokens_seen") &&
        is_int64(value))
      out[key] = static_cast<int64_t>(value);
    else if (std::isfinite(value))
      out[key] = value;
    else
      out[key] = std::isnan(value) ? "NaN" : (value > 0 ? "Infinity" : "-Infinity");
  }
  return out;
}

// HF's ExportableState.state() (an object of "args" and "attributes", either may be missing),
// or a list of them: what stateful_callbacks holds under a name.
void check_exported_state(const json& v, const std::string& where, const std::string& name) {
  auto exported = [](const json& e) {
    return e.is_object() && e.value("args", json::object()).is_object() &&
           e.value("attributes", json::object()).is_object();
  };
  const bool ok = v.is_array() ? std::all_of(v.begin(), v.end(), exported) : exported(v);
  TORCH_CHECK(ok, where, ": stateful_callbacks '", name,
              "' expects {\"args\": {...}, \"attributes\": {...}} or a list of them, got ",
              v.dump(-1, ' ', false, json::error_handler_t::replace));
}

}  // namespace

std::string TrainerState::to_json() const {
  json history = json::array();
  for (const auto& entry : log_history) history.push_back(log_entry(entry));
  json callbacks = json::object();
  for (const auto& [name, text] : stateful_callbacks) {
    try {
      callbacks[name] = json::parse(text);
    } catch (const json::exception& e) {
      TORCH_CHECK(false, "TrainerState: stateful_callbacks '", name, "' is not JSON: ", e.what());
    }
    check_exported_state(callbacks[name], "TrainerState", name);
  }
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
              {"stateful_callbacks", callbacks},
              {"total_flos", total_flos},
              {"train_batch_size", optional_json(train_batch_size)},
              {"trial_name", nullptr},
              {"trial_params", nullptr}};
  try {  // a name or text a callback's state() gave that is not UTF-8
    return out.dump(2);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, "TrainerState: cannot be written as JSON: ", e.what());
  }
}

namespace {

// Typed reads of trainer_state.json that name the key, what was expected and
// what was found.
struct StateReader {
  const json& j;
  const std::string& source;

  const json* find(const char* key, bool required) const {
    auto it = j.find(key);
    const bool present = it != j.end() && !it->is_null();
    TORCH_CHECK(present || !required, source, ": not a trainer state: missing key '", key, "'");
    return present ? &*it : nullptr;
  }
  [[noreturn]] void wrong(const char* key, const char* expected, const json& v) const {
    TORCH_CHECK(false, source, ": not a trainer state: '", key, "' expects ", expected, ", got ",
                v.dump(), " (", v.type_name(), ")");
  }
  std::optional<int64_t> integer(const char* key, bool required = false) const {
    const json* v = find(key, required);
    if (!v) return std::nullopt;
    if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t{INT64_MAX})
      wrong(key, "an integer that fits in 64 bits", *v);
    if (v->is_number_integer()) return v->get<int64_t>();
    // HF writes a ratio (0.1) for logging/eval/save steps below 1: truncated, as before.
    const double d = v->is_number_float() ? std::trunc(v->get<double>()) : 0.5;
    if (is_int64(d)) return static_cast<int64_t>(d);
    wrong(key, "an integer", *v);
  }
  std::optional<double> number(const char* key, bool required = false) const {
    const json* v = find(key, required);
    if (!v) return std::nullopt;
    if (!v->is_number()) wrong(key, "a number", *v);
    return v->get<double>();
  }
};

}  // namespace

TrainerState TrainerState::from_json(const std::string& text, const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, source, ": not a trainer state: malformed JSON: ", e.what());
  }
  TORCH_CHECK(j.is_object(), source, ": not a trainer state: expected a JSON object, got ",
              j.type_name());
  const StateReader r{j, source};
  TrainerState s;
  s.epoch = r.number("epoch", /*required=*/true).value_or(0.0);
  s.global_step = r.integer("global_step", /*required=*/true).value_or(0);
  s.max_steps = r.integer("max_steps").value_or(0);
  s.logging_steps = r.integer("logging_steps").value_or(500);
  s.eval_steps = r.integer("eval_steps").value_or(500);
  s.save_steps = r.integer("save_steps").value_or(500);
  s.train_batch_size = r.integer("train_batch_size");
  s.num_train_epochs = r.integer("num_train_epochs").value_or(0);
  s.num_input_tokens_seen = r.integer("num_input_tokens_seen").value_or(0);
  s.total_flos = r.number("total_flos").value_or(0.0);
  const json* history = r.find("log_history", /*required=*/true);
  if (history && !history->is_array()) r.wrong("log_history", "a list", *history);
  if (history) {
    for (const auto& entry : *history) {
      if (!entry.is_object()) r.wrong("log_history", "a list of objects", entry);
      Metrics m;
      for (const auto& [key, value] : entry.items()) {
        if (value.is_number()) m[key] = value.get<double>();
        // What log_entry writes for values JSON has no number for.
        if (value == "NaN") m[key] = std::numeric_limits<double>::quiet_NaN();
        if (value == "Infinity") m[key] = std::numeric_limits<double>::infinity();
        if (value == "-Infinity") m[key] = -std::numeric_limits<double>::infinity();
      }
      s.log_history.push_back(m);
    }
  }
  if (const json* callbacks = r.find("stateful_callbacks", false)) {
    if (!callbacks->is_object()) r.wrong("stateful_callbacks", "an object", *callbacks);
    for (const auto& [name, value] : callbacks->items()) {
      check_exported_state(value, source + ": not a trainer state", name);
      s.stateful_callbacks[name] = value.dump();
    }
  }
  s.best_metric = r.number("best_metric");
  s.best_global_step = r.integer("best_global_step");
  if (const json* best = r.find("best_model_checkpoint", false)) {
    if (!best->is_string()) r.wrong("best_model_checkpoint", "a string or null", *best);
    s.best_model_checkpoint = best->get<std::string>();
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

void TrainerCallback::load_state(const std::string&) {
  const auto exported = state();
  MIXPREC_WARN("Trainer: the checkpoint holds the state of callback '",
               exported ? exported->name : "?",
               "', whose load_state() is not overridden: the state is not restored");
}

std::optional<CallbackState> EarlyStoppingCallback::state() const {
  const json state = {
      {"args", {{"early_stopping_patience", patience_}, {"early_stopping_threshold", threshold_}}},
      {"attributes", {{"early_stopping_patience_counter", counter_}}}};
  return CallbackState{"EarlyStoppingCallback", state.dump()};
}

void EarlyStoppingCallback::load_state(const std::string& text) {
  const json state = json::parse(text);  // checked when trainer_state.json was read
  const json args = state.value("args", json::object());
  const json attributes = state.value("attributes", json::object());
  auto read = [&](const json& from, const char* key, auto& field) {
    if (!from.contains(key)) return;
    using T = std::decay_t<decltype(field)>;
    const json& v = from[key];
    const bool fits =
        std::is_integral_v<T>
            ? v.is_number_integer() && !(v.is_number_unsigned() && v.get<uint64_t>() > INT64_MAX)
            : v.is_number();
    TORCH_CHECK(fits, "EarlyStoppingCallback: state '", key, "' expects ",
                std::is_integral_v<T> ? "an integer" : "a number", ", got ", v.dump());
    field = v.get<T>();
  };
  int64_t patience = patience_, counter = counter_;  // all read before any is set
  double threshold = threshold_;
  read(args, "early_stopping_patience", patience);
  read(args, "early_stopping_threshold", threshold);
  read(attributes, "early_stopping_patience_counter", counter);
  patience_ = patience, threshold_ = threshold, counter_ = counter;
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
