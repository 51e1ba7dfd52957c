// The Trainer against transformers' Trainer (tests/reference/trainer_reference.py):
// the same task, initial weights, arguments and batch order, so every logged
// value and the final metrics can be compared.
#include "mixprec/models/gpt2.h"
#include "mixprec/models/mlp_classifier.h"
#include "mixprec/train/trainer.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

at::Tensor tensor_of(const json& values) { return torch::tensor(values.get<std::vector<float>>()); }

// Samples held in a list, as a Python dataset of dicts.
class ExampleList : public mixprec::data::Dataset {
 public:
  explicit ExampleList(std::vector<mixprec::data::Example> examples)
      : examples_(std::move(examples)) {}
  size_t size() const override { return examples_.size(); }
  mixprec::data::Example get(size_t index) const override { return examples_.at(index); }

 private:
  std::vector<mixprec::data::Example> examples_;
};

struct Tolerance {
  double rtol;           // on losses, learning rate, grad norm and parameters
  double accuracy_diff;  // on eval_accuracy, absolute
};

void expect_near_rel(double got, double expected, double rtol, const std::string& what) {
  EXPECT_NEAR(got, expected, rtol * std::abs(expected)) << what;
}

// What a checkpoint holds, by HF's files: model, optimizer, scheduler, scaler, rng,
// trainer_state, training_args (mixprec's other files are its bookkeeping).
std::set<std::string> checkpoint_contents(const std::vector<std::string>& files) {
  // mixprec's accelerator.json and custom_checkpoint.json (the step and the data position)
  // count as what HF keeps in rng_state.pth; optimizer.json is the optimizer's param groups.
  const std::map<std::string, std::string> kinds = {{"accelerator.json", "rng"},
                                                    {"custom_checkpoint.json", "rng"},
                                                    {"optimizer.json", "optimizer"},
                                                    {"checksums.json", ""},
                                                    {"model.safetensors", "model"},
                                                    {"optimizer.pt", "optimizer"},
                                                    {"optimizer.safetensors", "optimizer"},
                                                    {"scheduler.pt", "scheduler"},
                                                    {"scheduler.json", "scheduler"},
                                                    {"scaler.pt", "scaler"},
                                                    {"scaler.json", "scaler"},
                                                    {"rng_state.pth", "rng"},
                                                    {"random_states_0.safetensors", "rng"},
                                                    {"trainer_state.json", "trainer_state"},
                                                    {"training_args.bin", "training_args"},
                                                    {"training_args.json", "training_args"}};
  std::set<std::string> contents;
  for (const auto& file : files)  // an unknown file stands for itself, to be found out
    if (!kinds.count(file) || !kinds.at(file).empty())
      contents.insert(kinds.count(file) ? kinds.at(file) : file);
  return contents;
}

