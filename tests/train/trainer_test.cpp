#include "mixprec/train/trainer.h"

#include "mixprec/data/synthetic.h"
#include "mixprec/io/checkpoint.h"
#include "mixprec/io/safetensors.h"
#include "mixprec/log/logging.h"
#include "mixprec/models/gpt2.h"

#include "models/tiny_gpt2.h"

#include "test_util.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <utility>

namespace {

namespace fs = std::filesystem;
using mixprec::TrainingArguments;
using mixprec::train::Metrics;
using mixprec::train::Trainer;
using json = nlohmann::json;
using mixprec::testing::checkpoint_names;
using mixprec::train::TrainerControl;
using mixprec::train::TrainerState;

// A classifier with the Trainer's contract: forward(batch) -> loss, logits.
struct ClassifierImpl : torch::nn::Module {
  ClassifierImpl()
      : fc1(register_module("fc1", torch::nn::Linear(6, 32))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({32})))),
        fc2(register_module("fc2", torch::nn::Linear(32, 3))) {}
  mixprec::models::ModelOutput forward(const mixprec::data::Batch& batch) {
    auto logits = fc2(torch::relu(norm(fc1(batch.at("x")))));  // (B, 3)
    at::Tensor loss;
    if (batch.count("labels"))
      loss = torch::nn::functional::cross_entropy(logits, batch.at("labels"));
    return {loss, logits};
  }
  std::string main_input_name = "x";  // HF's model.main_input_name
  torch::nn::Linear fc1;
  torch::nn::LayerNorm norm;
  torch::nn::Linear fc2;
};
TORCH_MODULE(Classifier);

Metrics accuracy(const mixprec::train::EvalPrediction& p) {
  return {
      {"accuracy", p.predictions.argmax(1).eq(p.label_ids).to(at::kFloat).mean().item<double>()}};
}

// One task, split: 160 samples to train on, 64 to evaluate.
std::pair<mixprec::data::DatasetPtr, mixprec::data::DatasetPtr> datasets() {
  auto task = mixprec::data::make_classification(
      {.n_samples = 224, .n_features = 6, .n_classes = 3, .class_sep = 2.0, .seed = 1});
  auto all = std::make_shared<mixprec::data::TensorDataset>(
      std::map<std::string, at::Tensor>{{"x", task.x}, {"labels", task.labels}});
  auto parts = mixprec::data::random_split(all, {160, 64}, 0);
  return {parts[0], parts[1]};
}

at::Tensor flat_params(torch::nn::Module& m) {
  std::vector<at::Tensor> flat;
  for (const auto& p : m.parameters()) flat.push_back(p.detach().reshape(-1));
  return torch::cat(flat);
}

class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("mixprec_trainer_" + std::to_string(getpid()));
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  TrainingArguments args(const std::string& name) {
    TrainingArguments a;
    a.output_dir = (dir_ / name).string();
    a.per_device_train_batch_size = 16;
    a.per_device_eval_batch_size = 32;
    a.learning_rate = 5e-3;
    a.num_train_epochs = 4;
    a.eval_strategy = "epoch";
    a.save_strategy = "epoch";
    a.logging_strategy = "steps";
    a.logging_steps = 5;
    a.disable_tqdm = true;
    a.seed = 0;
    return a;
  }
  fs::path dir_;
  mixprec::data::DatasetPtr train_ = datasets().first, eval_ = datasets().second;
};

TEST_F(TrainerTest, TrainsEvaluatesLogsAndCheckpoints) {
  for (const char* precision : {"no", "bf16", "fp16"}) {
    SCOPED_TRACE(precision);
    auto a = args(std::string("run_") + precision);
    a.fp16 = std::string(precision) == "fp16";
    a.bf16 = std::string(precision) == "bf16";
    a.report_to = {"jsonl"};
    torch::manual_seed(0);
    Classifier model;
    Trainer trainer(model, a, train_, eval_, accuracy);
    const Metrics before = trainer.evaluate();
    const auto out = trainer.train();
    const Metrics after = trainer.evaluate();
    EXPECT_EQ(out.global_step, 40);  // 160 / 16 = 10 steps per epoch, 4 epochs
    EXPECT_LT(after.at("eval_loss"), 0.7 * before.at("eval_loss"));
    EXPECT_GT(after.at("eval_accuracy"), 0.8);
    for (const char* key :
         {"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss"})
      EXPECT_TRUE(out.metrics.count(key)) << key;
    // Logged every 5 steps, evaluated every epoch, with HF's names.
    int losses = 0, evals = 0;
    for (const auto& entry : trainer.state().log_history) {
      losses += entry.count("loss") && entry.count("learning_rate") && entry.count("grad_norm");
      evals += entry.count("eval_accuracy");
    }
    EXPECT_EQ(losses, 8);
    EXPECT_EQ(evals,
              4 + 1);  // each epoch, and the call after (train() starts a new history, as HF)
    for (int step : {10, 20, 30, 40}) {
      const auto ckpt = fs::path(a.output_dir) / ("checkpoint-" + std::to_string(step));
      for (const char* file : {"model.safetensors", "optimizer.safetensors", "scheduler.json",
                               "trainer_state.json", "training_args.json", "checksums.json"})
        EXPECT_TRUE(fs::exists(ckpt / file)) << ckpt / file;
    }
    EXPECT_EQ(fs::exists(fs::path(a.output_dir) / "checkpoint-40" / "scaler.json"), a.fp16);
    EXPECT_TRUE(fs::exists(fs::path(a.output_dir) / "runs" / "log.jsonl"));
  }
}

// The Classifier, whose gradients are inf on the training calls in `poisoned`.
// With poison_loss, the loss itself is inf on those calls. `losses` are the training losses.
struct PoisonedClassifierImpl : ClassifierImpl {
  std::set<int> poisoned;
  bool poison_loss = false;
  float poison = INFINITY;  // what the poisoned gradients are multiplied by
  int calls = 0;
  std::vector<double> losses;
  mixprec::models::ModelOutput forward(const mixprec::data::Batch& batch) {
    auto out = ClassifierImpl::forward(batch);
    if (is_training() && poisoned.count(calls++)) {
      if (poison_loss)
        out.loss = out.loss * INFINITY;
      else
        out.logits.register_hook([p = poison](at::Tensor g) { return g * p; });
    }
    if (is_training()) losses.push_back(out.loss.item<double>());
    return out;
  }
};
TORCH_MODULE(PoisonedClassifier);

// Over 1,000 fp16 steps with inf/NaN gradients injected at 12 random steps,
// exactly those steps are skipped, and a skipped step changes no parameter.
TEST_F(TrainerTest, SkippedStepsNeverChangeParameters) {
  auto a = args("non_finite");
  a.fp16 = true;
  a.max_steps = 1000;
  a.save_strategy = "no";
  a.eval_strategy = "no";
  a.logging_strategy = "no";
  torch::manual_seed(0);
  PoisonedClassifier model;
  std::mt19937 rng(3);
  while (model->poisoned.size() < 12) model->poisoned.insert(static_cast<int>(rng() % 1000));
  struct Watch : mixprec::train::TrainerCallback {
    PoisonedClassifier model{nullptr};
    Trainer* trainer = nullptr;
    at::Tensor before;
    int skipped = 0, wrong = 0, changed = 0;
    void on_step_begin(const TrainingArguments&, mixprec::train::TrainerState&,
                       mixprec::train::TrainerControl&) override {
      before = flat_params(*model).clone();
    }
    void on_step_end(const TrainingArguments&, mixprec::train::TrainerState& state,
                     mixprec::train::TrainerControl&) override {
      const bool poisoned = model->poisoned.count(static_cast<int>(state.global_step) - 1) > 0;
      const bool was_skipped = trainer->accelerator().optimizer_step_was_skipped();
      const bool unchanged = torch::equal(before, flat_params(*model));
      skipped += was_skipped;
      changed += !unchanged;
      wrong += was_skipped != poisoned || unchanged != poisoned;
    }
  };
  auto watch = std::make_shared<Watch>();
  watch->model = model;
  Trainer trainer(model, a, train_, eval_, accuracy, {watch});
  watch->trainer = &trainer;
  trainer.train();
  EXPECT_EQ(watch->skipped, static_cast<int>(model->poisoned.size()));
  EXPECT_EQ(watch->wrong, 0);
  EXPECT_EQ(watch->changed, 1000 - 12);
  EXPECT_TRUE(torch::isfinite(flat_params(*model)).all().item<bool>());
}

// In fp32 nothing skips a step: a NaN loss stops training before the step,
// naming the last good checkpoint, which stays as it was.
TEST_F(TrainerTest, NanLossWithoutScalerStopsAndNamesTheLastGoodCheckpoint) {
  auto a = args("nan_fp32");
  a.save_strategy = "steps";
  a.save_steps = 5;
  torch::manual_seed(0);
  struct NanAtStep8Impl : ClassifierImpl {
    int calls = 0;
    mixprec::models::ModelOutput forward(const mixprec::data::Batch& batch) {
      auto out = ClassifierImpl::forward(batch);
      if (is_training() && calls++ == 7) out.loss = out.loss * NAN;
      return out;
    }
  };
  auto model = std::make_shared<NanAtStep8Impl>();
  Trainer trainer(model, mixprec::train::forward_on_batches(model), a, train_, eval_, accuracy, {},
                  {});
  const auto checkpoint = (fs::path(a.output_dir) / "checkpoint-5").string();
  const std::string error = mixprec::testing::error_of([&] { trainer.train(); });
  EXPECT_NE(error.find("stopped at step 8: the loss is nan (fp32: no loss scaling to skip it). The "
                       "last good checkpoint is " +
                       checkpoint),
            std::string::npos)
      << error;
  EXPECT_EQ(trainer.state().global_step, 7);
  EXPECT_NO_THROW(mixprec::io::verify_checkpoint(checkpoint));
}

