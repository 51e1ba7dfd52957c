#include "mixprec/log/tracker.h"

#include "test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

fs::path fresh_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() / ("mixprec_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(dir);
  return dir;
}

TEST(Crc32c, KnownValues) {
  EXPECT_EQ(mixprec::log::crc32c("123456789", 9), 0xe3069283u);  // the standard check value
  EXPECT_EQ(mixprec::log::crc32c("", 0), 0u);
  // In pieces, each call given the CRC so far (a checkpoint's files are summed so).
  const uint32_t first = mixprec::log::crc32c("1234", 4);
  EXPECT_EQ(mixprec::log::crc32c("56789", 5, first), 0xe3069283u);
}

TEST(JsonlTracker, OneObjectPerLine) {
  const auto dir = fresh_dir("jsonl");
  {
    mixprec::log::JsonlTracker tracker(dir / "log.jsonl");
    tracker.log({{"loss", 0.5}, {"lr", 1e-3}}, 1);
    tracker.log({{"loss", std::numeric_limits<double>::infinity()}}, 2);
  }
  std::ifstream in(dir / "log.jsonl");
  std::string line;
  std::vector<json> lines;
  while (std::getline(in, line)) lines.push_back(json::parse(line));
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0]["step"], 1);
  EXPECT_EQ(lines[0]["loss"], 0.5);
  EXPECT_EQ(lines[0]["lr"], 1e-3);
  EXPECT_TRUE(lines[0]["wall_time"].is_number());
  EXPECT_EQ(lines[1]["loss"], "inf");
  // A run killed in the middle of a line, then resumed into the same file: its first line
  // starts on a line of its own.
  std::ofstream(dir / "log.jsonl", std::ios::app) << R"({"step": 3, "lo)";
  {
    mixprec::log::JsonlTracker tracker(dir / "log.jsonl");
    tracker.log({{"loss", 0.25}}, 3);
  }
  std::ifstream again(dir / "log.jsonl");
  std::vector<std::string> texts;
  while (std::getline(again, line)) texts.push_back(line);
  ASSERT_EQ(texts.size(), 4u);
  EXPECT_EQ(texts[2], R"({"step": 3, "lo)");
  EXPECT_EQ(json::parse(texts[3])["loss"], 0.25);
  fs::remove_all(dir);
}

// The event file must be what TensorBoard itself reads.
TEST(TensorBoardTracker, TensorBoardReadsTheScalarsBack) {
  const auto dir = fresh_dir("tensorboard");
  {
    mixprec::log::TensorBoardTracker tracker(dir);
    for (int step = 1; step <= 3; ++step)
      tracker.log({{"train/loss", 1.0 / step}, {"train/loss_scale", 65536.0 * step}}, step);
  }
  const std::string out =
      mixprec::testing::run_reference_script("read_tensorboard.py " + dir.string());
  ASSERT_FALSE(out.empty());
  const json scalars = json::parse(out);
  ASSERT_EQ(scalars["train/loss"].size(), 3u);
  for (int step = 1; step <= 3; ++step) {
    EXPECT_EQ(scalars["train/loss"][step - 1][0], step);
    EXPECT_FLOAT_EQ(scalars["train/loss"][step - 1][1].get<float>(), 1.0f / step);
    EXPECT_EQ(scalars["train/loss_scale"][step - 1][1].get<double>(), 65536.0 * step);
  }
  fs::remove_all(dir);
}

TEST(JsonlTracker, TextAndTheConfiguration) {
  const auto dir = fresh_dir("jsonl_text");
  {
    mixprec::log::JsonlTracker tracker(dir / "log.jsonl");
    tracker.store_init_configuration({{"lr", 0.1},
                                      {"batch_size", int64_t{32}},
                                      {"optim", "sgd"},
                                      {"fused", true},
                                      {"clip", std::numeric_limits<double>::infinity()}});
    tracker.log_text({{"note", "warm-up done"}}, 4);
  }
  std::ifstream in(dir / "log.jsonl");
  std::string line;
  std::vector<json> lines;
  while (std::getline(in, line)) lines.push_back(json::parse(line));
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(
      lines[0]["config"],
      json({{"lr", 0.1}, {"batch_size", 32}, {"optim", "sgd"}, {"fused", true}, {"clip", "inf"}}));
  EXPECT_TRUE(lines[0]["wall_time"].is_number());
  EXPECT_EQ(lines[1]["step"], 4);
  EXPECT_EQ(lines[1]["note"], "warm-up done");
  fs::remove_all(dir);
}

// Text as TensorBoard's text plugin reads it (torch's add_text), at its steps.
TEST(TensorBoardTracker, TensorBoardReadsTheText) {
  const auto dir = fresh_dir("tensorboard_text");
  {
    mixprec::log::TensorBoardTracker tracker(dir);
    tracker.log_text({{"args", "{\"lr\": 0.1}"}}, 0);
    tracker.log_text({{"note", "done"}}, 5);
  }
  const json texts = json::parse(
      mixprec::testing::run_reference_script("read_tensorboard.py " + dir.string() + " --texts"));
  EXPECT_EQ(texts, json({{"args/text_summary", {{0, "{\"lr\": 0.1}"}}},
                         {"note/text_summary", {{5, "done"}}}}));
  fs::remove_all(dir);
}

// The configuration as Accelerate's TensorBoardTracker stores it: what TensorBoard's hparams
// plugin reads from torch's add_hparams (bools are numbers there, as torch's hparams() takes
// Python's bools for numbers), and hparams.yml as PyYAML writes it, to the byte.
TEST(TensorBoardTracker, StoresTheConfigurationAsAccelerate) {
  const auto dir = fresh_dir("tensorboard_hparams");
  {
    mixprec::log::TensorBoardTracker tracker(dir);
    tracker.store_init_configuration({{"lr", 1e-5},
                                      {"epochs", 3.0},
                                      {"batch_size", int64_t{32}},
                                      {"optim", "sgd"},
                                      {"seed_text", "1"},
                                      {"fused", true},
                                      {"switch", "on"},
                                      {"note", "a: b"}});
  }
  std::vector<fs::path> runs;  // add_hparams' folder, named by the time
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.is_directory()) runs.push_back(entry.path());
  ASSERT_EQ(runs.size(), 1u);
  const json ours = json::parse(mixprec::testing::run_reference_script(
      "read_tensorboard.py " + runs[0].string() + " --hparams"));
  const json accelerate = json::parse(mixprec::testing::run_reference_script(
      "read_tensorboard.py --torch-hparams '{\"lr\": 1e-5, \"epochs\": 3.0, \"batch_size\": 32, "
      "\"optim\": \"sgd\", \"seed_text\": \"1\", \"fused\": true, \"switch\": \"on\", "
      "\"note\": \"a: b\"}'"));
  EXPECT_EQ(ours, accelerate);
  EXPECT_EQ(ours["hparams"]["fused"], 1.0);  // what both give, not what was compared only
  EXPECT_EQ(ours["status"], "STATUS_SUCCESS");
  fs::remove_all(dir);
}

TEST(Trackers, MadeByNameWithClearErrors) {
  const auto dir = fresh_dir("trackers");
  EXPECT_EQ(mixprec::log::make_trackers({"jsonl", "tensorboard"}, dir).size(), 2u);
  EXPECT_TRUE(mixprec::log::make_trackers({"none"}, dir).empty());
  try {
    mixprec::log::make_trackers({"wandb"}, dir);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("unknown tracker 'wandb'"),
              std::string::npos);
  }
  fs::remove_all(dir);
}

}  // namespace