// `resume_from`: then a second Trainer with `resume_args` trains again from that checkpoint of
// the first, into the same folder, and is the one compared.
void compare_with_hf(const std::string& name, Tolerance tol,
                     const std::function<void(mixprec::TrainingArguments&)>& more_args = {},
                     mixprec::train::ComputeLoss compute_loss_func = {},
                     const std::string& resume_from = "",
                     const std::function<void(mixprec::TrainingArguments&)>& resume_args = {}) {
  const json ref = mixprec::testing::load_reference("trainer_reference.json");
  const json& hf = ref.at("cases").at(name);
  const int64_t n_train = ref.at("n_train"), features = ref.at("features");
  const auto x = tensor_of(ref.at("x")).reshape({-1, features});
  const auto y = torch::tensor(ref.at("y").get<std::vector<int64_t>>());
  auto part = [&](int64_t from, int64_t to) {
    return std::make_shared<mixprec::data::TensorDataset>(std::map<std::string, at::Tensor>{
        {"inputs", x.slice(0, from, to)}, {"labels", y.slice(0, from, to)}});
  };

  torch::set_num_threads(1);  // as the reference: reductions in one order
  mixprec::models::MLPClassifier model(mixprec::models::MLPClassifierOptions{
      .in_features = features, .hidden = ref.at("hidden"), .num_labels = ref.at("classes")});
  {
    torch::NoGradGuard no_grad;
    for (auto& param : model->named_parameters())
      param.value().copy_(tensor_of(ref.at("init").at(param.key())).reshape(param->sizes()));
  }

  const auto out = fs::temp_directory_path() / ("mixprec_hf_" + std::to_string(getpid()));
  mixprec::TrainingArguments args;
  args.output_dir = out.string();
  args.use_cpu = true;
  args.bf16 = name == "bf16";
  args.per_device_train_batch_size = 32;
  args.per_device_eval_batch_size = 64;
  args.num_train_epochs = 5;
  args.learning_rate = 3e-3;
  args.weight_decay = 0.01;
  args.warmup_steps = 4;
  args.eval_strategy = "epoch";
  args.logging_strategy = "epoch";
  args.save_strategy = "no";
  args.disable_tqdm = true;
  if (more_args) more_args(args);
  auto accuracy = [](const mixprec::train::EvalPrediction& p) {
    return mixprec::train::Metrics{
        {"accuracy", p.predictions.argmax(1).eq(p.label_ids).to(at::kFloat).mean().item<double>()}};
  };
  auto trainer = std::make_unique<mixprec::Trainer>(
      model, args, part(0, n_train), part(n_train, x.size(0)), accuracy,
      std::vector<std::shared_ptr<mixprec::train::TrainerCallback>>{}, mixprec::data::CollateFn{},
      compute_loss_func);
  auto result = trainer->train();
  if (!resume_from.empty()) {
    resume_args(args);
    trainer = std::make_unique<mixprec::Trainer>(
        model, args, part(0, n_train), part(n_train, x.size(0)), accuracy,
        std::vector<std::shared_ptr<mixprec::train::TrainerCallback>>{}, mixprec::data::CollateFn{},
        compute_loss_func);
    result = trainer->train((out / resume_from).string());
  }
  const auto final_eval = trainer->evaluate();
  const auto checkpoints = mixprec::testing::checkpoint_names(out);
  std::vector<std::string> files;
  if (!checkpoints.empty())
    for (const auto& entry : fs::directory_iterator(out / checkpoints.front()))
      files.push_back(entry.path().filename().string());
  fs::remove_all(out);
  EXPECT_EQ(checkpoints, hf.at("checkpoints").get<std::vector<std::string>>());
  EXPECT_EQ(checkpoint_contents(files),
            checkpoint_contents(hf.at("checkpoint_files").get<std::vector<std::string>>()));

  EXPECT_EQ(result.global_step, hf.at("global_step").get<int64_t>());
  expect_near_rel(result.training_loss, hf.at("train_loss"), tol.rtol, "train_loss");
  expect_near_rel(final_eval.at("eval_loss"), hf.at("final_eval").at("eval_loss"), tol.rtol,
                  "final eval_loss");
  EXPECT_NEAR(final_eval.at("eval_accuracy"), hf.at("final_eval").at("eval_accuracy").get<double>(),
              tol.accuracy_diff);

  // Every value HF logged, at the same epoch, in the same kind of entry.
  int compared = 0;
  for (const auto& hf_entry : hf.at("log_history")) {
    const bool is_eval = hf_entry.contains("eval_loss");
    if (!is_eval && !hf_entry.contains("loss")) continue;  // the train summary
    const auto& log = trainer->state().log_history;
    auto ours = std::find_if(log.begin(), log.end(), [&](const auto& e) {
      return e.count("epoch") && e.at("epoch") == hf_entry.at("epoch").get<double>() &&
             e.count(is_eval ? "eval_loss" : "loss");
    });
    ASSERT_NE(ours, log.end()) << "no entry like " << hf_entry.dump();
    for (const auto& [key, value] : hf_entry.items()) {
      SCOPED_TRACE("epoch " + std::to_string(ours->at("epoch")) + " " + key);
      ASSERT_TRUE(ours->count(key)) << "missing";
      if (key == "eval_accuracy")
        EXPECT_NEAR(ours->at(key), value.get<double>(), tol.accuracy_diff);
      else
        expect_near_rel(ours->at(key), value.get<double>(), tol.rtol, key);
      ++compared;
    }
  }
  // Per epoch (5), or per 2 of the 10 updates, a train entry (4 values); an eval entry (3) per
  // epoch, or at updates 3, 6, 9 and 10 ("accumulation"), 5 and 10 ("compute_loss"), or
  // ("smoothing") before the first step and from epoch 2.
  EXPECT_GE(compared, name == "accumulation"   ? 5 * 4 + 4 * 3
                      : name == "compute_loss" ? 5 * 4 + 2 * 3
                      // resumed after epoch 2's last step, before its log and evaluation
                      : name == "ignore_data_skip_at_epoch_end" ? 4 * 4 + 5 * 3
                                                                : 5 * (4 + 3));
  // No more evaluations than HF's (eval_delay skips some).
  auto evaluations = [](const auto& log) {
    return std::count_if(log.begin(), log.end(), [](const auto& e) {
      if constexpr (std::is_same_v<std::decay_t<decltype(e)>, json>)
        return e.contains("eval_loss");
      else
        return e.count("eval_loss") > 0;
    });
  };
  EXPECT_EQ(evaluations(trainer->state().log_history), evaluations(hf.at("log_history")));

  double to_hf = 0, to_hf_fp32 = 0, hf_to_hf_fp32 = 0;  // squared distances of all parameters
  for (const auto& param : model->named_parameters()) {
    const auto value = param.value().detach();
    const auto expected = tensor_of(hf.at("params").at(param.key())).reshape(value.sizes());
    EXPECT_TRUE(torch::allclose(value, expected, tol.rtol, tol.rtol))
        << param.key() << ": max diff " << (value - expected).abs().max().item<double>();
    const auto fp32 = tensor_of(ref.at("cases").at("fp32").at("params").at(param.key()));
    to_hf += (value - expected).pow(2).sum().item<double>();
    to_hf_fp32 += (value - fp32.reshape(value.sizes())).pow(2).sum().item<double>();
    hf_to_hf_fp32 += (expected - fp32.reshape(value.sizes())).pow(2).sum().item<double>();
  }
  // The tolerances alone would pass an fp32 run as bf16 (or another case's run): it must end
  // nearer HF's own run, where that differs from HF's fp32 run.
  if (hf_to_hf_fp32 > 0) {
    EXPECT_LT(to_hf, to_hf_fp32) << "nearer HF's fp32 run than its " << name;
  }
}