// Gradients that overflow at every scale: the scale halves down to 1, then the
// run stops with a message, rather than skip every step from then on.
TEST_F(TrainerTest, ScaleStuckAtItsMinimumStopsTheRun) {
  auto a = args("stuck");
  a.fp16 = true;
  a.save_strategy = "steps";
  a.save_steps = 2;
  torch::manual_seed(0);
  PoisonedClassifier model;
  for (int call = 3; call < 40; ++call) model->poisoned.insert(call);
  Trainer trainer(model, a, train_, eval_, accuracy);
  const std::string error = mixprec::testing::error_of([&] { trainer.train(); });
  // 65536 = 2^16: 16 skipped steps bring it to 1, the 17th overflow stops the run.
  EXPECT_NE(error.find("Trainer: stopped at step 20: GradScaler: inf/NaN gradients with the loss "
                       "scale already at min_scale (1)"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("The last good checkpoint is " +
                       (fs::path(a.output_dir) / "checkpoint-18").string()),
            std::string::npos)
      << error;
  EXPECT_EQ(trainer.accelerator().scaler()->get_scale(), 1.0);
}

// Neither fp16 nor bf16: the mixed precision `accelerate launch` set (ACCELERATE_MIXED_PRECISION),
// as HF's TrainingArguments take it; either flag wins over it.
TEST_F(TrainerTest, MixedPrecisionFromTheLauncherWhenNoFlagIsSet) {
  mixprec::testing::ScopedEnv launcher("ACCELERATE_MIXED_PRECISION", "bf16");
  Classifier model;
  auto a = args("launched");
  Trainer launched(model, a, train_, eval_, accuracy);
  a.fp16 = true;
  Trainer flagged(model, a, train_, eval_, accuracy);
  EXPECT_EQ(launched.accelerator().mixed_precision(), "bf16");
  EXPECT_EQ(flagged.accelerator().mixed_precision(), "fp16");
}

// A damaged newest checkpoint: "last" resumes from the one before, with a
// warning that names the damaged one.
TEST_F(TrainerTest, ResumeLastFallsBackFromADamagedCheckpoint) {
  auto a = args("fallback");
  a.num_train_epochs = 2;
  torch::manual_seed(0);
  Classifier model;
  Trainer(model, a, train_, eval_, accuracy).train();  // checkpoint-10, checkpoint-20
  const auto newest = fs::path(a.output_dir) / "checkpoint-20";
  {
    std::fstream f(newest / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-1, std::ios::end);
    f.put('\x7f');
  }
  fs::create_directories(fs::path(a.output_dir) / "checkpoint-25.tmp-123");  // a killed writer's
  a.resume_from_checkpoint = "last";
  std::string warnings;
  struct Capture : c10::WarningHandler {
    std::string* out;
    explicit Capture(std::string* o) : out(o) {}
    void process(const c10::Warning& w) override { *out += w.msg() + "\n"; }
  } capture(&warnings);
  c10::WarningUtils::WarningHandlerGuard guard(&capture);
  Trainer resumed(model, a, train_, eval_, accuracy);
  resumed.train();
  EXPECT_NE(warnings.find("checkpoint " + newest.string() + " is damaged"), std::string::npos)
      << warnings;
  EXPECT_FALSE(fs::exists(fs::path(a.output_dir) / "checkpoint-25.tmp-123"));
  EXPECT_EQ(resumed.state().global_step, 20);
  // Resumed at 10: the second epoch ran again and wrote a good checkpoint-20.
  EXPECT_NO_THROW(mixprec::io::verify_checkpoint(newest));
}

// What the Trainer logs, read back by tensorboard's own EventAccumulator.
TEST_F(TrainerTest, LogsToTensorBoardWithLossScaleAndSkippedSteps) {
  auto a = args("tensorboard");
  a.fp16 = true;
  a.num_train_epochs = 2;  // 20 steps, logged every 5
  a.report_to = {"tensorboard", "jsonl"};
  torch::manual_seed(0);
  PoisonedClassifier model;
  model->poisoned = {2, 3, 12};  // skipped: steps 3 and 4, then 13
  Trainer trainer(model, a, train_, eval_, accuracy);
  trainer.train();

  const auto scalars = json::parse(mixprec::testing::run_reference_script(
      "read_tensorboard.py " + (fs::path(a.output_dir) / "runs").string()));
  // Tagged as HF's integrations do (rewrite_logs).
  for (const char* tag :
       {"train/loss", "train/learning_rate", "train/grad_norm", "train/loss_scale",
        "train/skipped_steps", "eval/loss", "eval/accuracy", "train/epoch"})
    EXPECT_TRUE(scalars.contains(tag)) << tag << " not in " << scalars.dump();
  // Every logged value, at its step, as log_history has it (fp32 in the event file).
  int compared = 0;
  for (const auto& entry : trainer.state().log_history) {
    const int64_t step = static_cast<int64_t>(entry.at("step"));
    for (const auto& [key, value] : entry) {
      const std::string tag = key.starts_with("eval_") ? "eval/" + key.substr(5) : "train/" + key;
      if (key == "step" || !scalars.contains(tag)) continue;
      bool found = false;
      for (const auto& point : scalars.at(tag))
        if (point[0].get<int64_t>() == step) {
          EXPECT_FLOAT_EQ(point[1].get<float>(), static_cast<float>(value)) << key << "@" << step;
          found = true;
        }
      EXPECT_TRUE(found) << key << "@" << step;
      ++compared;
    }
  }
  EXPECT_GE(compared, 4 * 6 + 2 * 3);
  // As HF's TensorBoardCallback: the arguments as text, at step 0.
  const auto texts = json::parse(mixprec::testing::run_reference_script(
      "read_tensorboard.py " + (fs::path(a.output_dir) / "runs").string() + " --texts"));
  EXPECT_EQ(texts, json({{"args/text_summary", {{0, trainer.args().to_json()}}}}));

  // evaluate() after training is logged too, as HF makes its writer again (counted in the JSONL
  // log: TensorBoard's reader keeps one point per step).
  auto eval_lines = [&] {
    std::ifstream log(fs::path(a.output_dir) / "runs" / "log.jsonl");
    int n = 0;
    for (std::string line; std::getline(log, line);)
      n += line.find("\"eval/loss\"") != std::string::npos;
    return n;
  };
  EXPECT_EQ(eval_lines(), 2);
  trainer.evaluate();
  trainer.accelerator().end_training();
  EXPECT_EQ(eval_lines(), 3);
  // Two skips in the first window halve the scale twice; one in the third.
  std::vector<std::pair<int64_t, double>> skipped, scale;
  for (const auto& p : scalars.at("train/skipped_steps")) skipped.emplace_back(p[0], p[1]);
  for (const auto& p : scalars.at("train/loss_scale")) scale.emplace_back(p[0], p[1]);
  EXPECT_EQ(skipped, (std::vector<std::pair<int64_t, double>>{{5, 2}, {10, 0}, {15, 1}, {20, 0}}));
  EXPECT_EQ(scale, (std::vector<std::pair<int64_t, double>>{
                       {5, 16384}, {10, 16384}, {15, 8192}, {20, 8192}}));
}

TEST_F(TrainerTest, TrainerStateIsReadByTransformers) {
  auto a = args("hf_state");
  a.metric_for_best_model = "accuracy";
  a.num_train_epochs = 2;
  torch::manual_seed(0);
  Classifier model;
  Trainer trainer(model, a, train_, eval_, accuracy);
  trainer.train();
  const auto file = fs::path(a.output_dir) / "checkpoint-20" / "trainer_state.json";
  const json read = json::parse(
      mixprec::testing::run_reference_script("check_trainer_state.py " + file.string()));
  EXPECT_EQ(read["global_step"], 20);
  EXPECT_DOUBLE_EQ(read["epoch"].get<double>(), 2.0);
  EXPECT_EQ(read["best_metric"].get<double>(), *trainer.state().best_metric);
  EXPECT_EQ(read["best_model_checkpoint"], *trainer.state().best_model_checkpoint);
  // The history as saved with the last checkpoint: what the run had logged by then.
  const auto& history = trainer.state().log_history;
  ASSERT_TRUE(read["log_history"].is_array() && !read["log_history"].empty());
  ASSERT_LE(read["log_history"].size(), history.size());
  for (size_t i = 0; i < read["log_history"].size(); ++i) {
    std::map<std::string, double> entry;
    for (const auto& [key, value] : read["log_history"][i].items()) entry[key] = value;
    EXPECT_EQ(entry, history[i]) << "entry " << i;
  }
  // The model file is readable by Python safetensors, with the module's names.
  const auto model_file = mixprec::io::load_safetensors(file.parent_path() / "model.safetensors");
  EXPECT_TRUE(model_file.count("fc1.weight") && model_file.count("norm.weight"));
}

// Stopped after epoch 2 and resumed from its checkpoint, a run ends where an
// uninterrupted one does, bit for bit (same seed, same data order).
TEST_F(TrainerTest, ResumeFromCheckpointMatchesAnUninterruptedRun) {
  for (const char* precision : {"no", "fp16"}) {
    SCOPED_TRACE(precision);
    auto a = args(std::string("whole_") + precision);
    a.fp16 = std::string(precision) == "fp16";
    a.gradient_accumulation_steps = 3;  // windows that straddle epochs
    torch::manual_seed(0);
    Classifier whole;
    Trainer(whole, a, train_, eval_, accuracy).train();

    torch::manual_seed(5);  // other initial weights: the checkpoint must bring them back
    Classifier resumed;
    // After epoch 2: 10 batches an epoch make 4 steps (3 windows of 3, one of 1).
    const auto checkpoint = fs::path(a.output_dir) / "checkpoint-8";
    ASSERT_TRUE(fs::exists(checkpoint));
    auto b = a;
    b.output_dir = (dir_ / (std::string("resumed_") + precision)).string();
    Trainer trainer(resumed, b, train_, eval_, accuracy);
    const auto out = trainer.train(checkpoint.string());
    EXPECT_EQ(out.global_step, 16);
    EXPECT_TRUE(torch::equal(flat_params(*resumed), flat_params(*whole)))
        << (flat_params(*resumed) - flat_params(*whole)).abs().max().item<double>();
  }
}

// HF's optimizers=(optimizer, lr_scheduler): the Trainer steps the optimizer given, with the
// schedule given or args' made on it from the lrs it was given with; a checkpoint resumes its
// state; what does not fit the model is refused.
TEST_F(TrainerTest, SetOptimizersTrainsWithTheGivenOptimizerAndSchedule) {
  auto a = args("given");
  a.max_steps = 6;
  a.eval_strategy = "no";
  a.save_strategy = "steps";
  a.save_steps = 3;
  a.learning_rate = 100.0;        // not read: the optimizer given has its own
  a.overwrite_output_dir = true;  // train() twice
  const auto sgd = [](Classifier& m) {
    return std::make_shared<torch::optim::SGD>(m->parameters(),
                                               torch::optim::SGDOptions(0.05).momentum(0.9));
  };
  torch::manual_seed(0);
  Classifier whole;
  auto optimizer = sgd(whole);
  Trainer trainer(whole, a, train_, eval_);
  trainer.set_optimizers(optimizer);
  trainer.train();
  EXPECT_FALSE(optimizer->state().empty());  // its momentum buffers
  // args' linear schedule on the given lr, 0.05: 0.05 x (6 - s) / 6 at step s.
  EXPECT_NEAR(optimizer->param_groups()[0].options().get_lr(), 0.0, 1e-12);
  int logged = 0;
  for (const auto& entry : trainer.state().log_history) {
    if (!entry.count("learning_rate")) continue;
    EXPECT_NEAR(entry.at("learning_rate"), 0.05 * (6 - (entry.at("step") - 1)) / 6, 1e-9);
    ++logged;
  }
  EXPECT_GT(logged, 0);
  // Another train() starts args' schedule again from the lr given, not from the 0 it ended at.
  const auto before = flat_params(*whole);
  trainer.train();
  EXPECT_FALSE(torch::equal(flat_params(*whole), before));

  // A fresh model and optimizer resumed from step 3 end where the first run did.
  const auto run = [&](uint64_t seed, const std::string& name,
                       std::optional<std::string> checkpoint) {
    torch::manual_seed(seed);
    Classifier model;
    auto b = a;
    b.output_dir = (dir_ / name).string();
    Trainer t(model, b, train_, eval_);
    t.set_optimizers(sgd(model));
    t.train(checkpoint);
    return flat_params(*model);
  };
  const auto first = run(0, "given_first", std::nullopt);
  const auto resumed = run(5, "given_resumed", (dir_ / "given_first" / "checkpoint-3").string());
  EXPECT_TRUE(torch::equal(resumed, first)) << (resumed - first).abs().max().item<double>();

  // A schedule given is stepped as it is: constant here.
  Classifier constant;
  auto constant_optimizer = sgd(constant);
  auto schedule = std::make_shared<mixprec::optim::LRScheduler>(*constant_optimizer,
                                                                [](int64_t) { return 1.0; });
  auto d = a;
  d.output_dir = (dir_ / "given_schedule").string();
  d.save_strategy = "no";
  Trainer constant_trainer(constant, d, train_, eval_);
  constant_trainer.set_optimizers(constant_optimizer, schedule);
  constant_trainer.train();
  EXPECT_EQ(schedule->last_epoch(), 6);
  EXPECT_DOUBLE_EQ(constant_optimizer->param_groups()[0].options().get_lr(), 0.05);

  using mixprec::testing::error_of;
  Classifier other;
  EXPECT_NE(error_of([&] { constant_trainer.set_optimizers(sgd(other)); })
                .find("the optimizer holds a tensor of shape [32, 6] that is not a parameter of "
                      "the model"),
            std::string::npos);
  auto foreign =
      std::make_shared<mixprec::optim::LRScheduler>(*optimizer, [](int64_t) { return 1.0; });
  EXPECT_NE(error_of([&] {
              constant_trainer.set_optimizers(constant_optimizer, foreign);
            }).find("the scheduler was made for another optimizer"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              constant_trainer.set_optimizers(nullptr, schedule);
            }).find("a scheduler needs its optimizer"),
            std::string::npos);
  auto rmsprop = std::make_shared<torch::optim::RMSprop>(constant->parameters());
  EXPECT_NE(error_of([&] { constant_trainer.set_optimizers(rmsprop); }).find("not supported"),
            std::string::npos);
  // Set again after a run, the optimizer keeps the lrs it was first given (PyTorch's
  // initial_lr), not the 0 the linear schedule ended at.
  trainer.set_optimizers(optimizer);
  const auto again = flat_params(*whole);
  trainer.train();
  EXPECT_FALSE(torch::equal(flat_params(*whole), again));
}

// use_seedable_sampler = false: an epoch resumed mid-way goes on in the order torch's generator
// drew for it, and after an epoch's end the next draws on as the uninterrupted run's did.
// A checkpoint that records no order (save_only_model's) draws it afresh, as HF's, and says so.
TEST_F(TrainerTest, ResumeWithTheRandomSamplerMatchesAnUninterruptedRun) {
  auto a = args("random_whole");
  a.accelerator_config.use_seedable_sampler = false;
  a.save_strategy = "steps";
  a.save_steps = 5;  // 10 batches an epoch: mid-epoch and at its end in turn
  torch::manual_seed(0);
  Classifier whole;
  Trainer(whole, a, train_, eval_, accuracy).train();
  auto seedable = a;
  seedable.accelerator_config.use_seedable_sampler = true;
  seedable.output_dir = (dir_ / "random_seedable").string();
  torch::manual_seed(0);
  Classifier by_seed;
  Trainer(by_seed, seedable, train_, eval_, accuracy).train();
  EXPECT_FALSE(torch::equal(flat_params(*by_seed), flat_params(*whole)));  // other orders

  for (const char* checkpoint : {"checkpoint-15", "checkpoint-20"}) {
    SCOPED_TRACE(checkpoint);
    torch::manual_seed(5);
    Classifier resumed;
    auto b = a;
    b.output_dir = (dir_ / (std::string("random_") + checkpoint)).string();
    const auto out = Trainer(resumed, b, train_, eval_, accuracy)
                         .train((fs::path(a.output_dir) / checkpoint).string());
    EXPECT_EQ(out.global_step, 40);
    EXPECT_TRUE(torch::equal(flat_params(*resumed), flat_params(*whole)))
        << (flat_params(*resumed) - flat_params(*whole)).abs().max().item<double>();
  }

  auto only_model = a;
  only_model.save_only_model = true;
  only_model.output_dir = (dir_ / "random_only_model").string();
  torch::manual_seed(0);
  Classifier first;
  Trainer(first, only_model, train_, eval_, accuracy).train();
  mixprec::testing::CapturedWarnings warnings;
  Classifier resumed;
  auto b = only_model;
  b.output_dir = (dir_ / "random_only_model_resumed").string();
  const auto checkpoint = fs::path(only_model.output_dir) / "checkpoint-15";
  EXPECT_EQ(Trainer(resumed, b, train_, eval_, accuracy).train(checkpoint.string()).global_step,
            40);
  EXPECT_NE(std::find(warnings.messages.begin(), warnings.messages.end(),
                      "Trainer: " + checkpoint.string() +
                          " records no shuffled order for its epoch (use_seedable_sampler = "
                          "false); the epoch's order is drawn afresh and its first 5 batches "
                          "skipped"),
            warnings.messages.end())
      << c10::Join("\n", warnings.messages);
}

