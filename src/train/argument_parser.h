// Named arguments read from JSON/YAML files and command-line flags, in groups:
// what TrainingArguments and the `mixprec` command share (HF's HfArgumentParser).
// Internal: not installed.
#pragma once

#include "mixprec/train/training_args.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace mixprec::train::detail {

using json = nlohmann::json;

/// One named field of an arguments struct, type-erased.
struct Argument {
  std::string name;
  std::vector<std::string> aliases;  // old names that still work
  std::string type;                  // "a boolean", "an integer or null", ... for messages and help
  bool is_bool = false;              // a flag alone means true
  bool is_list = false;              // takes the words up to the next flag
  bool negatable = false;            // a boolean whose default is true: --no_<name> sets false
  std::function<void(const json& value, const std::string& error_prefix)> assign;
  std::function<json()> value;
  std::function<json(const std::vector<std::string>& words)> from_words;
};

template <typename T>
Argument argument(const char* name, T& field, std::vector<std::string> aliases = {});

/// JSON or YAML text as JSON; `owner` starts error messages.
json parse_config_text(const std::string& text, bool yaml, const std::string& owner);
/// A .json or .yaml/.yml file as JSON; YAML plain scalars typed as YAML 1.2's
/// core schema types them. `owner` starts error messages.
json read_config_file(const std::string& path, const std::string& owner);

/// Argument groups filled from a JSON object, a config file and flags; an
/// unknown name is an error that suggests the closest known one.
class ArgumentParser {
 public:
  explicit ArgumentParser(std::string owner) : owner_(std::move(owner)) {}
  ArgumentParser& add_group(std::string title, std::vector<Argument> arguments);

  /// Every key of `object` to its argument; `where` says where they came from.
  void assign(const json& object, const std::string& where = "") const;
  /// `--config FILE` (optional, first) then `--name value` / `--name=value` overrides; as
  /// HfArgumentParser's, `--no_name` for a boolean whose default is true, and dashes for
  /// underscores (`--learning-rate`, `--no-logging-nan-inf-filter`).
  void parse_args(const std::vector<std::string>& words) const;
  /// Each group with every argument, its type and its current value as default.
  std::string help() const;

 private:
  const Argument* find(const std::string& name) const;
  [[noreturn]] void unknown(const std::string& name, const std::string& where) const;

  std::string owner_;
  std::vector<std::pair<std::string, std::vector<Argument>>> groups_;
};

/// TrainingArguments' fields, in the order of help and training_args.json.
std::vector<Argument> training_arguments(TrainingArguments& args);

// --- how each field type is read and written ---

std::string type_name(const bool&);
std::string type_name(const int64_t&);
std::string type_name(const double&);
std::string type_name(const std::string&);
std::string type_name(const std::vector<std::string>&);
std::string type_name(const optim::SchedulerKwargs&);
std::string type_name(const ActivationCheckpointingKwargs&);
std::string type_name(const AcceleratorConfig&);
template <typename T>
std::string type_name(const std::optional<T>&) {
  return type_name(T{}) + " or null";
}

void assign_value(bool& field, const json& v, const std::string& prefix);
void assign_value(int64_t& field, const json& v, const std::string& prefix);
void assign_value(double& field, const json& v, const std::string& prefix);
void assign_value(std::string& field, const json& v, const std::string& prefix);
void assign_value(std::vector<std::string>& field, const json& v, const std::string& prefix);
void assign_value(optim::SchedulerKwargs& field, const json& v, const std::string& prefix);
void assign_value(ActivationCheckpointingKwargs& field, const json& v, const std::string& prefix);
void assign_value(GradientAccumulationKwargs& field, const json& v, const std::string& prefix);
void assign_value(AcceleratorConfig& field, const json& v, const std::string& prefix);
template <typename T>
void assign_value(std::optional<T>& field, const json& v, const std::string& prefix) {
  if (v.is_null()) {
    field.reset();
    return;
  }
  T value{};
  assign_value(value, v, prefix);
  field = value;
}

json words_value(const bool&, const std::vector<std::string>& words);
json words_value(const std::string&, const std::vector<std::string>& words);
json words_value(const std::vector<std::string>&, const std::vector<std::string>& words);
json words_value(const int64_t&, const std::vector<std::string>& words);
json words_value(const double&, const std::vector<std::string>& words);
json words_value(const optim::SchedulerKwargs&, const std::vector<std::string>& words);
json words_value(const ActivationCheckpointingKwargs&, const std::vector<std::string>& words);
json words_value(const AcceleratorConfig&, const std::vector<std::string>& words);
// The field as training_args.json and help show it.
template <typename T>
json to_json_value(const T& field) {
  return field;
}
json to_json_value(const optim::SchedulerKwargs& field);
json to_json_value(const ActivationCheckpointingKwargs& field);
json to_json_value(const GradientAccumulationKwargs& field);
json to_json_value(const AcceleratorConfig& field);
template <typename T>
json words_value(const std::optional<T>&, const std::vector<std::string>& words) {
  if (!words.empty() && (words[0] == "None" || words[0] == "null")) return nullptr;
  return words_value(T{}, words);
}

template <typename T>
Argument argument(const char* name, T& field, std::vector<std::string> aliases) {
  Argument a;
  a.name = name;
  a.aliases = std::move(aliases);
  a.type = type_name(field);
  a.is_bool = std::is_same_v<T, bool> || std::is_same_v<T, std::optional<bool>>;
  // As HfArgumentParser: a boolean that defaults to true also gets --no_<name> (the parser is
  // made on a default struct).
  if constexpr (std::is_same_v<T, bool>) a.negatable = field;
  a.is_list = std::is_same_v<T, std::vector<std::string>> ||
              std::is_same_v<T, std::optional<std::vector<std::string>>>;
  a.assign = [&field](const json& v, const std::string& prefix) { assign_value(field, v, prefix); };
  a.value = [&field]() -> json {
    if constexpr (requires { field.has_value(); })
      return field ? to_json_value(*field) : json(nullptr);
    else
      return to_json_value(field);
  };
  a.from_words = [&field](const std::vector<std::string>& w) { return words_value(field, w); };
  return a;
}

}  // namespace mixprec::train::detail