// fp32: the same batches in the same order and the same kernels; what is left
// is summation order inside the kernels (LibTorch C++ vs Python dispatch).
TEST(TrainerReference, Fp32MatchesTransformersTrainer) { compare_with_hf("fp32", {1e-4, 0.0}); }

// bf16 autocast: the same ops in bf16, but 8-bit mantissas amplify any
// difference in rounding over 60 steps; one eval sample may flip (1/128).
TEST(TrainerReference, Bf16MatchesTransformersTrainer) {
  compare_with_hf("bf16", {2e-2, 1.0 / 128 + 1e-9});
}

// 10 batches of 40 an epoch in accumulation windows of 4, 4 and 2, for 10 updates, logged every 2
// and evaluated by steps (CASES "accumulation" and "compute_loss" in trainer_reference.py).
void short_windows(mixprec::TrainingArguments& a) {
  a.per_device_train_batch_size = 40;
  a.gradient_accumulation_steps = 4;
  a.max_steps = 10;
  a.logging_strategy = "steps";
  a.logging_steps = 2;
  a.eval_strategy = "steps";
}

// The flow of CASES' "accumulation" in trainer_reference.py: short accumulation windows, steps
// logging, evaluation and saves with the last ones at max_steps, rotation that keeps the best
// (step 9) and deletes the newest at the end (save_total_limit 1).
TEST(TrainerReference, AccumulationStepsAndCheckpointsMatchTransformersTrainer) {
  compare_with_hf("accumulation", {1e-4, 0.0}, [](mixprec::TrainingArguments& a) {
    short_windows(a);
    a.eval_steps = 3;
    a.save_strategy = "steps";
    a.save_steps = 3;
    a.save_total_limit = 1;
    a.metric_for_best_model = "accuracy";
    a.max_grad_norm = 0;
  });
}