TEST_F(TrainerTest, RotationKeepsTheBestAndLoadsItAtTheEnd) {
  auto a = args("best");
  a.num_train_epochs = 5;
  a.save_total_limit = 2;
  a.load_best_model_at_end = true;
  a.metric_for_best_model = "accuracy";
  a.learning_rate = 0.5;  // erratic on purpose: the best is not the last
  a.optim = "sgd";
  // Not a checkpoint (its number does not fit int64): rotation leaves it alone.
  const auto not_a_checkpoint = fs::path(a.output_dir) / "checkpoint-123456789012345678901";
  fs::create_directories(not_a_checkpoint);
  a.overwrite_output_dir = true;
  torch::manual_seed(0);
  Classifier model;
  Trainer trainer(model, a, train_, eval_, accuracy);
  trainer.train();
  const auto& best = trainer.state().best_model_checkpoint;
  ASSERT_TRUE(best.has_value());
  EXPECT_TRUE(fs::exists(*best));
  ASSERT_NE(fs::path(*best).filename(), "checkpoint-50");  // else loading it proves nothing
  EXPECT_EQ(mixprec::io::checkpoints(a.output_dir).size(), 2u);
  EXPECT_TRUE(fs::exists(fs::path(a.output_dir) / "checkpoint-50"));  // the last
  EXPECT_TRUE(fs::exists(not_a_checkpoint));
  // The model at the end is the best checkpoint's.
  const auto saved = mixprec::io::load_safetensors(fs::path(*best) / "model.safetensors");
  EXPECT_TRUE(torch::equal(saved.at("fc2.weight"), model->fc2->weight.detach()));
}

struct Recorder : mixprec::train::TrainerCallback {
  std::vector<std::string> events;
  std::function<void()> at_first_epoch_end;
  bool optimizer_after_nested_event = false;
  void on_train_begin(const TrainingArguments&, mixprec::train::TrainerState&,
                      mixprec::train::TrainerControl&) override {
    events.push_back("train_begin");
  }
  void on_epoch_end(const TrainingArguments&, mixprec::train::TrainerState&,
                    mixprec::train::TrainerControl&) override {
    events.push_back("epoch_end");
    if (at_first_epoch_end) {
      std::exchange(at_first_epoch_end, nullptr)();
      optimizer_after_nested_event = kwargs().optimizer != nullptr;
    }
  }
  void on_predict(const TrainingArguments&, mixprec::train::TrainerState&,
                  mixprec::train::TrainerControl&, const Metrics&) override {
    events.push_back("predict");
  }
  void on_evaluate(const TrainingArguments&, mixprec::train::TrainerState&,
                   mixprec::train::TrainerControl&, const Metrics&) override {
    events.push_back("evaluate");
  }
  void on_save(const TrainingArguments&, mixprec::train::TrainerState&,
               mixprec::train::TrainerControl&) override {
    events.push_back("save");
  }
  void on_step_end(const TrainingArguments&, mixprec::train::TrainerState& state,
                   mixprec::train::TrainerControl& control) override {
    if (state.global_step == 13) control.should_training_stop = true;  // callbacks steer
  }
  void on_train_end(const TrainingArguments&, mixprec::train::TrainerState&,
                    mixprec::train::TrainerControl&) override {
    events.push_back("train_end");
  }
};

TEST_F(TrainerTest, CallbacksSeeEventsAndCanStopTraining) {
  auto a = args("callbacks");
  auto recorder = std::make_shared<Recorder>();
  torch::manual_seed(0);
  Classifier model;
  Trainer trainer(model, a, train_, eval_, accuracy, {recorder});
  recorder->at_first_epoch_end = [&] { trainer.predict(eval_); };  // on_predict, in training too
  EXPECT_EQ(trainer.train().global_step, 13);
  EXPECT_EQ(recorder->events,
            (std::vector<std::string>{"train_begin", "epoch_end", "predict", "evaluate", "save",
                                      "epoch_end", "evaluate", "save", "train_end"}));
  EXPECT_TRUE(recorder->optimizer_after_nested_event);  // predict()'s events left it in place
}

// HF's callback kwargs: the model always; the optimizer, its schedule and the train loader
// while train() runs. A callback can change them: here every step's lr is 0, so nothing moves.
TEST_F(TrainerTest, CallbacksReachTheModelOptimizerAndSchedule) {
  struct Frozen : mixprec::train::TrainerCallback {
    std::vector<std::string> seen;
    std::vector<double> lrs_after_step_5;
    void note(const std::string& event) {
      const auto& k = kwargs();
      seen.push_back(event + ":" + (k.model ? "m" : "") + (k.optimizer ? "o" : "") +
                     (k.lr_scheduler ? "s" : "") + (k.train_dataloader ? "d" : "") +
                     (k.eval_dataloader ? "e" : ""));
    }
    void on_init_end(const TrainingArguments&, TrainerState&, TrainerControl&) override {
      note("init");
    }
    void on_train_begin(const TrainingArguments&, TrainerState&, TrainerControl&) override {
      note("train_begin");
    }
    void on_step_begin(const TrainingArguments&, TrainerState&, TrainerControl&) override {
      for (auto& group : kwargs().optimizer->param_groups()) group.options().set_lr(0.0);
    }
    void on_step_end(const TrainingArguments&, TrainerState& state, TrainerControl&) override {
      // The schedule has stepped: the optimizer holds its lr for the next step again.
      const auto lrs = kwargs().lr_scheduler->get_last_lr();
      EXPECT_EQ(kwargs().optimizer->param_groups()[0].options().get_lr(), lrs[0]);
      if (state.global_step == 5) lrs_after_step_5 = lrs;
    }
    void on_evaluate(const TrainingArguments&, TrainerState&, TrainerControl&,
                     const Metrics&) override {
      note("evaluate");
      EXPECT_EQ(kwargs().eval_dataloader->size(), 2u);  // 64 samples in batches of 32
      EXPECT_EQ(kwargs().eval_dataloader->options().prefetch_factor, 3u);
    }
    void on_train_end(const TrainingArguments&, TrainerState&, TrainerControl&) override {
      note("train_end");
      EXPECT_EQ(kwargs().train_dataloader->size(), 10u);  // 160 samples in batches of 16
      EXPECT_EQ(kwargs().train_dataloader->options().num_workers, 2u);
      EXPECT_EQ(kwargs().train_dataloader->options().prefetch_factor, 3u);
    }
  };
  auto a = args("kwargs");
  a.num_train_epochs = 1;
  a.dataloader_num_workers = 2;
  a.dataloader_prefetch_factor = 3;
  a.save_strategy = "no";
  auto frozen = std::make_shared<Frozen>();
  torch::manual_seed(0);
  Classifier model;
  const at::Tensor before = flat_params(*model).clone();
  Trainer trainer(model, a, train_, eval_, accuracy, {frozen});
  trainer.train();
  trainer.evaluate();  // after train(): its optimizer, schedule and loader are gone
  EXPECT_EQ(frozen->seen, (std::vector<std::string>{"init:m", "train_begin:mosd", "evaluate:mosde",
                                                    "train_end:mosde", "evaluate:me"}));
  // The linear schedule halfway through 10 steps, for both param groups (decay, no decay).
  ASSERT_EQ(frozen->lrs_after_step_5.size(), 2u);
  for (double lr : frozen->lrs_after_step_5) EXPECT_DOUBLE_EQ(lr, 2.5e-3);
  EXPECT_TRUE(torch::equal(flat_params(*model), before));
  EXPECT_EQ(frozen->kwargs().model, nullptr);  // outside an event, nothing: none dangles
}

TEST_F(TrainerTest, EarlyStoppingStopsWhenTheMetricStalls) {
  auto a = args("early");
  a.num_train_epochs = 30;
  a.metric_for_best_model = "loss";
  a.learning_rate = 0.0;  // nothing improves after the first evaluation
  auto early = std::make_shared<mixprec::train::EarlyStoppingCallback>(/*patience=*/2);
  torch::manual_seed(0);
  Classifier model;
  Trainer trainer(model, a, train_, eval_, accuracy, {early});
  EXPECT_EQ(trainer.train().global_step, 30);  // epochs 1, 2, 3; stopped after the third
}

// HF's stateful callbacks: every checkpoint's trainer_state.json holds EarlyStoppingCallback's
// patience counter (and TrainerControl's flags), which transformers reads back. A run resumed
// with restore_callback_states_from_checkpoint stops where the uninterrupted run stopped; without
// it, the counter starts again at 0 and the run goes one evaluation further.
TEST_F(TrainerTest, EarlyStoppingStateSurvivesAResume) {
  auto a = args("early_resume");
  a.num_train_epochs = 30;
  a.metric_for_best_model = "loss";
  a.learning_rate = 0.0;  // nothing improves after the first evaluation
  auto run = [&](std::optional<std::string> resume, bool restore, int64_t patience = 3) {
    a.restore_callback_states_from_checkpoint = restore;
    torch::manual_seed(0);
    Classifier model;
    auto early = std::make_shared<mixprec::train::EarlyStoppingCallback>(patience);
    Trainer trainer(model, a, train_, eval_, accuracy, {early});
    return trainer.train(resume).global_step;
  };
  auto read_by_transformers = [&](int64_t step) {
    const auto file =
        fs::path(a.output_dir) / ("checkpoint-" + std::to_string(step)) / "trainer_state.json";
    return json::parse(mixprec::testing::run_reference_script("check_trainer_state.py " +
                                                              file.string()))["restored_callbacks"];
  };
  EXPECT_EQ(run(std::nullopt, false), 40);  // counter 1, 2, 3 after epochs 2, 3, 4
  const json at_20 = read_by_transformers(20), at_40 = read_by_transformers(40);
  EXPECT_EQ(at_20["EarlyStoppingCallback"],
            json::parse(R"({"args": {"early_stopping_patience": 3, "early_stopping_threshold": 0.0},
                            "attributes": {"early_stopping_patience_counter": 1}})"));
  // TrainerControl as HF's at a save after an evaluation; at the last one, stopping.
  EXPECT_EQ(at_20["TrainerControl"],
            json::parse(R"({"args": {"should_training_stop": false, "should_epoch_stop": false,
                                     "should_save": true, "should_evaluate": true,
                                     "should_log": false}, "attributes": {}})"));
  EXPECT_EQ(at_40["TrainerControl"]["args"]["should_training_stop"], true);

  const std::string checkpoint = (fs::path(a.output_dir) / "checkpoint-20").string();
  EXPECT_EQ(run(checkpoint, true), 40);
  // The checkpoint's patience wins over the new callback's, as HF makes it anew from its args.
  EXPECT_EQ(run(checkpoint, true, /*patience=*/10), 40);
  EXPECT_EQ(run(checkpoint, false), 50);

  // A state no callback of this run takes, or one a callback saves but cannot load: a warning.
  struct SavesOnly : mixprec::train::TrainerCallback {
    std::optional<mixprec::train::CallbackState> state() const override {
      return mixprec::train::CallbackState{"EarlyStoppingCallback", "{}"};
    }
  };
  a.num_train_epochs = 3;
  a.restore_callback_states_from_checkpoint = true;
  for (bool saves_only : {false, true}) {
    mixprec::testing::CapturedWarnings warnings;
    Classifier model;
    std::vector<std::shared_ptr<mixprec::train::TrainerCallback>> callbacks;
    if (saves_only) callbacks.push_back(std::make_shared<SavesOnly>());
    Trainer(model, a, train_, eval_, accuracy, callbacks).train(checkpoint);
    const std::string expected =
        saves_only ? "the checkpoint holds the state of callback 'EarlyStoppingCallback', whose "
                     "load_state() is not overridden"
                   : "the checkpoint holds the state of callbacks this run does not have, "
                     "ignored: EarlyStoppingCallback";
    EXPECT_TRUE(std::any_of(warnings.messages.begin(), warnings.messages.end(),
                            [&](const std::string& m) { return m.find(expected) != m.npos; }))
        << expected;
  }
}

