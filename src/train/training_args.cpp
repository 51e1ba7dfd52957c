#include "mixprec/train/training_args.h"

#include "mixprec/optim/lr_scheduler.h"

#include <c10/util/Exception.h>
#include <yaml-cpp/yaml.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

namespace mixprec::train {

namespace {

using json = nlohmann::json;

// Every field, by name: one list drives JSON, YAML, the command line, help
// and training_args.json.
template <typename Args, typename F>
void visit(Args& a, F&& f) {
  f("output_dir", a.output_dir);
  f("overwrite_output_dir", a.overwrite_output_dir);
  f("eval_strategy", a.eval_strategy);
  f("eval_steps", a.eval_steps);
  f("fp16", a.fp16);
  f("bf16", a.bf16);
  f("fp16_full_eval", a.fp16_full_eval);
  f("bf16_full_eval", a.bf16_full_eval);
  f("per_device_train_batch_size", a.per_device_train_batch_size);
  f("per_device_eval_batch_size", a.per_device_eval_batch_size);
  f("gradient_accumulation_steps", a.gradient_accumulation_steps);
  f("learning_rate", a.learning_rate);
  f("weight_decay", a.weight_decay);
  f("adam_beta1", a.adam_beta1);
  f("adam_beta2", a.adam_beta2);
  f("adam_epsilon", a.adam_epsilon);
  f("max_grad_norm", a.max_grad_norm);
  f("num_train_epochs", a.num_train_epochs);
  f("max_steps", a.max_steps);
  f("lr_scheduler_type", a.lr_scheduler_type);
  f("warmup_steps", a.warmup_steps);
  f("logging_strategy", a.logging_strategy);
  f("logging_steps", a.logging_steps);
  f("logging_first_step", a.logging_first_step);
  f("save_strategy", a.save_strategy);
  f("save_steps", a.save_steps);
  f("save_total_limit", a.save_total_limit);
  f("load_best_model_at_end", a.load_best_model_at_end);
  f("metric_for_best_model", a.metric_for_best_model);
  f("greater_is_better", a.greater_is_better);
  f("seed", a.seed);
  f("data_seed", a.data_seed);
  f("dataloader_num_workers", a.dataloader_num_workers);
  f("dataloader_drop_last", a.dataloader_drop_last);
  f("optim", a.optim);
  f("report_to", a.report_to);
  f("resume_from_checkpoint", a.resume_from_checkpoint);
  f("disable_tqdm", a.disable_tqdm);
  f("use_cpu", a.use_cpu);
  f("label_names", a.label_names);
  f("run_name", a.run_name);
}

// Old names transformers still documents, and what they mean now.
std::string canonical_name(const std::string& key) {
  if (key == "evaluation_strategy") return "eval_strategy";
  if (key == "warmup_ratio") return "warmup_steps";  // a value below 1 is a ratio
  return key;
}

std::vector<std::string> field_names() {
  std::vector<std::string> names;
  TrainingArguments a;
  visit(a, [&](const char* name, auto&) { names.emplace_back(name); });
  return names;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
      diagonal = up;
    }
  }
  return row[b.size()];
}

[[noreturn]] void unknown_key(const std::string& key, const std::string& where) {
  std::string closest;
  size_t best = std::string::npos;
  for (const auto& name : field_names()) {
    const size_t d = edit_distance(key, name);
    if (d < best) best = d, closest = name;
  }
  TORCH_CHECK(false, "TrainingArguments", where, ": unknown argument '", key, "'; did you mean '",
              closest, "'?");
}

std::string type_name(const bool&) { return "a boolean"; }
std::string type_name(const int64_t&) { return "an integer"; }
std::string type_name(const double&) { return "a number"; }
std::string type_name(const std::string&) { return "a string"; }
std::string type_name(const std::vector<std::string>&) { return "a list of strings"; }
template <typename T>
std::string type_name(const std::optional<T>&) {
  return type_name(T{}) + " or null";
}