// HF's LabelSmoother (label_smoothing_factor 0.1, the eval loss too), eval_on_start, eval_delay
// 2 (no evaluation at epoch 1) and lr_scheduler_kwargs (a cosine of one whole wave).
TEST(TrainerReference, LabelSmoothingEvalOnStartAndDelayMatchTransformersTrainer) {
  compare_with_hf("smoothing", {1e-4, 0.0}, [](mixprec::TrainingArguments& a) {
    a.label_smoothing_factor = 0.1;
    a.eval_on_start = true;
    a.eval_delay = 2;
    a.lr_scheduler_type = "cosine";
    a.lr_scheduler_kwargs = mixprec::optim::SchedulerKwargs{{"num_cycles", 1.0}};
  });
}

// HF's compute_loss_func over accumulation windows of 4, 4 and 2 batches: it gets the window's
// labels as num_items_in_batch (the short window's too), and its loss is not divided by the
// window's length; evaluation calls it per batch.
TEST(TrainerReference, ComputeLossFuncGetsTheWindowsItemsAsTransformersTrainer) {
  std::vector<int64_t> items;
  auto summed_loss = [&](const mixprec::models::ModelOutput& outputs, const at::Tensor& labels,
                         std::optional<int64_t> num_items_in_batch) {
    EXPECT_FALSE(outputs.loss.defined());  // the model ran without its labels
    items.push_back(num_items_in_batch.value());
    return (torch::nn::functional::cross_entropy(
                outputs.logits, labels,
                torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) +
            0.01 * outputs.logits.pow(2).sum()) /
           static_cast<double>(num_items_in_batch.value());
  };
  compare_with_hf(
      "compute_loss", {1e-4, 0.0},
      [](mixprec::TrainingArguments& a) {
        short_windows(a);
        a.eval_steps = 5;
        a.save_strategy = "no";
      },
      summed_loss);
  // The first epoch's windows: 4 batches of 40 samples, 4 more, then 40 and the last 24; the
  // count of the whole window reaches each of its batches.
  ASSERT_GE(items.size(), 10u);
  EXPECT_EQ(std::vector<int64_t>(items.begin(), items.begin() + 10),
            (std::vector<int64_t>{160, 160, 160, 160, 160, 160, 160, 160, 64, 64}));
}

// Resumed from checkpoint-18 (epoch 1, batch 6 of 12) with ignore_data_skip: epoch 1 runs again
// from its first batch, in the order it had, and the run still ends at step 60, half-way
// through epoch 4 (CASES' "ignore_data_skip" in trainer_reference.py).
TEST(TrainerReference, IgnoreDataSkipRestartsTheEpochAsTransformersTrainer) {
  auto save_every_18 = [](mixprec::TrainingArguments& a) {
    a.save_strategy = "steps";
    a.save_steps = 18;
  };
  compare_with_hf("ignore_data_skip", {1e-4, 0.0}, save_every_18, {}, "checkpoint-18",
                  [](mixprec::TrainingArguments& a) { a.ignore_data_skip = true; });
}

// From checkpoint-36, saved on epoch 2's last step: epoch 3 starts, as HF's.
TEST(TrainerReference, IgnoreDataSkipAtAnEpochsEndGoesOnWithTheNextAsTransformersTrainer) {
  compare_with_hf(
      "ignore_data_skip_at_epoch_end", {1e-4, 0.0},
      [](mixprec::TrainingArguments& a) {
        a.save_strategy = "steps";
        a.save_steps = 18;
      },
      {}, "checkpoint-36", [](mixprec::TrainingArguments& a) { a.ignore_data_skip = true; });
}

// train_sampling_strategy "sequential": every epoch in the dataset's order, as HF's
// SequentialSampler.
TEST(TrainerReference, SequentialSamplingMatchesTransformersTrainer) {
  compare_with_hf("sequential", {1e-4, 0.0},
                  [](mixprec::TrainingArguments& a) { a.train_sampling_strategy = "sequential"; });
}

