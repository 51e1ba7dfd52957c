// The `mixprec` command: trains a built-in model on data from files with the
// Trainer, without writing C++.
//
//   mixprec train --config run.yaml [--name value ...]
//   mixprec train --help        # every argument with its default
//   mixprec precision-report --config run.yaml   # fp32 vs bf16 vs fp16 (precision_report.cpp)
//
// The arguments are those of HF's example scripts (run_clm.py,
// run_classification.py): model arguments, data arguments and
// TrainingArguments, in one file and/or as flags (flags win).
#include "cli/command.h"
#include "mixprec/data/dataset.h"
#include "mixprec/data/tokenizer.h"
#include "mixprec/io/checkpoint.h"
#include "mixprec/io/safetensors.h"
#include "mixprec/models/gpt2.h"
#include "mixprec/models/mlp_classifier.h"

#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>

namespace mixprec::cli {

namespace {

namespace fs = std::filesystem;
using train::detail::json;

constexpr const char* kUsage = R"(usage: mixprec train [--config FILE] [--name value ...]
       mixprec precision-report [--config FILE] [--name value ...]   (--help: its own)

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
std::pair<data::DatasetPtr, data::DatasetPtr> split_datasets(
    const DataArguments& d, const std::function<data::DatasetPtr(const std::string&)>& load,
    uint64_t seed) {
  TORCH_CHECK(d.train_file, "mixprec train: --train_file is required");
  auto train = load(*d.train_file);
  data::DatasetPtr eval;
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
    auto parts = data::random_split(
        train, {static_cast<double>(n - n_eval), static_cast<double>(n_eval)}, seed);
    train = parts[0];
    eval = parts[1];
  }
  auto cap = [](data::DatasetPtr ds, std::optional<int64_t> max) {
    if (!ds || !max || static_cast<size_t>(*max) >= ds->size()) return ds;
    std::vector<size_t> first(static_cast<size_t>(*max));
    std::iota(first.begin(), first.end(), 0);
    return data::DatasetPtr(std::make_shared<data::Subset>(ds, first));
  };
  return {cap(train, d.max_train_samples), cap(eval, d.max_eval_samples)};
}

std::shared_ptr<data::Tokenizer> tokenizer_for(const ModelArguments& m) {
  std::optional<std::string> file = m.tokenizer_name;
  if (!file && m.model_name_or_path &&
      fs::exists(fs::path(*m.model_name_or_path) / "tokenizer.json"))
    file = (fs::path(*m.model_name_or_path) / "tokenizer.json").string();
  if (file) return std::make_shared<data::BPETokenizer>(data::BPETokenizer::from_file(*file));
  return std::make_shared<data::ByteTokenizer>(std::vector<std::string>{"<|endoftext|>"});
}

void write_results(const fs::path& output_dir, const train::Metrics& metrics) {
  json all = json::object();
  for (const auto& [key, value] : metrics) all[key] = value;
  fs::create_directories(output_dir);
  mixprec::io::write_file_atomically(output_dir / "all_results.json", all.dump(2) + "\n");
  for (const auto& [key, value] : metrics) std::printf("  %-28s %.6g\n", key.c_str(), value);
}

}  // namespace

