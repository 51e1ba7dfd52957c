#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

namespace mixprec::log {

/// A hyperparameter's value in a run's configuration (torch's add_hparams' types).
using ConfigValue = std::variant<bool, int64_t, double, std::string>;
using Config = std::map<std::string, ConfigValue>;

/// Where scalars of a run go (Accelerate's trackers, the Trainer's report_to).
class Tracker {
 public:
  virtual ~Tracker() = default;
  /// Accelerate's tracker name, by which Accelerator::get_tracker finds it.
  virtual std::string name() const { return ""; }
  virtual void log(const std::map<std::string, double>& values, int64_t step) = 0;
  /// Text values (Accelerate's log of str values). A tracker without it drops them.
  virtual void log_text(const std::map<std::string, std::string>& /*values*/, int64_t /*step*/) {}
  /// The run's hyperparameters, once, from Accelerator::init_trackers (Accelerate's
  /// store_init_configuration). A tracker without it drops them.
  virtual void store_init_configuration(const Config& /*config*/) {}
  virtual void flush() = 0;
};

/// One JSON object per call, one per line: {"step": 3, "wall_time": ..., "loss": 0.5}.
/// Non-finite values are written as the strings "inf", "-inf", "nan"; text values as strings;
/// the configuration as {"wall_time": ..., "config": {...}}.
class JsonlTracker : public Tracker {
 public:
  /// Appends to `path`, creating its folder.
  explicit JsonlTracker(const std::filesystem::path& path);
  std::string name() const override { return "jsonl"; }
  void log(const std::map<std::string, double>& values, int64_t step) override;
  void log_text(const std::map<std::string, std::string>& values, int64_t step) override;
  void store_init_configuration(const Config& config) override;
  void flush() override;

 private:
  void write_line(const std::string& line);
  std::filesystem::path path_;
  std::ofstream out_;
};

/// TensorBoard event files (`events.out.tfevents.*` in `log_dir`), scalars as
/// `simple_value` summaries, written without TensorFlow: TFRecord framing
/// with masked CRC-32C, and the few protobuf fields an event needs. Text as torch's add_text
/// (tag "<key>/text_summary", the text plugin's); the configuration as Accelerate's: torch's
/// add_hparams (the hparams plugin's experiment, session start and end) in an event file of a
/// folder named by the time, beside its hparams.yml.
class TensorBoardTracker : public Tracker {
 public:
  explicit TensorBoardTracker(const std::filesystem::path& log_dir);
  std::string name() const override { return "tensorboard"; }
  void log(const std::map<std::string, double>& values, int64_t step) override;
  void log_text(const std::map<std::string, std::string>& values, int64_t step) override;
  void store_init_configuration(const Config& config) override;
  void flush() override;
  const std::filesystem::path& file() const { return file_; }

 private:
  void write_record(const std::string& event);
  std::filesystem::path log_dir_;
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
