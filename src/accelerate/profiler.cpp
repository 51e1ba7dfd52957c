#include "mixprec/accelerate/profiler.h"

#include "mixprec/log/logging.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>
#include <utility>

namespace mixprec::accelerate {

namespace prof = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;

ProfilerAction profiler_action(const ProfilerSchedule& s, int64_t step) {
  TORCH_CHECK(s.wait >= 0 && s.warmup >= 0 && s.active > 0 && s.repeat >= 0 && s.skip_first >= 0,
              "Invalid profiler schedule arguments. Got wait=", s.wait,
              " (need >= 0), warmup=", s.warmup, " (need >= 0), active=", s.active,
              " (need > 0), repeat=", s.repeat, " (need >= 0), skip_first=", s.skip_first,
              " (need >= 0).");
  TORCH_CHECK(step >= 0, "Step must be non-negative. Got ", step, ".");
  if (step < s.skip_first) return ProfilerAction::kNone;
  step -= s.skip_first;
  if (s.skip_first_wait) step += s.wait;
  const int64_t cycle = s.wait + s.warmup + s.active;
  if (s.repeat > 0 && step / cycle >= s.repeat) return ProfilerAction::kNone;
  const int64_t in_cycle = step % cycle;
  if (in_cycle < s.wait) return ProfilerAction::kNone;
  if (in_cycle < s.wait + s.warmup) return ProfilerAction::kWarmup;
  return in_cycle < cycle - 1 ? ProfilerAction::kRecord : ProfilerAction::kRecordAndSave;
}

namespace {

std::set<ActivityType> activities_of(const std::vector<std::string>& names) {
  std::set<ActivityType> activities;
  if (names.empty()) {  // torch's supported_activities()
    activities.insert(ActivityType::CPU);
    if (torch::cuda::is_available()) activities.insert(ActivityType::CUDA);
    return activities;
  }
  for (const auto& name : names) {
    TORCH_CHECK(name == "cpu" || name == "cuda", "Invalid profiler activity: ", name,
                ". Must be one of ['cpu', 'cuda'].");
    TORCH_CHECK(name == "cpu" || torch::cuda::is_available(),
                "ProfileKwargs: activity \"cuda\" asked for, but CUDA is not available");
    activities.insert(name == "cpu" ? ActivityType::CPU : ActivityType::CUDA);
  }
  return activities;
}

prof::ProfilerConfig config_of(const ProfileKwargs& k) {
  return prof::ProfilerConfig(torch::profiler::impl::ProfilerState::KINETO, k.record_shapes,
                              k.profile_memory, k.with_stack, k.with_flops, k.with_modules);
}

const char* const kMemory = "[memory]";
const char* const kOutOfMemory = "[OutOfMemory]";

// The events torch's profiler leaves out of its FunctionEvents (_filter_name).
bool filtered_out(const std::string& name) {
  static const std::set<std::string> names = {kMemory,
                                              kOutOfMemory,
                                              "profiler::_record_function_enter",
                                              "profiler::_record_function_enter_new",
                                              "profiler::_record_function_exit",
                                              "aten::is_leaf",
                                              "aten::output_nr",
                                              "aten::_version"};
  return names.count(name) > 0;
}

bool on_cpu_memory(const prof::KinetoEvent& e) {
  const auto d = e.deviceType();
  return d == c10::DeviceType::CPU || d == c10::DeviceType::MKLDNN || d == c10::DeviceType::IDEEP;
}

// torch's FunctionEvent, as far as key_averages reads it.
struct Event {
  std::string key;
  c10::DeviceType device = c10::DeviceType::CPU;
  uint64_t thread = 0;
  uint64_t start_ns = 0, end_ns = 0;
  bool sync = true;  // on the CPU, not async: takes part in the nesting
  int64_t memory = 0, flops = 0;
  double children_us = 0;
  int64_t children_memory = 0;
  double total_us() const { return static_cast<double>(end_ns - start_ns) / 1e3; }
  double cpu_total_us() const { return device == c10::DeviceType::CPU ? total_us() : 0; }
};

// As torch's _parse_kineto_results and EventList._populate_cpu_children.
std::vector<Event> function_events(const prof::ProfilerResult& result) {
  std::vector<std::pair<const prof::KinetoEvent*, bool>> memory;  // (record, inside an op)
  for (const auto& e : result.events())
    if (e.name() == kMemory) memory.emplace_back(&e, false);
  std::sort(memory.begin(), memory.end(),
            [](const auto& a, const auto& b) { return a.first->startNs() < b.first->startNs(); });
  // A device runtime's CPU events (a kernel's launch) nest under the op whose correlation id
  // they are linked to, on its thread.
  std::map<uint64_t, uint64_t> op_threads;
  for (const auto& e : result.events())
    if (e.linkedCorrelationId() == 0 && e.deviceType() == c10::DeviceType::CPU)
      op_threads.emplace(e.correlationId(), e.startThreadId());
  std::vector<Event> events;
  for (const auto& e : result.events()) {
    const std::string name = e.name();
    if (name == kOutOfMemory)  // as torch's: an event of no duration
      events.push_back({.key = name,
                        .thread = e.startThreadId(),
                        .start_ns = e.startNs(),
                        .end_ns = e.startNs(),
                        .memory = on_cpu_memory(e) ? e.nBytes() : 0});
    if (filtered_out(name) || e.isHiddenEvent()) continue;
    const auto op_thread = op_threads.find(e.linkedCorrelationId());
    Event event{.key = name.starts_with("ProfilerStep#") ? "ProfilerStep*" : name,
                .device = e.deviceType(),
                .thread = e.linkedCorrelationId() > 0 && e.deviceType() == c10::DeviceType::CPU &&
                                  op_thread != op_threads.end()
                              ? op_thread->second
                              : e.startThreadId(),
                .start_ns = e.startNs(),
                .end_ns = e.endNs(),
                .sync = e.deviceType() == c10::DeviceType::CPU && !e.isAsync() &&
                        e.startThreadId() == e.endThreadId(),
                .flops = static_cast<int64_t>(e.flops())};
    if (e.deviceType() == c10::DeviceType::CPU) {
      auto it = std::lower_bound(memory.begin(), memory.end(), e.startNs(),
                                 [](const auto& m, uint64_t t) { return m.first->startNs() < t; });
      for (; it != memory.end() && it->first->startNs() <= e.endNs(); ++it) {
        if (on_cpu_memory(*it->first)) event.memory += it->first->nBytes();
        it->second = true;
      }
    }
    events.push_back(std::move(event));
  }
  for (const auto& [record, inside] : memory)
    if (!inside)
      events.push_back({.key = kMemory,
                        .thread = record->startThreadId(),
                        .start_ns = record->startNs(),
                        .end_ns = record->startNs(),
                        .memory = on_cpu_memory(*record) ? record->nBytes() : 0});
  auto by_start = [](const Event* a, const Event* b) {
    return a->start_ns != b->start_ns ? a->start_ns < b->start_ns : a->end_ns > b->end_ns;
  };
  std::map<uint64_t, std::vector<Event*>> threads;
  for (auto& e : events)
    if (e.sync) threads[e.thread].push_back(&e);
  for (auto& [thread, list] : threads) {
    std::stable_sort(list.begin(), list.end(), by_start);
    std::vector<Event*> open;
    for (Event* e : list) {
      while (!open.empty() &&
             (e->start_ns >= open.back()->end_ns || e->end_ns > open.back()->end_ns))
        open.pop_back();
      if (!open.empty()) {
        open.back()->children_us += e->cpu_total_us();
        open.back()->children_memory += e->memory;
      }
      open.push_back(e);
    }
  }
  std::stable_sort(events.begin(), events.end(),
                   [&](const Event& a, const Event& b) { return by_start(&a, &b); });
  return events;
}

// As torch's _format_time and _format_memory.
std::string format_time(double us) {
  char text[32];
  if (us >= 1e6)
    std::snprintf(text, sizeof text, "%.3fs", us / 1e6);
  else if (us >= 1e3)
    std::snprintf(text, sizeof text, "%.3fms", us / 1e3);
  else
    std::snprintf(text, sizeof text, "%.3fus", us);
  return text;
}

std::string format_memory(int64_t bytes) {
  const double units[] = {1024.0 * 1024 * 1024, 1024.0 * 1024, 1024.0};
  const char* names[] = {"GB", "MB", "KB"};
  char text[32];
  for (int i = 0; i < 3; ++i)
    if (std::abs(static_cast<double>(bytes)) >= units[i]) {
      std::snprintf(text, sizeof text, "%.2f %s", static_cast<double>(bytes) / units[i], names[i]);
      return text;
    }
  return std::to_string(bytes) + " B";
}

std::string format_share(double part, double total) {
  if (total == 0) return "NaN";
  char text[32];
  std::snprintf(text, sizeof text, "%.2f%%", part * 100 / total);
  return text;
}

}  // namespace

Profiler::Profiler(ProfileKwargs kwargs) : kwargs_(std::move(kwargs)) {
  activities_of(kwargs_.activities);  // checks them
  action_ = kwargs_.schedule_option ? profiler_action(*kwargs_.schedule_option, 0)
                                    : ProfilerAction::kRecord;
  if (kwargs_.schedule_option && kwargs_.schedule_option->warmup == 0)
    MIXPREC_WARN("Profiler won't be using warmup, this can skew profiler results");
  transit(ProfilerAction::kNone, action_);
  running_ = true;
  if (kwargs_.schedule_option) {
    step_event_ = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
    if (step_event_->isActive()) step_event_->before("ProfilerStep#0");
  }
}

Profiler::~Profiler() {
  if (!running_) return;
  kwargs_.on_trace_ready = nullptr;
  try {
    stop();
  } catch (const std::exception& e) {
    MIXPREC_WARN("Profiler: stopping LibTorch's profiler failed: ", e.what());
  }
}

Profiler::Profiler(Profiler&& other) noexcept
    : kwargs_(std::move(other.kwargs_)),
      step_num_(other.step_num_),
      action_(other.action_),
      running_(std::exchange(other.running_, false)),
      step_event_(std::move(other.step_event_)),
      result_(std::move(other.result_)) {}

void Profiler::step() {
  TORCH_CHECK(running_, "Profiler::step: the profiler was stopped");
  step_event_.reset();
  const ProfilerAction previous = action_;
  ++step_num_;
  if (kwargs_.schedule_option) action_ = profiler_action(*kwargs_.schedule_option, step_num_);
  transit(previous, action_);
  if (kwargs_.schedule_option) {
    step_event_ = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
    if (step_event_->isActive()) step_event_->before("ProfilerStep#" + std::to_string(step_num_));
  }
}

void Profiler::stop() {
  if (!running_) return;
  step_event_.reset();
  running_ = false;
  transit(action_, std::nullopt);
}

// torch.profiler.profile's action_map: what each change of action does.
void Profiler::transit(ProfilerAction from, std::optional<ProfilerAction> to) {
  using A = ProfilerAction;
  const auto activities = activities_of(kwargs_.activities);
  auto prepare = [&] { prof::prepareProfiler(config_of(kwargs_), activities); };
  auto start = [&] { prof::enableProfiler(config_of(kwargs_), activities); };
  auto stop = [&] {
    if (activities.count(ActivityType::CUDA)) torch::cuda::synchronize();  // as torch's
    result_ = prof::disableProfiler();
  };
  if (from == A::kNone) {
    if (to == A::kWarmup) prepare();
    if (to == A::kRecord || to == A::kRecordAndSave) {
      prepare();
      start();
    }
  } else if (from == A::kWarmup) {
    if (to == A::kNone) MIXPREC_WARN("Incorrect schedule: WARMUP followed by NONE");
    if (to != A::kWarmup) start();
    if (to == A::kNone || !to) stop();
  } else if (from == A::kRecord) {
    if (to == A::kNone || to == A::kWarmup) {
      MIXPREC_WARN("Incorrect schedule: RECORD followed by ", to == A::kNone ? "NONE" : "WARMUP");
      stop();
    }
    if (!to) {
      stop();
      trace_ready();
    }
  } else {  // kRecordAndSave: the trace is complete
    stop();
    trace_ready();
    if (to && to != A::kNone) prepare();
    if (to == A::kRecord || to == A::kRecordAndSave) start();
  }
}

void Profiler::trace_ready() {
  if (kwargs_.on_trace_ready) kwargs_.on_trace_ready(*this);
}

const prof::ProfilerResult* Profiler::result() const { return result_.get(); }

std::vector<FunctionEventAvg> Profiler::key_averages() const {
  std::vector<FunctionEventAvg> rows;
  if (!result_) return rows;
  std::map<std::pair<std::string, c10::DeviceType>, size_t> row_of;
  for (const Event& e : function_events(*result_)) {
    auto [it, added] = row_of.emplace(std::pair(e.key, e.device), rows.size());
    if (added) rows.push_back({.key = e.key});
    FunctionEventAvg& row = rows[it->second];
    ++row.count;
    row.cpu_time_total += e.cpu_total_us();
    row.cpu_memory_usage += e.memory;
    row.flops += e.flops;
    if (e.sync) {
      row.self_cpu_time_total += e.cpu_total_us() - e.children_us;
      row.self_cpu_memory_usage += e.memory - e.children_memory;
    }
  }
  return rows;
}

std::string Profiler::table(const std::string& sort_by, int64_t row_limit) const {
  using Field = double (*)(const FunctionEventAvg&);
  static const std::map<std::string, Field> fields = {
      {"self_cpu_time_total", [](const FunctionEventAvg& r) { return r.self_cpu_time_total; }},
      {"cpu_time_total", [](const FunctionEventAvg& r) { return r.cpu_time_total; }},
      {"count", [](const FunctionEventAvg& r) { return static_cast<double>(r.count); }},
      {"cpu_memory_usage",
       [](const FunctionEventAvg& r) { return static_cast<double>(r.cpu_memory_usage); }},
      {"self_cpu_memory_usage",
       [](const FunctionEventAvg& r) { return static_cast<double>(r.self_cpu_memory_usage); }}};
  const auto field = fields.find(sort_by);
  TORCH_CHECK(field != fields.end(), "Profiler::table: cannot sort by '", sort_by,
              "'; one of self_cpu_time_total, cpu_time_total, count, cpu_memory_usage, "
              "self_cpu_memory_usage");
  auto rows = key_averages();
  std::stable_sort(rows.begin(), rows.end(), [&](const auto& a, const auto& b) {
    return field->second(a) > field->second(b);
  });
  double self_total = 0;
  for (const auto& r : rows) self_total += r.self_cpu_time_total;
  const bool memory = kwargs_.profile_memory;
  // torch's last column with with_flops: each row's flops, in the unit of the smallest.
  int64_t min_flops = 0;
  for (const auto& r : rows)
    if (r.flops > 0 && (min_flops == 0 || r.flops < min_flops)) min_flops = r.flops;
  const bool flops = kwargs_.with_flops && min_flops > 0;
  const char* const flop_units[] = {"FLOPs", "KFLOPs", "MFLOPs", "GFLOPs", "TFLOPs", "PFLOPs"};
  const int flop_unit =
      flops ? static_cast<int>(std::clamp(std::log10(static_cast<double>(min_flops)) / 3, 0.0, 5.0))
            : 0;
  std::string out = "| Name | Self CPU % | Self CPU | CPU total % | CPU total | CPU time avg |";
  out += memory ? " CPU Mem | Self CPU Mem |" : "";
  out += " # of Calls |";
  out += flops ? std::string(" Total ") + flop_units[flop_unit] + " |" : "";
  out += "\n|---|---|---|---|---|---|";
  out += memory ? "---|---|" : "";
  out += flops ? "---|---|\n" : "---|\n";
  for (size_t i = 0; i < rows.size() && (row_limit < 0 || static_cast<int64_t>(i) < row_limit);
       ++i) {
    const auto& r = rows[i];
    out += "| " + r.key + " | " + format_share(r.self_cpu_time_total, self_total) + " | " +
           format_time(r.self_cpu_time_total) + " | " + format_share(r.cpu_time_total, self_total) +
           " | " + format_time(r.cpu_time_total) + " | " +
           format_time(r.cpu_time_total / static_cast<double>(r.count)) + " | ";
    if (memory)
      out += format_memory(r.cpu_memory_usage) + " | " + format_memory(r.self_cpu_memory_usage) +
             " | ";
    out += std::to_string(r.count) + " |";
    if (flops) {
      char text[32] = "--";
      if (r.flops > 0)
        std::snprintf(text, sizeof text, "%.3f",
                      static_cast<double>(r.flops) * std::pow(10.0, -3.0 * flop_unit));
      out += std::string(" ") + text + " |";
    }
    out += "\n";
  }
  return out + "Self CPU time total: " + format_time(self_total) + "\n";
}

void Profiler::export_chrome_trace(const std::string& path) const {
  TORCH_CHECK(result_, "Profiler::export_chrome_trace: no trace yet (nothing was recorded)");
  const std::string partial = path + ".tmp";
  std::filesystem::remove(partial);
  result_->save(partial);
  std::error_code error;
  TORCH_CHECK(std::filesystem::is_regular_file(partial, error),
              "Profiler::export_chrome_trace: could not write ", partial);
  std::filesystem::rename(partial, path, error);
  TORCH_CHECK(!error, "Profiler::export_chrome_trace: could not rename ", partial, " to ", path,
              ": ", error.message());
}

}  // namespace mixprec::accelerate
