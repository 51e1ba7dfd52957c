// The `mixprec` command: trains a built-in model on data from files with the
// Trainer, without writing C++.
//
//   mixprec train --config run.yaml [--name value ...]
//   mixprec train --help        # every argument with its default
//
// The arguments are those of HF's example scripts (run_clm.py,
// run_classification.py): model arguments, data arguments and
// TrainingArguments, in one file and/or as flags (flags win).
#include "mixprec/data/dataset.h"
#include "mixprec/data/tokenizer.h"
#include "mixprec/io/checkpoint.h"
#include "mixprec/io/safetensors.h"
#include "mixprec/models/gpt2.h"
#include "mixprec/models/mlp_classifier.h"
#include "mixprec/train/trainer.h"

#include "train/argument_parser.h"

#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>

namespace {

namespace fs = std::filesystem;
using mixprec::train::detail::argument;
using mixprec::train::detail::json;

struct ModelArguments {
  std::string model_type = "gpt2";                // "gpt2" | "mlp_classifier"
  std::optional<std::string> model_name_or_path;  // an HF folder: config.json + model.safetensors
  std::optional<std::string> config_name;         // a config.json for a new, random model
  std::optional<std::string> tokenizer_name;      // a tokenizer.json; see tokenizer_for
  int64_t hidden_size = 256;                      // mlp_classifier's hidden layers

