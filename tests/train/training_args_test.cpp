#include "mixprec/train/training_args.h"

#include "test_util.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <unistd.h>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

namespace {

using mixprec::testing::error_of;

using mixprec::TrainingArguments;
using json = nlohmann::json;

std::string write_temp(const std::string& name, const std::string& text) {
  const auto path = std::filesystem::temp_directory_path() / (std::to_string(getpid()) + name);
  std::ofstream(path) << text;
  return path.string();
}

// After validate(), every default equals transformers' after __post_init__.
TEST(TrainingArguments, DefaultsAreTransformers) {
  const json reference = mixprec::testing::load_reference("training_args_defaults.json");
  TrainingArguments args;
  args.validate();
  const json ours = json::parse(args.to_json());
  for (const auto& [key, value] : reference["defaults"].items()) {
    ASSERT_TRUE(ours.contains(key)) << key;
    if (value.is_number())
      EXPECT_DOUBLE_EQ(ours[key].get<double>(), value.get<double>()) << key;
    else
      EXPECT_EQ(ours[key], value) << key;
  }
}

TEST(TrainingArguments, FromJsonYamlAndTheCommandLine) {
  const auto from_json = TrainingArguments::from_json(
      R"({"output_dir": "out", "fp16": true, "learning_rate": 3e-4, "eval_strategy": "epoch",
          "report_to": ["tensorboard", "jsonl"], "save_total_limit": 2})");
  EXPECT_EQ(from_json.output_dir, "out");
  EXPECT_TRUE(from_json.fp16);
  EXPECT_EQ(from_json.learning_rate, 3e-4);
  EXPECT_EQ(from_json.report_to, (std::vector<std::string>{"tensorboard", "jsonl"}));
  EXPECT_EQ(from_json.save_total_limit, 2);

  const auto yaml = write_temp("args.yaml",
                               "output_dir: results\n"
                               "bf16: true\n"
                               "num_train_epochs: 2\n"
                               "run_name: '123'\n"
                               "label_names: [labels]\n"
                               "data_seed: null\n");
  const auto from_yaml = TrainingArguments::from_file(yaml);
  EXPECT_TRUE(from_yaml.bf16);
  EXPECT_EQ(from_yaml.num_train_epochs, 2.0);
  EXPECT_EQ(from_yaml.run_name, "123");  // quoted: a string, not a number
  EXPECT_EQ(from_yaml.label_names, (std::vector<std::string>{"labels"}));

  const auto cli = TrainingArguments::parse_args(
      {"--config", yaml, "--bf16", "false", "--fp16", "--learning_rate", "1e-3", "--report_to",
       "tensorboard", "jsonl", "--max_steps=50", "--use_cpu"});
  EXPECT_EQ(cli.output_dir, "results");  // from the file
  EXPECT_FALSE(cli.bf16);                // overridden
  EXPECT_TRUE(cli.fp16);
  EXPECT_TRUE(cli.use_cpu);
  EXPECT_EQ(cli.learning_rate, 1e-3);
  EXPECT_EQ(cli.max_steps, 50);
  EXPECT_EQ(cli.report_to.size(), 2u);
  std::filesystem::remove(yaml);
}

TEST(TrainingArguments, OldNamesAreAccepted) {
  const auto args = TrainingArguments::from_json(
      R"({"evaluation_strategy": "steps", "eval_steps": 10, "warmup_ratio": 0.1})");
  EXPECT_EQ(args.eval_strategy, "steps");
  EXPECT_EQ(args.warmup_steps, 0.1);
}

TEST(TrainingArguments, DependentDefaults) {
  TrainingArguments args;
  args.eval_strategy = "steps";
  args.logging_steps = 25;
  args.load_best_model_at_end = true;
  args.save_strategy = "steps";
  args.save_steps = 50;
  args.validate();
  EXPECT_EQ(args.eval_steps, 25.0);
  EXPECT_EQ(args.metric_for_best_model, "loss");
  EXPECT_EQ(args.greater_is_better, false);
  TrainingArguments accuracy;
  accuracy.metric_for_best_model = "accuracy";
  accuracy.validate();
  EXPECT_EQ(accuracy.greater_is_better, true);
  TrainingArguments nll;  // any name ending in "loss", as HF decides
  nll.metric_for_best_model = "eval_nll_loss";
  nll.validate();
  EXPECT_EQ(nll.greater_is_better, false);
  // As HF's: a boolean is "all" or "no"; anything else than the three names is an error.
  EXPECT_EQ(TrainingArguments::from_json(R"({"include_num_input_tokens_seen": true})")
                .include_num_input_tokens_seen,
            "all");
  EXPECT_EQ(TrainingArguments::from_yaml("include_num_input_tokens_seen: true\n")
                .include_num_input_tokens_seen,
            "all");
  for (const auto& [words, expected] :
       std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--include_num_input_tokens_seen", "True"}, "all"},
           {{"--include_num_input_tokens_seen", "--seed", "1"}, "all"},
           {{"--include_num_input_tokens_seen=non_padding"}, "non_padding"},
           {{"--include_num_input_tokens_seen=yes"}, "all"},
           {{"--include_num_input_tokens_seen=all", "--include_num_input_tokens_seen", "0"},
            "no"}}) {
    EXPECT_EQ(TrainingArguments::parse_args(words).include_num_input_tokens_seen, expected)
        << words[0];
  }
  EXPECT_EQ(error_of([] {
              TrainingArguments::from_json(R"({"include_num_input_tokens_seen": "some"})");
            }),
            "TrainingArguments: include_num_input_tokens_seen 'some' is not one of \"no\", "
            "\"all\", \"non_padding\" or a boolean");
  TrainingArguments on_cpu;  // as HF's: nothing to pin for
  on_cpu.use_cpu = true;
  on_cpu.validate();
  EXPECT_FALSE(on_cpu.dataloader_pin_memory);
  EXPECT_FALSE(TrainingArguments::parse_args({"--no_dataloader_pin_memory"}).dataloader_pin_memory);
  TrainingArguments best;  // as HF's: "best" names no metric by default
  best.save_strategy = "best";
  best.validate();
  EXPECT_FALSE(best.metric_for_best_model);
}

