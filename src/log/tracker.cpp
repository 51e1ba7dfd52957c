#include "mixprec/log/tracker.h"

#include "mixprec/log/logging.h"

#include <c10/util/Exception.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>
#include <nlohmann/json.hpp>

#include <array>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <set>
#include <string_view>
#include <type_traits>

namespace mixprec::log {

namespace {

double wall_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::ofstream open_for_append(const std::filesystem::path& path) {
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::app);
  TORCH_CHECK(out.good(), "cannot open ", path.string(), " for writing: ", std::strerror(errno));
  return out;
}

// The protobuf wire format, for the handful of fields below.
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
template <typename T>
void put_fixed(std::string& out, T v) {  // little-endian, as x86 and ARM store it
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));
  out.append(bytes, sizeof(T));
}
void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_varint(out, static_cast<uint64_t>(field) << 3 | 2);
  put_varint(out, bytes.size());
  out += bytes;
}

void put_varint_field(std::string& out, int field, uint64_t v) {
  put_varint(out, static_cast<uint64_t>(field) << 3);
  put_varint(out, v);
}

// tensorflow.Event{wall_time = 1 (double), step = 2 (int64), file_version = 3 (string),
// summary = 5 (Summary{value = 1 (Value, repeated)})}.
std::string event(int64_t step, const std::string* file_version, const std::string* summary) {
  std::string e;
  put_varint(e, 1 << 3 | 1);
  put_fixed(e, wall_time());
  put_varint_field(e, 2, static_cast<uint64_t>(step));
  if (file_version) put_bytes(e, 3, *file_version);
  if (summary) put_bytes(e, 5, *summary);
  return e;
}

// Summary.Value{tag = 1, simple_value = 2 (float)}.
std::string scalar_value(const std::string& tag, double value) {
  std::string v;
  put_bytes(v, 1, tag);
  put_varint(v, 2 << 3 | 5);
  put_fixed(v, static_cast<float>(value));
  return v;
}

// SummaryMetadata{plugin_data = 1 (PluginData{plugin_name = 1, content = 2 (bytes)})}.
std::string plugin_metadata(const std::string& plugin_name, const std::string& content) {
  std::string plugin_data;
  put_bytes(plugin_data, 1, plugin_name);
  if (!content.empty()) put_bytes(plugin_data, 2, content);
  std::string metadata;
  put_bytes(metadata, 1, plugin_data);
  return metadata;
}

// torch's add_text: Summary.Value{tag = 1, metadata = 9 (the text plugin's, TextPluginData
// version 0: empty), tensor = 8 (TensorProto{dtype = 1 (DT_STRING = 7), tensor_shape = 2
// (TensorShapeProto{dim = 2 (Dim{size = 1})}), string_val = 8})}.
std::string text_value(const std::string& tag, const std::string& text) {
  std::string dim, shape, tensor, v;
  put_varint_field(dim, 1, 1);
  put_bytes(shape, 2, dim);
  put_varint_field(tensor, 1, 7);
  put_bytes(tensor, 2, shape);
  put_bytes(tensor, 8, text);
  put_bytes(v, 1, tag + "/text_summary");
  put_bytes(v, 9, plugin_metadata("text", ""));
  put_bytes(v, 8, tensor);
  return v;
}

// torch's hparams(): one summary of a Value{tag, metadata} whose plugin content is
// HParamsPluginData{version = 1 (0), experiment = 2 | session_start_info = 3 |
// session_end_info = 4}.
std::string hparams_summary(const std::string& tag, int field, const std::string& message) {
  std::string content;
  put_varint_field(content, 1, 0);  // PLUGIN_DATA_VERSION
  put_bytes(content, field, message);
  std::string v, summary;
  put_bytes(v, 1, tag);
  put_bytes(v, 9, plugin_metadata("hparams", content));
  put_bytes(summary, 1, v);
  return summary;
}

// A JSON number, or the text "nan", "inf", "-inf" (JSON has no non-finite numbers).
nlohmann::json json_number(double value) {
  if (std::isfinite(value)) return value;
  return std::isnan(value) ? "nan" : (value > 0 ? "inf" : "-inf");
}