// optim "sgd" with optim_args: HF's momentum, nesterov and dampening reach torch's SGD, and its
// weight_decay is overridden by each parameter group's, as under HF.
TEST(TrainerReference, SgdOptimArgsMatchTransformersTrainer) {
  compare_with_hf("sgd_optim_args", {1e-4, 0.0}, [](mixprec::TrainingArguments& a) {
    a.optim = "sgd";
    a.learning_rate = 0.05;
    a.optim_args = "momentum=0.9, nesterov=True, weight_decay=0.5";
  });
  compare_with_hf("sgd_dampening", {1e-4, 0.0}, [](mixprec::TrainingArguments& a) {
    a.optim = "sgd";
    a.learning_rate = 0.05;
    a.optim_args = "momentum=0.9,dampening=0.5";
  });
}

// accelerator_config's use_seedable_sampler = false: each epoch's order from torch's global
// generator, as torch's RandomSampler draws it (the evaluations between epochs draw from it too).
TEST(TrainerReference, RandomSamplerMatchesTransformersTrainer) {
  compare_with_hf("random_sampler", {1e-4, 0.0}, [](mixprec::TrainingArguments& a) {
    a.accelerator_config.use_seedable_sampler = false;
  });
}

// save_only_model: checkpoints of the model and the Trainer's state, nothing to resume the
// optimizer, schedule or generators from, as HF's.
TEST(TrainerReference, SaveOnlyModelCheckpointsHoldWhatTransformersTrainersDo) {
  compare_with_hf("save_only_model", {1e-4, 0.0}, [](mixprec::TrainingArguments& a) {
    a.save_strategy = "steps";
    a.save_steps = 18;
    a.save_only_model = true;
  });
}

