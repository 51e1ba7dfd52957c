#pragma once

#include "mixprec/optim/scheduler_kwargs.h"

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace mixprec::train {

/// HF's `activation_checkpointing_kwargs`, with the keys mixprec's checkpoint takes: HF's own
/// `every_n_layers` and `torch.utils.checkpoint`'s `preserve_rng_state`. Read from an object
/// (or its JSON text) that may also say "use_reentrant": false and "offload": false; true for
/// either, or any other key, is an error.
struct ActivationCheckpointingKwargs {
  int64_t every_n_layers = 1;  // checkpoint layers 0, n, 2n, ...
  bool preserve_rng_state = true;
  bool operator==(const ActivationCheckpointingKwargs&) const = default;
};

/// HF's `AcceleratorConfig.gradient_accumulation_kwargs`: Accelerate's
/// GradientAccumulationPlugin's. Also read: "sync_with_dataloader" and "adjust_scheduler",
/// which change nothing under the Trainer, as under HF's (it says itself which micro-steps
/// sync, and steps its schedule once per update).
struct GradientAccumulationKwargs {
  /// Read as gradient_accumulation_steps, which must be left at 1 (HF's error otherwise; here
  /// the same value passes too, so that training_args.json reads back).
  std::optional<int64_t> num_steps = std::nullopt;
  /// Data parallel: all-reduce after every micro-step (accelerate::AcceleratorOptions').
  bool sync_each_batch = false;
  bool operator==(const GradientAccumulationKwargs&) const = default;
};

/// HF's `AcceleratorConfig` (TrainingArguments::accelerator_config), with its defaults: how
/// the Trainer's Accelerator is made. Read from an object, its JSON text, or a JSON/YAML file's
/// path (null: these defaults). mixprec's Trainer takes the other fields at these values only:
/// validate() says which is not supported.
struct AcceleratorConfig {
  bool split_batches = false;
  std::optional<bool> dispatch_batches = std::nullopt;
  bool even_batches = true;
  bool use_seedable_sampler = true;
  /// Non-blocking copies of batches to an accelerator. Read and ignored: mixprec has no pinned
  /// path to CUDA yet (see dataloader_pin_memory), and on a CPU there is nothing to copy.
  bool non_blocking = false;
  std::optional<GradientAccumulationKwargs> gradient_accumulation_kwargs = std::nullopt;
  bool use_configured_state = false;
  bool operator==(const AcceleratorConfig&) const = default;
};

/// `transformers.TrainingArguments` (5.24): the same names and defaults.
///
/// ```
/// mixprec::TrainingArguments args;
/// args.output_dir = "results";
/// args.eval_strategy = "epoch";
/// args.fp16 = true;
/// args.validate();
/// // or: auto args = TrainingArguments::from_file("run.yaml");
/// //     args = TrainingArguments::parse_args(argc, argv);
/// //     (argv: --config run.yaml --fp16 --learning_rate 3e-4)
/// ```
///
/// `*_steps` below 1 are a ratio of the total training steps, as in transformers 5.
struct TrainingArguments {
  std::string output_dir = "trainer_output";
  /// For scripts, as HF's: the Trainer does not read them. validate() sets do_eval when
  /// eval_strategy is not "no", as HF's.
  bool do_train = false;
  bool do_eval = false;
  bool do_predict = false;
  /// Start afresh even if output_dir holds checkpoints (otherwise an error
  /// suggests resume_from_checkpoint). Gone from transformers 5; kept here.
  bool overwrite_output_dir = false;
  std::string eval_strategy = "no";  // "no" | "steps" | "epoch"
  /// Defaults to logging_steps when eval_strategy is "steps".
  std::optional<double> eval_steps = std::nullopt;
  /// Epochs ("epoch") or steps ("steps") before the first evaluation by eval_strategy.
  double eval_delay = 0;
  /// Evaluates once before the first step, as a sanity check.
  bool eval_on_start = false;
  bool fp16 = false;
  bool bf16 = false;
  bool fp16_full_eval = false;
  bool bf16_full_eval = false;
  /// TensorFloat-32 matmuls and convolutions on CUDA (unset: torch's setting). true without
  /// CUDA is HF's error (HF also refuses a GPU older than Ampere, where torch ignores it).
  std::optional<bool> tf32 = std::nullopt;
  int64_t per_device_train_batch_size = 8;
  int64_t per_device_eval_batch_size = 8;
  /// evaluate() and predict() keep only the loss: no logits, labels nor compute_metrics.
  bool prediction_loss_only = false;
  /// What else compute_metrics gets in its EvalPrediction: "inputs" (the batches' main input,
  /// the model's main_input_name, "input_ids" by default) and "loss" (each sample's batch loss).
  std::vector<std::string> include_for_metrics = {};
  /// compute_metrics runs on each evaluation batch (EvalPrediction::compute_result is true on the
  /// last, whose metrics are the evaluation's) instead of once on them all, so that no logits are
  /// kept for the whole evaluation set.
  bool batch_eval_metrics = false;
  /// HF moves the evaluation's outputs from the accelerator to the CPU every this many batches
  /// (unset: at the end). mixprec moves each batch's at once (HF's 1): checked (> 0), no effect.
  std::optional<int64_t> eval_accumulation_steps = std::nullopt;
  /// Only true: EvalPrediction holds tensors, concatenated over the batches (HF's false gives
  /// Python lists of them).
  bool eval_do_concat_batches = true;
  /// Only false: the outputs are tensors, gathered as such (HF's true gathers Python objects).
  bool eval_use_gather_object = false;
  /// On running out of memory, train() starts again with 0.9 x the batch per device, down to 1
  /// (Accelerate's find_executable_batch_size); a resumed run starts from its checkpoint's.
  bool auto_find_batch_size = false;
  int64_t gradient_accumulation_steps = 1;
  /// Empty the accelerator's memory cache (accelerate::clear_device_cache) in each training
  /// micro-step whose global_step is a multiple of this, after the forward, as HF's. A CPU has
  /// no such cache.
  std::optional<int64_t> torch_empty_cache_steps = std::nullopt;
  AcceleratorConfig accelerator_config = {};
  /// Recompute each layer's activations in the backward instead of keeping them (the model's
  /// `activation_checkpointing_enable()`; models::SupportsActivationCheckpointing). Also read
  /// as `gradient_checkpointing`, its older name in transformers.
  bool activation_checkpointing = false;
  /// How (also read as `gradient_checkpointing_kwargs`); unset: every layer, as HF's.
  std::optional<ActivationCheckpointingKwargs> activation_checkpointing_kwargs = std::nullopt;
  double learning_rate = 5e-5;
  double weight_decay = 0.0;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_epsilon = 1e-8;
  double max_grad_norm = 1.0;
  double num_train_epochs = 3.0;
  /// When > 0, the number of optimizer steps, overriding num_train_epochs.
  int64_t max_steps = -1;
  std::string lr_scheduler_type = "linear";
  /// The schedule's own arguments, as HF's: cosine's num_cycles, polynomial's lr_end and power,
  /// inverse_sqrt's timescale, cosine_with_min_lr's min_lr or min_lr_rate
  /// (cosine_warmup_with_min_lr's too, and its warmup_lr_rate), warmup_stable_decay's
  /// num_decay_steps (required), num_stable_steps, warmup_type, decay_type, min_lr_ratio and
  /// num_cycles. One the schedule does not take is an error; the constant schedules ignore them,
  /// as HF's, with a warning. A JSON object on the command line.
  std::optional<optim::SchedulerKwargs> lr_scheduler_kwargs = std::nullopt;
  /// Below 1: a ratio of the training steps (transformers 5 folded warmup_ratio in here).
  double warmup_steps = 0;
  std::string logging_strategy = "steps";  // "no" | "steps" | "epoch"
  double logging_steps = 500;
  bool logging_first_step = false;
  /// An inf/NaN training loss is logged as the average since the last log instead.
  bool logging_nan_inf_filter = true;
  std::string save_strategy = "steps";  // "no" | "steps" | "epoch" | "best"
  double save_steps = 500;
  std::optional<int64_t> save_total_limit = std::nullopt;  // 0 or below: no limit, as HF's
  /// Checkpoints hold the model, trainer_state.json and training_args.json only: no optimizer,
  /// schedule, scaler, RNG nor data position. A run resumed from one starts its optimizer and
  /// loss scale afresh (with a warning); its schedule and data go on from the checkpoint's step.
  bool save_only_model = false;
  /// Each node's local main process writes checkpoints and models, not only process 0, for nodes
  /// that do not share a file system (accelerate::ProjectConfiguration's).
  bool save_on_each_node = false;
  bool load_best_model_at_end = false;
  /// "loss" when load_best_model_at_end is set; "eval_" is prefixed if missing.
  std::optional<std::string> metric_for_best_model = std::nullopt;
  /// Defaults to false for metrics whose name ends in "loss" (eval_nll_loss too), true for
  /// the others.
  std::optional<bool> greater_is_better = std::nullopt;
  /// NEFTune: during train(), noise uniform in +-alpha / sqrt(T x hidden) on the model's input
  /// embeddings in training mode (models::SupportsNEFTune; GPT-2's wte). The paper used 5 to 15.
  std::optional<double> neftune_noise_alpha = std::nullopt;
  /// HF's LabelSmoother: (1 - e) x the cross-entropy with the labels plus e x the mean over all
  /// classes of -log p, for a model returning logits. Causal LMs (those taking
  /// num_items_in_batch) have their labels shifted as their own loss does. 0: the model's loss.
  double label_smoothing_factor = 0;
  int64_t seed = 42;
  /// enable_full_determinism(seed) instead of set_seed(seed): deterministic algorithms only
  /// (LibTorch's error for an op that has none), slower.
  bool full_determinism = false;
  std::optional<int64_t> data_seed = std::nullopt;
  /// "random" (each epoch in the order of randperm(seed + epoch), Accelerate's seedable sampler),
  /// "sequential" (the dataset's order) or "group_by_length" (HF's LengthGroupedSampler: batches
  /// of about equal length, for less padding; evaluation's and predict()'s too, whose outputs
  /// then come in that order, as HF's). HF's "batch_rebalance" is not supported.
  std::string train_sampling_strategy = "random";
  /// With "group_by_length": the samples' key that holds their length (a number), read instead
  /// of the main input's size (as HF's dataset column of that name).
  std::string length_column_name = "length";
  int64_t dataloader_num_workers = 0;
  bool dataloader_drop_last = false;
  /// Batches each worker reads ahead (data::DataLoaderOptions::prefetch_factor); unset: 2, as
  /// torch's. Only with dataloader_num_workers > 0, as HF's.
  std::optional<int64_t> dataloader_prefetch_factor = std::nullopt;
  /// Keep the workers between passes. Checked as torch's (it needs workers), with nothing
  /// else to do: mixprec's workers are threads over the one dataset, not processes holding
  /// copies of it, and start again at each pass for the cost of a thread.
  bool dataloader_persistent_workers = false;
  /// Page-locked batches for copies to an accelerator. false after validate() with use_cpu, as
  /// HF's. Pins nothing: on a machine without an accelerator torch's DataLoader pins nothing
  /// either, and mixprec has no pinned path to CUDA yet.
  bool dataloader_pin_memory = true;
  /// Batches in the order they were dispatched to the workers. false lets torch's loader yield
  /// them as they are ready; mixprec's always yields them in order, which that allows.
  bool dataloader_in_order = true;
  /// "fork", "spawn" or "forkserver", with workers (torch's checks). No effect: mixprec's
  /// workers are threads, not processes.
  std::optional<std::string> dataloader_multiprocessing_context = std::nullopt;
  /// HF drops a dataset's columns that the model's forward does not take. No effect: a
  /// data::Batch holds what the dataset's collation puts in it, all of which reaches the model.
  bool remove_unused_columns = true;
  /// For a model that takes HF's num_items_in_batch (a causal LM such as GPT-2): count the label
  /// tokens of an accumulation window on all processes, not on this one only.
  bool average_tokens_across_devices = true;
  /// "no", "all" (input_ids' elements) or "non_padding" (attention_mask's ones): counts the
  /// tokens trained on, on all processes, into the logs (num_input_tokens_seen, and
  /// train_tokens_per_second in the training logs). true/false read as "all"/"no", as HF's.
  std::string include_num_input_tokens_seen = "no";
  std::string optim = "adamw_torch_fused";  // "adamw_torch" | "adamw_torch_fused" | "sgd"
  /// "key=value,key=value" (spaces ignored), as HF's: sgd reads momentum, dampening, nesterov
  /// (true/1/yes) and weight_decay (which, as under HF, the parameter groups' own weight decay
  /// overrides). The AdamW optimizers read none, as HF's; a key that is not read is a warning.
  std::optional<std::string> optim_args = std::nullopt;
  /// "tensorboard", "jsonl", "all" or "none"; validate() leaves the trackers to use.
  std::vector<std::string> report_to = {"none"};
  /// HF's model.config.use_cache during training. No effect: mixprec's models keep no cache.
  bool use_cache = false;
  /// HF's Trainer saves a checkpoint on SIGTERM when true. mixprec's saves one on SIGTERM and
  /// SIGINT whatever it says (TrainOutput::stopped_by_signal).
  bool enable_jit_checkpoint = false;
  /// HF's debug features: none here. "underflow_overflow" (HF's DebugUnderflowOverflow) is an
  /// error that points to numerics_monitor_steps; "tpu_metrics_debug" is an error.
  std::vector<std::string> debug = {};
  std::optional<std::string> resume_from_checkpoint = std::nullopt;
  /// On a resume, start the checkpoint's epoch from its first batch rather than skip the batches
  /// it had trained on.
  bool ignore_data_skip = false;
  /// On a resume, give the callbacks their states from the checkpoint's trainer_state.json
  /// (TrainerCallback::state; EarlyStoppingCallback's patience counter).
  bool restore_callback_states_from_checkpoint = false;
  /// Defaults to off when stdout is a terminal, on otherwise.
  std::optional<bool> disable_tqdm = std::nullopt;
  /// HF's: mixprec's verbosity (log::set_verbosity) on the main process from the Trainer's
  /// constructor on: "debug", "info" (HF's "***** Running training *****" summary, evaluations,
  /// checkpoints saved and deleted), "warning", "error", "critical", or "passive" (as it is:
  /// warning unless log::set_verbosity or MIXPREC_VERBOSITY said otherwise).
  std::string log_level = "passive";
  std::string log_level_replica = "warning";  // the same on the other processes
  /// log_level on each node's main process, else on process 0's only.
  bool log_on_each_node = true;
  bool use_cpu = false;
  /// Data parallel (under torchrun): DDP's find_unused_parameters. Unset: on unless the model
  /// checkpoints its activations, HF's rule for its models (mixprec's checkpointing works with it
  /// on, unlike HF's reentrant one: set it to true to have both).
  std::optional<bool> ddp_find_unused_parameters = std::nullopt;
  std::optional<int64_t> ddp_bucket_cap_mb = std::nullopt;   // unset: DDP's 25
  std::optional<bool> ddp_broadcast_buffers = std::nullopt;  // unset: DDP's true
  /// DDP's static_graph. true turns find_unused_parameters on, even over
  /// ddp_find_unused_parameters = false: a parameter no rank uses then trains, as under DDP's
  /// static graph, which finds them in its first iteration (c10d's static-graph mode needs DDP's
  /// Python _DDPSink). Its other gains (no search at each step, a parameter ready twice) are not
  /// had here.
  std::optional<bool> ddp_static_graph = std::nullopt;
  /// Only "gloo" (unset: gloo): mixprec's data parallel runs on c10d's Gloo.
  std::optional<std::string> ddp_backend = std::nullopt;
  /// Seconds a collective waits for the other processes before it fails (HF's and torch's 30
  /// minutes: main_process_first may wait out a long preprocessing).
  int64_t ddp_timeout = 1800;
  /// mixprec's own (Accelerate's DistributedDataParallelKwargs.comm_hook): "no", or "fp16" /
  /// "bf16" to all-reduce gradients in 16 bits, half the bytes (dist::GradientCompression).
  std::string ddp_comm_hook = "no";
  /// The batch keys that hold labels (default {"labels"}): they keep their dtype when inputs go
  /// 16-bit; in evaluation, only a batch that holds them all has labels and a loss (HF's
  /// has_labels; so an empty list means no eval loss, as HF's for a model without return_loss),
  /// and EvalPrediction::all_label_ids gets each one's (label_ids the first's).
  std::optional<std::vector<std::string>> label_names = std::nullopt;
  std::optional<std::string> run_name = std::nullopt;
  /// Without it, train(), evaluate() and predict() add the process's resident memory that each
  /// left allocated and the peak above that to their metrics (train_mem_cpu_alloc_delta,
  /// train_mem_cpu_peaked_delta, ... in bytes; the first also init's, for the constructor).
  /// CPU memory only: CUDA's is not reported. The peak is the kernel's high-water mark, reset when
  /// each of them starts, which also resets the process's peak that getrusage reports.
  bool skip_memory_metrics = true;
  /// mixprec's own: inspect gradient and activation numerics (fp16 underflow
  /// and overflow, exponent ranges) at step 1 and every N steps, log them to
  /// report_to and print a summary at the end (log::NumericsMonitor); 0 = off.
  int64_t numerics_monitor_steps = 0;

  /// Checks the combinations transformers checks in __post_init__ and fills the
  /// defaults that depend on others; an error says which arguments clash.
  void validate();

  /// From a JSON object, a `.json` file or a `.yaml`/`.yml` file. An unknown
  /// key is an error that suggests the closest name; a value of the wrong
  /// type names the key, the expected type and what was found. Old names
  /// (evaluation_strategy, warmup_ratio) are accepted.
  static TrainingArguments from_json(const std::string& json_text);
  static TrainingArguments from_yaml(const std::string& yaml_text);
  static TrainingArguments from_file(const std::string& path);
  /// `--config FILE` (optional) then `--name value` overrides; a bool flag
  /// alone means true. Validates.
  static TrainingArguments parse_args(const std::vector<std::string>& args);
  static TrainingArguments parse_args(int argc, const char* const* argv);
  /// Every argument with its type and default, for --help.
  static std::string help();

  /// All fields as a JSON object (training_args.json).
  std::string to_json() const;
};

/// HF's string_to_bool (hf_argparser): yes/no, true/false, t/f, y/n, 1/0, in any case, as how a
/// boolean flag's value is read; none for any other word.
std::optional<bool> string_to_bool(std::string word);

/// HF's _parse_optim_args: "a=1, b=2" as {a: "1", b: "2"} (none for unset or empty); an error
/// for a pair without exactly one '='.
std::map<std::string, std::string> parse_optim_args(const std::optional<std::string>& optim_args);

}  // namespace mixprec::train

namespace mixprec {
using train::TrainingArguments;
}  // namespace mixprec