// save_only_model: checkpoints of the model and the Trainer's files only. SGD without momentum
// keeps no state, so a run resumed from one (mid-epoch) with other initial weights ends where
// the uninterrupted run did: the weights come back, and the schedule and the data go on from
// the checkpoint's step. AdamW's moments start afresh, with a warning that says so.
TEST_F(TrainerTest, SaveOnlyModelResumesTheScheduleAndDataWithAFreshOptimizer) {
  auto a = args("model_only");
  a.optim = "sgd";
  a.learning_rate = 0.1;
  a.save_strategy = "steps";
  a.save_steps = 7;  // 10 batches an epoch: mid-epoch
  a.save_only_model = true;
  auto files_in = [](const fs::path& checkpoint) {
    std::vector<std::string> files;
    for (const auto& entry : fs::directory_iterator(checkpoint))
      files.push_back(entry.path().filename().string());
    std::ranges::sort(files);
    return files;
  };
  for (const std::string optim : {"sgd", "adamw_torch"}) {
    SCOPED_TRACE(optim);
    a.optim = optim;
    a.output_dir = (dir_ / ("model_only_" + optim)).string();
    torch::manual_seed(0);
    Classifier whole;
    Trainer(whole, a, train_, eval_, accuracy).train();
    const auto checkpoint = fs::path(a.output_dir) / "checkpoint-7";
    EXPECT_EQ(files_in(checkpoint),
              (std::vector<std::string>{"checksums.json", "model.safetensors", "trainer_state.json",
                                        "training_args.json"}));
    auto b = a;
    b.output_dir = (dir_ / ("model_only_resumed_" + optim)).string();
    torch::manual_seed(5);
    Classifier resumed;
    mixprec::testing::CapturedWarnings warnings;
    Trainer trainer(resumed, b, train_, eval_, accuracy);
    EXPECT_EQ(trainer.train(checkpoint.string()).global_step, 40);
    EXPECT_TRUE(std::any_of(warnings.messages.begin(), warnings.messages.end(), [](auto& m) {
      return m.find("holds the model only (saved with save_only_model): the optimizer's state") !=
             m.npos;
    }));
    // The learning rate logged after the resume is the uninterrupted run's at that step.
    const auto& log = trainer.state().log_history;
    auto at_step_10 = std::find_if(log.begin(), log.end(), [](const Metrics& e) {
      return e.count("loss") && e.at("step") == 10;
    });
    ASSERT_NE(at_step_10, log.end());
    EXPECT_DOUBLE_EQ(at_step_10->at("learning_rate"), 0.1 * (40 - 9) / 40.0);
    if (optim == "sgd")
      EXPECT_TRUE(torch::equal(flat_params(*resumed), flat_params(*whole)));
    else  // AdamW's first steps are lr-sized whatever the gradients: the moments were lost
      EXPECT_FALSE(torch::allclose(flat_params(*resumed), flat_params(*whole), 1e-3, 1e-3));
  }

  // A signal on a save step: that step's checkpoint is one to resume from, saved once.
  struct Interrupts : mixprec::train::TrainerCallback {
    void on_step_end(const TrainingArguments&, TrainerState& s, TrainerControl&) override {
      if (s.global_step == 7) std::raise(SIGTERM);
    }
    void on_save(const TrainingArguments&, TrainerState&, TrainerControl&) override { ++saves; }
    int saves = 0;
  };
  a.output_dir = (dir_ / "model_only_interrupted").string();
  Classifier model;
  const auto interrupts = std::make_shared<Interrupts>();
  Trainer interrupted(model, a, train_, eval_, accuracy, {interrupts});
  EXPECT_EQ(interrupted.train().stopped_by_signal, SIGTERM);
  const auto files = files_in(fs::path(a.output_dir) / "checkpoint-7");
  EXPECT_TRUE(std::ranges::count(files, "optimizer.safetensors") &&
              std::ranges::count(files, "accelerator.json"));
  EXPECT_EQ(interrupts->saves, 1);
}

// include_for_metrics gives compute_metrics the batches' main input (the model's
// main_input_name) and each sample's batch loss; batch_eval_metrics calls it per batch, the last
// with compute_result, whose metrics are the evaluation's, and keeps no logits, but predict()
// still returns them all.
TEST_F(TrainerTest, ComputeMetricsGetsInputsLossesAndRunsPerBatch) {
  auto a = args("metrics");
  a.include_for_metrics = {"inputs", "loss"};
  std::vector<at::Tensor> eval_x;
  for (size_t i = 0; i < eval_->size(); ++i) eval_x.push_back(eval_->get(i).at("x"));
  const at::Tensor expected_inputs = torch::stack(eval_x);
  torch::manual_seed(0);
  Classifier model;
  at::Tensor inputs, losses;
  auto b = args("metrics_plain");  // nothing included: neither is defined
  Trainer(model, b, train_, eval_, [&](const mixprec::train::EvalPrediction& p) {
    EXPECT_FALSE(p.inputs.defined() || p.losses.defined());
    return accuracy(p);
  }).evaluate();
  Trainer whole_set(model, a, train_, eval_, [&](const mixprec::train::EvalPrediction& p) {
    inputs = p.inputs;
    losses = p.losses;
    EXPECT_TRUE(p.compute_result);
    return accuracy(p);
  });
  const Metrics metrics = whole_set.evaluate();
  EXPECT_TRUE(torch::equal(inputs, expected_inputs));
  // Two batches of 32: each sample carries its batch's mean loss.
  ASSERT_EQ(losses.sizes(), (std::vector<int64_t>{64}));
  EXPECT_TRUE(torch::equal(losses.slice(0, 0, 32), losses[0].expand({32})));
  EXPECT_TRUE(torch::equal(losses.slice(0, 32), losses[32].expand({32})));
  EXPECT_NEAR(losses.to(at::kDouble).mean().item<double>(), metrics.at("eval_loss"), 1e-12);

  a.batch_eval_metrics = true;
  int64_t correct = 0, seen = 0;
  std::vector<bool> compute_results;
  Trainer per_batch(model, a, train_, eval_, [&](const mixprec::train::EvalPrediction& p) {
    EXPECT_EQ(p.inputs.size(0), p.predictions.size(0));
    EXPECT_EQ(p.losses.size(0), p.predictions.size(0));
    correct += p.predictions.argmax(1).eq(p.label_ids).sum().item<int64_t>();
    seen += p.predictions.size(0);
    compute_results.push_back(p.compute_result);
    if (!p.compute_result) return Metrics{};
    const Metrics result{{"accuracy", static_cast<double>(correct) / static_cast<double>(seen)}};
    correct = seen = 0;
    return result;
  });
  const Metrics batched = per_batch.evaluate();
  EXPECT_EQ(compute_results, (std::vector<bool>{false, true}));
  EXPECT_DOUBLE_EQ(batched.at("eval_accuracy"), metrics.at("eval_accuracy"));
  EXPECT_DOUBLE_EQ(batched.at("eval_loss"), metrics.at("eval_loss"));
  const auto predicted = per_batch.predict(eval_);
  EXPECT_EQ(predicted.predictions.size(0), 64);
  EXPECT_DOUBLE_EQ(predicted.metrics.at("test_accuracy"), metrics.at("eval_accuracy"));

  per_batch.set_main_input_name("pixels");
  EXPECT_NE(mixprec::testing::error_of([&] { per_batch.evaluate(); })
                .find("include_for_metrics has \"inputs\", but the eval batch holds no 'pixels' "
                      "(the model's main_input_name); its keys: labels, x"),
            std::string::npos);
}

// skip_memory_metrics = false: HF's memory metrics. A callback keeps 64 MB from step 2 on and
// holds 128 MB more during step 3: train() left 64 MB allocated, and peaked 128 MB above that.
// The first report also carries the constructor's ("init"); an evaluation returns its own but
// does not log them, as HF's.
TEST_F(TrainerTest, MemoryMetricsAsHfsTracker) {
  struct Allocates : mixprec::train::TrainerCallback {
    at::Tensor kept;
    void on_step_end(const TrainingArguments&, TrainerState& s, TrainerControl&) override {
      if (s.global_step == 2) kept = at::ones({16 << 20});             // 64 MB of floats
      if (s.global_step == 3) at::Tensor held = at::ones({32 << 20});  // 128 MB, then freed
    }
  };
  auto a = args("memory");
  a.max_steps = 4;
  a.save_strategy = "no";
  a.skip_memory_metrics = false;
  Classifier model;
  auto allocates = std::make_shared<Allocates>();
  Trainer trainer(model, a, train_, eval_, accuracy, {allocates});
  const Metrics train = trainer.train().metrics;
  constexpr double kMB = 1 << 20;
  // The sizes, where malloc gives freed memory back (ASan keeps it in quarantine).
  const bool sizes = !mixprec::testing::kAddressSanitizer;
  if (sizes) {
    EXPECT_GE(train.at("train_mem_cpu_alloc_delta"), 60 * kMB);
    EXPECT_GE(train.at("train_mem_cpu_peaked_delta"), 120 * kMB);
    EXPECT_LT(train.at("train_mem_cpu_peaked_delta"), 200 * kMB);
  }
  for (const char* key : {"init_mem_cpu_alloc_delta", "init_mem_cpu_peaked_delta"})
    EXPECT_TRUE(train.count(key)) << key;
  EXPECT_GT(train.at("before_init_mem_cpu"), 0);
  EXPECT_TRUE(trainer.state().log_history.back().count("train_mem_cpu_alloc_delta"));

  // Freed memory the heap keeps for reuse is neither allocated nor a peak of the next stage.
  { const at::Tensor freed = at::ones({48 << 20}); }  // 192 MB
  const Metrics eval = trainer.evaluate();
  EXPECT_TRUE(eval.count("eval_mem_cpu_alloc_delta") && eval.count("eval_mem_cpu_peaked_delta"));
  if (sizes) {
    EXPECT_LT(eval.at("eval_mem_cpu_peaked_delta"), 64 * kMB);
    EXPECT_LT(std::abs(eval.at("eval_mem_cpu_alloc_delta")), 64 * kMB);
  }
  EXPECT_FALSE(eval.count("init_mem_cpu_alloc_delta"));
  EXPECT_FALSE(trainer.state().log_history.back().count("eval_mem_cpu_alloc_delta"));
  EXPECT_TRUE(trainer.predict(eval_).metrics.count("test_mem_cpu_peaked_delta"));

  a.skip_memory_metrics = true;  // the default
  for (const auto& [key, value] : Trainer(model, a, train_, eval_, accuracy).train().metrics)
    EXPECT_EQ(key.find("_mem_"), std::string::npos) << key;
}

// full_determinism: enable_full_determinism instead of set_seed, as HF's, from the constructor
// on; LibTorch then refuses nondeterministic algorithms process-wide.
TEST_F(TrainerTest, FullDeterminismTurnsOnDeterministicAlgorithms) {
  auto& context = at::globalContext();
  struct Restore {  // the process's settings as they were, whatever happens below
    at::Context& context;
    bool algorithms = context.deterministicAlgorithms(), cudnn = context.deterministicCuDNN(),
         benchmark = context.benchmarkCuDNN();
    ~Restore() {
      context.setDeterministicAlgorithms(algorithms, false);
      context.setDeterministicCuDNN(cudnn);
      context.setBenchmarkCuDNN(benchmark);
      unsetenv("CUBLAS_WORKSPACE_CONFIG");
      unsetenv("CUDA_LAUNCH_BLOCKING");
    }
  } restore{context};
  context.setDeterministicAlgorithms(false, false);
  context.setBenchmarkCuDNN(true);
  auto a = args("deterministic");
  a.max_steps = 2;
  a.full_determinism = true;
  Classifier model;
  Trainer trainer(model, a, train_, eval_, accuracy);
  EXPECT_TRUE(context.deterministicAlgorithms());
  EXPECT_FALSE(context.deterministicAlgorithmsWarnOnly());
  EXPECT_TRUE(context.deterministicCuDNN());
  EXPECT_FALSE(context.benchmarkCuDNN());
  EXPECT_STREQ(std::getenv("CUBLAS_WORKSPACE_CONFIG"), ":16:8");
  // Seeded as set_seed seeds: the same draw as after manual_seed(seed).
  const auto drawn = torch::rand({4});
  torch::manual_seed(static_cast<uint64_t>(a.seed));
  EXPECT_TRUE(torch::equal(drawn, torch::rand({4})));
  trainer.train();
  EXPECT_TRUE(context.deterministicAlgorithms());

  // Without it, the constructor seeds all the same (HF's __init__ calls set_seed).
  a.full_determinism = false;
  a.seed = 11;
  torch::manual_seed(0);
  Trainer seeded(model, a, train_, eval_, accuracy);
  const auto after_constructor = torch::rand({4});
  torch::manual_seed(11);
  EXPECT_TRUE(torch::equal(after_constructor, torch::rand({4})));
}

