#pragma once

#include "mixprec/train/callbacks.h"

#include <cstdint>
#include <map>
#include <optional>
#include <string>

namespace mixprec::train::detail {

/// HF's TrainerMemoryTracker (TrainingArguments::skip_memory_metrics = false), for the CPU: the
/// process's resident memory when a stage starts and ends (after the heap returns what it keeps
/// freed, as HF empties CUDA's cache), and its peak in between, read from the kernel's high-water
/// mark (reset when the stage starts) rather than by HF's thread that polls the resident size.
/// CUDA's memory is not reported. Resetting the mark also resets the process's own peak
/// (getrusage's ru_maxrss, what `time` reports at exit) to the stage's start.
class MemoryTracker {
 public:
  explicit MemoryTracker(bool enabled) : enabled_(enabled) {}

  /// Measures a stage ("init", "train", "eval", "test") while it lives; a stage started inside
  /// another (an evaluation during train()) is not measured apart, as HF's.
  class Stage {
   public:
    Stage(MemoryTracker& tracker, std::string name);
    ~Stage();  // stops without reporting, when stop_and_update_metrics was not reached
    Stage(const Stage&) = delete;
    Stage& operator=(const Stage&) = delete;
    /// Ends the stage and adds `<stage>_mem_cpu_alloc_delta` (end - start) and
    /// `<stage>_mem_cpu_peaked_delta` (peak - end) to `metrics`; the first stage reported after
    /// "init" also gets init's and `before_init_mem_cpu`.
    void stop_and_update_metrics(Metrics* metrics = nullptr);

   private:
    MemoryTracker* tracker_;  // null: not measured
    std::string name_;
  };

 private:
  struct Measure {
    int64_t begin = 0, alloc = 0, peaked = 0;
  };
  bool enabled_;
  std::optional<std::string> current_;
  int64_t begin_ = 0;
  std::map<std::string, Measure> stages_;
  bool init_reported_ = false;
};

}  // namespace mixprec::train::detail