// As HfArgumentParser: --no_<name> for the booleans that default to true, and dashes for
// underscores.
TEST(TrainingArguments, NegatedFlagsAndDashesAsHfArgumentParser) {
  const auto args = TrainingArguments::parse_args(
      {"--no_logging_nan_inf_filter", "--no-average-tokens-across-devices",
       "--per-device-train-batch-size", "4", "--eval-on-start", "--eval_delay=2"});
  EXPECT_FALSE(args.logging_nan_inf_filter);
  EXPECT_FALSE(args.average_tokens_across_devices);
  EXPECT_EQ(args.per_device_train_batch_size, 4);
  EXPECT_TRUE(args.eval_on_start);
  EXPECT_EQ(args.eval_delay, 2.0);
  EXPECT_TRUE(
      TrainingArguments::parse_args({"--no_logging_nan_inf_filter", "--logging_nan_inf_filter"})
          .logging_nan_inf_filter);
  // The last flag wins, under a name or an alias.
  EXPECT_EQ(
      TrainingArguments::parse_args({"--evaluation_strategy", "steps", "--eval_strategy", "no"})
          .eval_strategy,
      "no");
  // A boolean that defaults to false has no --no_ form; --no_ takes no value.
  EXPECT_NE(error_of([] {
              TrainingArguments::parse_args({"--no_fp16"});
            }).find("unknown argument 'no_fp16'"),
            std::string::npos);
  EXPECT_EQ(error_of([] { TrainingArguments::parse_args({"--no_logging_nan_inf_filter=false"}); }),
            "TrainingArguments: --no_logging_nan_inf_filter takes no value, got "
            "'--no_logging_nan_inf_filter=false'");
}