// train() again, as HF allows: the second run makes its optimizer, schedule and data position
// afresh and trains on (fp16: its clipping unscales only its own optimizer's gradients), and
// the accelerator keeps nothing of a finished run (before, the first run's optimizer stayed
// registered, dangling).
TEST_F(TrainerTest, TrainsAgainAndLeavesNothingRegistered) {
  auto a = args("twice");
  a.fp16 = true;
  a.eval_strategy = "no";
  a.save_strategy = "no";
  a.num_train_epochs = 1;
  torch::manual_seed(0);
  Classifier model;
  Trainer trainer(model, a, train_, eval_, accuracy);
  EXPECT_EQ(trainer.train().global_step, 10);
  const auto after_first = flat_params(*model);
  EXPECT_EQ(trainer.train().global_step, 10);
  EXPECT_FALSE(torch::equal(flat_params(*model), after_first));
  const auto saved = dir_ / "accelerator_state";
  trainer.accelerator().save_state(saved.string());
  for (const auto& entry : fs::directory_iterator(saved))
    for (const char* prefix : {"model", "optimizer", "scheduler", "custom_checkpoint_1"})
      EXPECT_FALSE(entry.path().filename().string().starts_with(prefix)) << entry.path();
  // Only the Trainer's data position stays registered (once), as objects do in Accelerate.
  EXPECT_TRUE(fs::exists(saved / "custom_checkpoint.json"));
}

// logging_nan_inf_filter (HF's default): the inf loss of a skipped fp16 step is logged as the
// average of the losses since the last log; without it, the log and train_loss are inf.
TEST_F(TrainerTest, InfLossIsLoggedAsTheAverageSinceTheLastLog) {
  for (const bool filter : {true, false}) {
    SCOPED_TRACE(filter ? "filter" : "no filter");
    auto a = args(filter ? "inf_filter" : "no_inf_filter");
    a.fp16 = true;
    a.num_train_epochs = 1;
    a.eval_strategy = "no";
    a.save_strategy = "no";
    a.logging_nan_inf_filter = filter;
    torch::manual_seed(0);
    PoisonedClassifier model;
    model->poisoned = {2};
    model->poison_loss = true;
    Trainer trainer(model, a, train_, eval_, accuracy);
    const auto out = trainer.train();
    std::vector<double> losses;
    for (const auto& entry : trainer.state().log_history)
      if (entry.count("loss")) losses.push_back(entry.at("loss"));
    ASSERT_EQ(losses.size(), 2u);  // steps 5 and 10
    EXPECT_EQ(std::isfinite(losses[0]), filter) << losses[0];
    EXPECT_TRUE(std::isfinite(losses[1]));
    EXPECT_EQ(std::isfinite(out.training_loss), filter);
    if (filter) {  // HF's rule at step 3: the sum so far grows by itself / (1 + 2 steps)
      const auto& l = model->losses;
      const double sum = (l[0] + l[1]) * (1 + 1.0 / 3) + l[3] + l[4];
      EXPECT_NEAR(losses[0], sum / 5, 1e-6 * sum / 5);
    }
  }
}

// save_total_limit 1 with a best checkpoint: each rotation keeps the newest (to resume from)
// and the best, and at the end only the best stays (HF's rotate_checkpoints and
// _finalize_training).
TEST_F(TrainerTest, SaveTotalLimitOneKeepsTheNewestAndTheBestThenOnlyTheBest) {
  auto a = args("limit_one");
  a.num_train_epochs = 3;
  a.save_total_limit = 1;
  a.metric_for_best_model = "score";
  int evaluations = 0;
  auto score = [&](const mixprec::train::EvalPrediction&) {
    const double scores[] = {3, 1, 2};  // the first epoch's is the best
    return Metrics{{"score", scores[evaluations++]}};
  };
  struct Listing : mixprec::train::TrainerCallback {
    fs::path dir;
    std::vector<std::vector<std::string>> seen;
    void on_save(const TrainingArguments&, TrainerState&, TrainerControl&) override {
      seen.push_back(checkpoint_names(dir));
    }
  };
  auto listing = std::make_shared<Listing>();
  listing->dir = a.output_dir;
  torch::manual_seed(0);
  Classifier model;
  Trainer trainer(model, a, train_, eval_, score, {listing});
  trainer.train();
  using Names = std::vector<std::string>;
  EXPECT_EQ(listing->seen, (std::vector<Names>{{"checkpoint-10"},
                                               {"checkpoint-10", "checkpoint-20"},
                                               {"checkpoint-10", "checkpoint-30"}}));
  EXPECT_EQ(checkpoint_names(a.output_dir), Names{"checkpoint-10"});
}

// As HF's rotation: a limit of 0 keeps every checkpoint.
TEST_F(TrainerTest, SaveTotalLimitZeroKeepsEveryCheckpoint) {
  auto a = args("limit_zero");
  a.num_train_epochs = 3;
  a.eval_strategy = "no";
  a.save_total_limit = 0;
  torch::manual_seed(0);
  Classifier model;
  Trainer(model, a, train_, eval_, accuracy).train();
  EXPECT_EQ(checkpoint_names(a.output_dir),
            (std::vector<std::string>{"checkpoint-10", "checkpoint-20", "checkpoint-30"}));
}

// Rotation after a resume from an earlier checkpoint than the folder's last: as HF's (by
// modification time), the new run's checkpoint stays, not the earlier run's later ones. And the
// folder just saved stays even when it is not the latest written (here: the earlier run's
// folders dated an hour ahead, as a clock set wrong would date them; in HF's fallback to the
// steps' order: a later step), which HF's rotation would delete.
TEST_F(TrainerTest, RotationAfterAnEarlierResumeKeepsTheNewRunsCheckpoint) {
  for (const int hours : {-1, 1}) {
    SCOPED_TRACE(hours);
    auto a = args("resumed_earlier" + std::to_string(hours));
    a.eval_strategy = "no";
    a.save_strategy = "steps";
    a.save_steps = 1;
    a.max_steps = 4;
    torch::manual_seed(0);
    Classifier first;
    Trainer(first, a, train_, eval_, accuracy).train();
    for (const auto& [step, dir] : mixprec::io::checkpoints(a.output_dir))
      fs::last_write_time(dir, fs::file_time_type::clock::now() + std::chrono::hours(hours) +
                                   std::chrono::minutes(step));
    a.max_steps = 3;
    a.save_total_limit = 1;
    Classifier second;
    Trainer(second, a, train_, eval_, accuracy).train(a.output_dir + "/checkpoint-2");
    using Names = std::vector<std::string>;
    const Names expected =
        hours < 0 ? Names{"checkpoint-3"} : Names{"checkpoint-3", "checkpoint-4"};
    EXPECT_EQ(checkpoint_names(a.output_dir), expected);
    const auto state = json::parse(
        mixprec::io::read_file(fs::path(a.output_dir) / "checkpoint-3" / "trainer_state.json"));
    EXPECT_EQ(state.at("max_steps"), 3);  // the new run's
  }
}

// save_strategy "best": a checkpoint at a new best only, even where a callback asks for one
// (HF sets should_save after the evaluation).
TEST_F(TrainerTest, SaveStrategyBestSavesAtANewBestOnly) {
  auto a = args("save_best");
  a.num_train_epochs = 3;
  a.save_strategy = "best";
  a.metric_for_best_model = "score";
  int evaluations = 0;
  auto score = [&](const mixprec::train::EvalPrediction&) {
    const double scores[] = {1, 3, 2};
    return Metrics{{"score", scores[evaluations++]}};
  };
  struct AlwaysSave : mixprec::train::TrainerCallback {
    void on_evaluate(const TrainingArguments&, TrainerState&, TrainerControl& c,
                     const Metrics&) override {
      c.should_save = true;
    }
  };
  torch::manual_seed(0);
  Classifier model;
  Trainer trainer(model, a, train_, eval_, score, {std::make_shared<AlwaysSave>()});
  trainer.train();
  EXPECT_EQ(checkpoint_names(a.output_dir),
            (std::vector<std::string>{"checkpoint-10", "checkpoint-20"}));
  EXPECT_EQ(trainer.state().best_model_checkpoint,
            (fs::path(a.output_dir) / "checkpoint-20").string());
}

// An evaluation may find the best at a step saved before it ("steps" saves at an epoch's last
// step, then the epoch's evaluation): the next save names that checkpoint the best, as HF's.
TEST_F(TrainerTest, TheBestCheckpointCanBeOneSavedBeforeItsEvaluation) {
  auto a = args("best_saved_before");
  a.num_train_epochs = 2;
  a.save_strategy = "steps";
  a.save_steps = 10;  // an epoch
  a.metric_for_best_model = "score";
  int evaluations = 0;
  auto score = [&](const mixprec::train::EvalPrediction&) {
    const double scores[] = {3, 1};
    return Metrics{{"score", scores[evaluations++]}};
  };
  torch::manual_seed(0);
  Classifier model;
  Trainer trainer(model, a, train_, eval_, score);
  trainer.train();
  EXPECT_EQ(trainer.state().best_global_step, 10);
  EXPECT_EQ(trainer.state().best_model_checkpoint,
            (fs::path(a.output_dir) / "checkpoint-10").string());
}

// As HF's CallbackHandler.on_step_begin: logs, evaluations and saves asked for before a step
// (in on_epoch_begin here) are dropped when it begins; asked for in it, they happen.
TEST_F(TrainerTest, WhatIsAskedBeforeAStepIsDroppedWhenItBegins) {
  struct Asking : mixprec::train::TrainerCallback {
    bool at_epoch_begin = true;
    void ask(TrainerControl& c) { c.should_log = c.should_evaluate = c.should_save = true; }
    void on_epoch_begin(const TrainingArguments&, TrainerState&, TrainerControl& c) override {
      if (at_epoch_begin) ask(c);
    }
    void on_step_begin(const TrainingArguments&, TrainerState& s, TrainerControl& c) override {
      if (!at_epoch_begin && s.global_step == 4) ask(c);
    }
  };
  for (const bool at_epoch_begin : {true, false}) {
    SCOPED_TRACE(at_epoch_begin);
    auto a = args(at_epoch_begin ? "asked_early" : "asked_in_step");
    a.num_train_epochs = 1;
    a.eval_strategy = "no";
    a.save_strategy = "no";
    a.logging_strategy = "no";
    auto asking = std::make_shared<Asking>();
    asking->at_epoch_begin = at_epoch_begin;
    torch::manual_seed(0);
    Classifier model;
    Trainer trainer(model, a, train_, eval_, accuracy, {asking});
    trainer.train();
    using Names = std::vector<std::string>;
    EXPECT_EQ(checkpoint_names(a.output_dir), at_epoch_begin ? Names{} : Names{"checkpoint-5"});
    int logs = 0, evaluations = 0;
    for (const auto& entry : trainer.state().log_history) {
      logs += entry.count("loss");
      evaluations += entry.count("eval_loss");
    }
    EXPECT_EQ(logs, at_epoch_begin ? 0 : 1);
    EXPECT_EQ(evaluations, at_epoch_begin ? 0 : 1);
  }
}

// A NaN gradient norm (an fp16 step the scaler skips) is logged, as HF's.
TEST_F(TrainerTest, ANaNGradientNormIsLogged) {
  auto a = args("nan_norm");
  a.fp16 = true;
  a.max_steps = 4;
  a.eval_strategy = "no";
  a.save_strategy = "no";
  a.logging_steps = 1;
  torch::manual_seed(0);
  PoisonedClassifier model;
  model->poisoned = {2};
  model->poison = NAN;
  Trainer trainer(model, a, train_, eval_, accuracy);
  trainer.train();
  std::vector<double> norms;
  for (const auto& entry : trainer.state().log_history)
    if (entry.count("loss")) norms.push_back(entry.count("grad_norm") ? entry.at("grad_norm") : 0);
  ASSERT_EQ(norms.size(), 4u);
  for (size_t i = 0; i < norms.size(); ++i)
    EXPECT_EQ(std::isnan(norms[i]), i == 2) << i << ": " << norms[i];
  for (const size_t i : {0, 1, 3}) EXPECT_GT(norms[i], 0) << i;
}

// save_strategy "epoch" and max_steps in the middle of an epoch: one save at the stop (not
// one at the step and another at the epoch's end), whose data position is that step, so a
// longer run resumed from it trains on the rest of that epoch.
TEST_F(TrainerTest, EpochSaveAtAStopMidEpochKeepsItsPosition) {
  auto a = args("stop_mid_epoch");
  a.max_steps = 15;  // 10 steps an epoch
  a.eval_strategy = "no";
  struct Saves : mixprec::train::TrainerCallback {
    std::vector<int64_t> steps;
    void on_save(const TrainingArguments&, TrainerState& s, TrainerControl&) override {
      steps.push_back(s.global_step);
    }
  };
  auto saves = std::make_shared<Saves>();
  torch::manual_seed(0);
  Classifier model;
  Trainer(model, a, train_, eval_, accuracy, {saves}).train();
  EXPECT_EQ(saves->steps, (std::vector<int64_t>{10, 15}));
  const auto position = json::parse(
      mixprec::io::read_file(fs::path(a.output_dir) / "checkpoint-15" / "custom_checkpoint.json"));
  EXPECT_EQ(position, json({{"epoch", 1}, {"batches_yielded", 5}, {"global_batch", 16}}));
  a.max_steps = 20;
  a.resume_from_checkpoint = (fs::path(a.output_dir) / "checkpoint-15").string();
  Trainer resumed(model, a, train_, eval_, accuracy);
  resumed.train();
  EXPECT_EQ(resumed.state().global_step, 20);
  EXPECT_EQ(resumed.state().max_steps, 20);  // this run's, not the checkpoint's 15
  EXPECT_DOUBLE_EQ(resumed.state().epoch, 2.0);
  // Resumed with another batch, the position counts other samples: a warning says so.
  a.per_device_train_batch_size = 8;
  a.max_steps = 16;
  mixprec::testing::CapturedWarnings warnings;
  Trainer(model, a, train_, eval_, accuracy).train();
  EXPECT_EQ(std::count_if(warnings.messages.begin(), warnings.messages.end(),
                          [](const std::string& m) {
                            return m.find(
                                       "stopped mid-epoch with a batch of 16 samples on all "
                                       "processes together; this run's is 8") != std::string::npos;
                          }),
            1);
}

