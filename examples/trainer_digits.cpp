// Level 3: the Trainer, as in Hugging Face Transformers. The digits classifier
// of the other examples, trained from TrainingArguments (defaults, a JSON/YAML
// file, or flags) with evaluation, checkpoints and logs every epoch:
//
//   build/examples/trainer_digits                       # fp16, 5 epochs, into results/
//   build/examples/trainer_digits --bf16 --num_train_epochs 3 --report_to tensorboard jsonl
//   build/examples/trainer_digits --config args.yaml    # the file instead of these defaults
//   build/examples/trainer_digits --help                # every argument, this example's values
#include <mixprec/data/dataset.h>
#include <mixprec/models/mlp_classifier.h>
#include <mixprec/train/trainer.h>

#include "digits.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <iostream>

namespace {

mixprec::data::DatasetPtr as_dataset(const digits::Dataset& d) {
  return std::make_shared<mixprec::data::TensorDataset>(
      std::map<std::string, at::Tensor>{{"pixels", d.images}, {"labels", d.labels}});
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> flags(argv + 1, argv + argc);
  // This example's values; the command line overrides them, and a --config file replaces them
  // (HF's defaults fill what it leaves out).
  std::vector<std::string> defaults = {"--output_dir",
                                       "results",
                                       "--eval_strategy",
                                       "epoch",
                                       "--save_strategy",
                                       "epoch",
                                       "--logging_strategy",
                                       "epoch",
                                       "--num_train_epochs",
                                       "5",
                                       "--per_device_train_batch_size",
                                       "32",
                                       "--learning_rate",
                                       "3e-3",
                                       "--save_total_limit",
                                       "2",
                                       "--load_best_model_at_end",
                                       "--metric_for_best_model",
                                       "accuracy",
                                       "--overwrite_output_dir",
                                       "--use_cpu"};
  // fp16 unless bf16 is asked for (--bf16, --bf16 true, --bf16=yes, ...): both would be an error.
  bool bf16 = false;
  for (size_t i = 0; i < flags.size(); ++i) {
    std::string value;
    if (flags[i] == "--bf16")
      value = i + 1 < flags.size() && !flags[i + 1].starts_with("--") ? flags[i + 1] : "true";
    else if (flags[i].starts_with("--bf16="))
      value = flags[i].substr(7);
    else
      continue;
    bf16 = mixprec::train::string_to_bool(value).value_or(false);
  }
  if (!bf16) defaults.push_back("--fp16");
  if (std::find(flags.begin(), flags.end(), "--help") != flags.end()) {
    std::cout << "usage: trainer_digits [--config FILE] [--name value ...]\n\nThis example runs "
                 "with: "
              << c10::Join(" ", defaults) << "\n\n"
              << mixprec::TrainingArguments::help();
    return 0;
  }
  try {
    if (!flags.empty() && flags[0] == "--config") defaults.clear();
    defaults.insert(defaults.end(), flags.begin(), flags.end());
    auto args = mixprec::TrainingArguments::parse_args(defaults);

    const auto [train, validation] = digits::split(digits::load_csv("data/digits.csv"), 0);
    torch::manual_seed(static_cast<uint64_t>(args.seed));
    mixprec::models::MLPClassifier model(
        mixprec::models::MLPClassifierOptions{.in_features = 64, .hidden = 256, .num_labels = 10});
    auto accuracy = [](const mixprec::train::EvalPrediction& p) {
      return mixprec::train::Metrics{
          {"accuracy",
           p.predictions.argmax(1).eq(p.label_ids).to(torch::kFloat).mean().item<double>()}};
    };
    mixprec::Trainer trainer(model, args, as_dataset(train), as_dataset(validation), accuracy,
                             {std::make_shared<mixprec::train::EarlyStoppingCallback>(3)});
    const auto result = trainer.train();
    for (const auto& entry : trainer.state().log_history) {
      if (!entry.count("eval_accuracy")) continue;
      std::printf("epoch %.0f  eval_loss %.4f  eval_accuracy %.1f%%\n", entry.at("epoch"),
                  entry.at("eval_loss"), 100 * entry.at("eval_accuracy"));
    }
    const auto metrics = trainer.evaluate();
    std::printf("train_loss %.4f  %.0f samples/s  best checkpoint %s  final eval_accuracy %.1f%%\n",
                result.training_loss, result.metrics.at("train_samples_per_second"),
                trainer.state().best_model_checkpoint.value_or("-").c_str(),
                100 * metrics.at("eval_accuracy"));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "trainer_digits: %s\n", e.what());
    return 1;
  }
  return 0;
}