// A float as PyYAML writes it: Python's repr, with .nan / .inf, and ".0" before a bare
// exponent ("1.0e-05").
std::string yaml_float(double v) {
  if (std::isnan(v)) return ".nan";
  if (std::isinf(v)) return v > 0 ? ".inf" : "-.inf";
  std::string text = python_repr(v);
  if (const size_t e = text.find('e');
      e != std::string::npos && text.find('.') == std::string::npos)
    text.insert(e, ".0");
  return text;
}

// Whether PyYAML would quote `text` (single quotes, as here): YAML 1.1 would read it unquoted
// as a bool, null or what may be a number, or it holds an indicator. Quoting more than needed
// is harmless; quoting less would change the value read back.
bool yaml_needs_quotes(const std::string& text) {
  static const std::set<std::string> words = {
      "y",  "Y",    "yes",  "Yes",  "YES",   "n",     "N",     "no",  "No",
      "NO", "true", "True", "TRUE", "false", "False", "FALSE", "on",  "On",
      "ON", "off",  "Off",  "OFF",  "~",     "null",  "Null",  "NULL"};
  return text.empty() || words.count(text) > 0 ||
         std::isdigit(static_cast<unsigned char>(text[0])) ||
         std::string_view("-+.?!&*|>%@`'\"{}[],#").find(text[0]) != std::string_view::npos ||
         text.find(": ") != std::string::npos || text.find(" #") != std::string::npos ||
         text.front() == ' ' || text.back() == ' ' || text.back() == ':';
}

uint32_t masked(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

}  // namespace

uint32_t crc32c(const void* data, size_t size, uint32_t previous) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t crc = previous ^ 0xffffffffu;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return crc ^ 0xffffffffu;
}

JsonlTracker::JsonlTracker(const std::filesystem::path& path)
    : path_(path), out_(open_for_append(path)) {
  // A line a killed run left half-written ends here, so that this run's first line stands alone.
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (in && in.tellg() > 0 && in.seekg(-1, std::ios::end) && in.get() != '\n') write_line("");
}

void JsonlTracker::log(const std::map<std::string, double>& values, int64_t step) {
  nlohmann::json line = {{"step", step}, {"wall_time", wall_time()}};
  for (const auto& [key, value] : values) line[key] = json_number(value);
  write_line(line.dump());
}

void JsonlTracker::log_text(const std::map<std::string, std::string>& values, int64_t step) {
  nlohmann::json line = {{"step", step}, {"wall_time", wall_time()}};
  for (const auto& [key, value] : values) line[key] = value;
  write_line(line.dump());
}

void JsonlTracker::store_init_configuration(const Config& config) {
  nlohmann::json values = nlohmann::json::object();
  for (const auto& [key, value] : config)
    std::visit(
        [&, &key = key](const auto& v) {
          if constexpr (std::is_same_v<std::decay_t<decltype(v)>, double>)
            values[key] = json_number(v);
          else
            values[key] = v;
        },
        value);
  write_line(nlohmann::json{{"wall_time", wall_time()}, {"config", values}}.dump());
}

void JsonlTracker::write_line(const std::string& line) {
  out_ << line << '\n';
  TORCH_CHECK(out_.good(), "writing ", path_.string(), " failed");
}

void JsonlTracker::flush() {
  out_.flush();
  TORCH_CHECK(out_.good(), "writing ", path_.string(), " failed");
}

TensorBoardTracker::TensorBoardTracker(const std::filesystem::path& log_dir) : log_dir_(log_dir) {
  std::filesystem::create_directories(log_dir);
  char host[256] = "localhost";
  gethostname(host, sizeof(host) - 1);
  const auto seconds = static_cast<int64_t>(wall_time());
  file_ = log_dir / ("events.out.tfevents." + std::to_string(seconds) + "." + host + "." +
                     std::to_string(getpid()) + ".mixprec");
  out_ = open_for_append(file_);
  const std::string version = "brain.Event:2";
  write_record(event(0, &version, nullptr));
}

void TensorBoardTracker::log(const std::map<std::string, double>& values, int64_t step) {
  std::string summary;
  for (const auto& [tag, value] : values) put_bytes(summary, 1, scalar_value(tag, value));
  write_record(event(step, nullptr, &summary));
}

void TensorBoardTracker::log_text(const std::map<std::string, std::string>& values, int64_t step) {
  std::string summary;
  for (const auto& [tag, text] : values) put_bytes(summary, 1, text_value(tag, text));
  write_record(event(step, nullptr, &summary));
}