// optim_args the optimizer does not read are a warning (HF ignores them silently); a value that
// is not a number, as Python's float() reads one, is an error.
TEST_F(TrainerTest, OptimArgsNotReadWarnAndBadNumbersFail) {
  auto a = args("optim_args");
  a.max_steps = 1;
  a.save_strategy = "no";
  a.eval_strategy = "no";
  a.optim = "adamw_torch";
  a.optim_args = "momentum=0.9,betas=1";
  {
    mixprec::testing::CapturedWarnings warnings;
    Trainer(Classifier(), a, train_).train();
    EXPECT_EQ(std::count(warnings.messages.begin(), warnings.messages.end(),
                         "Trainer: optim adamw_torch does not read optim_args' betas, momentum; "
                         "only sgd reads some (momentum, dampening, weight_decay, nesterov)"),
              1);
  }
  a.optim = "sgd";
  a.overwrite_output_dir = true;
  for (const char* bad : {"abc", "0x1", "1.5x", ""}) {
    a.optim_args = std::string("momentum=") + bad;
    EXPECT_EQ(mixprec::testing::error_of([&] { Trainer(Classifier(), a, train_).train(); }),
              std::string("Trainer: optim_args' momentum must be a number, got '") + bad + "'");
  }
  a.optim_args = "momentum=+0.5,nesterov=yes,foo=1";
  mixprec::testing::CapturedWarnings warnings;
  Trainer(Classifier(), a, train_).train();
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_NE(warnings.messages[0].find("optim sgd does not read optim_args' foo"),
            std::string::npos);
}

// The metrics as HF returns them: with the epoch, and keys that already carry the prefix kept.
TEST_F(TrainerTest, MetricsCarryTheEpochAndKeepPrefixedKeys) {
  auto a = args("metrics");
  a.num_train_epochs = 1;
  a.per_device_train_batch_size = 48;  // 160 samples: 4 batches, the last one of 16
  a.eval_strategy = "no";
  a.save_strategy = "no";
  auto metrics = [](const mixprec::train::EvalPrediction& p) {
    return Metrics{{"eval_f1", 0.5}, {"accuracy", accuracy(p).at("accuracy")}};
  };
  torch::manual_seed(0);
  Classifier model;
  Trainer trainer(model, a, train_, eval_, metrics);
  const auto out = trainer.train();
  EXPECT_EQ(out.metrics.at("epoch"), 1.0);
  // HF counts the dataset's samples per epoch, not whole batches (192).
  EXPECT_NEAR(out.metrics.at("train_samples_per_second") * out.metrics.at("train_runtime"), 160,
              1e-9);
  const Metrics eval = trainer.evaluate();
  EXPECT_EQ(eval.at("epoch"), 1.0);
  EXPECT_EQ(eval.at("eval_f1"), 0.5);
  // As HF's speed_metrics: the eval set's size, and the steps of a pass over it.
  const auto eval_size = static_cast<double>(eval_->size());
  EXPECT_NEAR(eval.at("eval_samples_per_second") * eval.at("eval_runtime"), eval_size, 1e-9);
  EXPECT_NEAR(eval.at("eval_steps_per_second") * eval.at("eval_runtime"),
              std::ceil(eval_size / static_cast<double>(a.per_device_eval_batch_size)), 1e-9);
  EXPECT_TRUE(eval.count("eval_accuracy"));
  EXPECT_FALSE(eval.count("eval_eval_f1"));
  const auto predicted = trainer.predict(eval_).metrics;
  EXPECT_EQ(predicted.at("test_eval_f1"), 0.5);
  EXPECT_TRUE(predicted.count("test_accuracy"));
  // prediction_loss_only: the loss, no logits, labels nor metrics (HF's).
  a.prediction_loss_only = true;
  Trainer loss_only(model, a, train_, eval_, metrics);
  const Metrics eval_loss_only = loss_only.evaluate();
  EXPECT_TRUE(eval_loss_only.count("eval_loss"));
  EXPECT_FALSE(eval_loss_only.count("eval_accuracy"));
  const auto predicted_loss_only = loss_only.predict(eval_);
  EXPECT_FALSE(predicted_loss_only.predictions.defined());
  EXPECT_FALSE(predicted_loss_only.label_ids.defined());
  EXPECT_TRUE(predicted_loss_only.metrics.count("test_loss"));
  EXPECT_FALSE(predicted_loss_only.metrics.count("test_accuracy"));
}

// eval_delay with the "steps" strategy, as HF's DefaultFlowCallback: no evaluation before the
// delay, the one at max_steps (not a multiple of eval_steps) only when the delay has passed.
TEST_F(TrainerTest, EvalDelayCountsStepsWithTheStepsStrategy) {
  for (const auto& [delay, expected] : std::vector<std::pair<double, std::vector<double>>>{
           {0, {2, 4, 5}}, {4, {4, 5}}, {5, {5}}, {6, {}}}) {
    SCOPED_TRACE("eval_delay " + std::to_string(delay));
    auto a = args("eval_delay");
    a.overwrite_output_dir = true;
    a.max_steps = 5;
    a.eval_strategy = "steps";
    a.eval_steps = 2;
    a.eval_delay = delay;
    a.save_strategy = "no";
    Classifier model;
    Trainer trainer(model, a, train_, eval_);
    trainer.train();
    std::vector<double> evaluated;
    for (const auto& entry : trainer.state().log_history)
      if (entry.count("eval_loss")) evaluated.push_back(entry.at("step"));
    EXPECT_EQ(evaluated, expected);
  }
}

// compute_loss_func replaces the model's loss in evaluation too; a batch without labels gets
// none, and no call (HF's prediction_step).
TEST_F(TrainerTest, ComputeLossFuncLeavesBatchesWithoutLabelsAlone) {
  auto a = args("compute_loss");
  a.eval_strategy = "no";
  Classifier model;
  int calls = 0;
  auto doubled = [&](const mixprec::models::ModelOutput& out, const at::Tensor& labels,
                     std::optional<int64_t> num_items_in_batch) {
    ++calls;
    EXPECT_EQ(num_items_in_batch, labels.numel());  // an evaluation batch's own labels
    return 2 * torch::nn::functional::cross_entropy(out.logits, labels);
  };
  const double plain = Trainer(model, a, train_, eval_).evaluate().at("eval_loss");
  Trainer trainer(model, a, train_, eval_, {}, {}, {}, doubled);
  EXPECT_NEAR(trainer.evaluate().at("eval_loss"), 2 * plain, 1e-6 * plain);
  EXPECT_EQ(calls, 2);  // 64 samples in batches of 32
  auto unlabelled = std::make_shared<mixprec::data::TensorDataset>(
      std::map<std::string, at::Tensor>{{"x", torch::randn({10, 6})}});
  const auto predicted = trainer.predict(unlabelled);
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(predicted.predictions.sizes(), (at::IntArrayRef{10, 3}));
  EXPECT_FALSE(predicted.metrics.count("test_loss"));
}

// As HF's compute_loss (its compute_loss_context_manager is empty): compute_loss_func runs on
// the model's outputs as Accelerate gives them, fp32 under mixed precision, outside autocast.
TEST_F(TrainerTest, ComputeLossFuncRunsOnFp32OutputsOutsideAutocast) {
  auto a = args("compute_loss_fp32");
  a.bf16 = true;
  a.max_steps = 2;
  a.eval_strategy = "steps";
  a.eval_steps = 2;
  a.save_strategy = "no";
  Classifier model;
  std::vector<std::pair<at::ScalarType, bool>> seen;  // logits' dtype, autocast on
  auto loss = [&](const mixprec::models::ModelOutput& out, const at::Tensor& labels,
                  std::optional<int64_t>) {
    seen.emplace_back(out.logits.scalar_type(), at::autocast::is_autocast_enabled(at::kCPU));
    return torch::nn::functional::cross_entropy(out.logits, labels);
  };
  Trainer(model, a, train_, eval_, {}, {}, {}, loss).train();
  ASSERT_EQ(seen.size(), 4u);  // 2 steps, then 2 evaluation batches
  for (const auto& [dtype, autocast] : seen) {
    EXPECT_EQ(dtype, at::kFloat);
    EXPECT_FALSE(autocast);
  }
}

// HF's LabelSmoother, written out: per counted label, (1 - e) x -log p[label] + e x the mean of
// -log p over the classes; a causal LM's position t predicts labels[t + 1].
TEST(LabelSmoothedLoss, IsHfsLabelSmoother) {
  torch::manual_seed(0);
  const auto logits = torch::randn({2, 4, 5}, torch::kDouble);
  const auto labels = torch::tensor({{1, 2, -100, 4}, {0, -100, 3, 3}});
  const double e = 0.2;
  auto expected = [&](bool shift, std::optional<double> divisor) {
    const auto x = shift ? logits.slice(1, 0, 3) : logits;
    const auto y = shift ? labels.slice(1, 1, 4) : labels;
    const auto neg_log_p = -torch::log_softmax(x, -1);
    double sum = 0;
    int64_t counted = 0;
    for (int64_t b = 0; b < y.size(0); ++b)
      for (int64_t t = 0; t < y.size(1); ++t) {
        const int64_t label = y[b][t].item<int64_t>();
        if (label == -100) continue;
        sum += (1 - e) * neg_log_p[b][t][label].item<double>() +
               e * neg_log_p[b][t].mean().item<double>();
        ++counted;
      }
    return sum / divisor.value_or(static_cast<double>(counted));
  };
  using mixprec::train::label_smoothed_loss;
  EXPECT_NEAR(label_smoothed_loss(logits, labels, e, false).item<double>(),
              expected(false, std::nullopt), 1e-6);
  EXPECT_NEAR(label_smoothed_loss(logits, labels, e, true).item<double>(),
              expected(true, std::nullopt), 1e-6);
  EXPECT_NEAR(label_smoothed_loss(logits, labels, e, true, 10).item<double>(), expected(true, 10.0),
              1e-6);
  EXPECT_EQ(label_smoothed_loss(logits, labels, e, true).scalar_type(), torch::kFloat);
  // Nothing to count: NaN, as HF's 0 / 0.
  EXPECT_TRUE(
      std::isnan(label_smoothed_loss(logits, torch::full({2, 4}, -100, torch::kLong), e, true)
                     .item<double>()));
  EXPECT_NE(mixprec::testing::error_of([&] {
              label_smoothed_loss(logits, labels.slice(1, 0, 3), e, true);
            }).find("expected labels of shape [2, 4]"),
            std::string::npos);
}

// Weight decay skips LayerNorms, biases and norms by name, as HF's (its
// get_parameter_names(model, [nn.LayerNorm], patterns) gives these three for this module).
TEST_F(TrainerTest, DecayParameterNamesFollowHf) {
  auto net = std::make_shared<torch::nn::Module>();
  for (const char* name : {"fc", "norm", "input_layernorm", "q_norm", "normal", "final_rmsnorm"})
    net->register_module(name, torch::nn::Linear(2, 2));
  net->register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({2})));
  auto frozen = net->register_module("frozen", torch::nn::Linear(2, 2));
  for (auto& p : frozen->parameters()) p.requires_grad_(false);
  Trainer trainer(net, [](const mixprec::data::Batch&) { return mixprec::models::ModelOutput{}; },
                  args("decay"), train_, eval_, {}, {}, {});
  EXPECT_EQ(trainer.get_decay_parameter_names(),
            (std::vector<std::string>{"fc.weight", "normal.weight", "frozen.weight"}));
}

