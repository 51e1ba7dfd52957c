#include "mixprec/train/callbacks.h"

#include "test_util.h"

#include <gtest/gtest.h>

#include <string>

namespace {

using mixprec::testing::error_of;
using mixprec::train::TrainerState;

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::string error_loading(const std::string& text) {
  return error_of([&] { TrainerState::from_json(text, "ckpt/trainer_state.json"); });
}

TEST(TrainerState, RoundTripsThroughJson) {
  TrainerState s;
  s.epoch = 1.5;
  s.global_step = 30;
  s.train_batch_size = 8;
  s.best_metric = 0.25;
  s.best_model_checkpoint = "out/checkpoint-20";
  s.log_history = {{{"loss", 0.5}, {"step", 10}}, {{"eval_loss", 0.25}, {"step", 20}}};
  s.stateful_callbacks = {
      {"TrainerControl", R"({"args":{"should_save":true},"attributes":{}})"},
      {"Mine", R"([{"args":{"n":1},"attributes":{}},{"args":{"n":2},"attributes":{}}])"}};
  const std::string text = s.to_json();
  const auto read = TrainerState::from_json(text, "x");
  EXPECT_EQ(read.to_json(), text);
  EXPECT_EQ(read.epoch, 1.5);
  EXPECT_EQ(read.global_step, 30);
  EXPECT_EQ(read.train_batch_size, 8);
  EXPECT_EQ(read.best_metric, 0.25);
  EXPECT_EQ(read.best_model_checkpoint, "out/checkpoint-20");
  EXPECT_EQ(read.log_history, s.log_history);
  EXPECT_EQ(read.stateful_callbacks, s.stateful_callbacks);
}

// Known-bad trainer_state.json files: a clear error that names the file and the key.
TEST(TrainerState, BadFilesNameTheFileAndKey) {
  EXPECT_TRUE(has(error_loading("{"), "ckpt/trainer_state.json: not a trainer state: malformed"));
  EXPECT_TRUE(has(error_loading("[]"), "expected a JSON object, got array"));
  EXPECT_TRUE(has(error_loading(R"({"global_step": 1, "log_history": []})"),
                  "ckpt/trainer_state.json: not a trainer state: missing key 'epoch'"));
  EXPECT_TRUE(has(error_loading(R"({"epoch": "1", "global_step": 1, "log_history": []})"),
                  "'epoch' expects a number, got \"1\" (string)"));
  // An integer key holding a number past int64 was cast to int64 (undefined behaviour).
  EXPECT_TRUE(has(error_loading(R"({"epoch": 1, "global_step": 1e300, "log_history": []})"),
                  "'global_step' expects an integer, got 1e+300 (number)"));
  EXPECT_TRUE(has(error_loading(R"({"epoch": 1, "global_step": 18446744073709551615,
                                    "log_history": []})"),
                  "'global_step' expects an integer that fits in 64 bits"));
  EXPECT_TRUE(has(error_loading(R"({"epoch": 1, "global_step": 1, "log_history": {}})"),
                  "'log_history' expects a list, got {} (object)"));
  EXPECT_TRUE(has(error_loading(R"({"epoch": 1, "global_step": 1, "log_history": [3]})"),
                  "'log_history' expects a list of objects, got 3 (number)"));
  EXPECT_TRUE(has(error_loading(R"({"epoch": 1, "global_step": 1, "log_history": [],
                                    "best_model_checkpoint": 7})"),
                  "'best_model_checkpoint' expects a string or null, got 7"));
  EXPECT_TRUE(has(error_loading(R"({"epoch": 1, "global_step": 1, "log_history": [],
                                    "stateful_callbacks": {"EarlyStoppingCallback": {"args": 3}}})"),
                  "ckpt/trainer_state.json: not a trainer state: stateful_callbacks "
                  "'EarlyStoppingCallback' expects {\"args\": {...}, \"attributes\": {...}} or "
                  "a list of them, got {\"args\":3}"));
  // HF writes a ratio for steps below 1; it is read as before (truncated).
  EXPECT_EQ(TrainerState::from_json(R"({"epoch": 1, "global_step": 2, "log_history": [],
                                        "logging_steps": 0.5})",
                                    "x")
                .logging_steps,
            0);
}

// A log entry's step that is not an int64 was cast to one when saving.
TEST(TrainerState, SavesAnyLoggedNumber) {
  TrainerState s;
  s.log_history = {{{"step", 1e300}, {"total_flos", std::nan("")}, {"eval_steps", 3}}};
  const std::string text = s.to_json();
  EXPECT_TRUE(has(text, "\"step\": 1e+300")) << text;
  EXPECT_TRUE(has(text, "\"total_flos\": \"NaN\"")) << text;
  EXPECT_TRUE(has(text, "\"eval_steps\": 3")) << text;
  EXPECT_EQ(TrainerState::from_json(text, "x").to_json(), text);
}

}  // namespace