  std::vector<mixprec::train::detail::Argument> arguments() {
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

  std::vector<mixprec::train::detail::Argument> arguments() {
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
  mixprec::TrainingArguments training;

  mixprec::train::detail::ArgumentParser parser() {
    mixprec::train::detail::ArgumentParser p("mixprec train");
    p.add_group("Model arguments", model.arguments())
        .add_group("Data arguments", data.arguments())
        .add_group("Training arguments (transformers.TrainingArguments' names and defaults)",
                   mixprec::train::detail::training_arguments(training));
    return p;
  }
};

constexpr const char* kUsage = R"(usage: mixprec train [--config FILE] [--name value ...]

Trains a built-in model with the Trainer (mixed precision, checkpoints, logs as
TrainingArguments say) and writes the model and all_results.json to output_dir.
  model_type gpt2            a causal language model on a text file: from
                             model_name_or_path (an HF folder) or config_name
                             (a config.json, random init); tokenizer_name, else
                             the model folder's tokenizer.json, else bytes.
  model_type mlp_classifier  a classifier on a CSV of numbers; the column
                             label_column_name holds class ids.
--config FILE: a .yaml or .json file of any of the arguments below; flags
after it override it.

)";

// train_file's samples and the held-out ones.
std::pair<mixprec::data::DatasetPtr, mixprec::data::DatasetPtr> split_datasets(
    const DataArguments& d,
    const std::function<mixprec::data::DatasetPtr(const std::string&)>& load, uint64_t seed) {
  TORCH_CHECK(d.train_file, "mixprec train: --train_file is required");
  auto train = load(*d.train_file);
  mixprec::data::DatasetPtr eval;
  if (d.validation_file) {
    eval = load(*d.validation_file);
  } else if (d.validation_split_percentage > 0) {
    TORCH_CHECK(d.validation_split_percentage < 100,
                "mixprec train: validation_split_percentage must be in [0, 100), got ",
                d.validation_split_percentage);
    const auto n = train->size();
    const auto n_eval = std::max<size_t>(1, n * d.validation_split_percentage / 100);
    TORCH_CHECK(n > n_eval, "mixprec train: ", *d.train_file, " has ", n,
                " samples, too few to hold out ", d.validation_split_percentage, "%");
    auto parts = mixprec::data::random_split(
        train, {static_cast<double>(n - n_eval), static_cast<double>(n_eval)}, seed);
    train = parts[0];
    eval = parts[1];
  }
  auto cap = [](mixprec::data::DatasetPtr ds, std::optional<int64_t> max) {
    if (!ds || !max || static_cast<size_t>(*max) >= ds->size()) return ds;
    std::vector<size_t> first(static_cast<size_t>(*max));
    std::iota(first.begin(), first.end(), 0);
    return mixprec::data::DatasetPtr(std::make_shared<mixprec::data::Subset>(ds, first));
  };
  return {cap(train, d.max_train_samples), cap(eval, d.max_eval_samples)};
}

std::shared_ptr<mixprec::data::Tokenizer> tokenizer_for(const ModelArguments& m) {
  std::optional<std::string> file = m.tokenizer_name;
  if (!file && m.model_name_or_path &&
      fs::exists(fs::path(*m.model_name_or_path) / "tokenizer.json"))
    file = (fs::path(*m.model_name_or_path) / "tokenizer.json").string();
  if (file)
    return std::make_shared<mixprec::data::BPETokenizer>(
        mixprec::data::BPETokenizer::from_file(*file));
  return std::make_shared<mixprec::data::ByteTokenizer>(std::vector<std::string>{"<|endoftext|>"});
}

void write_results(const fs::path& output_dir, const mixprec::train::Metrics& metrics) {
  json all = json::object();
  for (const auto& [key, value] : metrics) all[key] = value;
  fs::create_directories(output_dir);
  mixprec::io::write_file_atomically(output_dir / "all_results.json", all.dump(2) + "\n");
  for (const auto& [key, value] : metrics) std::printf("  %-28s %.6g\n", key.c_str(), value);
}

int train(Command& c) {
  auto& args = c.training;
  args.validate();
  torch::manual_seed(static_cast<uint64_t>(args.seed));
  const uint64_t seed = static_cast<uint64_t>(args.data_seed.value_or(args.seed));
  mixprec::train::Metrics results;
  int stopped_by = 0;
  auto run = [&](auto model, mixprec::data::DatasetPtr train, mixprec::data::DatasetPtr eval,
                 mixprec::train::ComputeMetrics metrics) {
    std::printf("mixprec train: %s, %zu training samples, %zu evaluation samples\n",
                c.model.model_type.c_str(), train->size(), eval ? eval->size() : 0);
    std::fflush(stdout);  // before the progress bar on stderr
    mixprec::Trainer trainer(model, args, train, eval, std::move(metrics));
    const auto output = trainer.train();
    stopped_by = output.stopped_by_signal;
    results = output.metrics;
    if (stopped_by) return;  // the Trainer saved a checkpoint and said how to resume
    if (eval)
      for (const auto& [key, value] : trainer.evaluate()) results[key] = value;
  };

  if (c.model.model_type == "gpt2") {
    mixprec::models::GPT2LMHeadModel model(nullptr);
    if (c.model.model_name_or_path) {
      model = mixprec::models::GPT2LMHeadModel::from_pretrained(*c.model.model_name_or_path);
    } else {
      TORCH_CHECK(c.model.config_name,
                  "mixprec train: gpt2 needs --model_name_or_path (an HF folder) or "
                  "--config_name (a config.json for a new model)");
      model = mixprec::models::GPT2LMHeadModel(
          mixprec::models::GPT2Config::from_json_file(*c.model.config_name));
    }
    const auto tokenizer = tokenizer_for(c.model);
    const auto& config = model->config();
    TORCH_CHECK(tokenizer->vocab_size() <= config.vocab_size, "mixprec train: the tokenizer has ",
                tokenizer->vocab_size(), " tokens, the model's vocab_size is ", config.vocab_size);
    const int64_t block_size = c.data.block_size.value_or(config.n_positions);
    TORCH_CHECK(block_size >= 2 && block_size <= config.n_positions,
                "mixprec train: block_size must be in [2, n_positions = ", config.n_positions,
                "], got ", block_size);
    auto load = [&](const std::string& path) -> mixprec::data::DatasetPtr {
      return mixprec::data::LanguageModelingDataset::from_text_file(
          path, [&](std::string_view text) { return tokenizer->encode(text); }, block_size);
    };
    auto [train, eval] = split_datasets(c.data, load, seed);
    run(model, train, eval, {});
    if (stopped_by) return 128 + stopped_by;  // as a shell reports a signal
    if (results.count("eval_loss")) results["perplexity"] = std::exp(results.at("eval_loss"));
    model->save_pretrained(args.output_dir);
  } else if (c.model.model_type == "mlp_classifier") {
    auto load = [&](const std::string& path) -> mixprec::data::DatasetPtr {
      return mixprec::data::TensorDataset::from_csv(path, c.data.label_column_name);
    };
    auto [train, eval] = split_datasets(c.data, load, seed);
    const auto first = train->get(0);
    int64_t num_labels = 2;
    for (const auto& ds : {train, eval})
      for (size_t i = 0; ds && i < ds->size(); ++i)
        num_labels = std::max(num_labels, ds->get(i).at("labels").item<int64_t>() + 1);
    mixprec::models::MLPClassifier model(
        mixprec::models::MLPClassifierOptions{.in_features = first.at("inputs").size(0),
                                              .hidden = c.model.hidden_size,
                                              .num_labels = num_labels});
    auto accuracy = [](const mixprec::train::EvalPrediction& p) {
      return mixprec::train::Metrics{
          {"accuracy",
           p.predictions.argmax(1).eq(p.label_ids).to(torch::kFloat).mean().item<double>()}};
    };
    run(model, train, eval, accuracy);
    if (stopped_by) return 128 + stopped_by;
    mixprec::io::save_safetensors(fs::path(args.output_dir) / "model.safetensors",
                                  mixprec::io::module_state(*model));
  } else {
    TORCH_CHECK(false, "mixprec train: unknown model_type '", c.model.model_type,
                "'; expected \"gpt2\" or \"mlp_classifier\"");
  }
  write_results(args.output_dir, results);
  std::printf("mixprec train: model and all_results.json in %s\n", args.output_dir.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> words(argv + 1, argv + argc);
  Command command;
  const bool help = std::find(words.begin(), words.end(), "--help") != words.end() ||
                    std::find(words.begin(), words.end(), "-h") != words.end();
  if (words.empty() || words[0] != "train") {
    std::cout << kUsage << (help ? command.parser().help() : "");
    return help ? 0 : 2;
  }
  if (help) {
    std::cout << kUsage << command.parser().help();
    return 0;
  }
  try {
    command.parser().parse_args({words.begin() + 1, words.end()});
    return train(command);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mixprec train: %s\n", e.what());
  }
  return 1;
}
