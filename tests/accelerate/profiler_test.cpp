// The Profiler (torch.profiler.profile) and Accelerator::profile, checked against torch's
// schedules and traces (tests/reference/profiler_traces.py).
#include "mixprec/accelerate/profiler.h"
#include "mixprec/accelerate/accelerator.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>

namespace {

using mixprec::accelerate::Accelerator;
using mixprec::accelerate::ProfileKwargs;
using mixprec::accelerate::Profiler;
using mixprec::accelerate::profiler_action;
using mixprec::accelerate::ProfilerAction;
using mixprec::accelerate::ProfilerSchedule;
using mixprec::testing::error_of;
using nlohmann::json;

ProfilerSchedule schedule_of(const json& j) {
  return {.wait = j.value("wait", 0),
          .warmup = j.value("warmup", 0),
          .active = j.value("active", 1),
          .repeat = j.value("repeat", 0),
          .skip_first = j.value("skip_first", 0),
          .skip_first_wait = j.value("skip_first_wait", 0) != 0};
}

// The script's step: (step % 3 + 1) matmuls and an add.
void work(int64_t step, const at::Tensor& a, const at::Tensor& b) {
  for (int64_t i = 0; i < step % 3 + 1; ++i) torch::mm(a, b);
  a.add(b);
}

// What the script records at each on_trace_ready.
json trace_of(const Profiler& profiler) {
  json trace = {{"step_num", profiler.step_num()},
                {"count", json::object()},
                {"cpu_memory_usage", json::object()},
                {"self_cpu_memory_usage", json::object()}};
  for (const auto& row : profiler.key_averages()) {
    trace["count"][row.key] = row.count;
    trace["cpu_memory_usage"][row.key] = row.cpu_memory_usage;
    trace["self_cpu_memory_usage"][row.key] = row.self_cpu_memory_usage;
  }
  return trace;
}

const char* name_of(ProfilerAction action) {
  switch (action) {
    case ProfilerAction::kNone:
      return "NONE";
    case ProfilerAction::kWarmup:
      return "WARMUP";
    case ProfilerAction::kRecord:
      return "RECORD";
    case ProfilerAction::kRecordAndSave:
      return "RECORD_AND_SAVE";
  }
  return "?";
}

std::filesystem::path fresh_dir(const std::string& name) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("mixprec_" + name + "_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  return dir;
}

TEST(ProfilerSchedule, ActionsAreTorchs) {
  const json reference = mixprec::testing::load_reference("profiler_traces.json");
  for (const auto& c : reference["schedules"]) {
    std::vector<std::string> actions;
    for (size_t step = 0; step < c["actions"].size(); ++step)
      actions.push_back(
          name_of(profiler_action(schedule_of(c["schedule"]), static_cast<int64_t>(step))));
    EXPECT_EQ(json(actions), c["actions"]) << c["schedule"];
  }
  EXPECT_EQ(error_of([] { profiler_action({.active = 0}, 0); }),
            "Invalid profiler schedule arguments. Got wait=0 (need >= 0), warmup=0 (need >= 0), "
            "active=0 (need > 0), repeat=0 (need >= 0), skip_first=0 (need >= 0).");
  EXPECT_EQ(error_of([] { profiler_action({}, -1); }), "Step must be non-negative. Got -1.");
}

// When on_trace_ready runs, and what each trace holds (ops, steps, memory), as under torch.
TEST(Profiler, TracesAreTorchs) {
  const json reference = mixprec::testing::load_reference("profiler_traces.json");
  const at::Tensor a = torch::ones({16, 16}), b = torch::ones({16, 16});
  for (const auto& run : reference["runs"]) {
    json traces = json::array();
    ProfileKwargs kwargs{.activities = {"cpu"},  // as the script's
                         .on_trace_ready = [&](Profiler& p) { traces.push_back(trace_of(p)); },
                         .profile_memory = run["profile_memory"].get<bool>()};
    if (!run["schedule"].is_null()) kwargs.schedule_option = schedule_of(run["schedule"]);
    mixprec::testing::CapturedWarnings warnings;  // warmup 0's
    Profiler profiler(kwargs);
    for (int64_t step = 0; step < run["steps"].get<int64_t>(); ++step) {
      work(step, a, b);
      profiler.step();
    }
    profiler.stop();
    EXPECT_EQ(traces, run["traces"]) << run["schedule"] << " memory " << run["profile_memory"];
  }
}

TEST(Profiler, SelfTimesLeaveOutTheCallsMade) {
  const at::Tensor a = torch::ones({64, 64}), b = torch::ones({64, 64});
  Profiler profiler({.activities = {"cpu"}});
  for (int64_t step = 0; step < 3; ++step) work(step, a, b);
  profiler.stop();
  std::map<std::string, mixprec::accelerate::FunctionEventAvg> rows;
  for (const auto& row : profiler.key_averages()) rows[row.key] = row;
  ASSERT_EQ(rows.size(), 3u) << profiler.table();  // mm, add, and mm's resolve_conj
  const auto &mm = rows["aten::mm"], &conj = rows["aten::resolve_conj"], &add = rows["aten::add"];
  EXPECT_EQ(mm.count, 6);
  EXPECT_GT(mm.cpu_time_total, 0);
  // resolve_conj runs inside mm only.
  EXPECT_NEAR(mm.self_cpu_time_total, mm.cpu_time_total - conj.cpu_time_total, 1e-6);
  EXPECT_LT(mm.self_cpu_time_total, mm.cpu_time_total);
  EXPECT_DOUBLE_EQ(conj.self_cpu_time_total, conj.cpu_time_total);
  EXPECT_DOUBLE_EQ(add.self_cpu_time_total, add.cpu_time_total);

  EXPECT_NE(profiler.table("count", -1).find("| aten::add |"), std::string::npos);  // all rows
  const std::string table = profiler.table("count", 2);
  EXPECT_NE(table.find("| Name | Self CPU % | Self CPU | CPU total % | CPU total | CPU time avg "
                       "| # of Calls |"),
            std::string::npos)
      << table;
  EXPECT_NE(table.find("| aten::resolve_conj |"), std::string::npos) << table;
  EXPECT_NE(table.find(" | 18 |\n"), std::string::npos) << table;
  EXPECT_NE(table.find("| aten::mm |"), std::string::npos) << table;
  EXPECT_EQ(table.find("| aten::add |"), std::string::npos) << table;  // past row_limit
  EXPECT_NE(table.find("Self CPU time total: "), std::string::npos) << table;
  EXPECT_EQ(error_of([&] { profiler.table("flops"); }),
            "Profiler::table: cannot sort by 'flops'; one of self_cpu_time_total, "
            "cpu_time_total, count, cpu_memory_usage, self_cpu_memory_usage");
}

TEST(Profiler, ChecksItsActivities) {
  EXPECT_EQ(error_of([] { Profiler({.activities = {"tpu"}}); }),
            "Invalid profiler activity: tpu. Must be one of ['cpu', 'cuda'].");
  if (!torch::cuda::is_available()) {
    EXPECT_EQ(error_of([] {
                Profiler({.activities = {"cpu", "cuda"}});
              }),
              "ProfileKwargs: activity \"cuda\" asked for, but CUDA is not available");
  }
  EXPECT_EQ(error_of([] { Profiler({.schedule_option = ProfilerSchedule{.wait = -1}}); }),
            "Invalid profiler schedule arguments. Got wait=-1 (need >= 0), warmup=0 (need >= 0), "
            "active=1 (need > 0), repeat=0 (need >= 0), skip_first=0 (need >= 0).");
  // A profiler dropped without stop() stops LibTorch's, so that another can start.
  { Profiler dropped({.activities = {"cpu"}}); }
  const at::Tensor x = torch::ones({4, 4});
  Profiler again({.activities = {"cpu"}});
  torch::mm(x, x);
  again.stop();
  ASSERT_EQ(again.key_averages().size(), 2u);
  EXPECT_EQ(again.key_averages()[0].key, "aten::mm");
}

// Every option at once; torch's flop formula for a matmul (2 M N K a call, as torch counts it).
TEST(Profiler, CountsFlopsWithEveryOptionOn) {
  const at::Tensor a = torch::ones({16, 16});
  Profiler profiler({.activities = {"cpu"},
                     .record_shapes = true,
                     .profile_memory = true,
                     .with_stack = true,
                     .with_flops = true,
                     .with_modules = true});
  torch::mm(a, a);
  torch::mm(a, a);
  profiler.stop();
  const auto rows = profiler.key_averages();
  const auto mm =
      std::find_if(rows.begin(), rows.end(), [](auto& r) { return r.key == "aten::mm"; });
  ASSERT_NE(mm, rows.end());
  EXPECT_EQ(mm->count, 2);
  EXPECT_EQ(mm->flops, 2 * 2 * 16 * 16 * 16);
  EXPECT_EQ(mm->cpu_memory_usage, 2 * 16 * 16 * 4);
  // torch's flops column: in the unit of the smallest count (16384: KFLOPs), "--" for none.
  const std::string table = profiler.table("count");
  EXPECT_NE(table.find(" | # of Calls | Total KFLOPs |\n"), std::string::npos) << table;
  EXPECT_NE(table.find(" | 2 | 16.384 |\n"), std::string::npos) << table;
  EXPECT_NE(table.find(" | 6 | -- |\n"), std::string::npos) << table;  // resolve_conj
}

// Accelerate's profile(): the options' kwargs when none are given, a Chrome trace per process.
TEST(Accelerator, ProfilesIntoAChromeTrace) {
  const auto dir = fresh_dir("profile");
  int traces_ready = 0;
  Accelerator accelerator(
      {.profile = ProfileKwargs{.activities = {"cpu"},
                                .on_trace_ready = [&](Profiler&) { ++traces_ready; },
                                .output_trace_dir = (dir / "traces").string()}});
  const at::Tensor a = torch::ones({8, 8});
  Profiler profiler = accelerator.profile([&](Profiler&) {
    for (int64_t step = 0; step < 2; ++step) work(step, a, a);
  });
  EXPECT_EQ(traces_ready, 1);
  EXPECT_EQ(profiler.key_averages().size(), 3u);
  const auto file = dir / "traces" / "profile_0.json";
  ASSERT_TRUE(std::filesystem::exists(file));
  EXPECT_FALSE(std::filesystem::exists(file.string() + ".tmp"));
  EXPECT_EQ(mixprec::testing::trace_events_named(file, "aten::mm"), 3);

  // Kwargs given win; an error in the body stops the profiler (on_trace_ready runs, as
  // torch's __exit__) and writes nothing.
  int ready_on_error = 0;
  EXPECT_THROW(
      accelerator.profile([&](Profiler&) { throw std::runtime_error("body"); },
                          ProfileKwargs{.on_trace_ready = [&](Profiler&) { ++ready_on_error; },
                                        .output_trace_dir = (dir / "other").string()}),
      std::runtime_error);
  EXPECT_EQ(ready_on_error, 1);
  EXPECT_EQ(traces_ready, 1);
  EXPECT_FALSE(std::filesystem::exists(dir / "other"));

  // A folder that cannot be made is an error that names it.
  std::ofstream(dir / "file") << "x";
  EXPECT_EQ(error_of([&] {
              accelerator.profile([](Profiler&) {},
                                  ProfileKwargs{.output_trace_dir = (dir / "file" / "t").string()});
            })
                .rfind("Accelerator::profile: cannot make output_trace_dir " +
                           (dir / "file" / "t").string(),
                       0),
            0u);
  std::filesystem::remove_all(dir);
}

}  // namespace