// The value as JSON text; bytes that are not UTF-8 (YAML and flags may hold
// them) shown as U+FFFD rather than failing.
std::string describe(const json& v) {
  return v.dump(-1, ' ', false, json::error_handler_t::replace) + " (" +
         std::string(v.type_name()) + ")";
}

// Assigns a JSON value to a field, or says what was expected.
void assign(bool& field, const json& v, const std::string& key) {
  TORCH_CHECK(v.is_boolean(), "TrainingArguments: '", key, "' expects a boolean, got ",
              describe(v));
  field = v.get<bool>();
}
void assign(int64_t& field, const json& v, const std::string& key) {
  // 2^63 is exact in a double; anything from there up does not fit an int64.
  const double d = v.is_number() ? v.get<double>() : 0.0;
  const bool integral = v.is_number_integer() || (v.is_number_float() && std::floor(d) == d);
  TORCH_CHECK(integral, "TrainingArguments: '", key, "' expects an integer, got ", describe(v));
  const bool fits = v.is_number_unsigned()
                        ? v.get<uint64_t>() <= uint64_t{std::numeric_limits<int64_t>::max()}
                        : v.is_number_integer() || (d >= -0x1p63 && d < 0x1p63);
  TORCH_CHECK(fits, "TrainingArguments: '", key, "' expects an integer, got ", describe(v),
              ", which does not fit in 64 bits");
  field = v.is_number_integer() ? v.get<int64_t>() : static_cast<int64_t>(d);
}
void assign(double& field, const json& v, const std::string& key) {
  TORCH_CHECK(v.is_number(), "TrainingArguments: '", key, "' expects a number, got ", describe(v));
  field = v.get<double>();
}
// training_args.json must be able to hold every string: they must be UTF-8.
void check_utf8(const std::string& s, const std::string& key) {
  try {
    (void)json(s).dump();
  } catch (const json::type_error&) {
    TORCH_CHECK(false, "TrainingArguments: '", key, "' expects UTF-8 text, got ", describe(s));
  }
}
void assign(std::string& field, const json& v, const std::string& key) {
  TORCH_CHECK(v.is_string(), "TrainingArguments: '", key, "' expects a string, got ", describe(v));
  check_utf8(v.get<std::string>(), key);
  field = v.get<std::string>();
}
void assign(std::vector<std::string>& field, const json& v, const std::string& key) {
  if (v.is_string()) {  // "tensorboard" or "tensorboard,jsonl"
    check_utf8(v.get<std::string>(), key);
    field.clear();
    std::stringstream parts(v.get<std::string>());
    for (std::string part; std::getline(parts, part, ',');)
      if (!part.empty()) field.push_back(part);
    return;
  }
  TORCH_CHECK(
      v.is_array() && std::all_of(v.begin(), v.end(), [](auto& e) { return e.is_string(); }),
      "TrainingArguments: '", key, "' expects a list of strings, got ", describe(v));
  for (const auto& item : v) check_utf8(item.get<std::string>(), key);
  field = v.get<std::vector<std::string>>();
}
template <typename T>
void assign(std::optional<T>& field, const json& v, const std::string& key) {
  if (v.is_null()) {
    field.reset();
    return;
  }
  T value{};
  assign(value, v, key);
  field = value;
}

json to_value(const auto& field) { return field; }
template <typename T>
json to_value(const std::optional<T>& field) {
  return field ? json(*field) : json(nullptr);
}

void assign_all(TrainingArguments& args, const json& object, const std::string& where) {
  TORCH_CHECK(object.is_object(), "TrainingArguments", where,
              ": expected an object of arguments, got ", object.type_name());
  for (const auto& [raw_key, value] : object.items()) {
    const std::string key = canonical_name(raw_key);
    bool found = false;
    visit(args, [&](const char* name, auto& field) {
      if (key != name) return;
      assign(field, value, raw_key);
      found = true;
    });
    if (!found) unknown_key(raw_key, where);
  }
}

