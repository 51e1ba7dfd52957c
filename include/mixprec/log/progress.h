#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

namespace mixprec::log {

/// Options of `ProgressBar`.
struct ProgressOptions {
  /// Shown at all; by default only when the stream is a terminal (tqdm's
  /// behaviour in the Trainer: no bar in logs and pipes).
  std::optional<bool> enabled = std::nullopt;
  std::FILE* stream = stderr;
  /// Redraw at most this often.
  double min_interval_s = 0.1;
};

/// A tqdm-style progress bar on one terminal line:
/// `train:  42%|████▏     | 42/100 [00:10<00:13,  4.20it/s, loss=0.512]`.
class ProgressBar {
 public:
  using Clock = std::chrono::steady_clock;
  ProgressBar(int64_t total, std::string description, ProgressOptions options = {});
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  void update(int64_t n = 1);
  /// Text after the rate, e.g. "loss=0.512, scale=65536".
  void set_postfix(std::string postfix);
  /// Draws the final state and ends the line.
  void close();
  bool enabled() const { return enabled_; }

  /// The line for `done` of `total` after `elapsed_s` seconds (no clock, for tests).
  static std::string format(const std::string& description, int64_t done, int64_t total,
                            double elapsed_s, const std::string& postfix, int bar_width = 10);

 private:
  void draw();
  int64_t total_, done_ = 0;
  std::string description_, postfix_;
  ProgressOptions options_;
  bool enabled_, closed_ = false;
  Clock::time_point start_, last_draw_;
};

}  // namespace mixprec::log