// HF's scheduler_specific_kwargs: each schedule's own, from JSON, YAML or JSON text on the command
// line; one the schedule does not take is an error when the arguments are read.
TEST(TrainingArguments, LrSchedulerKwargsAreTheSchedulesOwn) {
  using Kwargs = mixprec::optim::SchedulerKwargs;
  const auto cli =
      TrainingArguments::parse_args({"--lr_scheduler_type", "polynomial", "--lr_scheduler_kwargs",
                                     R"({"power": 2, "lr_end": 1e-6})"});
  EXPECT_EQ(cli.lr_scheduler_kwargs, (Kwargs{{"lr_end", 1e-6}, {"power", 2}}));
  const auto yaml = TrainingArguments::from_yaml(
      "lr_scheduler_type: cosine\nlr_scheduler_kwargs: {num_cycles: 2}\n");
  EXPECT_EQ(yaml.lr_scheduler_kwargs, (Kwargs{{"num_cycles", 2}}));
  EXPECT_EQ(TrainingArguments::from_json(yaml.to_json()).lr_scheduler_kwargs,
            yaml.lr_scheduler_kwargs);
  // warmup_stable_decay's kwargs hold strings too.
  const auto wsd = TrainingArguments::parse_args(
      {"--lr_scheduler_type", "warmup_stable_decay", "--lr_scheduler_kwargs",
       R"({"num_decay_steps": 10, "decay_type": "1-sqrt", "min_lr_ratio": 0.1})"});
  EXPECT_EQ(wsd.lr_scheduler_kwargs,
            (Kwargs{{"num_decay_steps", 10}, {"decay_type", "1-sqrt"}, {"min_lr_ratio", 0.1}}));
  EXPECT_EQ(TrainingArguments::from_json(wsd.to_json()).lr_scheduler_kwargs,
            wsd.lr_scheduler_kwargs);
  EXPECT_NE(wsd.to_json().find(R"("decay_type": "1-sqrt")"), std::string::npos) << wsd.to_json();
  EXPECT_EQ(error_of([] {
              TrainingArguments::from_json(R"({"lr_scheduler_type": "warmup_stable_decay"})");
            }),
            "warmup_stable_decay requires `num_decay_steps`; set it through the "
            "`lr_scheduler_kwargs`");
  EXPECT_EQ(error_of([] {
              TrainingArguments::from_json(
                  R"({"lr_scheduler_type": "warmup_stable_decay",
                      "lr_scheduler_kwargs": {"num_decay_steps": 5, "warmup_type": "step"}})");
            }),
            "Unknown warmup type: step, expected 'linear', 'cosine' or '1-sqrt'");
  EXPECT_EQ(error_of([] {
              TrainingArguments::from_json(
                  R"({"lr_scheduler_type": "warmup_stable_decay",
                      "lr_scheduler_kwargs": {"num_decay_steps": "5"}})");
            }),
            "lr_scheduler_kwargs: num_decay_steps must be a number, got \"5\"");
  EXPECT_EQ(error_of([] {
              TrainingArguments::from_json(
                  R"({"lr_scheduler_type": "warmup_stable_decay",
                      "lr_scheduler_kwargs": {"num_decay_steps": 5, "decay_type": 1}})");
            }),
            "lr_scheduler_kwargs: decay_type must be a string, got 1");
  EXPECT_EQ(error_of([] {
              TrainingArguments::from_json(R"({"lr_scheduler_kwargs": {"num_cycles": 2}})");
            }),
            "lr_scheduler_kwargs: the \"linear\" schedule takes no 'num_cycles' (it takes none)");
  EXPECT_EQ(error_of([] {
              TrainingArguments::from_json(
                  R"({"lr_scheduler_type": "polynomial", "lr_scheduler_kwargs": {"cycles": 2}})");
            }),
            "lr_scheduler_kwargs: the \"polynomial\" schedule takes no 'cycles' (it takes lr_end, "
            "power)");
  EXPECT_EQ(
      error_of([] {
        TrainingArguments::from_json(
            R"({"lr_scheduler_type": "inverse_sqrt", "lr_scheduler_kwargs": {"timescale": 2.5}})");
      }),
      "lr_scheduler_kwargs: timescale must be a positive integer below 2^53, got 2.5");
  EXPECT_EQ(
      error_of([] { TrainingArguments::from_json(R"({"lr_scheduler_kwargs": [1]})"); }),
      "TrainingArguments: 'lr_scheduler_kwargs' expects an object of numbers and strings, got [1] "
      "(array)");
  EXPECT_NE(error_of([] {
              TrainingArguments::parse_args({"--lr_scheduler_kwargs", "{num_cycles: 2}"});
            })
                .find("TrainingArguments (command line): 'lr_scheduler_kwargs' expects an "
                      "object of numbers and strings, got "
                      "\"{num_cycles: 2}\" (string), which is not JSON: "),
            std::string::npos);
  // cosine_with_min_lr needs one of min_lr and min_lr_rate: an error when the arguments are read.
  EXPECT_EQ(error_of([] {
              TrainingArguments::from_json(R"({"lr_scheduler_type": "cosine_with_min_lr"})");
            }),
            "One of min_lr or min_lr_rate should be set through the `lr_scheduler_kwargs`");
  // The constant schedules ignore them, as HF's, with one warning however often they are read.
  mixprec::testing::CapturedWarnings warnings;
  for (int i = 0; i < 2; ++i)
    EXPECT_NO_THROW(TrainingArguments::from_json(
        R"({"lr_scheduler_type": "constant", "lr_scheduler_kwargs": {"num_cycles": 2}})"));
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_NE(warnings.messages[0].find("ignored, as transformers ignores them: 'num_cycles'"),
            std::string::npos)
      << warnings.messages[0];
  EXPECT_EQ(error_of([] { TrainingArguments::from_json(R"({"label_smoothing_factor": 1.5})"); }),
            "TrainingArguments: label_smoothing_factor must be in [0, 1], got 1.5");
}

// HF's activation_checkpointing_kwargs (and its older name): the keys mixprec's checkpoint takes,
// from JSON, YAML or JSON text on the command line; the others are errors naming the key.
TEST(TrainingArguments, ActivationCheckpointingKwargs) {
  using mixprec::train::ActivationCheckpointingKwargs;
  const auto cli = TrainingArguments::parse_args(
      {"--activation_checkpointing", "--activation_checkpointing_kwargs",
       R"({"every_n_layers": 2, "use_reentrant": false, "offload": false})"});
  EXPECT_EQ(cli.activation_checkpointing_kwargs, (ActivationCheckpointingKwargs{2, true}));
  const auto yaml = TrainingArguments::from_yaml(
      "gradient_checkpointing: true\n"
      "gradient_checkpointing_kwargs: {preserve_rng_state: false}\n");
  EXPECT_TRUE(yaml.activation_checkpointing);
  EXPECT_EQ(yaml.activation_checkpointing_kwargs, (ActivationCheckpointingKwargs{1, false}));
  EXPECT_EQ(TrainingArguments::from_json(yaml.to_json()).activation_checkpointing_kwargs,
            yaml.activation_checkpointing_kwargs);
  EXPECT_FALSE(TrainingArguments().activation_checkpointing_kwargs.has_value());

  const std::string key = "TrainingArguments: 'activation_checkpointing_kwargs'";
  const auto error = [](const char* kwargs) {
    return error_of([&] {
      TrainingArguments::from_json(std::string(R"({"activation_checkpointing_kwargs": )") + kwargs +
                                   "}");
    });
  };
  EXPECT_EQ(error(R"({"every_n_layers": 0})"),
            "TrainingArguments: activation_checkpointing_kwargs' every_n_layers must be >= 1, "
            "got 0");
  EXPECT_EQ(error(R"({"every_n_layers": "2"})"),
            key + " key 'every_n_layers' expects an integer, got \"2\" (string)");
  EXPECT_EQ(error(R"({"use_reentrant": true})"),
            key +
                " key 'use_reentrant' is true, which mixprec does not have: its checkpoint is "
                "the non-reentrant one");
  EXPECT_NE(error(R"({"offload": true})").find("key 'offload' is true"), std::string::npos);
  EXPECT_EQ(error(R"({"debug": true})"),
            key +
                " key 'debug' is not one of every_n_layers, preserve_rng_state, "
                "use_reentrant, offload");
  EXPECT_EQ(error("2"), key + " expects an object, got 2 (number)");
}

