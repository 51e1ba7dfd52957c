#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace mixprec::log {

/// Where scalars of a run go (Accelerate's trackers, the Trainer's report_to).
class Tracker {
 public:
  virtual ~Tracker() = default;
  virtual void log(const std::map<std::string, double>& values, int64_t step) = 0;
  virtual void flush() = 0;
};

/// One JSON object per call, one per line: {"step": 3, "wall_time": ..., "loss": 0.5}.
/// Non-finite values are written as the strings "inf", "-inf", "nan".
class JsonlTracker : public Tracker {
 public:
  /// Appends to `path`, creating its folder.
  explicit JsonlTracker(const std::filesystem::path& path);
  void log(const std::map<std::string, double>& values, int64_t step) override;
  void flush() override;

 private:
  std::filesystem::path path_;
  std::ofstream out_;
};

/// TensorBoard event files (`events.out.tfevents.*` in `log_dir`), scalars as
/// `simple_value` summaries, written without TensorFlow: TFRecord framing
/// with masked CRC-32C, and the few protobuf fields a scalar event needs.
class TensorBoardTracker : public Tracker {
 public:
  explicit TensorBoardTracker(const std::filesystem::path& log_dir);
  void log(const std::map<std::string, double>& values, int64_t step) override;
  void flush() override;
  const std::filesystem::path& file() const { return file_; }

 private:
  void write_record(const std::string& event);
  std::filesystem::path file_;
  std::ofstream out_;
};

/// Makes trackers by name: "jsonl" (`dir/log.jsonl`), "tensorboard" (`dir`);
/// "none" or an empty list makes none. An unknown name is an error that lists
/// the known ones.
std::vector<std::unique_ptr<Tracker>> make_trackers(const std::vector<std::string>& names,
                                                    const std::filesystem::path& dir);

/// CRC-32C (Castagnoli), as TFRecord frames use it; also a checkpoint's checksums.json. Of data
/// in pieces: each piece's call gets the CRC of those before it as `previous`.
uint32_t crc32c(const void* data, size_t size, uint32_t previous = 0);

}  // namespace mixprec::log
