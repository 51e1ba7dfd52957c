#include "argument_parser.h"

#include "mixprec/io/safetensors.h"

#include "io/json_excerpt.h"

#include <c10/util/Exception.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <regex>
#include <sstream>

namespace mixprec::train::detail {

namespace {

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

// The value as JSON text (cut if long); bytes that are not UTF-8 (YAML and flags may hold
// them) shown as U+FFFD rather than failing.
std::string describe(const json& v) {
  return io::detail::json_excerpt(v, 200) + " (" + std::string(v.type_name()) + ")";
}

// training_args.json must be able to hold every string: they must be UTF-8.
void check_utf8(const std::string& s, const std::string& prefix) {
  try {
    (void)json(s).dump();
  } catch (const json::type_error&) {
    TORCH_CHECK(false, prefix, " expects UTF-8 text, got ", describe(s));
  }
}

// YAML scalars carry no JSON type: plain ones are read as YAML 1.2's core
// schema reads them (null, true/false, integers in decimal, 0x hex and 0o
// octal, floats, .inf and .nan), quoted ones as strings. (Not YAML 1.1's
// yes/no/on/off booleans, which PyYAML takes: `eval_strategy: no` is "no".)
// Aliases are followed, within bounds: an anchor inside itself, or aliases of
// aliases that expand to millions of values, are errors.
json yaml_to_json(const YAML::Node& node, int depth, size_t& values) {
  constexpr int kMaxDepth = 64;
  constexpr size_t kMaxValues = 1'000'000;
  TORCH_CHECK(depth <= kMaxDepth, "nested deeper than ", kMaxDepth,
              " levels (an alias inside its own anchor?)");
  TORCH_CHECK(++values <= kMaxValues, "more than ", kMaxValues, " values (aliases that expand?)");
  switch (node.Type()) {
    case YAML::NodeType::Null:
      return nullptr;
    case YAML::NodeType::Sequence: {
      json array = json::array();
      for (const auto& item : node) array.push_back(yaml_to_json(item, depth + 1, values));
      return array;
    }
    case YAML::NodeType::Map: {
      json object = json::object();
      for (const auto& item : node)
        object[item.first.as<std::string>()] = yaml_to_json(item.second, depth + 1, values);
      return object;
    }
    default: {
      const std::string s = node.Scalar();
      if (node.Tag() == "!") return s;  // quoted
      if (s == "null" || s == "~" || s == "Null" || s == "NULL") return nullptr;
      if (s == "true" || s == "True" || s == "TRUE") return true;
      if (s == "false" || s == "False" || s == "FALSE") return false;
      // Longer, it is no number (and std::regex would recurse once per character).
      if (s.size() > 64) return s;
      static const std::regex integer("[-+]?[0-9]+"), hex("0x[0-9a-fA-F]+"), octal("0o[0-7]+");
      static const std::regex floating(R"([-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?)");
      static const std::regex infinity(R"([-+]?\.(inf|Inf|INF))"), nan(R"(\.(nan|NaN|NAN))");
      try {
        if (std::regex_match(s, integer)) return std::stoll(s);
        if (std::regex_match(s, hex)) return std::stoll(s.substr(2), nullptr, 16);
        if (std::regex_match(s, octal)) return std::stoll(s.substr(2), nullptr, 8);
        if (std::regex_match(s, floating)) return std::stod(s);
      } catch (const std::out_of_range&) {  // read as a string, refused where a number goes
      }
      if (std::regex_match(s, infinity))
        return s[0] == '-' ? -std::numeric_limits<double>::infinity()
                           : std::numeric_limits<double>::infinity();
      if (std::regex_match(s, nan)) return std::numeric_limits<double>::quiet_NaN();
      return s;
    }
  }
}

}  // namespace

json parse_config_text(const std::string& text, bool yaml, const std::string& owner) {
  try {
    size_t values = 0;
    return yaml ? yaml_to_json(YAML::Load(text), 0, values) : json::parse(text);
  } catch (const YAML::Exception& e) {
    TORCH_CHECK(false, owner, ": malformed YAML: ", e.what());
  } catch (const c10::Error& e) {  // yaml_to_json's bounds
    TORCH_CHECK(false, owner, ": malformed YAML: ", e.what_without_backtrace());
  } catch (const json::exception& e) {
    TORCH_CHECK(false, owner, ": malformed JSON: ", e.what());
  }
}

json read_config_file(const std::string& path, const std::string& owner) {
  std::string text;
  try {
    text = io::read_file(path);
  } catch (const c10::Error& e) {  // "<path>: cannot open (...)", "<path>: is a directory, ..."
    TORCH_CHECK(false, owner, ": ", e.what_without_backtrace());
  }
  return parse_config_text(text, path.ends_with(".yaml") || path.ends_with(".yml"),
                           owner + ": " + path);
}

ArgumentParser& ArgumentParser::add_group(std::string title, std::vector<Argument> arguments) {
  groups_.emplace_back(std::move(title), std::move(arguments));
  return *this;
}

const Argument* ArgumentParser::find(const std::string& name) const {
  for (const auto& [title, arguments] : groups_)
    for (const auto& a : arguments)
      if (a.name == name || std::find(a.aliases.begin(), a.aliases.end(), name) != a.aliases.end())
        return &a;
  return nullptr;
}

void ArgumentParser::unknown(const std::string& name, const std::string& where) const {
  std::string closest;
  size_t best = std::string::npos;
  for (const auto& [title, arguments] : groups_)
    for (const auto& a : arguments)
      if (const size_t d = edit_distance(name, a.name); d < best) best = d, closest = a.name;
  TORCH_CHECK(false, owner_, where, ": unknown argument '", name, "'; did you mean '", closest,
              "'?");
}

void ArgumentParser::assign(const json& object, const std::string& where) const {
  TORCH_CHECK(object.is_object(), owner_, where, ": expected an object of arguments, got ",
              object.type_name());
  for (const auto& [key, value] : object.items()) {
    const Argument* a = find(key);
    if (!a) unknown(key, where);
    a->assign(value, owner_ + where + ": '" + key + "'");
  }
}

void ArgumentParser::parse_args(const std::vector<std::string>& words) const {
  size_t i = 0;
  if (words.size() >= 2 && words[0] == "--config") {
    assign(read_config_file(words[1], owner_), " (" + words[1] + ")");
    i = 2;
  }
  json overrides = json::object();
  while (i < words.size()) {
    const std::string& word = words[i++];
    TORCH_CHECK(word.starts_with("--"), owner_, ": expected --name, got '", word, "'");
    std::string key = word.substr(2);
    std::vector<std::string> values;
    const auto eq = key.find('=');
    if (eq != std::string::npos) {  // --name=value
      values.push_back(key.substr(eq + 1));
      key = key.substr(0, eq);
    }
    std::replace(key.begin(), key.end(), '-', '_');
    const Argument* a = find(key);
    if (const Argument* negated = key.starts_with("no_") ? find(key.substr(3)) : nullptr;
        !a && negated && negated->negatable && negated->name == key.substr(3)) {
      TORCH_CHECK(eq == std::string::npos, owner_, ": --", key, " takes no value, got '", word,
                  "'");
      overrides[negated->name] = false;
      continue;
    }
    if (!a) unknown(key, " (command line)");
    if (eq != std::string::npos) {
    } else if (a->is_bool) {
      if (i < words.size() && string_to_bool(words[i])) values.push_back(words[i++]);
    } else if (a->is_list) {
      while (i < words.size() && !words[i].starts_with("--")) values.push_back(words[i++]);
    } else {
      TORCH_CHECK(i < words.size(), owner_, ": --", key, " expects a value");
      values.push_back(words[i++]);
    }
    overrides[a->name] = a->from_words(values);  // under one name: the last flag wins
  }
  assign(overrides, " (command line)");
}

std::string ArgumentParser::help() const {
  std::ostringstream out;
  for (const auto& [title, arguments] : groups_) {
    out << title << ":\n";
    for (const auto& a : arguments)
      out << "  --" << a.name << "  " << a.type << " (default: " << a.value().dump() << ")\n";
  }
  return out.str();
}

std::string type_name(const bool&) { return "a boolean"; }
std::string type_name(const int64_t&) { return "an integer"; }
std::string type_name(const double&) { return "a number"; }
std::string type_name(const std::string&) { return "a string"; }
std::string type_name(const std::vector<std::string>&) { return "a list of strings"; }
std::string type_name(const optim::SchedulerKwargs&) { return "an object of numbers and strings"; }
std::string type_name(const ActivationCheckpointingKwargs&) {
  return "an object (every_n_layers, preserve_rng_state)";
}
std::string type_name(const AcceleratorConfig&) { return "an object or a file's path"; }

void assign_value(bool& field, const json& v, const std::string& prefix) {
  TORCH_CHECK(v.is_boolean(), prefix, " expects a boolean, got ", describe(v));
  field = v.get<bool>();
}
void assign_value(int64_t& field, const json& v, const std::string& prefix) {
  const double d = v.is_number() ? v.get<double>() : 0.0;
  const bool integral = v.is_number_integer() || (v.is_number_float() && std::floor(d) == d);
  TORCH_CHECK(integral, prefix, " expects an integer, got ", describe(v));
  // 2^63 is exact in a double; anything from there up does not fit an int64.
  const bool fits = v.is_number_unsigned()
                        ? v.get<uint64_t>() <= uint64_t{std::numeric_limits<int64_t>::max()}
                        : v.is_number_integer() || (d >= -0x1p63 && d < 0x1p63);
  TORCH_CHECK(fits, prefix, " expects an integer, got ", describe(v),
              ", which does not fit in 64 bits");
  field = v.is_number_integer() ? v.get<int64_t>() : static_cast<int64_t>(d);
}
void assign_value(double& field, const json& v, const std::string& prefix) {
  TORCH_CHECK(v.is_number(), prefix, " expects a number, got ", describe(v));
  field = v.get<double>();
}
void assign_value(std::string& field, const json& v, const std::string& prefix) {
  TORCH_CHECK(v.is_string(), prefix, " expects a string, got ", describe(v));
  check_utf8(v.get<std::string>(), prefix);
  field = v.get<std::string>();
}
void assign_value(std::vector<std::string>& field, const json& v, const std::string& prefix) {
  if (v.is_string()) {  // "tensorboard" or "tensorboard,jsonl"
    check_utf8(v.get<std::string>(), prefix);
    field.clear();
    std::stringstream parts(v.get<std::string>());
    for (std::string part; std::getline(parts, part, ',');)
      if (!part.empty()) field.push_back(part);
    return;
  }
  TORCH_CHECK(
      v.is_array() && std::all_of(v.begin(), v.end(), [](auto& e) { return e.is_string(); }),
      prefix, " expects a list of strings, got ", describe(v));
  for (const auto& item : v) check_utf8(item.get<std::string>(), prefix);
  field = v.get<std::vector<std::string>>();
}

namespace {
// As HF's dict fields, an object or its JSON text ('{"num_cycles": 2}').
json object_or_json_text(const json& v, const std::string& prefix, const std::string& expected) {
  json object = v;
  if (v.is_string() && v.get<std::string>().starts_with("{")) {
    try {
      object = json::parse(v.get<std::string>());
    } catch (const json::exception& e) {
      TORCH_CHECK(false, prefix, expected, describe(v), ", which is not JSON: ", e.what());
    }
  }
  TORCH_CHECK(object.is_object(), prefix, expected, describe(v));
  return object;
}

// Each key of `object` to its field's reader; another key is an error that lists the known ones.
using KeyReaders =
    std::vector<std::pair<std::string, std::function<void(const json&, const std::string&)>>>;
void assign_keys(const json& object, const std::string& prefix, const KeyReaders& readers) {
  for (const auto& [key, value] : object.items()) {
    const std::string at = prefix + " key '" + key + "'";
    const auto match =
        std::find_if(readers.begin(), readers.end(), [&](const auto& r) { return r.first == key; });
    if (match != readers.end()) {
      match->second(value, at);
      continue;
    }
    std::string known;
    for (const auto& r : readers) known += (known.empty() ? "" : ", ") + r.first;
    TORCH_CHECK(false, at, " is not one of ", known);
  }
}
template <typename T>
auto reader(T& field) {
  return [&field](const json& v, const std::string& at) { assign_value(field, v, at); };
}
}  // namespace

void assign_value(optim::SchedulerKwargs& field, const json& v, const std::string& prefix) {
  const std::string expected = " expects an object of numbers and strings, got ";
  const json object = object_or_json_text(v, prefix, expected);
  TORCH_CHECK(std::all_of(object.begin(), object.end(),
                          [](auto& e) { return e.is_number() || e.is_string(); }),
              prefix, expected, describe(v));
  optim::SchedulerKwargs kwargs;
  for (const auto& [key, value] : object.items()) {
    check_utf8(key, prefix);
    if (value.is_number()) {
      kwargs.emplace(key, value.get<double>());
    } else {
      check_utf8(value.get<std::string>(), prefix);
      kwargs.emplace(key, value.get<std::string>());
    }
  }
  field = std::move(kwargs);
}

void assign_value(ActivationCheckpointingKwargs& field, const json& v, const std::string& prefix) {
  ActivationCheckpointingKwargs kwargs;
  // What mixprec's checkpoint does, and nothing else: their true is an error.
  const auto only_false = [](const char* why) {
    return [why](const json& value, const std::string& at) {
      bool on = false;
      assign_value(on, value, at);
      TORCH_CHECK(!on, at, " is true, which mixprec does not have: ", why);
    };
  };
  assign_keys(object_or_json_text(v, prefix, " expects an object, got "), prefix,
              {{"every_n_layers", reader(kwargs.every_n_layers)},
               {"preserve_rng_state", reader(kwargs.preserve_rng_state)},
               {"use_reentrant", only_false("its checkpoint is the non-reentrant one")},
               {"offload", only_false("it keeps the saved activations where they are made (HF's "
                                      "offload needs an accelerator's pinned host memory)")}});
  field = kwargs;
}

void assign_value(GradientAccumulationKwargs& field, const json& v, const std::string& prefix) {
  GradientAccumulationKwargs kwargs;
  bool unused = false;
  assign_keys(object_or_json_text(v, prefix, " expects an object, got "), prefix,
              {{"num_steps", reader(kwargs.num_steps)},
               {"sync_each_batch", reader(kwargs.sync_each_batch)},
               {"sync_with_dataloader", reader(unused)},
               {"adjust_scheduler", reader(unused)}});
  field = kwargs;
}

void assign_value(AcceleratorConfig& field, const json& v, const std::string& prefix) {
  AcceleratorConfig config;  // null: the defaults, as HF's
  json object = v.is_null() ? json::object() : v;
  std::string where = prefix;
  if (v.is_string() && !v.get<std::string>().starts_with("{")) {  // a file, as HF's
    object = read_config_file(v.get<std::string>(), prefix);
    where += " (" + v.get<std::string>() + ")";
  }
  assign_keys(object_or_json_text(object, where, " expects an object or a file's path, got "),
              where,
              {{"split_batches", reader(config.split_batches)},
               {"dispatch_batches", reader(config.dispatch_batches)},
               {"even_batches", reader(config.even_batches)},
               {"use_seedable_sampler", reader(config.use_seedable_sampler)},
               {"non_blocking", reader(config.non_blocking)},
               {"gradient_accumulation_kwargs", reader(config.gradient_accumulation_kwargs)},
               {"use_configured_state", reader(config.use_configured_state)}});
  field = config;
}

json to_json_value(const GradientAccumulationKwargs& field) {
  return {{"num_steps", field.num_steps ? json(*field.num_steps) : json(nullptr)},
          {"sync_each_batch", field.sync_each_batch}};
}

json to_json_value(const AcceleratorConfig& field) {
  return {
      {"split_batches", field.split_batches},
      {"dispatch_batches", field.dispatch_batches ? json(*field.dispatch_batches) : json(nullptr)},
      {"even_batches", field.even_batches},
      {"use_seedable_sampler", field.use_seedable_sampler},
      {"non_blocking", field.non_blocking},
      {"gradient_accumulation_kwargs", field.gradient_accumulation_kwargs
                                           ? to_json_value(*field.gradient_accumulation_kwargs)
                                           : json(nullptr)},
      {"use_configured_state", field.use_configured_state}};
}

json to_json_value(const ActivationCheckpointingKwargs& field) {
  return {{"every_n_layers", field.every_n_layers},
          {"preserve_rng_state", field.preserve_rng_state}};
}

json to_json_value(const optim::SchedulerKwargs& field) {
  json object = json::object();
  for (const auto& [key, value] : field)
    std::visit([&, &key = key](const auto& v) { object[key] = v; }, value);
  return object;
}

json words_value(const bool&, const std::vector<std::string>& words) {
  if (words.empty()) return true;
  const auto value = string_to_bool(words[0]);
  return value ? json(*value) : json(words[0]);  // a word that is none: refused as a string
}
json words_value(const std::string&, const std::vector<std::string>& words) {
  return words.empty() ? json("") : json(words[0]);
}
json words_value(const std::vector<std::string>&, const std::vector<std::string>& words) {
  return words;
}
namespace {
json number_from_words(const std::vector<std::string>& words) {
  if (words.empty()) return nullptr;
  try {
    return json::parse(words[0]);
  } catch (const json::exception&) {
    return words[0];  // reported as a string where a number was expected
  }
}
}  // namespace
json words_value(const int64_t&, const std::vector<std::string>& words) {
  return number_from_words(words);
}
json words_value(const double&, const std::vector<std::string>& words) {
  return number_from_words(words);
}
json words_value(const optim::SchedulerKwargs&, const std::vector<std::string>& words) {
  return words_value(std::string(), words);  // JSON text, read by assign_value
}
json words_value(const ActivationCheckpointingKwargs&, const std::vector<std::string>& words) {
  return words_value(std::string(), words);
}
json words_value(const AcceleratorConfig&, const std::vector<std::string>& words) {
  return words_value(std::string(), words);  // JSON text or a file's path
}

}  // namespace mixprec::train::detail

namespace mixprec::train {

std::optional<bool> string_to_bool(std::string word) {
  std::ranges::transform(word, word.begin(), [](unsigned char c) { return std::tolower(c); });
  if (word == "yes" || word == "true" || word == "t" || word == "y" || word == "1") return true;
  if (word == "no" || word == "false" || word == "f" || word == "n" || word == "0") return false;
  return std::nullopt;
}

}  // namespace mixprec::train