// HF's accelerator_config: an object, its JSON text or a file; gradient_accumulation_kwargs'
// num_steps is gradient_accumulation_steps when that is 1; the fields mixprec's Trainer does
// not take are errors at any other value than HF's default.
TEST(TrainingArguments, AcceleratorConfig) {
  const auto cli = TrainingArguments::parse_args(
      {"--accelerator_config",
       R"({"gradient_accumulation_kwargs": {"num_steps": 4, "sync_each_batch": true,
           "sync_with_dataloader": false}, "non_blocking": true})"});
  ASSERT_TRUE(cli.accelerator_config.gradient_accumulation_kwargs);
  EXPECT_TRUE(cli.accelerator_config.gradient_accumulation_kwargs->sync_each_batch);
  EXPECT_TRUE(cli.accelerator_config.non_blocking);
  EXPECT_EQ(cli.gradient_accumulation_steps, 4);
  EXPECT_EQ(TrainingArguments::from_json(cli.to_json()).accelerator_config, cli.accelerator_config);

  const auto file = std::filesystem::temp_directory_path() /
                    ("mixprec_accelerator_config_" + std::to_string(getpid()) + ".yaml");
  std::ofstream(file) << "gradient_accumulation_kwargs: {sync_each_batch: true}\n";
  const auto from_file = TrainingArguments::parse_args(
      {"--gradient_accumulation_steps", "2", "--accelerator_config", file.string()});
  std::filesystem::remove(file);
  EXPECT_EQ(from_file.accelerator_config.gradient_accumulation_kwargs,
            (mixprec::train::GradientAccumulationKwargs{.sync_each_batch = true}));
  EXPECT_EQ(from_file.gradient_accumulation_steps, 2);

  const std::string key = "TrainingArguments: 'accelerator_config'";
  EXPECT_EQ(error_of([] {
              TrainingArguments::from_json(
                  R"({"gradient_accumulation_steps": 2,
                      "accelerator_config": {"gradient_accumulation_kwargs": {"num_steps": 4}}})");
            }),
            "TrainingArguments: accelerator_config's gradient_accumulation_kwargs' num_steps (4) "
            "is set but gradient_accumulation_steps is 2; set only one of them");
  auto twice = cli;  // validating again keeps num_steps (training_args.json reads back)
  twice.validate();
  EXPECT_EQ(twice.gradient_accumulation_steps, 4);
  EXPECT_FALSE(TrainingArguments::from_json(R"({"accelerator_config": null})")
                   .accelerator_config.gradient_accumulation_kwargs);
  EXPECT_EQ(error_of([] {
              TrainingArguments::from_json(R"({"accelerator_config": {"even_batches": false}})");
            }),
            "TrainingArguments: accelerator_config's even_batches = false is not supported by "
            "mixprec's Trainer, only true (HF's default)");
  const auto taken = TrainingArguments::from_json(
      R"({"accelerator_config": {"split_batches": true, "use_seedable_sampler": false}})");
  EXPECT_TRUE(taken.accelerator_config.split_batches);
  EXPECT_FALSE(taken.accelerator_config.use_seedable_sampler);
  for (const char* field : {"dispatch_batches", "use_configured_state"}) {
    EXPECT_NE(error_of([&] {
                TrainingArguments::from_json(std::string(R"({"accelerator_config": {")") + field +
                                             "\": true}}");
              }).find(std::string(field) + " = true is not supported"),
              std::string::npos)
        << field;
  }
  EXPECT_NE(error_of([] {
              TrainingArguments::from_json(
                  R"({"accelerator_config": {"gradient_accumulation_kwargs": {"num_steps": 0}}})");
            }).find("num_steps must be >= 1, got 0"),
            std::string::npos);
  EXPECT_EQ(error_of([] {
              TrainingArguments::from_json(R"({"accelerator_config": {"split_batch": true}})");
            }),
            key +
                " key 'split_batch' is not one of split_batches, dispatch_batches, "
                "even_batches, use_seedable_sampler, non_blocking, "
                "gradient_accumulation_kwargs, use_configured_state");
  EXPECT_EQ(error_of([] {
              TrainingArguments::from_json(
                  R"({"accelerator_config": {"gradient_accumulation_kwargs": {"steps": 2}}})");
            }),
            key +
                " key 'gradient_accumulation_kwargs' key 'steps' is not one of num_steps, "
                "sync_each_batch, sync_with_dataloader, adjust_scheduler");
  EXPECT_NE(error_of([] {
              TrainingArguments::from_json(R"({"accelerator_config": "no_such_file.json"})");
            }).find("no_such_file.json: cannot open"),
            std::string::npos);
}