// fp16_full_eval / bf16_full_eval, outside train(): the whole model evaluates in 16 bits (and
// stays there, as in HF), its predictions those of the 16-bit model.
TEST_F(TrainerTest, FullEvalRunsTheModelIn16Bits) {
  for (const bool fp16 : {true, false}) {
    const auto dtype = fp16 ? at::kHalf : at::kBFloat16;
    auto a = args(fp16 ? "full_eval_fp16" : "full_eval_bf16");
    a.fp16_full_eval = fp16;
    a.bf16_full_eval = !fp16;
    torch::manual_seed(0);
    Classifier model;
    Trainer trainer(model, a, train_, eval_, accuracy);
    const auto fp32 =
        Trainer(model, args("full_eval_fp32"), train_, eval_, accuracy).predict(eval_).predictions;
    const auto out = trainer.predict(eval_);
    for (const auto& p : model->parameters()) EXPECT_EQ(p.scalar_type(), dtype);
    EXPECT_FALSE(torch::equal(out.predictions, fp32));
    EXPECT_TRUE(torch::allclose(out.predictions, fp32, 0.05, 0.05))
        << (out.predictions - fp32).abs().max().item<double>();
  }
  // The inputs go 16-bit; what label_names names keeps its dtype (the loss compares with it).
  auto a = args("full_eval_labels");
  a.bf16_full_eval = true;
  a.label_names = std::vector<std::string>{"labels", "targets"};
  Classifier model;
  std::set<std::pair<std::string, at::ScalarType>> seen;
  auto forward = [&](const mixprec::data::Batch& batch) {
    for (const auto& [key, t] : batch) seen.emplace(key, t.scalar_type());
    return model->forward(batch);
  };
  auto with_targets = [](const std::vector<mixprec::data::Example>& examples) {
    auto batch = mixprec::data::collate(examples);
    batch["targets"] = torch::rand({static_cast<int64_t>(examples.size())});
    return batch;
  };
  Trainer(model.ptr(), forward, a, train_, eval_, accuracy, {}, with_targets).evaluate();
  EXPECT_EQ(seen, (std::set<std::pair<std::string, at::ScalarType>>{
                      {"x", at::kBFloat16}, {"labels", at::kLong}, {"targets", at::kFloat}}));
}

// train_sampling_strategy "group_by_length": each epoch's batches in the order of
// get_length_grouped_indices over randperm(seed + epoch), in megabatches of the accumulation
// window's samples; each evaluation in that of the seed, by eval batches. A resumed epoch goes on
// in the same order, so the resumed run ends where the uninterrupted one does.
TEST_F(TrainerTest, GroupByLengthOrdersBatchesByLengthAndResumes) {
  const auto [x, labels] = [] {
    auto task = mixprec::data::make_classification(
        {.n_samples = 88, .n_features = 6, .n_classes = 3, .class_sep = 2.0, .seed = 2});
    return std::pair{task.x, task.labels};
  }();
  torch::manual_seed(7);
  const at::Tensor lengths = torch::randint(1, 40, {88});
  auto dataset = [&](int64_t from, int64_t to) {
    return std::make_shared<mixprec::data::TensorDataset>(
        std::map<std::string, at::Tensor>{{"x", x.slice(0, from, to)},
                                          {"labels", labels.slice(0, from, to)},
                                          {"length", lengths.slice(0, from, to)},
                                          {"index", torch::arange(to - from)}});
  };
  const auto train = dataset(0, 48), eval = dataset(48, 88);
  auto lengths_of = [](const at::Tensor& t) {
    return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
  };
  auto a = args("grouped");
  a.train_sampling_strategy = "group_by_length";
  // Sizes whose megabatches tell the sampler's batch sizes apart: 48 samples in megabatches of
  // 8 (4 x 2 accumulated; 12 if it were 4), 40 to evaluate in megabatches of 10 (batches of 5;
  // 8 if it were training's).
  a.per_device_train_batch_size = 4;
  a.gradient_accumulation_steps = 2;
  a.per_device_eval_batch_size = 5;
  a.num_train_epochs = 3;
  a.eval_strategy = "epoch";
  a.save_strategy = "steps";
  a.save_steps = 11;  // 6 steps an epoch: checkpoint-11 is in the middle of epoch 1
  a.seed = 3;

  struct Seen {
    std::vector<int64_t> train, eval;
  };
  auto run = [&](Classifier& model, const TrainingArguments& args, Seen& seen,
                 std::optional<std::string> resume = std::nullopt) {
    auto forward = [&](const mixprec::data::Batch& batch) {
      auto& into = model->is_training() ? seen.train : seen.eval;
      const auto index = batch.at("index");
      into.insert(into.end(), index.data_ptr<int64_t>(), index.data_ptr<int64_t>() + index.numel());
      return model->forward(batch);
    };
    Trainer(model.ptr(), forward, args, train, eval, accuracy, {}, {}).train(resume);
  };
  torch::manual_seed(0);
  Classifier whole;
  Seen seen;
  run(whole, a, seen);

  std::vector<int64_t> expected_train, expected_eval;
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    const auto order = mixprec::data::get_length_grouped_indices(
        lengths_of(lengths.slice(0, 0, 48)), 8, std::nullopt,
        at::make_generator<at::CPUGeneratorImpl>(3 + epoch));
    expected_train.insert(expected_train.end(), order.begin(), order.end());
    const auto eval_order = mixprec::data::get_length_grouped_indices(
        lengths_of(lengths.slice(0, 48, 88)), 5, std::nullopt,
        at::make_generator<at::CPUGeneratorImpl>(3));
    expected_eval.insert(expected_eval.end(), eval_order.begin(), eval_order.end());
  }
  EXPECT_EQ(seen.train, expected_train);
  EXPECT_EQ(seen.eval, expected_eval);
  // The batches do group: each megabatch of 8 in descending length but for the first sample.
  for (size_t start = 0; start < 48; start += 8)
    for (size_t i = start + 2; i < start + 8; ++i)
      EXPECT_GE(lengths[seen.train[i - 1]].item<int64_t>(), lengths[seen.train[i]].item<int64_t>());

  torch::manual_seed(5);
  Classifier resumed;
  auto b = a;
  b.output_dir = (dir_ / "grouped_resumed").string();
  Seen after;
  run(resumed, b, after, (fs::path(a.output_dir) / "checkpoint-11").string());
  // Step 11 is batch 10 of epoch 1 (windows of 2 batches): from there on, the same batches.
  EXPECT_EQ(after.train,
            std::vector<int64_t>(expected_train.begin() + 48 + 10 * 4, expected_train.end()));
  EXPECT_TRUE(torch::equal(flat_params(*resumed), flat_params(*whole)));

  // Lengths from the main input's size without a length key; neither: a clear error.
  a.output_dir = (dir_ / "no_lengths").string();
  a.eval_strategy = "no";
  a.save_strategy = "no";
  Classifier model;
  EXPECT_EQ(mixprec::testing::error_of([&] {
              Trainer(model.ptr(), [&](const auto& batch) { return model->forward(batch); }, a,
                      train_, nullptr, {}, {}, {})
                  .train();
            }),
            "Trainer: train_sampling_strategy \"group_by_length\" needs each sample's 'length' "
            "(length_column_name) or a sequence 'input_ids' (the model's main input); sample 0 "
            "has keys labels, x");
  const auto fractional = std::make_shared<mixprec::data::TensorDataset>(
      std::map<std::string, at::Tensor>{{"x", x.slice(0, 0, 8)},
                                        {"labels", labels.slice(0, 0, 8)},
                                        {"length", torch::full({8}, 1.5)}});
  EXPECT_NE(mixprec::testing::error_of([&] {
              Trainer(model, a, fractional).train();
            }).find("Trainer: sample 0's 'length' (length_column_name) is not one whole number"),
            std::string::npos);
  Trainer by_main_input(model, a, train_);               // main_input_name "x": every length 6
  EXPECT_EQ(by_main_input.train().global_step, 3 * 20);  // 160 / 4 / 2 a window
}

// Several label_names: compute_metrics and predict() get each one's labels (HF's label_ids
// tuple), label_ids the first's. A batch without every one of them has no labels and no loss,
// as in HF's prediction_step, so compute_metrics is not called.
TEST_F(TrainerTest, SeveralLabelNamesGiveEachOnesLabels) {
  auto a = args("label_names");
  a.label_names = std::vector<std::string>{"labels", "targets"};
  Classifier model;
  auto with_targets = [](const std::vector<mixprec::data::Example>& examples) {
    auto batch = mixprec::data::collate(examples);
    batch["targets"] = batch.at("labels") * 10;
    return batch;
  };
  std::vector<at::Tensor> seen;
  auto metrics = [&](const mixprec::train::EvalPrediction& p) {
    seen = p.all_label_ids;
    EXPECT_TRUE(torch::equal(p.label_ids, p.all_label_ids.at(0)));
    return accuracy(p);
  };
  std::vector<at::Tensor> eval_labels;
  for (size_t i = 0; i < eval_->size(); ++i) eval_labels.push_back(eval_->get(i).at("labels"));
  const at::Tensor expected = torch::stack(eval_labels);
  Trainer trainer(
      model.ptr(), [&](const mixprec::data::Batch& b) { return model->forward(b); }, a, train_,
      eval_, metrics, {}, with_targets);
  const Metrics both = trainer.evaluate();
  EXPECT_TRUE(both.count("eval_loss") && both.count("eval_accuracy"));
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_TRUE(torch::equal(seen[0], expected));
  EXPECT_TRUE(torch::equal(seen[1], expected * 10));
  const auto predicted = trainer.predict(eval_);
  ASSERT_EQ(predicted.all_label_ids.size(), 2u);
  EXPECT_TRUE(torch::equal(predicted.label_ids, expected));
  EXPECT_TRUE(torch::equal(predicted.all_label_ids[1], expected * 10));

  a.label_names = std::vector<std::string>{"labels", "missing"};
  seen.clear();
  Trainer without(model, a, train_, eval_, metrics);
  const Metrics none = without.evaluate();
  EXPECT_FALSE(none.count("eval_loss") || none.count("eval_accuracy"));
  EXPECT_TRUE(seen.empty());
  EXPECT_FALSE(without.predict(eval_).label_ids.defined());
}