// YAML scalars carry no JSON type: plain ones are read as YAML 1.2's core
// schema reads them (null, booleans, integers, floats), quoted ones as strings.
json yaml_to_json(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Null:
      return nullptr;
    case YAML::NodeType::Sequence: {
      json array = json::array();
      for (const auto& item : node) array.push_back(yaml_to_json(item));
      return array;
    }
    case YAML::NodeType::Map: {
      json object = json::object();
      for (const auto& item : node)
        object[item.first.as<std::string>()] = yaml_to_json(item.second);
      return object;
    }
    default: {
      const std::string s = node.Scalar();
      if (node.Tag() == "!") return s;  // quoted
      if (s == "null" || s == "~" || s == "Null" || s == "NULL") return nullptr;
      if (s == "true" || s == "True" || s == "TRUE") return true;
      if (s == "false" || s == "False" || s == "FALSE") return false;
      try {
        size_t used = 0;
        const long long i = std::stoll(s, &used);
        if (used == s.size()) return i;
        const double d = std::stod(s, &used);
        if (used == s.size()) return d;
      } catch (const std::exception&) {
      }
      return s;
    }
  }
}

bool is_bool_literal(const std::string& s) {
  return s == "true" || s == "false" || s == "True" || s == "False" || s == "1" || s == "0";
}

// A command-line value, typed by the field it goes to.
json cli_value(const bool&, const std::vector<std::string>& words) {
  return words.empty() || words[0] == "true" || words[0] == "True" || words[0] == "1";
}
json cli_value(const std::string&, const std::vector<std::string>& words) {
  return words.empty() ? json("") : json(words[0]);
}
json cli_value(const std::vector<std::string>&, const std::vector<std::string>& words) {
  return words;
}
template <typename T>
json cli_value(const T&, const std::vector<std::string>& words) {  // numbers
  if (words.empty()) return nullptr;
  try {
    return json::parse(words[0]);
  } catch (const json::exception&) {
    return words[0];  // reported as a string where a number was expected
  }
}
template <typename T>
json cli_value(const std::optional<T>&, const std::vector<std::string>& words) {
  if (!words.empty() && (words[0] == "None" || words[0] == "null")) return nullptr;
  return cli_value(T{}, words);
}

template <typename T>
bool is_bool_field(const T&) {
  return std::is_same_v<T, bool> || std::is_same_v<T, std::optional<bool>>;
}
template <typename T>
bool is_list_field(const T&) {
  return std::is_same_v<T, std::vector<std::string>> ||
         std::is_same_v<T, std::optional<std::vector<std::string>>>;
}

bool one_of(const std::string& value, std::initializer_list<const char*> allowed) {
  return std::any_of(allowed.begin(), allowed.end(), [&](const char* a) { return value == a; });
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "TrainingArguments: cannot open '", path, "'");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