// HF's fields that mixprec checks (with HF's and torch's errors where they have one), takes at
// one value only, or takes without effect (each says why in training_args.h).
TEST(TrainingArguments, OptimArgsAndFieldsTakenAsHfs) {
  EXPECT_EQ(mixprec::train::parse_optim_args(" momentum = 0.9, nesterov=True"),
            (std::map<std::string, std::string>{{"momentum", "0.9"}, {"nesterov", "True"}}));
  EXPECT_TRUE(mixprec::train::parse_optim_args(std::nullopt).empty());
  EXPECT_TRUE(mixprec::train::parse_optim_args("").empty());
  EXPECT_EQ(error_of([] { TrainingArguments::from_json(R"({"optim_args": "momentum=0.9,"})"); }),
            "TrainingArguments: optim_args must be key=value pairs separated by commas, got '' in "
            "'momentum=0.9,'");
  EXPECT_EQ(error_of([] { TrainingArguments::from_json(R"({"optim_args": "a=1=2"})"); }),
            "TrainingArguments: optim_args must be key=value pairs separated by commas, got "
            "'a=1=2' in 'a=1=2'");
  EXPECT_EQ(error_of([] { TrainingArguments::from_json(R"({"torch_empty_cache_steps": 0})"); }),
            "`torch_empty_cache_steps` must be an integer bigger than 0, got 0.");
  EXPECT_EQ(error_of([] { TrainingArguments::from_json(R"({"eval_accumulation_steps": -1})"); }),
            "TrainingArguments: eval_accumulation_steps must be > 0, got -1");
  for (const auto& [json, part] : std::vector<std::pair<std::string, std::string>>{
           {R"({"eval_do_concat_batches": false})",
            "eval_do_concat_batches = false is not supported by mixprec"},
           {R"({"eval_use_gather_object": true})",
            "eval_use_gather_object = true is not supported by mixprec"},
           {R"({"debug": "underflow_overflow"})",
            "not supported by mixprec; numerics_monitor_steps watches"},
           {R"({"debug": " tpu_metrics_debug"})", "debug \"tpu_metrics_debug\" is not supported"}})
    EXPECT_NE(error_of([&] { TrainingArguments::from_json(json); }).find(part), std::string::npos)
        << json;
  if (!torch::cuda::is_available()) {
    EXPECT_EQ(error_of([] { TrainingArguments::from_json(R"({"tf32": true})"); }),
              "--tf32 requires Ampere or a newer GPU arch, cuda>=11 and torch>=1.7");
  }
  EXPECT_EQ(error_of([] {
              TrainingArguments::from_json(R"({"dataloader_multiprocessing_context": "spawn"})");
            }),
            "TrainingArguments: dataloader_multiprocessing_context: multiprocessing_context can "
            "only be used with multi-process loading (num_workers > 0), but got num_workers=0");
  EXPECT_EQ(
      error_of([] {
        TrainingArguments::from_json(
            R"({"dataloader_num_workers": 2, "dataloader_multiprocessing_context": "thread"})");
      }),
      "TrainingArguments: dataloader_multiprocessing_context: multiprocessing_context option "
      "should specify a valid start method in ['fork', 'spawn', 'forkserver'], but got "
      "multiprocessing_context='thread'");
  EXPECT_EQ(error_of([] { TrainingArguments::from_json(R"({"debug": "verbose tpu"})"); }),
            "TrainingArguments: debug 'verbose' is not one of HF's options "
            "(\"underflow_overflow\", \"tpu_metrics_debug\"), which mixprec does not support "
            "either");
  EXPECT_TRUE(TrainingArguments::from_json(R"({"debug": " "})").debug.empty());
  // As HF's: evaluating sets do_eval.
  EXPECT_FALSE(TrainingArguments::from_json("{}").do_eval);
  EXPECT_TRUE(TrainingArguments::from_json(R"({"eval_strategy": "epoch"})").do_eval);
  // Every one of them at a value it takes, on the command line too, and back from to_json.
  const auto args =
      TrainingArguments::parse_args(std::vector<std::string>{"--optim",
                                                             "sgd",
                                                             "--optim_args",
                                                             "momentum=0.5",
                                                             "--torch_empty_cache_steps",
                                                             "3",
                                                             "--eval_accumulation_steps",
                                                             "2",
                                                             "--eval_do_concat_batches",
                                                             "true",
                                                             "--eval_use_gather_object",
                                                             "false",
                                                             "--tf32",
                                                             "false",
                                                             "--save_on_each_node",
                                                             "--ddp_static_graph",
                                                             "--remove_unused_columns",
                                                             "false",
                                                             "--dataloader_in_order",
                                                             "false",
                                                             "--dataloader_num_workers",
                                                             "1",
                                                             "--dataloader_multiprocessing_context",
                                                             "forkserver",
                                                             "--do_train",
                                                             "--do_predict",
                                                             "--use_cache",
                                                             "--enable_jit_checkpoint"});
  EXPECT_EQ(args.optim_args, "momentum=0.5");
  EXPECT_EQ(args.torch_empty_cache_steps, 3);
  EXPECT_EQ(args.eval_accumulation_steps, 2);
  EXPECT_EQ(args.tf32, false);
  EXPECT_TRUE(args.save_on_each_node);
  EXPECT_EQ(args.ddp_static_graph, true);
  EXPECT_FALSE(args.remove_unused_columns);
  EXPECT_FALSE(args.dataloader_in_order);
  EXPECT_EQ(args.dataloader_multiprocessing_context, "forkserver");
  EXPECT_TRUE(args.do_train && args.do_predict && args.use_cache && args.enable_jit_checkpoint);
  EXPECT_EQ(TrainingArguments::from_json(args.to_json()).to_json(), args.to_json());
}