// The tiny GPT-2 on sequences padded with -100 labels, in accumulation windows of 2, 2 and 1
// batches (trainer_reference.py's "gpt2"): as HF's for a causal LM, the loss of a window is the
// sum over its label tokens divided by their number (num_items_in_batch), not the mean of its
// batches' means. `key` "gpt2_label_smoothing": the same through HF's LabelSmoother;
// "gpt2_group_by_length": sequences of their own lengths, in batches grouped by length.
void compare_gpt2_with_hf(const std::string& key, double label_smoothing_factor,
                          bool group_by_length = false) {
  const json hf = mixprec::testing::load_reference("trainer_reference.json").at(key);
  const fs::path tiny = fs::path(MIXPREC_REFERENCE_DIR) / "gpt2_tiny";
  auto config = mixprec::models::GPT2Config::from_json_file(tiny / "config.json");
  config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0;
  mixprec::models::GPT2LMHeadModel model(config);
  {
    torch::NoGradGuard no_grad;
    const auto pretrained = mixprec::models::GPT2LMHeadModel::from_pretrained(tiny);
    const auto weights = pretrained->named_parameters();
    for (auto& param : model->named_parameters()) param.value().copy_(weights[param.key()]);
  }
  // Sample i: {"input_ids": (T_i), "labels": (T_i)}, padded per batch by collate() (as HF's run
  // pads them) where their lengths differ.
  std::vector<mixprec::data::Example> examples;
  for (size_t i = 0; i < hf.at("input_ids").size(); ++i)
    examples.push_back(
        {{"input_ids", torch::tensor(hf.at("input_ids")[i].get<std::vector<int64_t>>())},
         {"labels", torch::tensor(hf.at("labels")[i].get<std::vector<int64_t>>())}});
  const auto data = std::make_shared<ExampleList>(std::move(examples));

  torch::set_num_threads(1);
  const auto out = fs::temp_directory_path() / ("mixprec_hf_gpt2_" + std::to_string(getpid()));
  mixprec::TrainingArguments args;
  args.output_dir = out.string();
  args.use_cpu = true;
  args.per_device_train_batch_size = 2;
  args.gradient_accumulation_steps = 2;
  args.per_device_eval_batch_size = group_by_length ? 3 : 4;  // as the reference's
  args.num_train_epochs = 2;
  args.learning_rate = group_by_length ? 1e-3 : 1e-2;  // as the reference's
  args.lr_scheduler_type = "constant";
  args.logging_strategy = "steps";
  args.logging_steps = 1;
  args.eval_strategy = "no";
  args.save_strategy = "no";
  args.include_num_input_tokens_seen = "all";
  args.disable_tqdm = true;
  args.label_smoothing_factor = label_smoothing_factor;
  if (group_by_length) args.train_sampling_strategy = "group_by_length";
  mixprec::Trainer trainer(model, args, data);
  const auto result = trainer.train();
  const double eval_loss = trainer.evaluate(data).at("eval_loss");
  fs::remove_all(out);

  EXPECT_EQ(result.global_step, hf.at("global_step").get<int64_t>());
  expect_near_rel(result.training_loss, hf.at("train_loss"), 1e-4, "train_loss");
  expect_near_rel(eval_loss, hf.at("eval_loss"), 1e-4, "eval_loss");
  // 6 x tokens x non-embedding parameters, as HF's floating_point_ops; the tokens trained on.
  EXPECT_EQ(trainer.state().total_flos, hf.at("total_flos").get<double>());
  EXPECT_EQ(trainer.state().num_input_tokens_seen, hf.at("num_input_tokens_seen").get<int64_t>());
  const auto& log = trainer.state().log_history;
  size_t compared = 0;
  for (const auto& hf_entry : hf.at("log_history")) {
    auto ours = std::find_if(log.begin(), log.end(), [&](const auto& e) {
      return e.count("loss") && e.at("epoch") == hf_entry.at("epoch").get<double>();
    });
    ASSERT_NE(ours, log.end()) << "no entry like " << hf_entry.dump();
    for (const char* key : {"loss", "grad_norm"}) {
      expect_near_rel(ours->at(key), hf_entry.at(key), 1e-4,
                      key + (" at epoch " + std::to_string(ours->at("epoch"))));
      ++compared;
    }
    EXPECT_EQ(ours->at("num_input_tokens_seen"), hf_entry.at("num_input_tokens_seen"));
    EXPECT_TRUE(ours->count("train_tokens_per_second"));
  }
  EXPECT_EQ(compared, 2 * hf.at("log_history").size());
  EXPECT_EQ(hf.at("log_history").size(), static_cast<size_t>(result.global_step));
  for (const auto& param : model->named_parameters()) {
    const auto& sums = hf.at("param_sums").at(param.key());
    auto value = param.value().detach().to(at::kDouble);
    // Without the key bias, as the reference: its gradient is rounding noise (softmax ignores
    // a constant added to every score), which Adam turns into steps of lr either way.
    if (param.key().ends_with("c_attn.bias")) {
      const auto qkv = value.chunk(3);
      value = torch::cat({qkv[0], qkv[2]});
    }
    const double sum_sq = sums[1].get<double>();
    EXPECT_NEAR(value.sum().item<double>(), sums[0].get<double>(), 1e-4 * std::sqrt(sum_sq))
        << param.key();
    expect_near_rel(value.pow(2).sum().item<double>(), sum_sq, 1e-4, param.key());
  }
}

TEST(TrainerReference, Gpt2AccumulationWeighsEveryTokenAsTransformersTrainer) {
  compare_gpt2_with_hf("gpt2", 0);
}

TEST(TrainerReference, Gpt2LabelSmoothingShiftsLabelsAsTransformersTrainer) {
  compare_gpt2_with_hf("gpt2_label_smoothing", 0.1);
}

// HF's LengthGroupedSampler: megabatches of the accumulation window's samples sorted by length,
// the longest first; the tokens seen count the padded batches, so they match only if every
// batch holds the same sequences as HF's. The evaluation is grouped too, in the order of the
// seed.
TEST(TrainerReference, Gpt2GroupByLengthBatchesAsTransformersTrainer) {
  compare_gpt2_with_hf("gpt2_group_by_length", 0, /*group_by_length=*/true);
}

}  // namespace