// log_level "info": HF's summary of the run, of each evaluation and of the checkpoints saved
// and deleted, on stderr. The level is the process's verbosity, as HF's set_verbosity, which
// "passive" leaves as it is.
TEST_F(TrainerTest, LogLevelInfoSaysWhatHFsTrainerSays) {
  mixprec::testing::VerbosityGuard guard;
  auto a = args("log_info");
  a.log_level = "info";
  a.save_total_limit = 1;
  Classifier model;
  ::testing::internal::CaptureStderr();
  Trainer trainer(model, a, train_, eval_, accuracy);
  trainer.train();
  const std::string err = ::testing::internal::GetCapturedStderr();
  const std::string out = a.output_dir;
  for (const std::string& lines : std::vector<std::string>{
           "***** Running training *****\n  Num examples = 160\n  Num Epochs = 4\n  Num update "
           "steps "
           "per epoch = 10\n  Instantaneous batch size per device = 16\n  Total train batch size "
           "(w. "
           "parallel, distributed & accumulation) = 16\n  Gradient Accumulation steps = 1\n  Total "
           "optimization steps = 40\n  Number of trainable parameters = 387\n",
           "\n***** Running Evaluation *****\n  Num examples = 64\n  Batch size = 32\n",
           "Saving model checkpoint to " + out + "/checkpoint-20\n",
           "Deleting older checkpoint [" + out + "/checkpoint-10] due to args.save_total_limit\n",
           std::string("\n\nTraining completed.\n\n")})
    EXPECT_NE(err.find(lines), std::string::npos) << lines << "\nnot in:\n" << err;
  auto count = [&](const std::string& text) {
    size_t n = 0;
    for (auto at = err.find(text); at != std::string::npos; at = err.find(text, at + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count("***** Running training *****"), 1u);
  EXPECT_EQ(count("***** Running Evaluation *****"), 4u);  // one an epoch
  EXPECT_EQ(count("Saving model checkpoint to "), 4u);
  EXPECT_EQ(mixprec::log::get_verbosity(), mixprec::log::Level::kInfo);

  // Numbers as Python's f"{n:,}".
  auto many = mixprec::data::make_classification(
      {.n_samples = 1200, .n_features = 6, .n_classes = 3, .class_sep = 2.0, .seed = 3});
  auto b = args("log_many");
  b.log_level = "info";
  b.max_steps = 1;
  b.eval_strategy = b.save_strategy = "no";
  ::testing::internal::CaptureStderr();
  Trainer(model, b,
          std::make_shared<mixprec::data::TensorDataset>(
              std::map<std::string, at::Tensor>{{"x", many.x}, {"labels", many.labels}}))
      .train();
  EXPECT_NE(::testing::internal::GetCapturedStderr().find("  Num examples = 1,200\n"),
            std::string::npos);

  a.log_level = "passive";
  mixprec::log::set_verbosity(mixprec::log::Level::kError);
  Trainer passive(model, a, train_, eval_, accuracy);
  EXPECT_EQ(mixprec::log::get_verbosity(), mixprec::log::Level::kError);
  ::testing::internal::CaptureStderr();
  passive.evaluate();
  EXPECT_EQ(::testing::internal::GetCapturedStderr().find("Running Evaluation"), std::string::npos);
}

TEST_F(TrainerTest, ClearErrors) {
  auto a = args("errors");
  Classifier model;
  EXPECT_NE(mixprec::testing::error_of([&] {
              Trainer(model, a, train_, nullptr);
            }).find("eval_strategy is \"epoch\" but no eval_dataset was given"),
            std::string::npos);
  a.eval_strategy = "no";
  a.eval_on_start = true;
  EXPECT_EQ(mixprec::testing::error_of([&] { Trainer(model, a, train_, nullptr).train(); }),
            "Trainer::train: eval_on_start is true but no eval_dataset was given");
  a.eval_on_start = false;
  // Label smoothing needs logits.
  a.label_smoothing_factor = 0.1;
  auto loss_only = [&](const mixprec::data::Batch& batch) {
    mixprec::models::ModelOutput out;
    out.loss = model->forward(batch).loss;
    return out;
  };
  EXPECT_EQ(mixprec::testing::error_of(
                [&] { Trainer(model.ptr(), loss_only, a, train_, nullptr, {}, {}, {}).train(); }),
            "Trainer: label_smoothing_factor smooths the model's logits, but the model returned "
            "none");
  a.label_smoothing_factor = 0;
  // As HF's compute_loss: an evaluation batch with labels must give a loss.
  auto logits_only = [&](const mixprec::data::Batch& batch) {
    return mixprec::models::ModelOutput{at::Tensor(), model->forward(batch).logits};
  };
  EXPECT_EQ(mixprec::testing::error_of([&] {
              Trainer(model.ptr(), logits_only, a, train_, eval_, {}, {}, {}).evaluate();
            }),
            "Trainer: the model did not return a loss from the inputs, only the following keys: "
            "logits. For reference, the inputs it received are labels,x.");
  Trainer trainer(model, a, train_);
  trainer.train();
  Trainer again(model, a, train_);
  EXPECT_NE(mixprec::testing::error_of([&] { again.train(); }).find("already holds checkpoints"),
            std::string::npos);
  // overwrite_output_dir: the new run replaces the checkpoints of the same steps.
  a.overwrite_output_dir = true;
  a.learning_rate *= 2;  // another run, other weights
  Trainer overwriting(model, a, train_);
  overwriting.train();
  const auto last = fs::path(a.output_dir) / "checkpoint-40";
  const auto saved = mixprec::io::load_safetensors(last / "model.safetensors");
  EXPECT_TRUE(torch::equal(saved.at("fc2.weight"), model->fc2->weight.detach()));
  EXPECT_EQ(json::parse(std::ifstream(last / "training_args.json"))["learning_rate"],
            a.learning_rate);
}

// include_num_input_tokens_seen and total_flos as HF's, carried on by a resumed run:
// "non_padding" counts attention_mask's ones, "all" input_ids' elements; total_flos is
// 6 x input_ids' elements x the parameters outside embeddings; train_tokens_per_second counts
// this run's tokens only.
TEST_F(TrainerTest, TokensSeenAndFlosCarryOnAcrossAResume) {
  torch::manual_seed(0);
  const auto ids = torch::randint(256, {8, 8});
  const auto mask =
      (torch::arange(8) < torch::tensor({3, 8, 5, 8, 2, 6, 8, 4}).unsqueeze(1)).to(torch::kLong);
  auto tokens = std::make_shared<mixprec::data::TensorDataset>(std::map<std::string, at::Tensor>{
      {"input_ids", ids}, {"labels", ids}, {"attention_mask", mask}});
  int64_t non_embedding = 0;
  const auto run = [&](const std::string& name, const std::string& counted, int64_t max_steps,
                       std::optional<std::string> resume) {
    torch::manual_seed(0);
    mixprec::models::GPT2LMHeadModel model(models_test::tiny_gpt2_config());
    non_embedding = 0;
    for (const auto& p : model->named_parameters())
      if (!p.key().ends_with("wte.weight") && !p.key().ends_with("wpe.weight"))
        non_embedding += p.value().numel();
    auto a = args(name);
    a.eval_strategy = "no";
    a.save_steps = 2;
    a.logging_steps = 1;
    a.per_device_train_batch_size = 4;
    a.max_steps = max_steps;
    a.include_num_input_tokens_seen = counted;
    a.resume_from_checkpoint = resume;
    Trainer trainer(model, a, tokens);
    trainer.train();
    return trainer.state();
  };
  const auto whole = run("tokens_whole", "non_padding", 4, std::nullopt);  // 2 epochs
  EXPECT_EQ(whole.num_input_tokens_seen, 2 * mask.sum().item<int64_t>());
  EXPECT_EQ(whole.total_flos, 6.0 * 4 * 32 * static_cast<double>(non_embedding));
  run("tokens_resumed", "non_padding", 2, std::nullopt);
  const auto resumed =
      run("tokens_resumed", "non_padding", 4, (dir_ / "tokens_resumed" / "checkpoint-2").string());
  EXPECT_EQ(resumed.num_input_tokens_seen, whole.num_input_tokens_seen);
  EXPECT_EQ(resumed.total_flos, whole.total_flos);
  const auto& at_2 = whole.log_history.at(1);
  const auto& at_4 = resumed.log_history.back().count("loss") ? resumed.log_history.back()
                                                              : resumed.log_history.rbegin()[1];
  ASSERT_EQ(at_2.at("step"), 2);
  ASSERT_EQ(at_4.at("step"), 4);
  EXPECT_NEAR(at_4.at("train_tokens_per_second") * at_4.at("train_runtime"),
              at_4.at("num_input_tokens_seen") - at_2.at("num_input_tokens_seen"), 1e-9);
  EXPECT_EQ(run("tokens_all", "all", 2, std::nullopt).num_input_tokens_seen, 2 * 4 * 8);
}

// NEFTune (neftune_noise_alpha): noise on the input embeddings while train() runs and the model
// is in training mode. The training loss moves; the evaluation at the last step equals
// evaluate() of the same weights afterwards; train() gives the model back the alpha it had (HF's
// deactivate_neftune removes its hook). A model without input embeddings is an error.
TEST_F(TrainerTest, NEFTuneNoisesTrainingOnly) {
  torch::manual_seed(0);
  const auto ids = torch::randint(256, {16, 32});
  auto tokens = std::make_shared<mixprec::data::TensorDataset>(
      std::map<std::string, at::Tensor>{{"input_ids", ids}, {"labels", ids}});
  const auto train = [&](std::optional<double> alpha) {
    torch::manual_seed(0);
    mixprec::models::GPT2LMHeadModel model(models_test::tiny_gpt2_config());
    auto a = args(alpha ? "neftune" : "plain");
    a.eval_strategy = "steps";
    a.eval_steps = 4;
    a.save_strategy = "no";
    a.per_device_train_batch_size = 4;
    a.max_steps = 4;
    a.neftune_noise_alpha = alpha;
    if (alpha) model->set_neftune_noise_alpha(1.0);  // the user's, for outside train()
    Trainer trainer(model, a, tokens, tokens);
    const double loss = trainer.train().training_loss;
    EXPECT_EQ(model->neftune_noise_alpha(), alpha ? std::optional(1.0) : std::nullopt);
    EXPECT_EQ(
        trainer.evaluate().at("eval_loss"),
        trainer.state().log_history.at(trainer.state().log_history.size() - 2).at("eval_loss"));
    return loss;
  };
  const double plain = train(std::nullopt);
  EXPECT_GT(std::abs(train(5.0) - plain), 1e-4 * plain);  // seen: 3.4e-4

  auto a = args("classifier");
  a.neftune_noise_alpha = 5.0;
  EXPECT_NE(mixprec::testing::error_of([&] {
              Trainer(Classifier(), a, train_, eval_).train();
            }).find("has no input embeddings to add the noise to"),
            std::string::npos);
}

// auto_find_batch_size: a model whose batches of more than 3 samples make LibTorch's allocator
// fail (a 1 PiB tensor, past any address space) trains at 8, then as Accelerate's search goes,
// 7, 6, 5, 4 and 3, and ends where a run started at 3 ends; its checkpoint records 3, which a
// resumed run takes. Without the argument, the allocator's error stands.
TEST_F(TrainerTest, AutoFindBatchSizeShrinksTheBatchOnOutOfMemory) {
  struct Hungry : torch::nn::Module {
    Hungry() : fc(register_module("fc", torch::nn::Linear(6, 3))) {}
    mixprec::models::ModelOutput forward(const mixprec::data::Batch& batch) {
      if (batch.at("x").size(0) > 3) at::empty({int64_t{1} << 50}, at::kByte);
      auto logits = fc(batch.at("x"));
      return {torch::nn::functional::cross_entropy(logits, batch.at("labels")), logits};
    }
    torch::nn::Linear fc;
  };
  struct Run {
    at::Tensor params;
    int64_t train_batch_size;
    std::vector<std::string> warnings;
  };
  const auto run = [&](const std::string& name, int64_t batch, bool auto_find,
                       std::optional<std::string> resume = std::nullopt) {
    torch::manual_seed(0);
    auto model = std::make_shared<Hungry>();
    auto a = args(name);
    a.eval_strategy = "no";
    a.save_strategy = "steps";
    a.save_steps = 10;
    a.max_steps = 15;
    a.per_device_train_batch_size = batch;
    a.auto_find_batch_size = auto_find;
    Trainer trainer(model, a, train_);
    mixprec::testing::CapturedWarnings warnings;
    trainer.train(resume);
    return Run{flat_params(*model), *trainer.state().train_batch_size, warnings.messages};
  };
  const auto found = run("found", 8, true);
  const auto three = run("three", 3, false);
  EXPECT_TRUE(torch::equal(found.params, three.params));
  EXPECT_EQ(found.train_batch_size, 3);
  std::vector<std::string> expected;
  for (const auto& [from, to] : {std::pair{8, 7}, {7, 6}, {6, 5}, {5, 4}, {4, 3}})
    expected.push_back("Trainer: out of memory with a batch of " + std::to_string(from) +
                       " per device; trying " + std::to_string(to) + " (auto_find_batch_size)");
  EXPECT_EQ(found.warnings, expected);
  const auto checkpoint = (dir_ / "found" / "checkpoint-10").string();
  EXPECT_EQ(json::parse(std::ifstream(checkpoint + "/trainer_state.json"))["train_batch_size"], 3);
  const auto resumed = run("found", 8, true, checkpoint);
  EXPECT_TRUE(resumed.warnings.empty());
  EXPECT_TRUE(torch::equal(resumed.params, found.params));
  EXPECT_NE(mixprec::testing::error_of([&] {
              run("not_found", 8, false);
            }).find("DefaultCPUAllocator: can't allocate memory"),
            std::string::npos);
}

// TrainingArguments::activation_checkpointing (HF's gradient_checkpointing): the same losses on
// GPT-2 with dropout, in bf16 and fp16, every layer or every second one; without
// preserve_rng_state, the recompute's dropout masks differ and so does the loss. A model without
// the capability is an error naming it.
TEST_F(TrainerTest, ActivationCheckpointingTrainsTheSame) {
  torch::manual_seed(0);
  const auto ids = torch::randint(256, {16, 32});
  auto tokens = std::make_shared<mixprec::data::TensorDataset>(
      std::map<std::string, at::Tensor>{{"input_ids", ids}, {"labels", ids}});
  // fp16 too: the recompute under fp16 autocast, the GradScaler's skipped steps.
  for (const bool fp16 : {false, true}) {
    SCOPED_TRACE(fp16 ? "fp16" : "bf16");
    const auto train = [&](bool checkpointing,
                           std::optional<mixprec::train::ActivationCheckpointingKwargs> kwargs =
                               std::nullopt) {
      auto config = models_test::tiny_gpt2_config();
      config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.1;
      torch::manual_seed(0);
      mixprec::models::GPT2LMHeadModel model(config);
      auto a = args(checkpointing ? "checkpointed" : "plain");
      a.eval_strategy = "no";
      a.save_strategy = "no";
      a.bf16 = !fp16;
      a.fp16 = fp16;
      a.activation_checkpointing = checkpointing;
      a.activation_checkpointing_kwargs = kwargs;
      a.per_device_train_batch_size = 4;
      a.max_steps = 6;
      Trainer trainer(model, a, tokens);
      EXPECT_EQ(model->is_activation_checkpointing(), checkpointing);
      return trainer.train().training_loss;
    };
    const double plain = train(false);
    EXPECT_NEAR(train(true), plain, 1e-5 * plain);
    EXPECT_NEAR(train(true, {{.every_n_layers = 2}}), plain, 1e-5 * plain);
    EXPECT_GT(std::abs(train(true, {{.preserve_rng_state = false}}) - plain), 1e-4 * plain);
  }
  // What reaches the model of activation_checkpointing_kwargs.
  struct Recording : ClassifierImpl, mixprec::models::SupportsActivationCheckpointing {
    void activation_checkpointing_enable(int64_t n, bool preserve) override {
      every_n_layers = n;
      preserve_rng_state = preserve;
    }
    void activation_checkpointing_disable() override { every_n_layers = 0; }
    bool is_activation_checkpointing() const override { return every_n_layers > 0; }
    int64_t every_n_layers = 0;
    bool preserve_rng_state = true;
  };
  auto recording = std::make_shared<Recording>();
  auto with_kwargs = args("recording");
  with_kwargs.activation_checkpointing = true;
  with_kwargs.activation_checkpointing_kwargs = {
      {.every_n_layers = 3, .preserve_rng_state = false}};
  Trainer(recording, with_kwargs, train_, eval_);
  EXPECT_EQ(recording->every_n_layers, 3);
  EXPECT_FALSE(recording->preserve_rng_state);

  auto a = args("classifier");
  a.activation_checkpointing = true;
  EXPECT_NE(mixprec::testing::error_of([&] {
              Trainer(Classifier(), a, train_, eval_);
            }).find("does not support activation checkpointing"),
            std::string::npos);
  EXPECT_TRUE(
      TrainingArguments::from_json(R"({"gradient_checkpointing": true})").activation_checkpointing);
}

}  // namespace