void TrainingArguments::validate() {
  for (const auto& [name, value] : {std::pair{"eval_strategy", &eval_strategy},
                                    std::pair{"logging_strategy", &logging_strategy}}) {
    TORCH_CHECK(one_of(*value, {"no", "steps", "epoch"}), "TrainingArguments: ", name, " '", *value,
                "' is not one of \"no\", \"steps\", \"epoch\"");
  }
  TORCH_CHECK(one_of(save_strategy, {"no", "steps", "epoch", "best"}),
              "TrainingArguments: save_strategy '", save_strategy,
              "' is not one of \"no\", \"steps\", \"epoch\", \"best\"");
  const auto& schedulers = optim::scheduler_types();
  TORCH_CHECK(
      std::find(schedulers.begin(), schedulers.end(), lr_scheduler_type) != schedulers.end(),
      "TrainingArguments: unknown lr_scheduler_type '", lr_scheduler_type, "'");
  TORCH_CHECK(one_of(optim, {"adamw_torch", "adamw_torch_fused", "sgd"}),
              "TrainingArguments: optim '", optim,
              "' is not one of \"adamw_torch\", \"adamw_torch_fused\", \"sgd\"");
  for (const auto& r : report_to)
    TORCH_CHECK(one_of(r, {"tensorboard", "jsonl", "none", "all"}),
                "TrainingArguments: report_to '", r,
                "' is not one of \"tensorboard\", \"jsonl\", \"none\", \"all\"");
  // As transformers: "none" means no tracker, "all" every one there is.
  std::vector<std::string> trackers;
  for (const auto& r : report_to) {
    if (r == "all")
      trackers = {"tensorboard", "jsonl"};
    else if (r != "none" && std::find(trackers.begin(), trackers.end(), r) == trackers.end())
      trackers.push_back(r);
  }
  report_to = trackers;
  TORCH_CHECK(!(fp16 && bf16), "At most one of fp16 and bf16 can be True, but not both");
  TORCH_CHECK(!(fp16_full_eval && bf16_full_eval),
              "At most one of fp16 and bf16 can be True for full eval, but not both");
  TORCH_CHECK(per_device_train_batch_size >= 1 && per_device_eval_batch_size >= 1,
              "TrainingArguments: batch sizes must be >= 1, got per_device_train_batch_size=",
              per_device_train_batch_size,
              " per_device_eval_batch_size=", per_device_eval_batch_size);
  TORCH_CHECK(gradient_accumulation_steps >= 1,
              "TrainingArguments: gradient_accumulation_steps must be >= 1, got ",
              gradient_accumulation_steps);
  TORCH_CHECK(dataloader_num_workers >= 0,
              "TrainingArguments: dataloader_num_workers must be >= 0, got ",
              dataloader_num_workers);
  TORCH_CHECK(warmup_steps >= 0, "Got warmup_steps = ", warmup_steps,
              ", Expected value warmup_steps >= 0");
  TORCH_CHECK(!save_total_limit || *save_total_limit >= 1,
              "TrainingArguments: save_total_limit must be >= 1 (or unset), got ",
              *save_total_limit);
  TORCH_CHECK(max_steps > 0 || num_train_epochs > 0,
              "TrainingArguments: set num_train_epochs > 0 or max_steps > 0");

  if (eval_strategy == "steps" && (!eval_steps || *eval_steps == 0)) {
    TORCH_CHECK(logging_steps > 0,
                "evaluation strategy steps requires either non-zero "
                "--eval_steps or --logging_steps");
    eval_steps = logging_steps;
  }
  TORCH_CHECK(!(logging_strategy == "steps" && logging_steps == 0), "logging strategy ",
              logging_strategy, " requires non-zero --logging_steps");
  auto check_integral = [](const char* name, double steps) {
    TORCH_CHECK(steps <= 1 || steps == std::floor(steps), "--", name,
                " must be an integer if bigger than 1: ", steps);
  };
  if (logging_strategy == "steps") check_integral("logging_steps", logging_steps);
  if (eval_strategy == "steps") check_integral("eval_steps", *eval_steps);
  if (save_strategy == "steps") check_integral("save_steps", save_steps);
  TORCH_CHECK(save_strategy != "steps" || save_steps > 0,
              "Setting `strategy` as 'steps' requires a positive value for `steps`.");

  if (load_best_model_at_end && save_strategy != "best") {
    TORCH_CHECK(eval_strategy == save_strategy,
                "--load_best_model_at_end requires the save and eval strategy to match, except "
                "when --save_strategy=\"best\", but found\n- Evaluation strategy: ",
                eval_strategy, "\n- Save strategy: ", save_strategy);
    if (eval_strategy == "steps") {
      const double ratio = save_steps / *eval_steps;
      TORCH_CHECK(ratio == std::floor(ratio),
                  "--load_best_model_at_end requires the saving steps to be a round multiple of "
                  "the evaluation steps, but found ",
                  save_steps, ", which is not a round multiple of ", *eval_steps, ".");
    }
  }
  if ((load_best_model_at_end || save_strategy == "best") && !metric_for_best_model)
    metric_for_best_model = "loss";
  if (metric_for_best_model && !greater_is_better) {
    const std::string& m = *metric_for_best_model;
    greater_is_better = !(m == "loss" || m == "eval_loss");
  }
}