TEST(TrainingArguments, ClearErrors) {
  EXPECT_EQ(error_of([] { TrainingArguments::from_json(R"({"learnig_rate": 0.1})"); }),
            "TrainingArguments: unknown argument 'learnig_rate'; did you mean 'learning_rate'?");
  EXPECT_EQ(error_of([] { TrainingArguments::from_json(R"({"fp16": "yes"})"); }),
            "TrainingArguments: 'fp16' expects a boolean, got \"yes\" (string)");
  EXPECT_EQ(error_of([] { TrainingArguments::from_json(R"({"seed": 1.5})"); }),
            "TrainingArguments: 'seed' expects an integer, got 1.5 (number)");
  EXPECT_EQ(error_of([] { TrainingArguments::from_json(R"({"fp16": true, "bf16": true})"); }),
            "At most one of fp16 and bf16 can be True, but not both");
  EXPECT_NE(error_of([] {
              TrainingArguments::from_json(
                  R"({"load_best_model_at_end": true, "eval_strategy": "epoch"})");
            }).find("requires the save and eval strategy to match"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              TrainingArguments::from_json(R"({"load_best_model_at_end": true,
                  "eval_strategy": "steps", "eval_steps": 30, "save_steps": 50})");
            }).find("not a round multiple of 30"),
            std::string::npos);
  // Ratios as HF compares them: 0.3 is a multiple of 0.1 (0.3 / 0.1 is 2.9999999999999996); a
  // ratio and a count cannot be compared.
  EXPECT_NO_THROW(TrainingArguments::from_json(R"({"load_best_model_at_end": true,
      "eval_strategy": "steps", "eval_steps": 0.1, "save_steps": 0.3})"));
  EXPECT_NE(error_of([] {
              TrainingArguments::from_json(R"({"load_best_model_at_end": true,
                  "eval_strategy": "steps", "eval_steps": 0.1, "save_steps": 500})");
            }).find("mixing ratio and absolute steps for save_steps 500 and eval_steps 0.1"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              TrainingArguments::from_json(R"({"eval_strategy": "sometimes"})");
            }).find("eval_strategy 'sometimes' is not one of"),
            std::string::npos);
  EXPECT_EQ(error_of([] {
              TrainingArguments::from_json(R"({"train_sampling_strategy": "batch_rebalance"})");
            }),
            "TrainingArguments: train_sampling_strategy 'batch_rebalance' is not supported by "
            "mixprec; use \"random\", \"sequential\" or \"group_by_length\"");
  EXPECT_EQ(error_of([] { TrainingArguments::from_json(R"({"log_level_replica": "verbose"})"); }),
            "TrainingArguments: log_level_replica 'verbose' is not one of \"passive\", \"detail\", "
            "\"debug\", "
            "\"info\", \"warning\", \"error\", \"critical\"");
  EXPECT_EQ(error_of([] { TrainingArguments::from_json(R"({"include_for_metrics": ["input"]})"); }),
            "TrainingArguments: include_for_metrics 'input' is not one of \"inputs\", \"loss\"");
  EXPECT_EQ(error_of([] { TrainingArguments::from_json(R"({"dataloader_prefetch_factor": 2})"); }),
            "TrainingArguments: dataloader_prefetch_factor can only be set when data is loaded in "
            "a different thread, i.e. when dataloader_num_workers > 0");
  EXPECT_EQ(error_of([] {
              TrainingArguments::from_json(
                  R"({"dataloader_num_workers": 1, "dataloader_prefetch_factor": 0})");
            }),
            "TrainingArguments: dataloader_prefetch_factor must be > 0, got 0");
  EXPECT_EQ(
      error_of([] { TrainingArguments::from_json(R"({"dataloader_persistent_workers": true})"); }),
      "TrainingArguments: dataloader_persistent_workers needs dataloader_num_workers > 0");
  EXPECT_NO_THROW(TrainingArguments::from_json(
      R"({"dataloader_num_workers": 1, "dataloader_persistent_workers": true})"));
  EXPECT_EQ(error_of([] { TrainingArguments::from_json(R"({"ddp_backend": "nccl"})"); }),
            "TrainingArguments: ddp_backend 'nccl' is not supported: mixprec's data parallel runs "
            "on \"gloo\"");
  EXPECT_EQ(error_of([] { TrainingArguments::from_json(R"({"ddp_timeout": 0})"); }),
            "TrainingArguments: ddp_timeout must be > 0 seconds, got 0");
  EXPECT_EQ(error_of([] { TrainingArguments::from_json(R"({"ddp_bucket_cap_mb": -5})"); }),
            "TrainingArguments: ddp_bucket_cap_mb must be > 0, got -5");
  EXPECT_EQ(error_of([] { TrainingArguments::from_json(R"({"ddp_comm_hook": "int8"})"); }),
            "TrainingArguments: ddp_comm_hook 'int8' is not one of \"no\", \"fp16\", \"bf16\"");
  EXPECT_NO_THROW(TrainingArguments::from_json(R"({"ddp_backend": "gloo", "ddp_timeout": 60})"));
  EXPECT_NE(error_of([] { TrainingArguments::from_json("{\"fp16\": tru"); }).find("malformed JSON"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              TrainingArguments::parse_args({"--lerning_rate", "1"});
            }).find("did you mean 'learning_rate'"),
            std::string::npos);
  EXPECT_EQ(error_of([] {
              TrainingArguments::parse_args({"--learning_rate", "fast"});
            }),
            "TrainingArguments (command line): 'learning_rate' expects a number, got \"fast\" "
            "(string)");
  // A config file's bad value names the file.
  const auto bad_value = write_temp("bad_value.yaml", "learning_rate: abc\n");
  EXPECT_EQ(error_of([&] {
              TrainingArguments::parse_args({"--config", bad_value});
            }),
            "TrainingArguments (" + bad_value +
                "): 'learning_rate' expects a number, got \"abc\" (string)");
  std::filesystem::remove(bad_value);
  // Step counts whose arithmetic would leave int64 (mixprec's bound).
  EXPECT_EQ(error_of([] {
              TrainingArguments::parse_args({"--num_train_epochs", "1e30"});
            }),
            "TrainingArguments: num_train_epochs must be a number at most 1e15, got 1e+30");
  EXPECT_EQ(error_of([] {
              TrainingArguments::parse_args({"--max_steps", "9223372036854775807"});
            }),
            "TrainingArguments: max_steps must be a number at most 1e15, got 9.22337e+18");
  const auto bad_yaml = write_temp("bad.yaml", "fp16: [true\n");
  EXPECT_NE(error_of([&] { TrainingArguments::from_file(bad_yaml); }).find("malformed YAML"),
            std::string::npos);
  std::filesystem::remove(bad_yaml);
  EXPECT_NE(
      error_of([] {
        TrainingArguments::from_file("/nonexistent/args.json");
      }).find("TrainingArguments: /nonexistent/args.json: cannot open (No such file or directory)"),
      std::string::npos);
}

