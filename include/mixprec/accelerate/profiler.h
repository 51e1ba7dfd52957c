#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace at {
struct RecordFunction;
}  // namespace at
namespace torch::autograd::profiler {
struct ProfilerResult;
}  // namespace torch::autograd::profiler

namespace mixprec::accelerate {

/// What the profiler does in a step (torch.profiler.ProfilerAction, less the DEVICE_STOPPED
/// that torch sets when a device's buffer overflows).
enum class ProfilerAction { kNone, kWarmup, kRecord, kRecordAndSave };

/// torch.profiler.schedule's arguments: after `skip_first` steps, cycles of `wait` steps
/// unrecorded, `warmup` steps with the profiler started but not recording, and `active` steps
/// recorded, the last of which hands the trace to on_trace_ready; `repeat` cycles (0: no end).
/// `skip_first_wait` skips the first cycle's wait.
struct ProfilerSchedule {
  int64_t wait = 0;
  int64_t warmup = 0;
  int64_t active = 1;
  int64_t repeat = 0;
  int64_t skip_first = 0;
  bool skip_first_wait = false;
};

/// What torch.profiler.schedule(...)(step) returns. Negative arguments, or active < 1, are an
/// error, as torch's; warmup 0 is a warning (the first recorded step is then slower).
ProfilerAction profiler_action(const ProfilerSchedule& schedule, int64_t step);

class Profiler;

/// Accelerate's ProfileKwargs (torch.profiler.profile's arguments).
struct ProfileKwargs {
  /// "cpu" and/or "cuda". Empty: torch's default, the CPU and CUDA when there is one.
  std::vector<std::string> activities = {};
  /// Unset: every step is recorded, and on_trace_ready runs once, at the end.
  std::optional<ProfilerSchedule> schedule_option = std::nullopt;
  /// Called with the profiler each time a trace is complete (the last active step of a
  /// cycle, or the end of profiling while recording).
  std::function<void(Profiler&)> on_trace_ready = nullptr;
  bool record_shapes = false;
  bool profile_memory = false;
  bool with_stack = false;
  bool with_flops = false;
  bool with_modules = false;
  /// Accelerator::profile writes the last trace there as profile_{process_index}.json, a
  /// Chrome trace (chrome://tracing, Perfetto).
  std::optional<std::string> output_trace_dir = std::nullopt;
};

/// One row of key_averages(): torch's FunctionEventAvg for the events of one name ("ProfilerStep*"
/// for every step's), times in microseconds, memory in bytes (with profile_memory).
struct FunctionEventAvg {
  std::string key;
  int64_t count = 0;
  double cpu_time_total = 0;       // from each call's start to its end
  double self_cpu_time_total = 0;  // less the time of the calls it made on its thread
  int64_t cpu_memory_usage = 0;    // allocated (less freed) during its calls
  int64_t self_cpu_memory_usage = 0;
  int64_t flops = 0;  // with with_flops, for the ops torch has a formula for
};

/// torch.profiler.profile on LibTorch's (Kineto) profiler: construction starts it (as
/// `__enter__`), step() marks a step's end, stop() ends it (as `__exit__`). The steps run
/// the schedule's transitions as torch's do; with a schedule, each recorded step is a
/// "ProfilerStep#N" event. Profiles the calling thread and those that take its thread-local
/// state (autograd's backward threads, at::launch's), not OpenMP's workers within an op.
/// Start, step and stop it on one thread.
class Profiler {
 public:
  explicit Profiler(ProfileKwargs kwargs = {});
  /// Stops profiling if stop() was not called, without calling on_trace_ready.
  ~Profiler();
  Profiler(Profiler&& other) noexcept;
  Profiler& operator=(Profiler&&) = delete;

  void step();
  void stop();
  /// The steps done: step()'s calls so far.
  int64_t step_num() const { return step_num_; }

  /// The last trace's events (null before the first trace is complete): every op, and with
  /// profile_memory every allocation ("[memory]").
  const torch::autograd::profiler::ProfilerResult* result() const;
  /// The last trace's events by name (and device), as torch's key_averages(): the same
  /// filtering (profiler bookkeeping and hidden events out, allocations outside any op as
  /// "[memory]"), nesting and self times; in the order names first appear. (torch also
  /// keeps user annotations apart from ops of the same name.)
  std::vector<FunctionEventAvg> key_averages() const;
  /// key_averages() as a Markdown table of torch's table() CPU columns (and with with_flops
  /// its flops, in the unit of the smallest; not its device ones), sorted by `sort_by`
  /// ("self_cpu_time_total", "cpu_time_total", "count", "cpu_memory_usage" or
  /// "self_cpu_memory_usage"; torch's default leaves them unsorted), largest first, at most
  /// row_limit rows (< 0: all).
  std::string table(const std::string& sort_by = "self_cpu_time_total",
                    int64_t row_limit = 100) const;
  /// The last trace in Chrome's JSON format, written atomically (a temporary file, renamed).
  /// Once per trace, as torch's (Kineto hands a trace over once). Without torch's metadata
  /// (the options, the process's rank).
  void export_chrome_trace(const std::string& path) const;

 private:
  void transit(ProfilerAction from, std::optional<ProfilerAction> to);
  void trace_ready();

  ProfileKwargs kwargs_;
  int64_t step_num_ = 0;
  ProfilerAction action_ = ProfilerAction::kRecord;
  bool running_ = false;  // between construction and stop()
  std::unique_ptr<at::RecordFunction> step_event_;
  std::unique_ptr<torch::autograd::profiler::ProfilerResult> result_;
};

}  // namespace mixprec::accelerate