namespace {

// JSON or YAML text to validated arguments; `where` names the source in errors.
TrainingArguments parse_text(const std::string& text, bool yaml, const std::string& where) {
  json object;
  try {
    object = yaml ? yaml_to_json(YAML::Load(text)) : json::parse(text);
  } catch (const YAML::Exception& e) {
    TORCH_CHECK(false, "TrainingArguments", where, ": malformed YAML: ", e.what());
  } catch (const json::exception& e) {
    TORCH_CHECK(false, "TrainingArguments", where, ": malformed JSON: ", e.what());
  }
  TrainingArguments args;
  assign_all(args, object, where);
  args.validate();
  return args;
}

}  // namespace

TrainingArguments TrainingArguments::from_json(const std::string& json_text) {
  return parse_text(json_text, /*yaml=*/false, "");
}

TrainingArguments TrainingArguments::from_yaml(const std::string& yaml_text) {
  return parse_text(yaml_text, /*yaml=*/true, "");
}

TrainingArguments TrainingArguments::from_file(const std::string& path) {
  const bool yaml = path.ends_with(".yaml") || path.ends_with(".yml");
  return parse_text(read_file(path), yaml, " (" + path + ")");
}

TrainingArguments TrainingArguments::parse_args(const std::vector<std::string>& words) {
  TrainingArguments args;
  size_t i = 0;
  if (words.size() >= 2 && words[0] == "--config") {
    args = from_file(words[1]);
    i = 2;
  }
  json overrides = json::object();
  while (i < words.size()) {
    const std::string& word = words[i];
    TORCH_CHECK(word.starts_with("--"), "TrainingArguments: expected --name, got '", word, "'");
    std::string key = word.substr(2);
    std::vector<std::string> values;
    if (auto eq = key.find('='); eq != std::string::npos) {
      values.push_back(key.substr(eq + 1));
      key = key.substr(0, eq);
    }
    ++i;
    bool found = false;
    visit(args, [&](const char* name, auto& field) {
      if (canonical_name(key) != name) return;
      found = true;
      const bool inline_value = !values.empty();  // --name=value
      if (!inline_value && is_bool_field(field)) {
        if (i < words.size() && is_bool_literal(words[i])) values.push_back(words[i++]);
      } else if (!inline_value && is_list_field(field)) {
        while (i < words.size() && !words[i].starts_with("--")) values.push_back(words[i++]);
      } else if (!inline_value) {
        TORCH_CHECK(i < words.size(), "TrainingArguments: --", key, " expects a value");
        values.push_back(words[i++]);
      }
      overrides[key] = cli_value(field, values);
    });
    if (!found) unknown_key(key, " (command line)");
  }
  assign_all(args, overrides, " (command line)");
  args.validate();
  return args;
}

TrainingArguments TrainingArguments::parse_args(int argc, const char* const* argv) {
  return parse_args(std::vector<std::string>(argv + 1, argv + argc));
}

std::string TrainingArguments::help() {
  std::ostringstream out;
  out << "Training arguments (transformers.TrainingArguments' names and defaults):\n"
      << "  --config FILE  a .json or .yaml file of arguments; later flags override it\n";
  TrainingArguments defaults;
  visit(defaults, [&](const char* name, const auto& field) {
    out << "  --" << name << "  " << type_name(field) << " (default: " << to_value(field).dump()
        << ")\n";
  });
  return out.str();
}

std::string TrainingArguments::to_json() const {
  json object = json::object();
  visit(*this, [&](const char* name, const auto& field) { object[name] = to_value(field); });
  return object.dump(2);
}

}  // namespace mixprec::train