// Known-bad configs, each a clear error naming the key (fuzz/ checks the same readers).
TEST(TrainingArguments, BadConfigsNameTheKey) {
  // An integral float past int64 was cast to int64 (undefined behaviour).
  EXPECT_EQ(error_of([] { TrainingArguments::from_json(R"({"seed": 1e300})"); }),
            "TrainingArguments: 'seed' expects an integer, got 1e+300 (number), which does not "
            "fit in 64 bits");
  EXPECT_NE(error_of([] {
              TrainingArguments::from_json(R"({"max_steps": 18446744073709551615})");
            }).find("which does not fit in 64 bits"),
            std::string::npos);
  EXPECT_EQ(TrainingArguments::from_json(R"({"seed": -9223372036854775808})").seed, INT64_MIN);
  EXPECT_EQ(TrainingArguments::from_json(R"({"seed": 4.0})").seed, 4);
  // YAML text: the same checks, the same messages.
  EXPECT_EQ(error_of([] { TrainingArguments::from_yaml("learnig_rate: 0.1\n"); }),
            "TrainingArguments: unknown argument 'learnig_rate'; did you mean 'learning_rate'?");
  EXPECT_EQ(error_of([] { TrainingArguments::from_yaml("fp16: 'yes'\n"); }),
            "TrainingArguments: 'fp16' expects a boolean, got \"yes\" (string)");
  EXPECT_EQ(error_of([] { TrainingArguments::from_yaml("seed: 1e300\n"); }),
            "TrainingArguments: 'seed' expects an integer, got 1e+300 (number), which does not "
            "fit in 64 bits");
  EXPECT_EQ(error_of([] { TrainingArguments::from_yaml("- fp16\n"); }),
            "TrainingArguments: expected an object of arguments, got array");
  EXPECT_NE(error_of([] { TrainingArguments::from_yaml("{fp16: true"); }).find("malformed YAML"),
            std::string::npos);
  EXPECT_EQ(TrainingArguments::from_yaml("bf16: true\nseed: 7\n").seed, 7);
  // YAML 1.2's floats without a leading digit, and its infinity (which HF reads too).
  const auto floats = TrainingArguments::from_yaml(
      "warmup_steps: .5\nweight_decay: .5e-1\n"
      "max_grad_norm: .inf\n");
  EXPECT_EQ(floats.warmup_steps, 0.5);
  EXPECT_EQ(floats.weight_decay, 0.05);
  const auto integers = TrainingArguments::from_yaml("seed: 0x1F\nlogging_steps: 0o17\n");
  EXPECT_EQ(integers.seed, 31);
  EXPECT_EQ(integers.logging_steps, 15);
  // A number of 50,000 digits is text (std::regex would have overflowed the stack on it).
  EXPECT_EQ(error_of([] { TrainingArguments::from_yaml("seed: " + std::string(50000, '1')); }),
            "TrainingArguments: 'seed' expects an integer, got \"" + std::string(196, '1') +
                "... (string)");
  EXPECT_TRUE(std::isinf(floats.max_grad_norm));
  EXPECT_EQ(error_of([] { TrainingArguments::from_yaml("seed: nan\n"); }),
            "TrainingArguments: 'seed' expects an integer, got \"nan\" (string)");
  // An anchor inside itself, and aliases that would expand to 10^7 values: errors, not a stack
  // overflow or all the memory.
  EXPECT_EQ(error_of([] { TrainingArguments::from_yaml("seed: &a [*a]\n"); }),
            "TrainingArguments: malformed YAML: nested deeper than 64 levels (an alias inside "
            "its own anchor?)");
  std::string laughs = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n";
  for (int i = 1; i <= 6; ++i)
    laughs += "a" + std::to_string(i) + ": &a" + std::to_string(i) + " [" + [&] {
      std::string items;
      for (int j = 0; j < 10; ++j) items += (j ? ", *a" : "*a") + std::to_string(i - 1);
      return items;
    }() + "]\n";
  EXPECT_EQ(error_of([&] { TrainingArguments::from_yaml(laughs); }),
            "TrainingArguments: malformed YAML: more than 1000000 values (aliases that expand?)");
  // JSON nested too deep to print is named by its type.
  const std::string deep =
      "{\"seed\": " + std::string(100000, '[') + std::string(100000, ']') + "}";
  EXPECT_EQ(error_of([&] { TrainingArguments::from_json(deep); }),
            "TrainingArguments: 'seed' expects an integer, got <array nested deeper than 64 "
            "levels> (array)");
  // Booleans as HF's string_to_bool reads them; any other word is an error.
  EXPECT_TRUE(TrainingArguments::parse_args({"--bf16=YES"}).bf16);
  EXPECT_TRUE(TrainingArguments::parse_args({"--bf16", "y"}).bf16);
  EXPECT_FALSE(TrainingArguments::parse_args({"--bf16=No"}).bf16);
  EXPECT_EQ(error_of([] { TrainingArguments::parse_args({"--fp16=garbage"}); }),
            "TrainingArguments (command line): 'fp16' expects a boolean, got \"garbage\" "
            "(string)");
  // Bytes that are not UTF-8 (found by fuzz/fuzz_training_args_yaml): the error message itself
  // threw a raw JSON error, and training_args.json could not have been written.
  EXPECT_EQ(error_of([] { TrainingArguments::from_yaml("fp16: t\x8cue\n"); }),
            "TrainingArguments: 'fp16' expects a boolean, got \"t\xEF\xBF\xBDue\" (string)");
  EXPECT_EQ(error_of([] { TrainingArguments::from_yaml("output_dir: a\x8c\n"); }),
            "TrainingArguments: 'output_dir' expects UTF-8 text, got \"a\xEF\xBF\xBD\" (string)");
  EXPECT_NE(error_of([] {
              TrainingArguments::parse_args({"--report_to", "jsonl", "\xff"});
            }).find("'report_to' expects UTF-8 text"),
            std::string::npos);
}

TEST(TrainingArguments, JsonRoundTripAndHelp) {
  auto args = TrainingArguments::from_json(R"({"fp16": true, "save_total_limit": 3})");
  const auto again = TrainingArguments::from_json(args.to_json());
  EXPECT_EQ(again.to_json(), args.to_json());
  EXPECT_TRUE(again.fp16);
  EXPECT_EQ(again.save_total_limit, 3);
  EXPECT_EQ(again.learning_rate, 5e-5);  // a default, written and read back
  const std::string help = TrainingArguments::help();
  EXPECT_NE(help.find("--learning_rate  a number (default: 5e-05)"), std::string::npos) << help;
  EXPECT_NE(help.find("--save_total_limit  an integer or null (default: null)"), std::string::npos);
}

}  // namespace
