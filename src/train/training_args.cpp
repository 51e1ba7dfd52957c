#include "mixprec/train/training_args.h"

#include "mixprec/optim/lr_scheduler.h"

#include "argument_parser.h"

#include <c10/util/Exception.h>
#include <torch/cuda.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <sstream>
#include <tuple>

namespace mixprec::train {

namespace {

// Text, or as HF's a boolean: true is "all", false "no"; alone on the command line, true
// (then --include_num_input_tokens_seen=non_padding names the other value).
detail::Argument include_num_input_tokens_seen(TrainingArguments& a) {
  auto arg = detail::argument("include_num_input_tokens_seen", a.include_num_input_tokens_seen);
  arg.type = "\"no\", \"all\", \"non_padding\" or a boolean";
  arg.is_bool = true;
  arg.from_words = [](const std::vector<std::string>& words) {
    return words.empty() ? nlohmann::json(true) : nlohmann::json(words[0]);
  };
  arg.assign = [&a, text = arg.assign](const nlohmann::json& v, const std::string& prefix) {
    if (v.is_boolean())
      a.include_num_input_tokens_seen = v.get<bool>() ? "all" : "no";
    else
      text(v, prefix);
  };
  return arg;
}

}  // namespace

// Every field, by name: one list drives JSON, YAML, the command line, help
// and training_args.json.
std::vector<detail::Argument> detail::training_arguments(TrainingArguments& a) {
  using detail::argument;
  return {
      argument("output_dir", a.output_dir),
      argument("do_train", a.do_train),
      argument("do_eval", a.do_eval),
      argument("do_predict", a.do_predict),
      argument("overwrite_output_dir", a.overwrite_output_dir),
      argument("eval_strategy", a.eval_strategy, {"evaluation_strategy"}),
      argument("eval_steps", a.eval_steps),
      argument("eval_delay", a.eval_delay),
      argument("eval_on_start", a.eval_on_start),
      argument("fp16", a.fp16),
      argument("bf16", a.bf16),
      argument("fp16_full_eval", a.fp16_full_eval),
      argument("bf16_full_eval", a.bf16_full_eval),
      argument("tf32", a.tf32),
      argument("per_device_train_batch_size", a.per_device_train_batch_size),
      argument("per_device_eval_batch_size", a.per_device_eval_batch_size),
      argument("prediction_loss_only", a.prediction_loss_only),
      argument("include_for_metrics", a.include_for_metrics),
      argument("batch_eval_metrics", a.batch_eval_metrics),
      argument("eval_accumulation_steps", a.eval_accumulation_steps),
      argument("eval_do_concat_batches", a.eval_do_concat_batches),
      argument("eval_use_gather_object", a.eval_use_gather_object),
      argument("auto_find_batch_size", a.auto_find_batch_size),
      argument("gradient_accumulation_steps", a.gradient_accumulation_steps),
      argument("torch_empty_cache_steps", a.torch_empty_cache_steps),
      argument("accelerator_config", a.accelerator_config),
      argument("activation_checkpointing", a.activation_checkpointing, {"gradient_checkpointing"}),
      argument("activation_checkpointing_kwargs", a.activation_checkpointing_kwargs,
               {"gradient_checkpointing_kwargs"}),
      argument("learning_rate", a.learning_rate),
      argument("weight_decay", a.weight_decay),
      argument("adam_beta1", a.adam_beta1),
      argument("adam_beta2", a.adam_beta2),
      argument("adam_epsilon", a.adam_epsilon),
      argument("max_grad_norm", a.max_grad_norm),
      argument("num_train_epochs", a.num_train_epochs),
      argument("max_steps", a.max_steps),
      argument("lr_scheduler_type", a.lr_scheduler_type),
      argument("lr_scheduler_kwargs", a.lr_scheduler_kwargs),
      argument("warmup_steps", a.warmup_steps, {"warmup_ratio"}),  // below 1: a ratio
      argument("logging_strategy", a.logging_strategy),
      argument("logging_steps", a.logging_steps),
      argument("logging_first_step", a.logging_first_step),
      argument("logging_nan_inf_filter", a.logging_nan_inf_filter),
      argument("save_strategy", a.save_strategy),
      argument("save_steps", a.save_steps),
      argument("save_total_limit", a.save_total_limit),
      argument("save_only_model", a.save_only_model),
      argument("save_on_each_node", a.save_on_each_node),
      argument("load_best_model_at_end", a.load_best_model_at_end),
      argument("metric_for_best_model", a.metric_for_best_model),
      argument("greater_is_better", a.greater_is_better),
      argument("label_smoothing_factor", a.label_smoothing_factor),
      argument("neftune_noise_alpha", a.neftune_noise_alpha),
      argument("seed", a.seed),
      argument("full_determinism", a.full_determinism),
      argument("data_seed", a.data_seed),
      argument("train_sampling_strategy", a.train_sampling_strategy),
      argument("log_level", a.log_level),
      argument("log_level_replica", a.log_level_replica),
      argument("log_on_each_node", a.log_on_each_node),
      argument("length_column_name", a.length_column_name),
      argument("dataloader_num_workers", a.dataloader_num_workers),
      argument("dataloader_drop_last", a.dataloader_drop_last),
      argument("dataloader_prefetch_factor", a.dataloader_prefetch_factor),
      argument("dataloader_persistent_workers", a.dataloader_persistent_workers),
      argument("dataloader_pin_memory", a.dataloader_pin_memory),
      argument("dataloader_in_order", a.dataloader_in_order),
      argument("dataloader_multiprocessing_context", a.dataloader_multiprocessing_context),
      argument("remove_unused_columns", a.remove_unused_columns),
      argument("average_tokens_across_devices", a.average_tokens_across_devices),
      include_num_input_tokens_seen(a),
      argument("optim", a.optim),
      argument("optim_args", a.optim_args),
      argument("report_to", a.report_to),
      argument("use_cache", a.use_cache),
      argument("enable_jit_checkpoint", a.enable_jit_checkpoint),
      argument("debug", a.debug),
      argument("resume_from_checkpoint", a.resume_from_checkpoint),
      argument("ignore_data_skip", a.ignore_data_skip),
      argument("restore_callback_states_from_checkpoint",
               a.restore_callback_states_from_checkpoint),
      argument("disable_tqdm", a.disable_tqdm),
      argument("use_cpu", a.use_cpu),
      argument("ddp_find_unused_parameters", a.ddp_find_unused_parameters),
      argument("ddp_bucket_cap_mb", a.ddp_bucket_cap_mb),
      argument("ddp_broadcast_buffers", a.ddp_broadcast_buffers),
      argument("ddp_static_graph", a.ddp_static_graph),
      argument("ddp_backend", a.ddp_backend),
      argument("ddp_timeout", a.ddp_timeout),
      argument("ddp_comm_hook", a.ddp_comm_hook),
      argument("label_names", a.label_names),
      argument("run_name", a.run_name),
      argument("skip_memory_metrics", a.skip_memory_metrics),
      argument("numerics_monitor_steps", a.numerics_monitor_steps),
  };
}

namespace {

bool one_of(const std::string& value, std::initializer_list<const char*> allowed) {
  return std::any_of(allowed.begin(), allowed.end(), [&](const char* a) { return value == a; });
}

// The fields the Trainer takes at HF's defaults only; gradient_accumulation_kwargs' num_steps
// read as gradient_accumulation_steps, as HF's Trainer reads it.
void validate_accelerator_config(TrainingArguments& a) {
  const auto& c = a.accelerator_config;
  for (const auto& [name, value, default_value] :
       {std::tuple{"dispatch_batches", c.dispatch_batches.value_or(false), false},
        std::tuple{"even_batches", c.even_batches, true},
        std::tuple{"use_configured_state", c.use_configured_state, false}})
    TORCH_CHECK(value == default_value, "TrainingArguments: accelerator_config's ", name, " = ",
                value ? "true" : "false", " is not supported by mixprec's Trainer, only ",
                default_value ? "true" : "false", " (HF's default)");
  if (!c.gradient_accumulation_kwargs || !c.gradient_accumulation_kwargs->num_steps) return;
  const int64_t num_steps = *c.gradient_accumulation_kwargs->num_steps;
  TORCH_CHECK(num_steps >= 1,
              "TrainingArguments: accelerator_config's gradient_accumulation_kwargs' num_steps "
              "must be >= 1, got ",
              num_steps);
  // HF's error when gradient_accumulation_steps is also set; the same value passes, so that
  // validating twice, or reading back training_args.json, works.
  TORCH_CHECK(a.gradient_accumulation_steps == 1 || a.gradient_accumulation_steps == num_steps,
              "TrainingArguments: accelerator_config's gradient_accumulation_kwargs' num_steps (",
              num_steps, ") is set but gradient_accumulation_steps is ",
              a.gradient_accumulation_steps, "; set only one of them");
  a.gradient_accumulation_steps = num_steps;
}

}  // namespace

std::map<std::string, std::string> parse_optim_args(const std::optional<std::string>& optim_args) {
  std::map<std::string, std::string> parsed;
  if (!optim_args || optim_args->empty()) return parsed;
  std::string text = *optim_args;
  std::erase(text, ' ');
  for (size_t start = 0;;) {  // as Python's split(","): "a=1," ends in an empty pair
    const size_t comma = text.find(',', start);
    const std::string pair = text.substr(start, comma - start);
    const size_t equals = pair.find('=');
    TORCH_CHECK(equals != std::string::npos && pair.find('=', equals + 1) == std::string::npos,
                "TrainingArguments: optim_args must be key=value pairs separated by commas, got '",
                pair, "' in '", *optim_args, "'");
    parsed[pair.substr(0, equals)] = pair.substr(equals + 1);
    if (comma == std::string::npos) return parsed;
    start = comma + 1;
  }
}

void TrainingArguments::validate() {
  for (const auto& [name, value] : {std::pair{"eval_strategy", &eval_strategy},
                                    std::pair{"logging_strategy", &logging_strategy}}) {
    TORCH_CHECK(one_of(*value, {"no", "steps", "epoch"}), "TrainingArguments: ", name, " '", *value,
                "' is not one of \"no\", \"steps\", \"epoch\"");
  }
  TORCH_CHECK(one_of(save_strategy, {"no", "steps", "epoch", "best"}),
              "TrainingArguments: save_strategy '", save_strategy,
              "' is not one of \"no\", \"steps\", \"epoch\", \"best\"");
  TORCH_CHECK(numerics_monitor_steps >= 0,
              "TrainingArguments: numerics_monitor_steps must be >= 0 (0 = off), got ",
              numerics_monitor_steps);
  const auto& schedulers = optim::scheduler_types();
  TORCH_CHECK(
      std::find(schedulers.begin(), schedulers.end(), lr_scheduler_type) != schedulers.end(),
      "TrainingArguments: unknown lr_scheduler_type '", lr_scheduler_type, "'");
  {  // checked now rather than when train() makes the schedule
    optim::SchedulerOptions options;
    optim::set_scheduler_kwargs(options, lr_scheduler_type,
                                lr_scheduler_kwargs.value_or(optim::SchedulerKwargs{}));
  }
  // LibTorch's cross-entropy would refuse it at the first step.
  TORCH_CHECK(label_smoothing_factor >= 0 && label_smoothing_factor <= 1,
              "TrainingArguments: label_smoothing_factor must be in [0, 1], got ",
              label_smoothing_factor);
  TORCH_CHECK(one_of(optim, {"adamw_torch", "adamw_torch_fused", "sgd"}),
              "TrainingArguments: optim '", optim,
              "' is not one of \"adamw_torch\", \"adamw_torch_fused\", \"sgd\"");
  parse_optim_args(optim_args);  // its errors now rather than when train() makes the optimizer
  TORCH_CHECK(torch_empty_cache_steps.value_or(1) > 0,
              "`torch_empty_cache_steps` must be an integer bigger than 0, got ",
              torch_empty_cache_steps.value_or(0), ".");
  // mixprec's check (HF would divide by it during the evaluation).
  TORCH_CHECK(eval_accumulation_steps.value_or(1) > 0,
              "TrainingArguments: eval_accumulation_steps must be > 0, got ",
              eval_accumulation_steps.value_or(0));
  TORCH_CHECK(eval_do_concat_batches,
              "TrainingArguments: eval_do_concat_batches = false is not supported by mixprec: "
              "EvalPrediction holds each output as one tensor over all batches");
  TORCH_CHECK(!eval_use_gather_object,
              "TrainingArguments: eval_use_gather_object = true is not supported by mixprec: "
              "the evaluation's outputs are tensors, gathered as tensors");
  // HF's message: TF32 needs CUDA (and an Ampere GPU, which torch then checks).
  TORCH_CHECK(!tf32.value_or(false) || torch::cuda::is_available(),
              "--tf32 requires Ampere or a newer GPU arch, cuda>=11 and torch>=1.7");
  for (const auto& r : report_to)
    TORCH_CHECK(one_of(r, {"tensorboard", "jsonl", "none", "all"}),
                "TrainingArguments: report_to '", r,
                "' is not one of \"tensorboard\", \"jsonl\", \"none\", \"all\"");
  // As transformers: "none" means no tracker, "all" every one there is.
  std::vector<std::string> trackers;
  for (const auto& r : report_to) {
    if (r == "all")
      trackers = {"tensorboard", "jsonl"};
    else if (r != "none" && std::find(trackers.begin(), trackers.end(), r) == trackers.end())
      trackers.push_back(r);
  }
  report_to = trackers;
  TORCH_CHECK(train_sampling_strategy != "batch_rebalance",
              "TrainingArguments: train_sampling_strategy 'batch_rebalance' is not supported by "
              "mixprec; use \"random\", \"sequential\" or \"group_by_length\"");
  TORCH_CHECK(one_of(train_sampling_strategy, {"random", "sequential", "group_by_length"}),
              "TrainingArguments: train_sampling_strategy '", train_sampling_strategy,
              "' is not one of \"random\", \"sequential\", \"group_by_length\", "
              "\"batch_rebalance\"");
  for (const std::string* level : {&log_level, &log_level_replica})
    TORCH_CHECK(
        one_of(*level, {"passive", "detail", "debug", "info", "warning", "error", "critical"}),
        "TrainingArguments: ", level == &log_level ? "log_level" : "log_level_replica", " '",
        *level,
        "' is not one of \"passive\", \"detail\", \"debug\", \"info\", \"warning\", \"error\", "
        "\"critical\"");
  // HF ignores other names; a typo here would silently give compute_metrics nothing.
  for (const auto& name : include_for_metrics)
    TORCH_CHECK(one_of(name, {"inputs", "loss"}), "TrainingArguments: include_for_metrics '", name,
                "' is not one of \"inputs\", \"loss\"");
  // As HF's command line reads a boolean (strtobool).
  std::string tokens_seen = include_num_input_tokens_seen;
  std::transform(tokens_seen.begin(), tokens_seen.end(), tokens_seen.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  if (one_of(tokens_seen, {"true", "t", "yes", "y", "1"})) include_num_input_tokens_seen = "all";
  if (one_of(tokens_seen, {"false", "f", "n", "0"})) include_num_input_tokens_seen = "no";
  TORCH_CHECK(one_of(include_num_input_tokens_seen, {"no", "all", "non_padding"}),
              "TrainingArguments: include_num_input_tokens_seen '", include_num_input_tokens_seen,
              "' is not one of \"no\", \"all\", \"non_padding\" or a boolean");
  TORCH_CHECK(!(fp16 && bf16), "At most one of fp16 and bf16 can be True, but not both");
  TORCH_CHECK(!(fp16_full_eval && bf16_full_eval),
              "At most one of fp16 and bf16 can be True for full eval, but not both");
  TORCH_CHECK(per_device_train_batch_size >= 1 && per_device_eval_batch_size >= 1,
              "TrainingArguments: batch sizes must be >= 1, got per_device_train_batch_size=",
              per_device_train_batch_size,
              " per_device_eval_batch_size=", per_device_eval_batch_size);
  TORCH_CHECK(gradient_accumulation_steps >= 1,
              "TrainingArguments: gradient_accumulation_steps must be >= 1, got ",
              gradient_accumulation_steps);
  validate_accelerator_config(*this);
  TORCH_CHECK(
      !activation_checkpointing_kwargs || activation_checkpointing_kwargs->every_n_layers >= 1,
      "TrainingArguments: activation_checkpointing_kwargs' every_n_layers must be >= 1, "
      "got ",
      activation_checkpointing_kwargs ? activation_checkpointing_kwargs->every_n_layers : 0);
  TORCH_CHECK(dataloader_num_workers >= 0,
              "TrainingArguments: dataloader_num_workers must be >= 0, got ",
              dataloader_num_workers);
  // HF's message, and torch's DataLoader's for persistent_workers.
  TORCH_CHECK(dataloader_num_workers > 0 || !dataloader_prefetch_factor,
              "TrainingArguments: dataloader_prefetch_factor can only be set when data is loaded "
              "in a different thread, i.e. when dataloader_num_workers > 0");
  TORCH_CHECK(!dataloader_prefetch_factor || *dataloader_prefetch_factor > 0,
              "TrainingArguments: dataloader_prefetch_factor must be > 0, got ",
              dataloader_prefetch_factor.value_or(0));
  TORCH_CHECK(dataloader_num_workers > 0 || !dataloader_persistent_workers,
              "TrainingArguments: dataloader_persistent_workers needs dataloader_num_workers > 0");
  // torch's DataLoader's errors, with Linux's start methods.
  if (dataloader_multiprocessing_context) {
    TORCH_CHECK(dataloader_num_workers > 0,
                "TrainingArguments: dataloader_multiprocessing_context: multiprocessing_context "
                "can only be used with multi-process loading (num_workers > 0), but got "
                "num_workers=",
                dataloader_num_workers);
    TORCH_CHECK(one_of(*dataloader_multiprocessing_context, {"fork", "spawn", "forkserver"}),
                "TrainingArguments: dataloader_multiprocessing_context: multiprocessing_context "
                "option should specify a valid start method in ['fork', 'spawn', 'forkserver'], "
                "but got multiprocessing_context='",
                *dataloader_multiprocessing_context, "'");
  }
  if (use_cpu) dataloader_pin_memory = false;
  TORCH_CHECK(warmup_steps >= 0, "Got warmup_steps = ", warmup_steps,
              ", Expected value warmup_steps >= 0");
  TORCH_CHECK(neftune_noise_alpha.value_or(0) >= 0,
              "TrainingArguments: neftune_noise_alpha must be >= 0, got ", *neftune_noise_alpha);
  TORCH_CHECK(!ddp_backend || *ddp_backend == "gloo", "TrainingArguments: ddp_backend '",
              ddp_backend.value_or(""),
              "' is not supported: mixprec's data parallel runs on \"gloo\"");
  TORCH_CHECK(ddp_timeout > 0, "TrainingArguments: ddp_timeout must be > 0 seconds, got ",
              ddp_timeout);
  TORCH_CHECK(ddp_bucket_cap_mb.value_or(1) > 0,
              "TrainingArguments: ddp_bucket_cap_mb must be > 0, got ",
              ddp_bucket_cap_mb.value_or(0));
  TORCH_CHECK(one_of(ddp_comm_hook, {"no", "fp16", "bf16"}), "TrainingArguments: ddp_comm_hook '",
              ddp_comm_hook, "' is not one of \"no\", \"fp16\", \"bf16\"");
  TORCH_CHECK(max_steps > 0 || num_train_epochs > 0,
              "TrainingArguments: set num_train_epochs > 0 or max_steps > 0");
  // mixprec's bound, which HF lacks: far beyond any run, and the step arithmetic stays in int64.
  for (const auto& [name, value] :
       {std::pair{"num_train_epochs", num_train_epochs},
        std::pair{"max_steps", static_cast<double>(max_steps)},
        std::pair{"gradient_accumulation_steps", static_cast<double>(gradient_accumulation_steps)},
        std::pair{"warmup_steps", warmup_steps}, std::pair{"logging_steps", logging_steps},
        std::pair{"save_steps", save_steps}, std::pair{"eval_steps", eval_steps.value_or(0)}})
    TORCH_CHECK(value <= 1e15, "TrainingArguments: ", name, " must be a number at most 1e15, got ",
                value);

  if (eval_strategy != "no") do_eval = true;  // HF's
  {  // HF splits text on whitespace ("underflow_overflow tpu_metrics_debug")
    std::vector<std::string> options;
    for (const auto& text : debug) {
      std::istringstream words(text);
      for (std::string word; words >> word;) options.push_back(word);
    }
    debug = options;
  }
  for (const auto& option : debug) {
    TORCH_CHECK(option != "underflow_overflow",
                "TrainingArguments: debug \"underflow_overflow\" (HF's DebugUnderflowOverflow) is "
                "not supported by mixprec; numerics_monitor_steps watches fp16 overflow and "
                "underflow in the gradients and activations");
    TORCH_CHECK(option != "tpu_metrics_debug",
                "TrainingArguments: debug \"tpu_metrics_debug\" is not supported: mixprec has no "
                "TPU support");
    TORCH_CHECK(false, "TrainingArguments: debug '", option,
                "' is not one of HF's options (\"underflow_overflow\", \"tpu_metrics_debug\"), "
                "which mixprec does not support either");
  }
  if (eval_strategy == "steps" && (!eval_steps || *eval_steps == 0)) {
    TORCH_CHECK(logging_steps > 0,
                "evaluation strategy steps requires either non-zero "
                "--eval_steps or --logging_steps");
    eval_steps = logging_steps;
  }
  TORCH_CHECK(!(logging_strategy == "steps" && logging_steps == 0), "logging strategy ",
              logging_strategy, " requires non-zero --logging_steps");
  auto check_integral = [](const char* name, double steps) {
    TORCH_CHECK(steps <= 1 || steps == std::floor(steps), "--", name,
                " must be an integer if bigger than 1: ", steps);
  };
  if (logging_strategy == "steps") check_integral("logging_steps", logging_steps);
  if (eval_strategy == "steps") check_integral("eval_steps", *eval_steps);
  if (save_strategy == "steps") check_integral("save_steps", save_steps);
  TORCH_CHECK(save_strategy != "steps" || save_steps > 0,
              "Setting `strategy` as 'steps' requires a positive value for `steps`.");

  if (load_best_model_at_end && save_strategy != "best") {
    TORCH_CHECK(eval_strategy == save_strategy,
                "--load_best_model_at_end requires the save and eval strategy to match, except "
                "when --save_strategy=\"best\", but found\n- Evaluation strategy: ",
                eval_strategy, "\n- Save strategy: ", save_strategy);
    if (eval_strategy == "steps" && std::fmod(save_steps, *eval_steps) != 0) {
      // HF's checks, in its order (ratios compared as millionths, so 0.3 is a multiple of 0.1).
      TORCH_CHECK(*eval_steps < 1 || save_steps < 1,
                  "--load_best_model_at_end requires the saving steps to be a round multiple of "
                  "the evaluation steps, but found ",
                  save_steps, ", which is not a round multiple of ", *eval_steps, ".");
      TORCH_CHECK(*eval_steps < 1 && save_steps < 1,
                  "--load_best_model_at_end requires the saving steps to be a multiple of the "
                  "evaluation steps, which cannot get guaranteed when mixing ratio and absolute "
                  "steps for save_steps ",
                  save_steps, " and eval_steps ", *eval_steps, ".");
      TORCH_CHECK(std::fmod(save_steps * 1e6, *eval_steps * 1e6) == 0,
                  "--load_best_model_at_end requires the saving steps to be a multiple of the "
                  "evaluation steps, but found ",
                  save_steps, ", which is not a multiple of ", *eval_steps, ".");
    }
  }
  // Only load_best_model_at_end gets "loss" by default (save_strategy "best" without a metric
  // is the Trainer's error, as HF's).
  if (load_best_model_at_end && !metric_for_best_model) metric_for_best_model = "loss";
  if (metric_for_best_model && !greater_is_better)
    greater_is_better = !metric_for_best_model->ends_with("loss");  // HF's rule
}

namespace {

detail::ArgumentParser parser_of(TrainingArguments& args) {
  detail::ArgumentParser parser("TrainingArguments");
  parser.add_group("Training arguments (transformers.TrainingArguments' names and defaults)",
                   detail::training_arguments(args));
  return parser;
}

}  // namespace

TrainingArguments TrainingArguments::from_json(const std::string& json_text) {
  TrainingArguments args;
  parser_of(args).assign(detail::parse_config_text(json_text, /*yaml=*/false, "TrainingArguments"));
  args.validate();
  return args;
}

TrainingArguments TrainingArguments::from_yaml(const std::string& yaml_text) {
  TrainingArguments args;
  parser_of(args).assign(detail::parse_config_text(yaml_text, /*yaml=*/true, "TrainingArguments"));
  args.validate();
  return args;
}

TrainingArguments TrainingArguments::from_file(const std::string& path) {
  TrainingArguments args;
  parser_of(args).assign(detail::read_config_file(path, "TrainingArguments"), " (" + path + ")");
  args.validate();
  return args;
}

TrainingArguments TrainingArguments::parse_args(const std::vector<std::string>& words) {
  TrainingArguments args;
  parser_of(args).parse_args(words);
  args.validate();
  return args;
}

TrainingArguments TrainingArguments::parse_args(int argc, const char* const* argv) {
  return parse_args(std::vector<std::string>(argv + 1, argv + argc));
}

std::string TrainingArguments::help() {
  TrainingArguments defaults;
  return "  --config FILE  a .json or .yaml file of arguments; later flags override it\n" +
         parser_of(defaults).help();
}

std::string TrainingArguments::to_json() const {
  TrainingArguments copy = *this;
  detail::json object = detail::json::object();
  for (const auto& a : detail::training_arguments(copy)) object[a.name] = a.value();
  return object.dump(2);
}

}  // namespace mixprec::train
