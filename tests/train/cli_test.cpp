// The `mixprec` command, run as a user runs it: a config file, flag overrides,
// the files it writes, and the errors it gives.
#include "mixprec/data/synthetic.h"
#include "mixprec/io/safetensors.h"
#include "mixprec/models/gpt2.h"
#include "mixprec/train/callbacks.h"
#include "mixprec/train/training_args.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

class MixprecCommand : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("mixprec_cli_" + std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& name, const std::string& contents) {
    std::ofstream(dir_ / name) << contents;
    return (dir_ / name).string();
  }
  // `mixprec ARGS` in the scratch folder: stdout and stderr, and the exit code.
  std::string run(const std::string& args, int* exit_code) {
    return mixprec::testing::run_command(
        "cd " + dir_.string() + " && " MIXPREC_CLI " " + args + " 2>&1", exit_code);
  }
  // A 3-class table of 5 numeric features and a label column.
  void write_classification_csv(const std::string& name, int64_t n) {
    auto task = mixprec::data::make_classification(
        {.n_samples = n, .n_features = 5, .n_classes = 3, .class_sep = 3.0, .seed = 2});
    std::string csv = "f0,f1,f2,f3,f4,label\n";
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t f = 0; f < 5; ++f) csv += std::to_string(task.x[i][f].item<float>()) + ",";
      csv += std::to_string(task.labels[i].item<int64_t>()) + "\n";
    }
    write(name, csv);
  }
  json read_json(const fs::path& path) {
    std::ifstream in(path);
    EXPECT_TRUE(in.good()) << path;
    return json::parse(in);
  }

  fs::path dir_;
};

TEST_F(MixprecCommand, HelpListsEveryArgumentWithItsDefault) {
  int code = -1;
  const std::string help = run("train --help", &code);
  EXPECT_EQ(code, 0);
  const json training_args = json::parse(mixprec::TrainingArguments().to_json());
  for (const auto& [name, value] : training_args.items()) {  // "--name  <type> (default: <json>)"
    const auto at = help.find("\n  --" + name + "  ");
    ASSERT_NE(at, std::string::npos) << name;
    const std::string line = help.substr(at + 1, help.find('\n', at + 1) - at - 1);
    EXPECT_NE(line.find("(default: " + value.dump() + ")"), std::string::npos) << line;
  }
  for (const char* line :
       {"--model_type  a string (default: \"gpt2\")", "--model_name_or_path  a string or null",
        "--train_file  a string or null (default: null)",
        "--validation_split_percentage  an integer (default: 5)",
        "--learning_rate  a number (default: 5e-05)"})
    EXPECT_NE(help.find(line), std::string::npos) << line << "\n" << help;
  run("", &code);
  EXPECT_EQ(code, 2);  // no command: usage
}

TEST_F(MixprecCommand, TrainsTheClassifierFromAYamlConfigWithFlagOverrides) {
  write_classification_csv("train.csv", 400);
  write("run.yaml", R"(model_type: mlp_classifier
train_file: train.csv
validation_split_percentage: 25
hidden_size: 32
output_dir: out
use_cpu: true
bf16: true
num_train_epochs: 1
learning_rate: 1.0e-2
per_device_train_batch_size: 30
eval_strategy: epoch
save_strategy: epoch
logging_strategy: epoch
report_to: jsonl
disable_tqdm: true
)");
  int code = -1;
  const std::string out = run("train --config run.yaml --num_train_epochs 3", &code);
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("mlp_classifier, 300 training samples, 100 evaluation samples"),
            std::string::npos)
      << out;

  // The flag won over the file: three epochs of 10 steps, a checkpoint each.
  const json results = read_json(dir_ / "out" / "all_results.json");
  EXPECT_GT(results.at("eval_accuracy").get<double>(), 0.9) << results.dump();
  const auto state = mixprec::train::TrainerState::from_json(
      mixprec::io::read_file(dir_ / "out" / "checkpoint-30" / "trainer_state.json"), "state");
  EXPECT_EQ(state.global_step, 30);
  EXPECT_EQ(state.epoch, 3.0);
  EXPECT_TRUE(fs::exists(dir_ / "out" / "checkpoint-10"));
  const auto model = mixprec::io::load_safetensors(dir_ / "out" / "model.safetensors");
  EXPECT_EQ(model.at("fc1.weight").sizes(), (std::vector<int64_t>{32, 5}));
  EXPECT_EQ(model.at("out.weight").sizes(), (std::vector<int64_t>{3, 32}));
  const json args = read_json(dir_ / "out" / "checkpoint-30" / "training_args.json");
  EXPECT_EQ(args.at("num_train_epochs").get<double>(), 3.0);
  EXPECT_TRUE(args.at("bf16").get<bool>());

  EXPECT_EQ(out.find("***** Running training *****"), std::string::npos) << out;  // warning level

  // Nothing made the output folder (no checkpoint, no tracker): the model goes there still.
  // MIXPREC_VERBOSITY=info (transformers' TRANSFORMERS_VERBOSITY) shows HF's run summary.
  const std::string bare = mixprec::testing::run_command(
      "cd " + dir_.string() +
          " && MIXPREC_VERBOSITY=info " MIXPREC_CLI
          " train --config run.yaml --output_dir bare --save_strategy no --report_to none 2>&1",
      &code);
  ASSERT_EQ(code, 0) << bare;
  EXPECT_TRUE(fs::exists(dir_ / "bare" / "model.safetensors"));
  EXPECT_NE(bare.find("***** Running training *****\n  Num examples = 300\n"), std::string::npos)
      << bare;
}

