#include "memory_tracker.h"

#include "mixprec/log/logging.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <fstream>
#include <string>

#include <malloc.h>
#include <unistd.h>

namespace mixprec::train::detail {

namespace {

// The resident set size now, in bytes (/proc/self/statm's second field, in pages), after the
// freed memory the heap keeps for reuse goes back (the Accelerator has malloc keep up to 1 GiB),
// as HF's tracker empties CUDA's cache before it reads.
int64_t resident_bytes() {
#ifdef __GLIBC__
  malloc_trim(0);
#endif
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

// The peak resident size since the last reset_peak(), in bytes (VmHWM, in kB).
int64_t peak_resident_bytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.starts_with("VmHWM:")) return std::stoll(line.substr(6)) * 1024;
  return 0;
}

// Sets the kernel's high-water mark to the resident size now (Linux 4.0+).
bool reset_peak() {
  std::ofstream clear_refs("/proc/self/clear_refs");
  clear_refs << "5";
  clear_refs.flush();
  return static_cast<bool>(clear_refs);
}

}  // namespace

MemoryTracker::Stage::Stage(MemoryTracker& tracker, std::string name)
    : tracker_(tracker.enabled_ && !tracker.current_ ? &tracker : nullptr), name_(std::move(name)) {
  if (!tracker_) return;
  tracker_->current_ = name_;
  // Trimmed first: the mark then starts from what is in use, not from what the heap kept.
  tracker_->begin_ = resident_bytes();
  if (!reset_peak()) {
    MIXPREC_WARN_ONCE("Trainer: cannot reset the peak memory (/proc/self/clear_refs); the ",
                      "mem_cpu_peaked_delta metrics count from the process's start");
  }
}

MemoryTracker::Stage::~Stage() {
  if (tracker_) tracker_->current_.reset();
}

void MemoryTracker::Stage::stop_and_update_metrics(Metrics* metrics) {
  if (!tracker_) return;
  MemoryTracker& t = *tracker_;
  tracker_ = nullptr;
  t.current_.reset();
  const int64_t end = resident_bytes();
  t.stages_[name_] = {t.begin_, end - t.begin_, std::max<int64_t>(0, peak_resident_bytes() - end)};
  if (!metrics) return;
  auto report = [&](const std::string& stage) {
    (*metrics)[stage + "_mem_cpu_alloc_delta"] = static_cast<double>(t.stages_.at(stage).alloc);
    (*metrics)[stage + "_mem_cpu_peaked_delta"] = static_cast<double>(t.stages_.at(stage).peaked);
  };
  // HF has nowhere to return init's, so the first stage reported after it carries them.
  if (!t.init_reported_ && t.stages_.count("init")) {
    report("init");
    (*metrics)["before_init_mem_cpu"] = static_cast<double>(t.stages_.at("init").begin);
  }
  t.init_reported_ = true;
  report(name_);
}

}  // namespace mixprec::train::detail
