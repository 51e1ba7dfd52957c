#include "mixprec/log/tracker.h"

#include <c10/util/Exception.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <array>
#include <chrono>
#include <cmath>
#include <cstring>

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

// tensorflow.Event{wall_time = 1 (double), step = 2 (int64), file_version = 3
// (string), summary = 5 (Summary{value = 1 (Value{tag = 1, simple_value = 2 (float)})})}.
std::string event(int64_t step, const std::string* file_version,
                  const std::map<std::string, double>* scalars) {
  std::string e;
  put_varint(e, 1 << 3 | 1);
  put_fixed(e, wall_time());
  put_varint(e, 2 << 3 | 0);
  put_varint(e, static_cast<uint64_t>(step));
  if (file_version) put_bytes(e, 3, *file_version);
  if (scalars) {
    std::string summary;
    for (const auto& [tag, value] : *scalars) {
      std::string v;
      put_bytes(v, 1, tag);
      put_varint(v, 2 << 3 | 5);
      put_fixed(v, static_cast<float>(value));
      put_bytes(summary, 1, v);
    }
    put_bytes(e, 5, summary);
  }
  return e;
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
    : path_(path), out_(open_for_append(path)) {}

void JsonlTracker::log(const std::map<std::string, double>& values, int64_t step) {
  nlohmann::json line = {{"step", step}, {"wall_time", wall_time()}};
  for (const auto& [key, value] : values) {
    if (std::isfinite(value))
      line[key] = value;
    else
      line[key] = std::isnan(value) ? "nan" : (value > 0 ? "inf" : "-inf");
  }
  out_ << line.dump() << '\n';
  TORCH_CHECK(out_.good(), "writing ", path_.string(), " failed");
}

void JsonlTracker::flush() { out_.flush(); }

TensorBoardTracker::TensorBoardTracker(const std::filesystem::path& log_dir) {
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
  write_record(event(step, nullptr, &values));
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

void TensorBoardTracker::flush() { out_.flush(); }

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