TEST_F(MixprecCommand, PrecisionReportComparesThePrecisionsAndRecommendsOne) {
  write_classification_csv("train.csv", 400);
  write("run.yaml", R"(model_type: mlp_classifier
train_file: train.csv
validation_split_percentage: 25
hidden_size: 64
use_cpu: true
max_steps: 40
learning_rate: 1.0e-2
per_device_train_batch_size: 30
disable_tqdm: true
numerics_monitor_steps: 10
)");
  int code = -1;
  // A folder name the shell would misread unquoted (gnuplot runs in it).
  const std::string out =
      run("precision-report --config run.yaml --report_dir \"bob's report\"", &code);
  ASSERT_EQ(code, 0) << out;
  // The Trainer prints the monitor's summary at the end of each run.
  EXPECT_NE(out.find("Numerics monitor: 5 of 40 steps inspected"), std::string::npos) << out;
  const fs::path report = dir_ / "bob's report";
  const json figures = read_json(report / "report.json");
  ASSERT_EQ(figures.at("runs").size(), 4u) << figures.dump();
  std::map<std::string, json> runs;
  for (const auto& r : figures.at("runs")) runs[r.at("precision").get<std::string>()] = r;
  for (const char* p : {"fp32", "bf16", "fp16", "bf16-true"}) {
    SCOPED_TRACE(p);
    ASSERT_TRUE(runs.count(p));
    EXPECT_EQ(runs[p].at("steps").get<int>(), 40);
    EXPECT_EQ(runs[p].at("inspected_steps").get<int>(), 5);            // steps 1, 10, 20, 30, 40
    EXPECT_LT(runs[p].at("final_loss").get<double>(), std::log(3.0));  // it learned
    EXPECT_FALSE(runs[p].contains("error"));
  }
  // Pure bf16 holds parameters and both AdamW moments in half the bytes.
  EXPECT_EQ(2 * runs["bf16-true"].at("state_bytes").get<int64_t>(),
            runs["fp32"].at("state_bytes").get<int64_t>());
  // The recommendation follows the rule the report states (tolerance 2%).
  const double fp32 = runs["fp32"].at("final_loss").get<double>();
  auto within = [&](const char* p) {
    return std::fabs(runs[p].at("final_loss").get<double>() - fp32) <= 0.02 * std::fabs(fp32);
  };
  EXPECT_EQ(figures.at("recommendation").get<std::string>(),
            within("bf16") ? "bf16" : (within("fp16") ? "fp16" : "fp32"));
  const double init_scale = figures.at("init_scale").get<double>();
  EXPECT_GE(init_scale, 1.0);
  EXPECT_EQ(std::ldexp(1.0, std::ilogb(init_scale)), init_scale);  // a power of two

  std::ifstream in(report / "report.md");
  const std::string md((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const char* text : {"## Recommendation", "| fp32 |", "| bf16 |", "| fp16 |", "| bf16-true |",
                           "![loss per precision](loss.png)", "fc1.weight",
                           "Numerics monitor: 5 of 40 steps inspected"})
    EXPECT_NE(md.find(text), std::string::npos) << text << "\n" << md;
  for (const char* png : {"loss.png", "loss_scale.png", "underflow.png"}) {
    std::ifstream image(report / png, std::ios::binary);
    char magic[4] = {};
    image.read(magic, 4);
    EXPECT_EQ(std::string(magic + 1, 3), "PNG") << png;
  }
  // Each run logged the monitor's figures to JSONL.
  std::ifstream log(report / "fp16" / "runs" / "log.jsonl");
  const std::string lines((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_NE(lines.find("\"numerics/grad_underflow/fc1.weight\""), std::string::npos);

  EXPECT_NE(run("precision-report --config run.yaml --precisions fp32 fp8", &code)
                .find("unknown precision 'fp8'"),
            std::string::npos);
  EXPECT_EQ(code, 1);
  EXPECT_NE(run("precision-report --config run.yaml --precisions bf16", &code)
                .find("precisions must start with fp32"),
            std::string::npos);
  EXPECT_EQ(code, 1);
}

TEST_F(MixprecCommand, TrainsGpt2OnATextFile) {
  std::string text;
  for (int i = 0; i < 60; ++i)
    text += "the quick brown fox " + std::to_string(i % 7) + " jumps over the lazy dog.\n";
  write("train.txt", text);
  write("config.json",
        R"({"vocab_size": 260, "n_positions": 32, "n_embd": 32, "n_layer": 1, "n_head": 2})");
  int code = -1;
  const std::string out =
      run("train --config_name config.json --train_file train.txt --output_dir gpt --use_cpu "
          "--fp16 --max_steps 12 --learning_rate 3e-3 --per_device_train_batch_size 8 "
          "--eval_strategy steps --eval_steps 12 --save_strategy no --disable_tqdm",
          &code);
  ASSERT_EQ(code, 0) << out;
  const json results = read_json(dir_ / "gpt" / "all_results.json");
  // Bytes of a repetitive text: clearly below the uniform loss log(260) = 5.56 after 12 steps.
  EXPECT_LT(results.at("eval_loss").get<double>(), std::log(260.0) - 0.5) << results.dump();
  EXPECT_NEAR(results.at("perplexity").get<double>(),
              std::exp(results.at("eval_loss").get<double>()), 1e-6);
  auto model = mixprec::models::GPT2LMHeadModel::from_pretrained(dir_ / "gpt");
  EXPECT_EQ(model->config().vocab_size, 260);
}

TEST_F(MixprecCommand, BadInputIsAClearErrorAndExitCodeOne) {
  write("typo.yaml", "model_type: mlp_classifier\nlearnig_rate: 0.1\n");
  write("bad.csv", "x,label\n1,0\ntwo,1\n");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"train --config typo.yaml",
       "mixprec train (typo.yaml): unknown argument 'learnig_rate'; did you mean "
       "'learning_rate'?"},
      {"train --model_typ gpt2", "unknown argument 'model_typ'; did you mean 'model_type'?"},
      {"train --hidden_size big", "'hidden_size' expects an integer, got \"big\""},
      {"train --model_type mlp_classifier", "--train_file is required"},
      {"train --model_type gpt2 --train_file x.txt",
       "gpt2 needs --model_name_or_path (an HF folder) or --config_name"},
      {"train --model_type resnet --train_file x", "unknown model_type 'resnet'"},
      {"train --model_type mlp_classifier --train_file bad.csv",
       "bad.csv:3: column 'x': expected a number, got 'two'"},
      {"train --fp16 --bf16 --train_file bad.csv",
       "At most one of fp16 and bf16 can be True, but not both"},
  };
  for (const auto& [args, message] : cases) {
    int code = -1;
    const std::string out = run(args, &code);
    EXPECT_EQ(code, 1) << args << "\n" << out;
    EXPECT_NE(out.find(message), std::string::npos) << args << "\n" << out;
  }
}

}  // namespace