// As torch's hparams(): numbers (bools too, which Python takes for numbers there) are
// DATA_TYPE_FLOAT64 = 3 with number_value = 2, text DATA_TYPE_STRING = 1 with string_value = 3.
void TensorBoardTracker::store_init_configuration(const Config& config) {
  std::string experiment, session_start, session_end;
  YAML::Emitter yaml;
  yaml << YAML::BeginMap;
  for (const auto& [key, value] : config) {
    const auto* text = std::get_if<std::string>(&value);
    std::string info, protobuf_value, entry;
    put_bytes(info, 1, key);
    put_varint_field(info, 4, text ? 1 : 3);
    put_bytes(experiment, 4, info);  // Experiment.hparam_infos
    if (text) {
      put_bytes(protobuf_value, 3, *text);
    } else {
      put_varint(protobuf_value, 2 << 3 | 1);
      put_fixed(protobuf_value, std::visit(
                                    [](const auto& v) -> double {
                                      if constexpr (std::is_arithmetic_v<std::decay_t<decltype(v)>>)
                                        return static_cast<double>(v);
                                      else
                                        return 0;
                                    },
                                    value));
    }
    put_bytes(entry, 1, key);
    put_bytes(entry, 2, protobuf_value);
    put_bytes(session_start, 1, entry);  // SessionStartInfo.hparams, a map
    yaml << YAML::Key << key << YAML::Value;
    std::visit(
        [&](const auto& v) {
          using T = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<T, double>)
            yaml << yaml_float(v);
          else if constexpr (std::is_same_v<T, std::string>)
            yaml << (yaml_needs_quotes(v) ? YAML::SingleQuoted : YAML::Auto) << v;
          else
            yaml << v;
        },
        value);
  }
  yaml << YAML::EndMap;
  put_varint_field(session_end, 1, 1);  // SessionEndInfo.status = STATUS_SUCCESS
  // As Accelerate's TensorBoardTracker: add_hparams' own event file, in a folder named by the
  // time (Python's str(time.time())), and hparams.yml (Accelerate's goes in a second folder
  // named by a later time; here beside it).
  char now[40];
  const double time = wall_time();
  const auto dir = log_dir_ / std::string(now, std::to_chars(now, now + sizeof(now), time).ptr);
  TensorBoardTracker writer(dir);
  for (const auto& summary : {hparams_summary("_hparams_/experiment", 2, experiment),
                              hparams_summary("_hparams_/session_start_info", 3, session_start),
                              hparams_summary("_hparams_/session_end_info", 4, session_end)})
    writer.write_record(event(0, nullptr, &summary));
  writer.flush();
  std::ofstream out(dir / "hparams.yml");
  out << yaml.c_str() << '\n';
  out.close();
  TORCH_CHECK(out.good(), "writing ", (dir / "hparams.yml").string(), " failed");
}

// TFRecord: uint64 length, masked crc of the length, data, masked crc of the data.
void TensorBoardTracker::write_record(const std::string& data) {
  std::string header;
  put_fixed(header, static_cast<uint64_t>(data.size()));
  std::string frame = header;
  put_fixed(frame, masked(crc32c(header.data(), header.size())));
  frame += data;
  put_fixed(frame, masked(crc32c(data.data(), data.size())));
  out_.write(frame.data(), static_cast<std::streamsize>(frame.size()));
  TORCH_CHECK(out_.good(), "writing ", file_.string(), " failed");
}

void TensorBoardTracker::flush() {
  out_.flush();
  TORCH_CHECK(out_.good(), "writing ", file_.string(), " failed");
}

std::vector<std::unique_ptr<Tracker>> make_trackers(const std::vector<std::string>& names,
                                                    const std::filesystem::path& dir) {
  std::vector<std::unique_ptr<Tracker>> trackers;
  for (const auto& name : names) {
    if (name == "jsonl")
      trackers.push_back(std::make_unique<JsonlTracker>(dir / "log.jsonl"));
    else if (name == "tensorboard")
      trackers.push_back(std::make_unique<TensorBoardTracker>(dir));
    else
      TORCH_CHECK(name == "none", "unknown tracker '", name,
                  "'; expected \"tensorboard\", \"jsonl\" or \"none\"");
  }
  return trackers;
}

}  // namespace mixprec::log
