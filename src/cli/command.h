// What the `mixprec` command's subcommands share: their arguments and the
// model and data those describe. Internal to the command.
#pragma once

#include "mixprec/data/dataset.h"
#include "mixprec/train/trainer.h"

#include "train/argument_parser.h"

#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace mixprec::cli {

using train::detail::argument;

struct ModelArguments {
  std::string model_type = "gpt2";                // "gpt2" | "mlp_classifier"
  std::optional<std::string> model_name_or_path;  // an HF folder: config.json + model.safetensors
  std::optional<std::string> config_name;         // a config.json for a new, random model
  std::optional<std::string> tokenizer_name;      // a tokenizer.json; see tokenizer_for
  int64_t hidden_size = 256;                      // mlp_classifier's hidden layers

  std::vector<train::detail::Argument> arguments() {
    return {argument("model_type", model_type), argument("model_name_or_path", model_name_or_path),
            argument("config_name", config_name), argument("tokenizer_name", tokenizer_name),
            argument("hidden_size", hidden_size)};
  }
};

struct DataArguments {
  std::optional<std::string> train_file;  // gpt2: a text file; mlp_classifier: a CSV of numbers
  std::optional<std::string> validation_file;
  /// Without validation_file, this share of train_file is held out (run_clm.py's default).
  int64_t validation_split_percentage = 5;
  std::optional<int64_t> block_size;        // gpt2: tokens per sample; default n_positions
  std::string label_column_name = "label";  // mlp_classifier: the CSV's class-id column
  std::optional<int64_t> max_train_samples;
  std::optional<int64_t> max_eval_samples;

  std::vector<train::detail::Argument> arguments() {
    return {argument("train_file", train_file),
            argument("validation_file", validation_file),
            argument("validation_split_percentage", validation_split_percentage),
            argument("block_size", block_size),
            argument("label_column_name", label_column_name),
            argument("max_train_samples", max_train_samples),
            argument("max_eval_samples", max_eval_samples)};
  }
};

struct Command {
  ModelArguments model;
  DataArguments data;
  TrainingArguments training;

  train::detail::ArgumentParser parser(const std::string& name = "mixprec train") {
    train::detail::ArgumentParser p(name);
    p.add_group("Model arguments", model.arguments())
        .add_group("Data arguments", data.arguments())
        .add_group("Training arguments (transformers.TrainingArguments' names and defaults)",
                   train::detail::training_arguments(training));
    return p;
  }
};

/// The model and data `c` describes, built afresh (the model from the
/// current seed), ready for a Trainer.
struct Job {
  std::shared_ptr<torch::nn::Module> module;
  /// A Trainer on the job's model, datasets and metrics, with `args`.
  std::function<std::unique_ptr<Trainer>(const TrainingArguments& args)> make_trainer;
  /// Writes the trained model into `dir` (an HF folder, or model.safetensors).
  std::function<void(const std::filesystem::path& dir)> save;
  size_t train_samples = 0, eval_samples = 0;
  /// Adds what the metrics imply (perplexity from eval_loss).
  std::function<void(train::Metrics&)> complete_metrics = [](train::Metrics&) {};
};
Job make_job(Command& c);

/// `mixprec precision-report`: see its usage text.
int precision_report(Command& c, const std::vector<std::string>& words);

}  // namespace mixprec::cli