Job make_job(Command& c) {
  auto& args = c.training;
  const uint64_t seed = static_cast<uint64_t>(args.data_seed.value_or(args.seed));
  Job job;
  auto finish = [&](auto model, data::DatasetPtr train, data::DatasetPtr eval,
                    train::ComputeMetrics metrics) {
    job.module = model.ptr();
    job.train_samples = train->size();
    job.eval_samples = eval ? eval->size() : 0;
    job.make_trainer = [=](const TrainingArguments& a) {
      return std::make_unique<Trainer>(model, a, train, eval, metrics);
    };
  };
  if (c.model.model_type == "gpt2") {
    models::GPT2LMHeadModel model(nullptr);
    if (c.model.model_name_or_path) {
      model = models::GPT2LMHeadModel::from_pretrained(*c.model.model_name_or_path);
    } else {
      TORCH_CHECK(c.model.config_name,
                  "mixprec train: gpt2 needs --model_name_or_path (an HF folder) or "
                  "--config_name (a config.json for a new model)");
      model = models::GPT2LMHeadModel(models::GPT2Config::from_json_file(*c.model.config_name));
    }
    const auto tokenizer = tokenizer_for(c.model);
    const auto& config = model->config();
    TORCH_CHECK(tokenizer->vocab_size() <= config.vocab_size, "mixprec train: the tokenizer has ",
                tokenizer->vocab_size(), " tokens, the model's vocab_size is ", config.vocab_size);
    const int64_t block_size = c.data.block_size.value_or(config.n_positions);
    TORCH_CHECK(block_size >= 2 && block_size <= config.n_positions,
                "mixprec train: block_size must be in [2, n_positions = ", config.n_positions,
                "], got ", block_size);
    auto load = [&](const std::string& path) -> data::DatasetPtr {
      return data::LanguageModelingDataset::from_text_file(
          path, [&](std::string_view text) { return tokenizer->encode(text); }, block_size);
    };
    auto [train, eval] = split_datasets(c.data, load, seed);
    finish(model, train, eval, {});
    job.save = [model](const fs::path& dir) { model->save_pretrained(dir.string()); };
    job.complete_metrics = [](train::Metrics& m) {
      if (m.count("eval_loss")) m["perplexity"] = std::exp(m.at("eval_loss"));
    };
  } else if (c.model.model_type == "mlp_classifier") {
    auto load = [&](const std::string& path) -> data::DatasetPtr {
      return data::TensorDataset::from_csv(path, c.data.label_column_name);
    };
    auto [train, eval] = split_datasets(c.data, load, seed);
    const auto first = train->get(0);
    int64_t num_labels = 2;
    for (const auto& ds : {train, eval})
      for (size_t i = 0; ds && i < ds->size(); ++i)
        num_labels = std::max(num_labels, ds->get(i).at("labels").item<int64_t>() + 1);
    models::MLPClassifier model(
        models::MLPClassifierOptions{.in_features = first.at("inputs").size(0),
                                     .hidden = c.model.hidden_size,
                                     .num_labels = num_labels});
    auto accuracy = [](const train::EvalPrediction& p) {
      return train::Metrics{
          {"accuracy",
           p.predictions.argmax(1).eq(p.label_ids).to(torch::kFloat).mean().item<double>()}};
    };
    finish(model, train, eval, accuracy);
    job.save = [model](const fs::path& dir) {
      io::save_safetensors(dir / "model.safetensors", io::module_state(*model));
    };
  } else {
    TORCH_CHECK(false, "mixprec train: unknown model_type '", c.model.model_type,
                "'; expected \"gpt2\" or \"mlp_classifier\"");
  }
  return job;
}

namespace {

int run_train(Command& c) {
  auto& args = c.training;
  args.validate();
  torch::manual_seed(static_cast<uint64_t>(args.seed));
  Job job = make_job(c);
  std::printf("mixprec train: %s, %zu training samples, %zu evaluation samples\n",
              c.model.model_type.c_str(), job.train_samples, job.eval_samples);
  std::fflush(stdout);  // before the progress bar on stderr
  auto trainer = job.make_trainer(args);
  const auto output = trainer->train();
  // The Trainer saved a checkpoint and said how to resume; exit as a shell reports a signal.
  if (output.stopped_by_signal) return 128 + output.stopped_by_signal;
  train::Metrics results = output.metrics;
  if (job.eval_samples > 0)
    for (const auto& [key, value] : trainer->evaluate()) results[key] = value;
  job.complete_metrics(results);
  fs::create_directories(args.output_dir);  // with save_strategy "no", nothing made it yet
  job.save(args.output_dir);
  write_results(args.output_dir, results);
  std::printf("mixprec train: model and all_results.json in %s\n", args.output_dir.c_str());
  return 0;
}

}  // namespace
}  // namespace mixprec::cli

int main(int argc, char** argv) {
  using mixprec::cli::kUsage;
  const std::vector<std::string> words(argv + 1, argv + argc);
  mixprec::cli::Command command;
  const bool help = std::find(words.begin(), words.end(), "--help") != words.end() ||
                    std::find(words.begin(), words.end(), "-h") != words.end();
  const std::string sub = words.empty() ? "" : words[0];
  if (sub != "train" && sub != "precision-report") {
    std::cout << kUsage << (help ? command.parser().help() : "");
    return help ? 0 : 2;
  }
  try {
    if (sub == "precision-report")
      return mixprec::cli::precision_report(command, {words.begin() + 1, words.end()});
    if (help) {
      std::cout << kUsage << command.parser().help();
      return 0;
    }
    command.parser().parse_args({words.begin() + 1, words.end()});
    return mixprec::cli::run_train(command);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mixprec %s: %s\n", sub.c_str(), e.what());
  }
  return 1;
}
