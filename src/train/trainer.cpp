#include "mixprec/train/trainer.h"

#include "mixprec/io/checkpoint.h"
#include "mixprec/log/logging.h"
#include "mixprec/log/progress.h"
#include "mixprec/models/activation_checkpoint.h"
#include "mixprec/models/neftune.h"
#include "mixprec/optim/adamw.h"

#include "memory_tracker.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/cuda.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/sgd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <regex>
#include <set>
#include <span>
#include <unordered_set>

#include <signal.h>

namespace mixprec::train {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// Whether two paths name one folder however they are spelled (HF: os.path.samefile).
bool same_folder(const fs::path& a, const fs::path& b) {
  std::error_code error;
  return fs::equivalent(a, b, error);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// HF's `*_steps` below 1 are a ratio of max_steps.
int64_t absolute_steps(double steps, int64_t max_steps) {
  return steps < 1 ? static_cast<int64_t>(std::ceil(steps * max_steps))
                   : static_cast<int64_t>(steps);
}

// HF's DistributedDataParallelKwargs: what the arguments set, DDP's defaults for the rest;
// find_unused_parameters on unless the model checkpoints its activations (HF's rule for its own
// models, which a model that supports checkpointing stands for).
dist::GradientReducerOptions ddp_options(const TrainingArguments& args,
                                         const torch::nn::Module& module) {
  dist::GradientReducerOptions ddp;
  if (args.ddp_bucket_cap_mb) ddp.bucket_cap_mb = *args.ddp_bucket_cap_mb;
  if (args.ddp_broadcast_buffers) ddp.broadcast_buffers = *args.ddp_broadcast_buffers;
  const auto* checkpointing = dynamic_cast<const models::SupportsActivationCheckpointing*>(&module);
  // DDP's static graph finds the unused parameters itself, in its first iteration; c10d's
  // static-graph mode needs DDP's Python _DDPSink, so here find_unused_parameters does it.
  ddp.find_unused_parameters =
      args.ddp_find_unused_parameters.value_or(
          !(checkpointing && checkpointing->is_activation_checkpointing())) ||
      args.ddp_static_graph.value_or(false);
  if (args.ddp_comm_hook == "fp16") ddp.compression = dist::GradientCompression::kFp16;
  if (args.ddp_comm_hook == "bf16") ddp.compression = dist::GradientCompression::kBf16;
  return ddp;
}

// The batch keys that hold labels.
std::vector<std::string> label_names_of(const TrainingArguments& args) {
  return args.label_names.value_or(std::vector<std::string>{"labels"});
}

// The processes whose label tokens num_items_in_batch counts (HF's average_tokens_across_devices):
// a loss divided by it is multiplied by their number, as data parallel averages gradients.
int64_t token_processes_of(const TrainingArguments& args, const accelerate::Accelerator& acc) {
  return args.average_tokens_across_devices ? acc.num_processes() : 1;
}

// HF's _get_num_items_in_batch: the labels other than -100 in `batches` (for a causal LM,
// `shift`, those of labels[..., 1:]: the ones its loss predicts), summed over the `processes`
// (this one or all); none without labels.
std::optional<int64_t> count_label_tokens(std::span<const data::Batch> batches,
                                          const accelerate::Accelerator& acc, int64_t processes,
                                          bool shift) {
  if (batches.empty() || !batches.front().count("labels")) return std::nullopt;
  int64_t count = 0;
  for (const auto& batch : batches) {
    const at::Tensor& labels = batch.at("labels");
    if (!shift)
      count += labels.ne(-100).sum().item<int64_t>();
    else if (labels.size(-1) > 1)
      count += labels.narrow(-1, 1, labels.size(-1) - 1).ne(-100).sum().item<int64_t>();
  }
  if (processes > 1) count = acc.reduce(at::full({1}, count, at::kLong), "sum").item<int64_t>();
  return count;
}

// HF's num_parameters(only_trainable, exclude_embeddings): each parameter once (tied ones too),
// those not trained or the embedding tables left out if asked.
int64_t num_parameters(torch::nn::Module& module, bool only_trainable, bool exclude_embeddings) {
  std::set<const c10::TensorImpl*> left_out;
  if (exclude_embeddings)
    for (const auto& m : module.modules())
      if (const auto* embedding = m->as<torch::nn::EmbeddingImpl>())
        left_out.insert(embedding->weight.unsafeGetTensorImpl());
  int64_t count = 0;
  for (const auto& p : module.parameters())
    if ((!only_trainable || p.requires_grad()) && left_out.insert(p.unsafeGetTensorImpl()).second)
      count += p.numel();
  return count;
}

// The samples of one step on all processes together: the batch of each times their number,
// or with accelerator_config's split_batches the batch itself. (HF's counts of samples and
// steps multiply by the number of processes in both cases.)
int64_t global_batch_of(const TrainingArguments& args, const accelerate::Accelerator& acc,
                        int64_t batch_size) {
  return args.accelerator_config.split_batches ? batch_size : batch_size * acc.num_processes();
}

// The options of the Trainer's loaders from HF's dataloader_* arguments. The Accelerator's
// prepared_loader_options then shards them as Accelerate's BatchSamplerShard (with
// split_batches, each batch cut among the processes) and shuffles as Accelerate.
data::DataLoaderOptions loader_options_of(const TrainingArguments& args, int64_t batch_size) {
  data::DataLoaderOptions options{.batch_size = static_cast<size_t>(batch_size),
                                  .drop_last = args.dataloader_drop_last,
                                  .num_workers = static_cast<size_t>(args.dataloader_num_workers)};
  if (args.dataloader_prefetch_factor)
    options.prefetch_factor = static_cast<size_t>(*args.dataloader_prefetch_factor);
  return options;
}

// As Python's f"{n:,}": 1284 -> "1,284".
std::string with_commas(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

template <typename Map>
std::vector<std::string> keys_of(const Map& map) {
  std::vector<std::string> keys;
  for (const auto& [key, value] : map) keys.push_back(key);
  return keys;
}

// train_sampling_strategy "group_by_length": HF's LengthGroupedSampler of `batch_size`, its
// order drawn from data_seed (or seed) + the epoch. A sample's length is its
// length_column_name value, else the size of its main input (HF: len(feature[model_input_name])).
void group_by_length(data::DataLoaderOptions& options, const TrainingArguments& args,
                     const data::Dataset& dataset, const std::string& main_input_name,
                     int64_t batch_size) {
  std::vector<int64_t> lengths(dataset.size());
  for (size_t i = 0; i < lengths.size(); ++i) {
    const data::Example example = dataset.get(i);
    if (auto length = example.find(args.length_column_name); length != example.end()) {
      const at::Tensor& value = length->second;
      TORCH_CHECK(value.numel() == 1 && value.item<double>() == std::floor(value.item<double>()),
                  "Trainer: sample ", i, "'s '", args.length_column_name,
                  "' (length_column_name) is not one whole number: ", value);
      lengths[i] = static_cast<int64_t>(value.item<double>());
      continue;
    }
    const auto input = example.find(main_input_name);
    TORCH_CHECK(input != example.end() && input->second.dim() > 0,
                "Trainer: train_sampling_strategy \"group_by_length\" needs each sample's '",
                args.length_column_name, "' (length_column_name) or a sequence '", main_input_name,
                "' (the model's main input); sample ", i, " has keys ",
                c10::Join(", ", keys_of(example)));
    lengths[i] = input->second.size(0);
  }
  options.shuffle = true;
  options.seed = static_cast<uint64_t>(args.data_seed.value_or(args.seed));
  options.group_by_length =
      data::LengthGrouping{std::move(lengths), static_cast<size_t>(batch_size)};
}

// Concatenates along dim 0, padding the other dims with -100 where they
// differ (HF's nested_concat with padding_index -100).
at::Tensor concat_padded(const std::vector<at::Tensor>& parts) {
  if (parts.empty()) return {};
  auto shape = parts.front().sizes().vec();
  for (const auto& p : parts)
    for (size_t d = 1; d < shape.size(); ++d) shape[d] = std::max(shape[d], p.size(d));
  std::vector<at::Tensor> padded;
  for (const auto& p : parts) {
    if (p.sizes().slice(1) == c10::IntArrayRef(shape).slice(1)) {
      padded.push_back(p);
      continue;
    }
    auto full_shape = shape;
    full_shape[0] = p.size(0);
    auto out = at::full(full_shape, -100, p.options());
    std::vector<at::indexing::TensorIndex> index;
    for (int64_t d = 0; d < p.dim(); ++d) index.emplace_back(at::indexing::Slice(0, p.size(d)));
    out.index_put_(index, p);
    padded.push_back(out);
  }
  return at::cat(padded, 0);
}

// SIGINT/SIGTERM while training: remembered, acted on at the next step
// boundary. A second one gets the previous handler (the default: die now).
std::atomic<int> stop_signal{0};
struct sigaction previous_int, previous_term;

extern "C" void on_stop_signal(int sig) {
  if (stop_signal.exchange(sig) != 0) {
    sigaction(sig, sig == SIGINT ? &previous_int : &previous_term, nullptr);
    raise(sig);
  }
}

struct StopSignals {
  StopSignals() {
    stop_signal = 0;
    struct sigaction action {};
    action.sa_handler = on_stop_signal;
    sigemptyset(&action.sa_mask);
    sigaction(SIGINT, &action, &previous_int);
    sigaction(SIGTERM, &action, &previous_term);
  }
  ~StopSignals() {
    sigaction(SIGINT, &previous_int, nullptr);
    sigaction(SIGTERM, &previous_term, nullptr);
  }
};

// Where the train loader stands, saved with each checkpoint, with the batch of all processes
// together that the position counts in.
struct DataPosition : accelerate::Checkpointable {
  data::DataLoaderState state;
  int64_t global_batch = 0;
  std::optional<int64_t> saved_global_batch;  // the loaded checkpoint's, when it records one
  std::string state_dict() const override {
    json j = state;
    j["global_batch"] = global_batch;
    return j.dump();
  }
  void load_state_dict(const std::string& text) override {
    const json j = json::parse(text);
    state = j.get<data::DataLoaderState>();
    saved_global_batch.reset();
    if (!j.contains("global_batch")) return;
    TORCH_CHECK(j.at("global_batch").is_number_integer(),
                "expected an integer 'global_batch', got ", j.at("global_batch").dump());
    saved_global_batch = j.at("global_batch").get<int64_t>();
  }
};

// HF's accelerator_config.gradient_accumulation_kwargs.sync_each_batch.
bool sync_each_batch(const TrainingArguments& args) {
  const auto& kwargs = args.accelerator_config.gradient_accumulation_kwargs;
  return kwargs && kwargs->sync_each_batch;
}

}  // namespace

struct Trainer::Impl {
  std::shared_ptr<torch::nn::Module> module;
  BatchForward forward;
  NumItemsForward num_items_forward;  // empty: the model takes no num_items_in_batch
  ComputeLoss compute_loss;           // empty: the model's loss (or the label smoother's)
  double label_smoothing = 0;         // args' label_smoothing_factor
  data::DatasetPtr train_dataset, eval_dataset;
  ComputeMetrics compute_metrics;
  std::vector<std::shared_ptr<TrainerCallback>> callbacks;
  data::CollateFn collate;
  TrainerControl control;
  bool in_train = false;
  double current_flos = 0;  // this process's, since they were last added to state.total_flos
  DataPosition position;    // registered for checkpointing once, by the constructor
  std::string main_input_name = "input_ids";      // HF's model.main_input_name
  detail::MemoryTracker memory{false};            // on without args' skip_memory_metrics
  std::shared_ptr<data::DataLoader> eval_loader;  // the last evaluation's, for kwargs()
  bool trackers_open = false;
  // set_optimizers()'s, and the optimizer's lrs as given: a schedule made on it starts from
  // them (PyTorch's initial_lr), not from where an earlier run's schedule left them.
  std::shared_ptr<torch::optim::Optimizer> given_optimizer;
  std::shared_ptr<optim::LRScheduler> given_schedule;
  std::vector<double> initial_lrs;

  // The dtype of the first 16-bit parameter, if any. A model whose parameters
  // are 16-bit (pure bf16, *_full_eval) gets its floating inputs in that dtype,
  // as HF's _prepare_input does for DeepSpeed. Looked up once per loop: the
  // parameters' dtypes do not change inside one.
  std::optional<at::ScalarType> sixteen_bit_dtype() const {
    for (const auto& p : module->parameters())
      if (p.scalar_type() == at::kHalf || p.scalar_type() == at::kBFloat16) return p.scalar_type();
    return std::nullopt;
  }

  // A causal LM (a model taking num_items_in_batch): its labels are shifted where they are
  // counted and smoothed.
  bool causal_lm() const { return static_cast<bool>(num_items_forward); }
  // As HF's: num_items_in_batch is counted for a model taking it or a compute_loss_func.
  bool counts_items() const { return num_items_forward || compute_loss; }

  // The model's output on a batch, as HF's compute_loss: its forward, which the caller runs
  // under the mixed precision, then add_loss() outside it on the fp32 outputs (as Accelerate
  // converts them). With compute_loss or label_smoothing, the model runs without the labels
  // and the loss comes from its outputs (HF's compute_loss_func, LabelSmoother). Else a model
  // taking num_items_in_batch divides its loss by `num_items`.
  bool loss_from_outputs(const data::Batch& batch) const {
    return compute_loss || (label_smoothing != 0 && batch.count("labels"));
  }
  models::ModelOutput model_outputs(const data::Batch& batch,
                                    std::optional<int64_t> num_items) const {
    if (loss_from_outputs(batch)) {
      data::Batch inputs = batch;
      inputs.erase("labels");
      return forward(inputs);
    }
    if (num_items && num_items_forward) return num_items_forward(batch, *num_items);
    return forward(batch);
  }
  // With `num_items`, as HF's with average_tokens_across_devices, the loss is multiplied by the
  // `processes` whose gradients data parallel averages.
  void add_loss(models::ModelOutput& out, const data::Batch& batch,
                std::optional<int64_t> num_items, int64_t processes) const {
    if (loss_from_outputs(batch)) {
      const auto labels = batch.find("labels");
      const at::Tensor label_ids = labels != batch.end() ? labels->second : at::Tensor();
      if (compute_loss) {
        if (!label_ids.defined()) {
          MIXPREC_WARN_ONCE(
              "Trainer: compute_loss_func is defined but the batch holds no labels; it is called "
              "with undefined labels");
        }
        out.loss = compute_loss(out, label_ids, num_items);
      } else {
        TORCH_CHECK(out.logits.defined(),
                    "Trainer: label_smoothing_factor smooths the model's logits, but the model "
                    "returned none");
        out.loss =
            label_smoothed_loss(out.logits, label_ids, label_smoothing, causal_lm(), num_items);
      }
    } else if (!num_items_forward) {
      return;  // the model's own loss
    }
    if (num_items && processes > 1 && out.loss.defined()) out.loss = out.loss * processes;
  }

  // Labels keep their dtype: the loss and the metrics compare with them.
  static data::Batch to_device(const data::Batch& batch, const c10::Device& device,
                               std::optional<at::ScalarType> dtype,
                               const std::vector<std::string>& label_names) {
    data::Batch moved;
    for (const auto& [key, t] : batch) {
      const bool label =
          std::find(label_names.begin(), label_names.end(), key) != label_names.end();
      moved[key] = dtype && t.is_floating_point() && !label ? t.to(device, *dtype) : t.to(device);
    }
    return moved;
  }

  template <typename Event>
  void call(const TrainingArguments& args, TrainerState& state, Event event) {
    for (auto& cb : callbacks) {
      // kwargs() holds only during an event (train()'s objects die with it); an event called
      // from inside another (predict() in on_epoch_end) gives the outer one its own back.
      struct Restore {
        TrainerCallback& cb;
        CallbackKwargs outer;
        ~Restore() { cb.kwargs_ = outer; }
      } restore{*cb, cb->kwargs_};
      cb->kwargs_ = kwargs;
      event(*cb, args, state, control);
    }
  }

  // HF's stateful_callbacks: TrainerControl's flags and each exportable callback's state (a list
  // for several of one name, in the callbacks' order).
  std::map<std::string, std::string> callback_states() const {
    std::map<std::string, std::vector<std::string>> states;
    const json flags = {{"should_training_stop", control.should_training_stop},
                        {"should_epoch_stop", control.should_epoch_stop},
                        {"should_save", control.should_save},
                        {"should_evaluate", control.should_evaluate},
                        {"should_log", control.should_log}};
    states["TrainerControl"].push_back(
        json{{"args", flags}, {"attributes", json::object()}}.dump());
    for (const auto& cb : callbacks)
      if (auto state = cb->state()) states[state->name].push_back(state->json);
    std::map<std::string, std::string> out;
    for (const auto& [name, texts] : states) {
      std::string list;
      for (const auto& text : texts) list += (list.empty() ? "[" : ",") + text;
      out[name] = texts.size() == 1 ? texts[0] : list + "]";
    }
    return out;
  }

  // HF's _load_callback_state: each stored state to the callbacks of its name, in their order.
  void restore_callback_states(const std::map<std::string, std::string>& stored) {
    std::vector<std::string> not_found;
    for (const auto& [name, text] : stored) {
      json states = json::parse(text);  // checked when trainer_state.json was read
      if (!states.is_array()) states = json::array({states});
      if (states.empty()) continue;
      // HF restores TrainerControl's flags too; its train and epoch begin events clear the stop
      // flags, and the first step's begin the others, before the loop reads any. mixprec's loop
      // clears them only after acting on them, so it does not restore them.
      if (name == "TrainerControl") continue;
      size_t given = 0;
      for (auto& cb : callbacks) {
        const auto state = cb->state();
        if (state && state->name == name && given < states.size())
          cb->load_state(states[given++].dump());
      }
      if (given == 0) not_found.push_back(name);
    }
    if (!not_found.empty())
      MIXPREC_WARN(
          "Trainer: the checkpoint holds the state of callbacks this run does not have, "
          "ignored: ",
          c10::Join(", ", not_found));
  }

  CallbackKwargs kwargs;  // for the callbacks: the model, and train()'s objects while it runs
  struct Training {       // sets train()'s objects, and clears them however it ends
    CallbackKwargs& kwargs;
    Training(CallbackKwargs& kwargs, torch::optim::Optimizer& optimizer,
             optim::LRScheduler& schedule, data::DataLoader& loader)
        : kwargs(kwargs) {
      kwargs.optimizer = &optimizer;
      kwargs.lr_scheduler = &schedule;
      kwargs.train_dataloader = &loader;
    }
    ~Training() { kwargs = {.model = kwargs.model, .eval_dataloader = kwargs.eval_dataloader}; }
  };
};

at::Tensor label_smoothed_loss(const at::Tensor& logits, const at::Tensor& labels, double epsilon,
                               bool shift_labels, std::optional<int64_t> num_items) {
  at::Tensor x = logits, y = labels;
  TORCH_CHECK(x.dim() >= 2 && x.sizes().slice(0, x.dim() - 1) == y.sizes(),
              "label_smoothed_loss: expected labels of shape ", x.sizes().slice(0, x.dim() - 1),
              " for logits of shape ", x.sizes(), ", got ", y.sizes());
  if (shift_labels) {  // position t predicts labels[t + 1]
    TORCH_CHECK(y.size(-1) >= 1, "label_smoothed_loss: no position to shift");
    x = x.narrow(-2, 0, x.size(-2) - 1);
    y = y.narrow(-1, 1, y.size(-1) - 1);
  }
  // LibTorch's cross-entropy with label smoothing is HF's formula: per label,
  // (1 - e) (-log p[label]) + e mean_c(-log p[c]).
  const at::Tensor loss =
      at::cross_entropy_loss(x.reshape({-1, x.size(-1)}).to(at::kFloat), y.reshape({-1}), {},
                             num_items ? at::Reduction::Sum : at::Reduction::Mean, -100, epsilon);
  return num_items ? loss / static_cast<double>(*num_items) : loss;
}

void enable_full_determinism(uint64_t seed, bool warn_only) {
  accelerate::set_seed(seed);
  // Read when CUDA and cuBLAS start, so they must be in the environment before.
  setenv("CUDA_LAUNCH_BLOCKING", "1", 1);
  setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8", 1);
  auto& context = at::globalContext();
  context.setDeterministicAlgorithms(true, warn_only);
  context.setDeterministicCuDNN(true);
  context.setBenchmarkCuDNN(false);
}

void Trainer::set_num_items_forward(NumItemsForward forward) {
  impl_->num_items_forward = std::move(forward);
}

void Trainer::set_main_input_name(std::string name) { impl_->main_input_name = std::move(name); }

Trainer::Trainer(std::shared_ptr<torch::nn::Module> module, BatchForward forward,
                 TrainingArguments args, data::DatasetPtr train_dataset,
                 data::DatasetPtr eval_dataset, ComputeMetrics compute_metrics,
                 std::vector<std::shared_ptr<TrainerCallback>> callbacks,
                 data::CollateFn data_collator, ComputeLoss compute_loss_func)
    : impl_(std::make_unique<Impl>()), args_(std::move(args)) {
  args_.validate();
  impl_->memory = detail::MemoryTracker(!args_.skip_memory_metrics);
  detail::MemoryTracker::Stage measured(impl_->memory, "init");
  // As HF's __init__, and again in train().
  if (args_.full_determinism)
    enable_full_determinism(static_cast<uint64_t>(args_.seed));
  else
    accelerate::set_seed(static_cast<uint64_t>(args_.seed));
  TORCH_CHECK(module, "Trainer: no model");
  if (args_.activation_checkpointing) {
    auto* model = dynamic_cast<models::SupportsActivationCheckpointing*>(module.get());
    TORCH_CHECK(model, "Trainer: activation_checkpointing is true, but ", module->name(),
                " does not support activation checkpointing (models::"
                "SupportsActivationCheckpointing)");
    const auto kwargs =
        args_.activation_checkpointing_kwargs.value_or(ActivationCheckpointingKwargs{});
    model->activation_checkpointing_enable(kwargs.every_n_layers, kwargs.preserve_rng_state);
  }
  impl_->module = std::move(module);
  impl_->kwargs.model = impl_->module.get();
  impl_->forward = std::move(forward);
  impl_->train_dataset = std::move(train_dataset);
  impl_->eval_dataset = std::move(eval_dataset);
  impl_->compute_metrics = std::move(compute_metrics);
  impl_->callbacks = std::move(callbacks);
  impl_->collate = std::move(data_collator);  // empty: the DataLoader's default
  impl_->label_smoothing = args_.label_smoothing_factor;
  impl_->compute_loss = std::move(compute_loss_func);
  TORCH_CHECK(args_.eval_strategy == "no" || impl_->eval_dataset, "Trainer: eval_strategy is \"",
              args_.eval_strategy, "\" but no eval_dataset was given");
  TORCH_CHECK(args_.save_strategy != "best" || args_.metric_for_best_model,
              "Trainer: metric_for_best_model must be provided when using 'best' save_strategy");
  // As HF's enable_tf32 before torch 2.9 (validate() refused tf32 = true without CUDA).
  if (args_.tf32 && torch::cuda::is_available()) {
    at::globalContext().setAllowTF32CuBLAS(*args_.tf32);
    at::globalContext().setAllowTF32CuDNN(*args_.tf32);
  }
  accelerator_ = std::make_shared<accelerate::Accelerator>(accelerate::AcceleratorOptions{
      // Neither: ACCELERATE_MIXED_PRECISION, else "no", as HF's TrainingArguments.
      .mixed_precision = args_.fp16   ? std::optional<std::string>("fp16")
                         : args_.bf16 ? std::optional<std::string>("bf16")
                                      : std::nullopt,
      // As HF's: the Trainer divides each loss by its accumulation window's length itself
      // (shorter at an epoch's end) and says which micro-steps sync.
      .gradient_accumulation_steps = 1,
      .sync_each_batch = sync_each_batch(args_),
      .cpu = args_.use_cpu,
      // DeepSpeed's min_loss_scale: a run whose gradients overflow even at
      // scale 1 would skip every step from then on; it stops instead.
      .scaler = {.min_scale = 1.0},
      // HF's DataLoaderConfiguration: the Trainer's loaders take them through
      // prepared_loader_options, as do loaders one prepares on trainer.accelerator().
      .split_batches = args_.accelerator_config.split_batches,
      .use_seedable_sampler = args_.accelerator_config.use_seedable_sampler,
      .data_seed =
          args_.data_seed ? std::optional(static_cast<uint64_t>(*args_.data_seed)) : std::nullopt,
      .ddp = ddp_options(args_, *impl_->module),
      .timeout = std::chrono::seconds(args_.ddp_timeout),
      .log_with = args_.report_to,
      .project_dir = args_.output_dir,
      .project_config = {.save_on_each_node = args_.save_on_each_node},
      .numerics_monitor = args_.numerics_monitor_steps > 0
                              ? std::optional(log::NumericsMonitorOptions{
                                    .every_n_steps = args_.numerics_monitor_steps})
                              : std::nullopt});
  // As HF's: log_level on the main process (of each node, with log_on_each_node),
  // log_level_replica on the others; "passive" leaves the verbosity as it is.
  const std::string& level = (args_.log_on_each_node ? accelerator_->is_local_main_process()
                                                     : accelerator_->is_main_process())
                                 ? args_.log_level
                                 : args_.log_level_replica;
  if (level != "passive") log::set_verbosity(log::level_from_name(level));
  accelerator_->register_for_checkpointing(impl_->position);
  state_.is_local_process_zero = accelerator_->is_local_main_process();
  state_.is_world_process_zero = accelerator_->is_main_process();
  impl_->call(args_, state_, [](auto& cb, auto& a, auto& s, auto& c) { cb.on_init_end(a, s, c); });
  measured.stop_and_update_metrics();
}

Trainer::~Trainer() = default;

void Trainer::set_optimizers(std::shared_ptr<torch::optim::Optimizer> optimizer,
                             std::shared_ptr<optim::LRScheduler> lr_scheduler) {
  TORCH_CHECK(optimizer || !lr_scheduler,
              "Trainer::set_optimizers: a scheduler needs its optimizer, given none");
  TORCH_CHECK(!lr_scheduler || &lr_scheduler->optimizer() == optimizer.get(),
              "Trainer::set_optimizers: the scheduler was made for another optimizer");
  if (optimizer) {
    TORCH_CHECK(!optimizer->param_groups().empty(),
                "Trainer::set_optimizers: the optimizer has no param groups");
    // Its state must fit a checkpoint: refused now, not at the first save hours in.
    (void)io::optimizer_state(*optimizer);
    std::unordered_set<const c10::TensorImpl*> parameters;
    for (const auto& p : impl_->module->parameters()) parameters.insert(p.unsafeGetTensorImpl());
    for (const auto& group : optimizer->param_groups())
      for (const auto& p : group.params())
        TORCH_CHECK(parameters.count(p.unsafeGetTensorImpl()),
                    "Trainer::set_optimizers: the optimizer holds a tensor of shape ", p.sizes(),
                    " that is not a parameter of the model");
  }
  // As PyTorch's initial_lr, recorded once: the same optimizer set again keeps its first lrs.
  if (optimizer != impl_->given_optimizer) {
    impl_->initial_lrs.clear();
    if (optimizer)
      for (const auto& group : optimizer->param_groups())
        impl_->initial_lrs.push_back(group.options().get_lr());
  }
  impl_->given_optimizer = std::move(optimizer);
  impl_->given_schedule = std::move(lr_scheduler);
}

void Trainer::add_callback(std::shared_ptr<TrainerCallback> callback) {
  impl_->callbacks.push_back(std::move(callback));
}

TrainOutput Trainer::train(std::optional<std::string> resume_from_checkpoint) {
  auto& acc = *accelerator_;
  auto& impl = *impl_;
  TORCH_CHECK(impl.train_dataset, "Trainer::train: no train_dataset");
  TORCH_CHECK(!args_.eval_on_start || impl.eval_dataset,
              "Trainer::train: eval_on_start is true but no eval_dataset was given");
  if (!resume_from_checkpoint) resume_from_checkpoint = args_.resume_from_checkpoint;
  if (acc.should_save()) {
    try {
      if (io::remove_unfinished_checkpoints(args_.output_dir) > 0)
        MIXPREC_WARN("Trainer: removed checkpoint folders a killed run left unfinished in ",
                     args_.output_dir);
    } catch (const std::exception& e) {  // left for later: not worth a stop (nor a hang below)
      MIXPREC_WARN("Trainer: could not clean up ", args_.output_dir, ": ", e.what());
    }
  }
  acc.wait_for_everyone();  // it may have put a checkpoint back: all look for the last after it
  const bool resume_last = resume_from_checkpoint == "last";
  if (resume_last) {
    const auto last = io::last_good_checkpoint(args_.output_dir);
    resume_from_checkpoint = last ? std::optional(last->string()) : std::nullopt;
    if (acc.is_main_process())
      std::fprintf(stderr, "Trainer: %s%s\n",
                   last ? "resuming from " : "no checkpoint to resume in ",
                   last ? last->c_str() : args_.output_dir.c_str());
  }
  // "last" with no good checkpoint starts afresh: the damaged ones were named above.
  if (!resume_from_checkpoint && !resume_last && !args_.overwrite_output_dir &&
      fs::exists(args_.output_dir)) {
    for (const auto& entry : fs::directory_iterator(args_.output_dir))
      TORCH_CHECK(
          !entry.path().filename().string().starts_with("checkpoint-"),
          "Trainer: ", args_.output_dir, " already holds checkpoints (",
          entry.path().filename().string(),
          "); pass resume_from_checkpoint to continue, or overwrite_output_dir to start over");
  }
  // As HF's activate_neftune and, when train() returns (here also when it throws),
  // deactivate_neftune: the model gets back the alpha it had.
  struct NEFTune {
    models::SupportsNEFTune* model = nullptr;
    std::optional<double> before;
    ~NEFTune() {
      try {
        if (model) model->set_neftune_noise_alpha(before);
      } catch (const std::exception& e) {  // a destructor must not throw
        MIXPREC_WARN("Trainer: could not restore the model's neftune_noise_alpha: ", e.what());
      }
    }
  } neftune;
  if (args_.neftune_noise_alpha) {
    neftune.model = dynamic_cast<models::SupportsNEFTune*>(impl.module.get());
    TORCH_CHECK(neftune.model, "Trainer: neftune_noise_alpha is set, but ", impl.module->name(),
                " has no input embeddings to add the noise to (models::SupportsNEFTune)");
    neftune.before = neftune.model->neftune_noise_alpha();
    neftune.model->set_neftune_noise_alpha(args_.neftune_noise_alpha);
  }

  // As HF's: a resumed run goes on with the batch size its search had found.
  int64_t batch_size = args_.per_device_train_batch_size;
  if (args_.auto_find_batch_size && resume_from_checkpoint) {
    const auto file = fs::path(*resume_from_checkpoint) / "trainer_state.json";
    batch_size = TrainerState::from_json(io::read_file(file), file.string())
                     .train_batch_size.value_or(batch_size);
  }
  while (true) {
    try {
      return train_with_batch_size(resume_from_checkpoint, batch_size);
    } catch (const c10::Error& e) {
      // Accelerate's should_reduce_batch_size: the allocators' out-of-memory errors.
      const std::string what = e.what_without_backtrace();
      if (!args_.auto_find_batch_size ||
          (what.find("DefaultCPUAllocator: can't allocate memory") == std::string::npos &&
           what.find(" out of memory.") == std::string::npos))
        throw;
    } catch (const std::bad_alloc&) {
      if (!args_.auto_find_batch_size) throw;
    }
    // Accelerate's find_executable_batch_size: int(batch_size * 0.9).
    const auto next = static_cast<int64_t>(static_cast<double>(batch_size) * 0.9);
    TORCH_CHECK(next > 0,
                "Trainer: auto_find_batch_size: no executable batch size found, reached zero");
    MIXPREC_WARN("Trainer: out of memory with a batch of ", batch_size, " per device; trying ",
                 next, " (auto_find_batch_size)");
    impl.module->zero_grad();  // a failed backward may have left some
    batch_size = next;
  }
}

TrainOutput Trainer::train_with_batch_size(const std::optional<std::string>& resume_from_checkpoint,
                                           int64_t batch_size) {
  auto& acc = *accelerator_;
  auto& impl = *impl_;
  detail::MemoryTracker::Stage measured(impl.memory, "train");  // the last attempt's
  // This run's optimizer and schedule live in this call: the accelerator forgets them when it
  // returns (another train() makes them afresh, as HF's does).
  // The loop says which micro-steps sync; after it, also after an error, every step does.
  struct FreeMemory {
    accelerate::Accelerator& acc;
    ~FreeMemory() {
      acc.free_memory();
      acc.gradient_state().sync_gradients = true;
    }
  } free_memory{acc};
  if (args_.full_determinism)
    enable_full_determinism(static_cast<uint64_t>(args_.seed));
  else
    accelerate::set_seed(static_cast<uint64_t>(args_.seed));
  auto loader_options = loader_options_of(args_, batch_size);
  // As Accelerate shuffles (the Accelerator's options carry accelerator_config's): with
  // use_seedable_sampler, by data_seed, else torch's seed (`seed`, set above); else HF's
  // RandomSampler, which Accelerate keeps, each pass's order drawn from torch's generator, or
  // in data parallel from one seeded by the main process's draw.
  loader_options.shuffle = args_.train_sampling_strategy == "random";
  // As HF's: a megabatch is a multiple of the accumulation window's samples. (HF's
  // LengthGroupedSampler draws its order from torch's generator; mixprec's from the seed and
  // the epoch, as Accelerate's seedable sampler does the "random" order, so that a resumed
  // epoch goes on in the same order.)
  if (args_.train_sampling_strategy == "group_by_length")
    group_by_length(loader_options, args_, *impl.train_dataset, impl.main_input_name,
                    batch_size * args_.gradient_accumulation_steps);
  loader_options = acc.prepared_loader_options(std::move(loader_options));
  data::DataLoader loader(impl.train_dataset, loader_options, impl.collate);
  const int64_t batches_per_epoch = static_cast<int64_t>(loader.size());
  TORCH_CHECK(batches_per_epoch > 0, "Trainer: the train dataset gives no batch of ", batch_size,
              " samples");
  // A last window shorter than gradient_accumulation_steps still updates.
  const int64_t updates_per_epoch =
      std::max<int64_t>((batches_per_epoch + args_.gradient_accumulation_steps - 1) /
                            args_.gradient_accumulation_steps,
                        1);
  TORCH_CHECK(args_.max_steps > 0 || args_.num_train_epochs * updates_per_epoch <= 1e15,
              "Trainer: num_train_epochs ", args_.num_train_epochs, " of ", updates_per_epoch,
              " steps each are more than 1e15 steps");
  const int64_t max_steps =
      args_.max_steps > 0
          ? args_.max_steps
          : static_cast<int64_t>(std::ceil(args_.num_train_epochs * updates_per_epoch));
  const int64_t num_epochs = args_.max_steps > 0
                                 ? (max_steps + updates_per_epoch - 1) / updates_per_epoch
                                 : static_cast<int64_t>(std::ceil(args_.num_train_epochs));

  // The optimizer and schedule of args, on the trained parameters.
  const std::optional<at::ScalarType> input_dtype = impl.sixteen_bit_dtype();
  const auto label_names = label_names_of(args_);
  // Held here: a set_optimizers() during the run must not free what it steps.
  const auto given_optimizer = impl.given_optimizer;
  const auto given_schedule = impl.given_schedule;
  std::unique_ptr<torch::optim::Optimizer> optimizer;  // args', unless one was given
  if (!given_optimizer) {
    std::vector<at::Tensor> decay, no_decay;
    {
      const auto names = get_decay_parameter_names();
      const std::set<std::string> decayed(names.begin(), names.end());
      for (const auto& p : impl.module->named_parameters())
        if (p.value().requires_grad())
          (decayed.count(p.key()) ? decay : no_decay).push_back(p.value());
    }
    std::vector<torch::optim::OptimizerParamGroup> groups;
    auto optim_args = parse_optim_args(args_.optim_args);
    if (args_.optim == "sgd") {
      // As HF's _get_sgd: optim_args are the defaults, whose weight_decay each group overrides.
      // So it is read and not set: LibTorch's param groups take the defaults' value for an option
      // at its default (weight decay 0 in the group without decay).
      auto options = torch::optim::SGDOptions(args_.learning_rate);
      auto number = [&](const char* key) {
        const auto it = optim_args.find(key);
        if (it == optim_args.end()) return std::optional<double>();
        // As Python's float() (less its "_" between digits): no hexadecimal, a "+" allowed.
        const std::string& text = it->second;
        const char* begin = text.c_str() + (text.starts_with('+') ? 1 : 0);
        double value = 0;
        const auto [end, error] = std::from_chars(begin, text.c_str() + text.size(), value);
        TORCH_CHECK(!text.empty() && error == std::errc() && end == text.c_str() + text.size(),
                    "Trainer: optim_args' ", key, " must be a number, got '", text, "'");
        optim_args.erase(it);
        return std::optional(value);
      };
      if (auto v = number("momentum")) options.momentum(*v);
      if (auto v = number("dampening")) options.dampening(*v);
      number("weight_decay");
      if (auto it = optim_args.find("nesterov"); it != optim_args.end()) {
        std::string value = it->second;
        std::transform(value.begin(), value.end(), value.begin(),
                       [](unsigned char c) { return std::tolower(c); });
        options.nesterov(value == "true" || value == "1" || value == "yes");
        optim_args.erase(it);
      }
      groups.emplace_back(decay,
                          std::make_unique<torch::optim::SGDOptions>(
                              torch::optim::SGDOptions(options).weight_decay(args_.weight_decay)));
      groups.emplace_back(no_decay, std::make_unique<torch::optim::SGDOptions>(
                                        torch::optim::SGDOptions(options).weight_decay(0.0)));
      optimizer = std::make_unique<torch::optim::SGD>(groups, options);
    } else {
      // A model whose parameters are bf16 trains pure bf16 (no fp32 master copy):
      // its updates are rounded stochastically, so those below half a bf16 ulp
      // still count on average (round-to-nearest would drop them).
      const bool pure_bf16 = input_dtype == at::kBFloat16;
      auto options = optim::AdamWOptions(args_.learning_rate)
                         .betas({args_.adam_beta1, args_.adam_beta2})
                         .eps(args_.adam_epsilon)
                         .fused(args_.optim == "adamw_torch_fused" && !pure_bf16)
                         .stochastic_rounding(pure_bf16);
      groups.emplace_back(decay,
                          std::make_unique<optim::AdamWOptions>(
                              optim::AdamWOptions(options).weight_decay(args_.weight_decay)));
      groups.emplace_back(no_decay, std::make_unique<optim::AdamWOptions>(
                                        optim::AdamWOptions(options).weight_decay(0.0)));
      optimizer = std::make_unique<optim::AdamW>(groups, options);
    }
    // HF ignores them silently.
    if (!optim_args.empty())
      MIXPREC_WARN("Trainer: optim ", args_.optim, " does not read optim_args' ",
                   c10::Join(", ", keys_of(optim_args)),
                   "; only sgd reads some (momentum, dampening, weight_decay, nesterov)");
  }
  torch::optim::Optimizer& stepped = given_optimizer ? *given_optimizer : *optimizer;
  std::optional<optim::LRScheduler> made_schedule;  // args', unless one was given
  if (!given_schedule) {
    optim::SchedulerOptions schedule_options{
        .num_warmup_steps = absolute_steps(args_.warmup_steps, max_steps),
        .num_training_steps = max_steps};
    if (args_.lr_scheduler_kwargs)
      optim::set_scheduler_kwargs(schedule_options, args_.lr_scheduler_type,
                                  *args_.lr_scheduler_kwargs);
    if (given_optimizer)
      for (size_t g = 0; g < impl.initial_lrs.size(); ++g)
        stepped.param_groups()[g].options().set_lr(impl.initial_lrs[g]);
    made_schedule.emplace(optim::get_scheduler(args_.lr_scheduler_type, stepped, schedule_options));
  }
  optim::LRScheduler& schedule = given_schedule ? *given_schedule : *made_schedule;
  auto prepared = acc.prepare(impl.module);
  auto accelerated = acc.prepare(stepped);
  acc.prepare(schedule);  // for save_state and load_state only: stepped below, as HF's Trainer
  auto& position = impl.position;
  position.state = {};
  position.global_batch = global_batch_of(args_, acc, batch_size);

  state_ = TrainerState{};
  state_.max_steps = max_steps;
  state_.num_train_epochs = num_epochs;
  state_.logging_steps = absolute_steps(args_.logging_steps, max_steps);
  state_.eval_steps = absolute_steps(args_.eval_steps.value_or(args_.logging_steps), max_steps);
  state_.save_steps = absolute_steps(args_.save_steps, max_steps);
  state_.train_batch_size = batch_size;
  state_.is_local_process_zero = acc.is_local_main_process();
  state_.is_world_process_zero = acc.is_main_process();
  if (resume_from_checkpoint) {
    const fs::path dir = *resume_from_checkpoint;
    // save_only_model's checkpoints have the model and the Trainer's files only.
    const bool model_only = accelerate::Accelerator::holds_models_only(dir);
    acc.load_state(dir.string(), model_only);
    const auto file = dir / "trainer_state.json";
    state_ = TrainerState::from_json(io::read_file(file), file.string());
    if (model_only) {
      // The schedule is a function of the step, and the data position is, as HF derives it,
      // the step's place in its epoch.
      const int64_t step = state_.global_step;
      schedule.load_state_dict({step, schedule.state_dict().base_lrs});
      position.state = {step / updates_per_epoch,
                        step % updates_per_epoch * args_.gradient_accumulation_steps};
      position.saved_global_batch.reset();
      MIXPREC_WARN("Trainer: ", dir.string(),
                   " holds the model only (saved with save_only_model): the optimizer's state, "
                   "the loss scale and the random generators start afresh; the schedule and the "
                   "data go on from step ",
                   step);
    }
    // As HF's: the epoch starts again from its first batch; after its last, the next does.
    if (args_.ignore_data_skip)
      position.state = {
          position.state.epoch + (position.state.batches_yielded >= batches_per_epoch), 0};
    // A RandomSampler's epoch resumes in its order from what the checkpoint recorded; one that
    // records none (save_only_model's, or one saved with the seedable sampler) draws it afresh,
    // as HF's does every time, and skips the batches done.
    auto& resumed = position.state;
    if (loader.random_sampler() && resumed.batches_yielded > 0 && !resumed.pass_seed &&
        !resumed.generator_state) {
      MIXPREC_WARN("Trainer: ", dir.string(),
                   " records no shuffled order for its epoch (use_seedable_sampler = false); the "
                   "epoch's order is drawn afresh and its first ",
                   resumed.batches_yielded, " batches skipped");
      const int64_t done = resumed.batches_yielded;
      resumed = loader.state_at(resumed.epoch, 0);
      if (!resumed.generator_state) resumed.pass_seed = data::draw_seed();
      resumed.batches_yielded = done;
    }
    loader.load_state(position.state);
    // Mid-epoch, the batches done stand for other samples when the batch of all processes
    // together changed (another batch size or number of processes).
    if (position.state.batches_yielded > 0 && position.saved_global_batch &&
        *position.saved_global_batch != position.global_batch)
      MIXPREC_WARN("Trainer: ", *resume_from_checkpoint, " stopped mid-epoch with a batch of ",
                   *position.saved_global_batch,
                   " samples on all processes together; this run's is ", position.global_batch,
                   " (a batch of ", loader_options.batch_size, " per device x ",
                   acc.num_processes(),
                   " processes), so the rest of the epoch can repeat or skip "
                   "samples");
    if (state_.best_model_checkpoint && !fs::exists(*state_.best_model_checkpoint)) {
      MIXPREC_WARN(
          "Trainer: the best checkpoint ", *state_.best_model_checkpoint,
          " recorded in the resumed state does not exist anymore; ignoring it for this run");
      state_.best_model_checkpoint.reset();
    }
    // This run's length, as HF's init_training_references (a resumed run may train longer).
    state_.max_steps = max_steps;
    state_.num_train_epochs = num_epochs;
    state_.is_local_process_zero = acc.is_local_main_process();
    state_.is_world_process_zero = acc.is_main_process();
  }
  open_trackers();

  const Impl::Training training(impl.kwargs, stepped, schedule, loader);
  impl.in_train = true;
  impl.control = {};
  if (resume_from_checkpoint && args_.restore_callback_states_from_checkpoint)
    impl.restore_callback_states(state_.stateful_callbacks);
  {  // a callback whose state() cannot be saved fails now, not at the first checkpoint
    TrainerState probe;
    probe.stateful_callbacks = impl.callback_states();
    (void)probe.to_json();
  }
  {
    const int64_t accumulation = args_.gradient_accumulation_steps;
    log::info("***** Running training *****");
    log::info("  Num examples = ", with_commas(static_cast<int64_t>(impl.train_dataset->size())));
    log::info("  Num Epochs = ", with_commas(num_epochs));
    log::info("  Num update steps per epoch = ", with_commas(updates_per_epoch));
    log::info("  Instantaneous batch size per device = ",
              with_commas(args_.per_device_train_batch_size));
    if (batch_size != args_.per_device_train_batch_size)  // HF's words, for auto_find_batch_size
      log::info("  Training with DataParallel so batch size has been adjusted to: ",
                with_commas(batch_size));
    log::info("  Total train batch size (w. parallel, distributed & accumulation) = ",
              with_commas(global_batch_of(args_, acc, batch_size) * accumulation));
    log::info("  Gradient Accumulation steps = ", accumulation);
    log::info("  Total optimization steps = ", with_commas(max_steps));
    log::info("  Number of trainable parameters = ",
              with_commas(num_parameters(*impl.module, /*only_trainable=*/true,
                                         /*exclude_embeddings=*/false)));
    if (resume_from_checkpoint) {
      log::info("  Resuming training from checkpoint with epoch ", loader.epoch(),
                " and global step ", state_.global_step);
      if (!args_.ignore_data_skip)
        log::info("  Fast-forwarding the dataloader past ", loader.epoch(), " epochs and ",
                  loader.batches_yielded(), " batches to resume from the exact training state.");
    }
  }
  const StopSignals stop_signals;
  int stopped_by = 0;
  // As HF's TensorBoardCallback.on_train_begin: the arguments, as text.
  if (std::ranges::count(args_.report_to, "tensorboard") > 0)
    if (auto* tensorboard = acc.get_tracker("tensorboard"))  // none on the other processes
      tensorboard->log_text({{"args", args_.to_json()}}, 0);
  impl.call(args_, state_, [](auto& cb, auto& a, auto& s, auto& c) { cb.on_train_begin(a, s, c); });
  if (args_.eval_on_start) evaluate();  // as HF's: no best metric from it
  log::ProgressBar progress(
      max_steps, "train",
      {.enabled = args_.disable_tqdm ? std::optional<bool>(!*args_.disable_tqdm) : std::nullopt});
  progress.update(state_.global_step);
  const auto start = std::chrono::steady_clock::now();
  const int64_t start_step = state_.global_step;
  const int64_t start_tokens = state_.num_input_tokens_seen;
  // HF's floating_point_ops for a batch with input_ids: 6 x its tokens x these parameters.
  const int64_t flos_parameters =
      num_parameters(*impl.module, /*only_trainable=*/false, /*exclude_embeddings=*/true);
  impl.current_flos = 0;
  at::Tensor loss_since_log = at::zeros({});
  int64_t last_logged_step = state_.global_step;
  double total_loss = 0;
  std::optional<double> last_grad_norm;  // from the last optimizer step; NaN and inf too, as HF
  double last_step_lr = NAN;      // the rate the last step used: HF logs it, not the next one
  int64_t skipped_since_log = 0;  // optimizer steps the scaler skipped (inf/NaN gradients)

  // Ends training on what no step can fix, keeping every checkpoint.
  auto stop_training = [&](const std::string& why) {
    const auto last = io::last_good_checkpoint(args_.output_dir);
    TORCH_CHECK(false, "Trainer: stopped at step ", state_.global_step + 1, ": ", why,
                ". The last good checkpoint is ", last ? last->string() : std::string("none"),
                ". Lower the learning rate or check the model and the data.");
  };
  int64_t saved_step = -1;  // the step of this run's last checkpoint
  // stopping: a signal stops training after this step, whose checkpoint must be one to resume
  // from (a whole one, even with save_only_model).
  auto maybe_log_save_evaluate = [&](bool stopping) {
    if (impl.control.should_log && state_.global_step > last_logged_step) {
      const double loss = acc.reduce(loss_since_log, "mean").item<double>() /
                          static_cast<double>(state_.global_step - last_logged_step);
      total_loss += loss * static_cast<double>(state_.global_step - last_logged_step);
      loss_since_log.zero_();
      last_logged_step = state_.global_step;
      Metrics logs{{"loss", loss}, {"learning_rate", last_step_lr}};
      if (last_grad_norm) logs["grad_norm"] = *last_grad_norm;
      store_flos();  // as HF: the state's total_flos is current in every log
      if (args_.include_num_input_tokens_seen != "no") {  // HF's speed_metrics with num_tokens
        logs["train_runtime"] = seconds_since(start);
        logs["train_tokens_per_second"] =
            static_cast<double>(state_.num_input_tokens_seen - start_tokens) /
            logs["train_runtime"];
      }
      if (acc.scaler()) {
        logs["loss_scale"] = acc.scaler()->get_scale();
        logs["skipped_steps"] = static_cast<double>(skipped_since_log);
        skipped_since_log = 0;
      }
      log(logs);
      char postfix[64];
      std::snprintf(postfix, sizeof(postfix), "loss=%.4g", loss);
      progress.set_postfix(postfix);
    }
    if (impl.control.should_evaluate) {
      const Metrics metrics = evaluate();
      bool new_best = false;
      if (args_.metric_for_best_model) {
        std::string name = *args_.metric_for_best_model;
        if (!name.starts_with("eval_")) name = "eval_" + name;
        auto it = metrics.find(name);
        TORCH_CHECK(it != metrics.end(), "Trainer: metric_for_best_model '", name,
                    "' is not among the evaluation metrics");
        const bool greater = args_.greater_is_better.value_or(true);
        // From -inf (+inf) as HF: a NaN never becomes the best.
        const double best = state_.best_metric.value_or(greater ? -INFINITY : INFINITY);
        new_best = greater ? it->second > best : it->second < best;
        if (new_best) {
          state_.best_metric = it->second;
          state_.best_global_step = state_.global_step;
        }
      }
      // As HF's: "best" saves on a new best only, whatever a callback asked.
      if (args_.save_strategy == "best") impl.control.should_save = new_best;
    }
    if (impl.control.should_save) {
      save_checkpoint(args_.save_only_model && !stopping);
      saved_step = state_.global_step;
    }
    impl.control.should_log = impl.control.should_evaluate = impl.control.should_save = false;
  };

  const int64_t token_processes = token_processes_of(args_, acc);
  impl.module->zero_grad();  // as HF: nothing left from before (a run stopped mid-window) adds in
  for (int64_t epoch = loader.epoch(); epoch < num_epochs && !impl.control.should_training_stop;
       ++epoch) {
    loader.set_epoch(epoch);
    impl.call(args_, state_,
              [](auto& cb, auto& a, auto& s, auto& c) { cb.on_epoch_begin(a, s, c); });
    int64_t step_in_epoch = loader.state().batches_yielded;
    // The rest of the accumulation window, read at its start (HF's get_batch_samples), and its
    // label tokens on all processes when the model takes num_items_in_batch.
    std::vector<data::Batch> window_batches;
    size_t next_in_window = 0;
    std::optional<int64_t> num_items_in_batch;
    for (auto it = loader.begin(); next_in_window < window_batches.size() || it != loader.end();) {
      if (step_in_epoch % args_.gradient_accumulation_steps == 0) {
        // As HF's CallbackHandler: what was asked before this step (on_epoch_begin, say) is not.
        impl.control.should_log = impl.control.should_evaluate = impl.control.should_save = false;
        impl.call(args_, state_,
                  [](auto& cb, auto& a, auto& s, auto& c) { cb.on_step_begin(a, s, c); });
      }
      // The last batches of an epoch that do not fill an accumulation window still update.
      const int64_t window_start =
          step_in_epoch - step_in_epoch % args_.gradient_accumulation_steps;
      const int64_t window =
          std::min(args_.gradient_accumulation_steps, batches_per_epoch - window_start);
      if (next_in_window == window_batches.size()) {
        window_batches.clear();
        next_in_window = 0;
        for (int64_t i = step_in_epoch; i < window_start + window && it != loader.end(); ++i, ++it)
          window_batches.push_back(*it);
        num_items_in_batch =
            impl.counts_items()
                ? count_label_tokens(window_batches, acc, token_processes, impl.causal_lm())
                : std::nullopt;
      }
      const data::Batch batch = std::move(window_batches[next_in_window++]);
      count_tokens_and_flos(batch, flos_parameters);
      acc.gradient_state().sync_gradients = step_in_epoch + 1 == window_start + window;
      // As HF's: the window's other batches keep their gradients on each process (unless
      // sync_each_batch).
      std::optional<accelerate::Accelerator::GradSyncGuard> local;
      if (!acc.sync_gradients() && !sync_each_batch(args_)) local.emplace(acc.no_sync(prepared));
      const data::Batch on_device = impl.to_device(batch, acc.device(), input_dtype, label_names);
      impl.module->train();
      models::ModelOutput out =
          prepared.run([&] { return impl.model_outputs(on_device, num_items_in_batch); });
      impl.add_loss(out, on_device, num_items_in_batch, token_processes);
      TORCH_CHECK(out.loss.defined(),
                  "Trainer: ", impl.compute_loss ? "compute_loss_func" : "the model",
                  " returned no loss; does the batch hold labels? (its keys: ",
                  c10::Join(", ", keys_of(batch)), ")");
      if (args_.torch_empty_cache_steps && state_.global_step % *args_.torch_empty_cache_steps == 0)
        accelerate::clear_device_cache();
      // One host read of the loss where its value matters: without a scaler nothing would skip
      // a non-finite step (stop before it is taken), and logging_nan_inf_filter keeps it out of
      // the logged loss.
      const bool read_loss = !acc.scaler() || args_.logging_nan_inf_filter;
      const bool finite_loss = !read_loss || std::isfinite(out.loss.item<double>());
      if (!acc.scaler() && !finite_loss)
        stop_training(c10::str("the loss is ", out.loss.item<double>(), " (",
                               acc.mixed_precision() == "no" ? "fp32" : acc.mixed_precision(),
                               ": no loss scaling to skip it)"));
      // Divided by the window's label tokens already, the loss adds up over the window.
      // As HF's: a compute_loss_func's loss is taken as scaled for the window already.
      const at::Tensor loss =
          num_items_in_batch || impl.compute_loss || window == 1 ? out.loss : out.loss / window;
      acc.backward(loss);
      const at::Tensor step_loss = loss.detach().to(at::kFloat).cpu();
      // As HF's logging_nan_inf_filter: an inf/NaN loss (a skipped fp16 step) counts as the
      // average of those since the last log.
      if (args_.logging_nan_inf_filter && !finite_loss)
        loss_since_log.add_(loss_since_log /
                            static_cast<double>(1 + state_.global_step - last_logged_step));
      else
        loss_since_log.add_(step_loss);
      ++step_in_epoch;
      if (acc.sync_gradients()) {
        // Without clipping, the norm is still measured for the logs (HF's _get_grad_norm).
        last_grad_norm =
            acc.clip_grad_norm_(impl.module->parameters(),
                                args_.max_grad_norm > 0 ? args_.max_grad_norm
                                                        : std::numeric_limits<double>::infinity());
        impl.call(args_, state_,
                  [](auto& cb, auto& a, auto& s, auto& c) { cb.on_pre_optimizer_step(a, s, c); });
        try {
          accelerated.step();
        } catch (const c10::Error& e) {  // the scale stuck at min_scale
          stop_training(e.what_without_backtrace());
        }
        skipped_since_log += acc.optimizer_step_was_skipped();
        impl.call(args_, state_,
                  [](auto& cb, auto& a, auto& s, auto& c) { cb.on_optimizer_step(a, s, c); });
        last_step_lr = schedule.get_last_lr()[0];
        // Once per update, as in HF's Trainer (which does not prepare its scheduler): the
        // schedule counts this process's updates, where a prepared scheduler would step
        // num_processes times each.
        if (!acc.optimizer_step_was_skipped()) schedule.step();
        accelerated.zero_grad();
        ++state_.global_step;
        state_.epoch = static_cast<double>(epoch) +
                       static_cast<double>(step_in_epoch) / static_cast<double>(batches_per_epoch);
        position.state = loader.state_at(epoch, step_in_epoch);
        progress.update();
        // HF's DefaultFlowCallback: what this step does by the strategies.
        auto& c = impl.control;
        c.should_log |= (state_.global_step == 1 && args_.logging_first_step) ||
                        (args_.logging_strategy == "steps" && state_.logging_steps > 0 &&
                         state_.global_step % state_.logging_steps == 0);
        // eval_delay: the steps before the first evaluation.
        const bool may_evaluate = args_.eval_strategy == "steps" &&
                                  args_.eval_delay <= static_cast<double>(state_.global_step);
        c.should_evaluate |=
            may_evaluate && state_.eval_steps > 0 && state_.global_step % state_.eval_steps == 0;
        c.should_save |= args_.save_strategy == "steps" && state_.save_steps > 0 &&
                         state_.global_step % state_.save_steps == 0;
        if (state_.global_step >= max_steps) {
          c.should_training_stop = true;
          // HF's DefaultFlowCallback: a last evaluation and save by "steps" (one by "epoch"
          // follows at the epoch's end).
          c.should_evaluate |= may_evaluate;
          c.should_save |= args_.save_strategy == "steps";
        }
        impl.call(args_, state_,
                  [](auto& cb, auto& a, auto& s, auto& c) { cb.on_step_end(a, s, c); });
        // A signal reaches the processes at different steps: they stop together at the first
        // step any saw one (else one would save while another trains, and collectives mismatch).
        int signal = stop_signal;
        if (acc.num_processes() > 1 &&
            acc.reduce(at::full({1}, signal, at::kInt), "sum").item<int>() != 0 && signal == 0)
          signal = SIGTERM;
        maybe_log_save_evaluate(/*stopping=*/signal != 0);
        if (signal != 0) {
          stopped_by = signal;
          const auto dir =
              fs::path(args_.output_dir) / ("checkpoint-" + std::to_string(state_.global_step));
          if (saved_step != state_.global_step) save_checkpoint(/*model_only=*/false);
          impl.control.should_training_stop = true;
          if (acc.is_main_process())
            std::fprintf(stderr,
                         "\nTrainer: stopped by %s at step %lld; saved %s. Resume with "
                         "--resume_from_checkpoint %s (or last)\n",
                         stopped_by == SIGINT ? "SIGINT" : "SIGTERM",
                         static_cast<long long>(state_.global_step), dir.c_str(), dir.c_str());
        }
      } else {
        impl.call(args_, state_,
                  [](auto& cb, auto& a, auto& s, auto& c) { cb.on_substep_end(a, s, c); });
      }
      if (impl.control.should_epoch_stop || impl.control.should_training_stop) break;
    }
    if (stopped_by) break;
    // Stopped by max_steps before the epoch's end, a resumed run goes on from this step.
    if (!impl.control.should_training_stop || step_in_epoch == batches_per_epoch)
      position.state = loader.state_at(epoch + 1, 0);
    auto& c = impl.control;
    c.should_log |= args_.logging_strategy == "epoch";
    c.should_evaluate |= args_.eval_strategy == "epoch" && args_.eval_delay <= state_.epoch;
    c.should_save |= args_.save_strategy == "epoch";
    impl.call(args_, state_, [](auto& cb, auto& a, auto& s, auto& c) { cb.on_epoch_end(a, s, c); });
    maybe_log_save_evaluate(/*stopping=*/false);
    c.should_epoch_stop = false;
  }
  progress.close();
  impl.in_train = false;
  if (acc.numerics_monitor() && acc.is_main_process())
    std::fprintf(stderr, "%s", acc.numerics_monitor()->summary().c_str());

  // What was not logged yet counts in the average loss.
  const int64_t unlogged = state_.global_step - last_logged_step;
  if (unlogged > 0) total_loss += acc.reduce(loss_since_log, "mean").item<double>();
  const int64_t trained = state_.global_step - start_step;
  const double runtime = seconds_since(start);
  const double train_loss = trained > 0 ? total_loss / static_cast<double>(trained) : 0.0;
  store_flos();
  // HF's count: the schedule's samples (the dataset's epochs, or max_steps whole batches),
  // in the share of its steps run in this call.
  const double schedule_samples =
      args_.max_steps > 0
          ? static_cast<double>(max_steps) *
                static_cast<double>(global_batch_of(args_, acc, batch_size)) *
                static_cast<double>(args_.gradient_accumulation_steps)
          : static_cast<double>(impl.train_dataset->size()) * args_.num_train_epochs;
  const double samples =
      schedule_samples * static_cast<double>(trained) / static_cast<double>(max_steps);
  TrainOutput output{state_.global_step,
                     train_loss,
                     {{"train_runtime", runtime},
                      {"train_samples_per_second", samples / runtime},
                      {"train_steps_per_second", static_cast<double>(trained) / runtime},
                      {"total_flos", state_.total_flos},
                      {"train_loss", train_loss}}};
  output.stopped_by_signal = stopped_by;
  measured.stop_and_update_metrics(&output.metrics);
  log::info("\n\nTraining completed.\n\n");
  log_in_place(output.metrics);
  // Then, as HF's _finalize_training: the best model, and with save_total_limit 1 only the best
  // checkpoint stays.
  if (args_.load_best_model_at_end && state_.best_model_checkpoint && !stopped_by) {
    log::info("Loading best model from ", *state_.best_model_checkpoint,
              " (score: ", log::python_repr(state_.best_metric.value_or(NAN)), ").");
    const auto file = fs::path(*state_.best_model_checkpoint) / "model.safetensors";
    io::load_module_state(*impl.module, io::load_safetensors(file), file.string());
  }
  if (args_.save_total_limit == 1 && state_.best_model_checkpoint && !stopped_by &&
      acc.should_save())
    for (const auto& [step, dir] : io::checkpoints(args_.output_dir))
      if (!same_folder(dir, *state_.best_model_checkpoint)) {
        log::info("Deleting older checkpoint [", dir.string(), "] due to args.save_total_limit");
        io::remove_old_checkpoint(dir);
      }
  impl.call(args_, state_, [](auto& cb, auto& a, auto& s, auto& c) { cb.on_train_end(a, s, c); });
  acc.end_training();
  impl.trackers_open = false;
  return output;
}

void Trainer::save_checkpoint(bool model_only) {
  auto& acc = *accelerator_;
  const fs::path dir =
      fs::path(args_.output_dir) / ("checkpoint-" + std::to_string(state_.global_step));
  // As HF's _save_checkpoint: the best step's folder, when it was saved (now, or earlier and
  // still there: an evaluation may find a best at a step saved before it).
  if (args_.metric_for_best_model && state_.best_global_step.value_or(0) > 0) {
    const fs::path best =
        fs::path(args_.output_dir) / ("checkpoint-" + std::to_string(*state_.best_global_step));
    if (*state_.best_global_step == state_.global_step || fs::is_directory(best))
      state_.best_model_checkpoint = best.string();
  }
  store_flos();
  state_.stateful_callbacks = impl_->callback_states();
  if (acc.is_main_process()) log::info("Saving model checkpoint to ", dir.string());
  acc.save_state(
      dir.string(),
      {{"trainer_state.json", state_.to_json()}, {"training_args.json", args_.to_json()}},
      model_only);
  // As HF's _rotate_checkpoints: a limit of 0 or below keeps every checkpoint.
  if (args_.save_total_limit.value_or(0) > 0 && acc.should_save())
    rotate_checkpoints(*args_.save_total_limit, dir);
  impl_->call(args_, state_, [](auto& cb, auto& a, auto& s, auto& c) { cb.on_save(a, s, c); });
}

// HF's rotate_checkpoints (with use_mtime): the least recently written go first, never the
// newest (to resume from) nor the best; so at least those two stay. Nor the folder just saved:
// HF's fallback to step order (below) would delete it when a run resumed from an earlier
// checkpoint than the output folder's last.
void Trainer::rotate_checkpoints(int64_t limit, const fs::path& just_saved) const {
  const auto found = io::checkpoints(args_.output_dir);
  if (static_cast<int64_t>(found.size()) <= limit) return;
  std::vector<std::pair<fs::file_time_type, fs::path>> by_time;
  for (const auto& [step, dir] : found) {
    std::error_code gone;  // a folder deleted meanwhile sorts first
    by_time.emplace_back(fs::last_write_time(dir, gone), dir);
  }
  std::ranges::stable_sort(by_time, {}, [](const auto& c) { return c.first; });
  // As HF: modification times less than a second apart are taken as unreliable (some file
  // systems fake them), and the steps' order used instead.
  const bool use_time = by_time.back().first - by_time.front().first >= std::chrono::seconds(1);
  std::vector<fs::path> checkpoints;
  for (size_t i = 0; i < found.size(); ++i)
    checkpoints.push_back(use_time ? by_time[i].second : found[i].second);
  const fs::path newest = checkpoints.back();
  auto kept = [&](const fs::path& dir) {
    return dir == newest || same_folder(dir, just_saved) ||
           (state_.best_model_checkpoint && same_folder(dir, *state_.best_model_checkpoint));
  };
  const auto protected_count =
      std::ranges::count_if(checkpoints, [&](const fs::path& dir) { return kept(dir); });
  auto left = static_cast<int64_t>(checkpoints.size());
  const auto keep = std::max<int64_t>(limit, protected_count);
  for (const auto& dir : checkpoints) {
    if (left <= keep) break;
    if (kept(dir)) continue;
    log::info("Deleting older checkpoint [", dir.string(), "] due to args.save_total_limit");
    io::remove_old_checkpoint(dir);
    --left;
  }
}

// As HF's TensorBoardCallback, which makes its writer again at the next log after training:
// evaluate() before or after train() is logged too.
void Trainer::open_trackers() {
  if (impl_->trackers_open) return;
  accelerator_->init_trackers(args_.run_name.value_or("runs"));
  impl_->trackers_open = true;
}

std::vector<std::string> Trainer::get_decay_parameter_names() const {
  static const std::regex no_decay_name(
      R"(bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.))");
  std::set<const c10::TensorImpl*> in_layer_norms;
  for (const auto& item : impl_->module->named_modules())
    if (item.value()->as<torch::nn::LayerNorm>())
      for (const auto& p : item.value()->parameters(/*recurse=*/false))
        in_layer_norms.insert(p.unsafeGetTensorImpl());
  std::vector<std::string> names;
  for (const auto& p : impl_->module->named_parameters()) {
    std::string name = p.key();
    std::ranges::transform(name, name.begin(), [](unsigned char c) { return std::tolower(c); });
    if (!in_layer_norms.count(p.value().unsafeGetTensorImpl()) &&
        !std::regex_search(name, no_decay_name))
      names.push_back(p.key());
  }
  return names;
}

void Trainer::log(Metrics logs) { log_in_place(logs); }

// HF's _track_num_input_tokens (all processes' tokens) and floating_point_ops, for one batch.
void Trainer::count_tokens_and_flos(const data::Batch& batch, int64_t flos_parameters) {
  auto& acc = *accelerator_;
  const auto ids = batch.find("input_ids");  // HF's main_input_name
  if (ids != batch.end())
    impl_->current_flos +=
        6.0 * static_cast<double>(ids->second.numel()) * static_cast<double>(flos_parameters);
  if (args_.include_num_input_tokens_seen == "no") return;
  if (ids == batch.end()) {
    MIXPREC_WARN_ONCE(
        "Trainer: include_num_input_tokens_seen counts input_ids, which the batches "
        "do not hold; no tokens are counted");
    return;
  }
  const auto mask = batch.find("attention_mask");
  if (args_.include_num_input_tokens_seen == "non_padding" && mask == batch.end()) {
    MIXPREC_WARN_ONCE(
        "Trainer: include_num_input_tokens_seen \"non_padding\" counts "
        "attention_mask's ones, which the batches do not hold; counting every token");
  }
  int64_t tokens = args_.include_num_input_tokens_seen == "non_padding" && mask != batch.end()
                       ? mask->second.sum().item<int64_t>()
                       : ids->second.numel();
  if (acc.num_processes() > 1)
    tokens = acc.reduce(at::full({1}, tokens, at::kLong), "sum").item<int64_t>();
  state_.num_input_tokens_seen += tokens;
}

// HF's store_flos: every process's operations since the last call, into the state.
void Trainer::store_flos() {
  auto& acc = *accelerator_;
  state_.total_flos +=
      acc.num_processes() > 1
          ? acc.reduce(at::full({1}, impl_->current_flos, at::kDouble), "sum").item<double>()
          : impl_->current_flos;
  impl_->current_flos = 0;
}

// As HF's log(), which adds the epoch to the caller's dict: evaluate() and train() return it.
void Trainer::log_in_place(Metrics& logs) {
  logs["epoch"] = state_.epoch;
  if (args_.include_num_input_tokens_seen != "no")
    logs["num_input_tokens_seen"] = static_cast<double>(state_.num_input_tokens_seen);
  Metrics entry = logs;
  entry["step"] = static_cast<double>(state_.global_step);
  state_.log_history.push_back(entry);
  // The trackers' tags as HF's integrations write them (rewrite_logs): eval_x -> eval/x,
  // test_x -> test/x, anything else x -> train/x.
  Metrics tagged;
  for (const auto& [key, value] : logs)
    tagged[key.starts_with("eval_")   ? "eval/" + key.substr(5)
           : key.starts_with("test_") ? "test/" + key.substr(5)
                                      : "train/" + key] = value;
  open_trackers();
  accelerator_->log(tagged, state_.global_step);
  impl_->call(args_, state_,
              [&](auto& cb, auto& a, auto& s, auto& c) { cb.on_log(a, s, c, logs); });
}

Metrics Trainer::evaluate(data::DatasetPtr eval_dataset) {
  if (!eval_dataset) eval_dataset = impl_->eval_dataset;
  TORCH_CHECK(eval_dataset, "Trainer::evaluate: no eval_dataset");
  detail::MemoryTracker::Stage measured(impl_->memory, "eval");
  // As HF: without compute_metrics, nothing needs the logits (a language model's are large).
  Metrics metrics =
      prediction_loop(eval_dataset, "eval", args_.prediction_loss_only || !impl_->compute_metrics,
                      /*predicting=*/false)
          .metrics;
  log_in_place(metrics);
  impl_->call(args_, state_,
              [&](auto& cb, auto& a, auto& s, auto& c) { cb.on_evaluate(a, s, c, metrics); });
  measured.stop_and_update_metrics(&metrics);  // as HF's: in what it returns, not in the logs
  return metrics;
}

PredictionOutput Trainer::predict(data::DatasetPtr test_dataset) {
  TORCH_CHECK(test_dataset, "Trainer::predict: no dataset");
  detail::MemoryTracker::Stage measured(impl_->memory, "test");
  PredictionOutput output =
      prediction_loop(std::move(test_dataset), "test", args_.prediction_loss_only,
                      /*predicting=*/true);
  impl_->call(args_, state_,
              [&](auto& cb, auto& a, auto& s, auto& c) { cb.on_predict(a, s, c, output.metrics); });
  measured.stop_and_update_metrics(&output.metrics);
  return output;
}

// HF's evaluation_loop: the metrics' names start with `prefix`_.
PredictionOutput Trainer::prediction_loop(data::DatasetPtr dataset, const std::string& prefix,
                                          bool loss_only, bool predicting) {
  auto& acc = *accelerator_;
  auto& impl = *impl_;
  // As HF: outside train(), *_full_eval runs the whole model in 16 bits.
  if (!impl.in_train && (args_.fp16_full_eval || args_.bf16_full_eval))
    impl.module->to(args_.fp16_full_eval ? at::kHalf : at::kBFloat16);
  const std::optional<at::ScalarType> input_dtype = impl.sixteen_bit_dtype();
  const auto label_names = label_names_of(args_);
  const int64_t token_processes = token_processes_of(args_, acc);
  // Kept for the callbacks' kwargs() until the next evaluation, as HF's callback handler keeps
  // it; held here too, for a callback that evaluates again from inside this loop.
  auto loader_options = loader_options_of(args_, args_.per_device_eval_batch_size);
  // As HF's eval sampler with "group_by_length": every evaluation in the order of one seed.
  if (args_.train_sampling_strategy == "group_by_length")
    group_by_length(loader_options, args_, *dataset, impl.main_input_name,
                    args_.per_device_eval_batch_size);
  loader_options = acc.prepared_loader_options(std::move(loader_options));
  const auto loader_ptr =
      std::make_shared<data::DataLoader>(std::move(dataset), loader_options, impl.collate);
  data::DataLoader& loader = *loader_ptr;
  log::info("\n***** Running ", predicting ? "Prediction" : "Evaluation", " *****");
  log::info("  Num examples = ", loader.dataset()->size());
  log::info("  Batch size = ", args_.per_device_eval_batch_size);
  impl.eval_loader = loader_ptr;
  impl.kwargs.eval_dataloader = loader_ptr.get();
  const auto start = std::chrono::steady_clock::now();
  impl.module->eval();
  at::NoGradGuard no_grad;
  const auto& include = args_.include_for_metrics;
  const bool computes_metrics = !loss_only && impl.compute_metrics;
  const bool with_inputs =
      computes_metrics && std::find(include.begin(), include.end(), "inputs") != include.end();
  const bool with_losses =
      computes_metrics && std::find(include.begin(), include.end(), "loss") != include.end();
  const bool per_batch_metrics = computes_metrics && args_.batch_eval_metrics;
  // As HF's: predict() returns every batch's logits and labels even when the metrics are per batch.
  const bool keep_outputs = !loss_only && (!per_batch_metrics || predicting);
  std::vector<at::Tensor> logits, losses, inputs;
  std::vector<std::vector<at::Tensor>> labels(label_names.size());  // each label name's batches
  Metrics metrics;  // compute_metrics' (with per_batch_metrics, its last call's)
  int64_t batches = 0;
  const size_t last = loader.size() - 1;
  for (const data::Batch& batch : loader) {
    const data::Batch on_device = impl.to_device(batch, acc.device(), input_dtype, label_names);
    // As HF's prediction_step: a causal LM's loss over the batch's label tokens, on all
    // processes with average_tokens_across_devices.
    const auto num_items =
        impl.counts_items()
            ? count_label_tokens({&batch, 1}, acc, token_processes, impl.causal_lm())
            : std::nullopt;
    // As HF's prediction_step: a batch without labels gets no compute_loss_func loss.
    const bool with_loss = !impl.compute_loss || on_device.count("labels");
    models::ModelOutput out;
    {
      auto autocast = acc.autocast();
      out = impl.model_outputs(on_device, num_items);
      if (autocast) out = accelerate::detail::to_fp32(std::move(out));
    }
    if (with_loss) impl.add_loss(out, on_device, num_items, token_processes);
    int64_t n = on_device.begin()->second.size(0);
    // Samples that only padded the ranks to equal shares are not counted (gather_for_metrics).
    const int64_t valid = n - (static_cast<size_t>(batches) == last
                                   ? static_cast<int64_t>(loader.num_padding_samples())
                                   : 0);
    const auto keep = acc.gather((at::arange(n) < valid).to(at::kByte)).to(at::kBool);
    // As HF's prediction_step: labels, and a loss, only for a batch that holds every label name.
    const bool has_labels =
        !label_names.empty() && std::ranges::all_of(label_names, [&](const std::string& name) {
          return on_device.count(name) > 0;
        });
    // As HF's compute_loss, which such a batch goes through: no loss is an error.
    TORCH_CHECK(!has_labels || out.loss.defined(),
                "Trainer: the model did not return a loss from the inputs, only the following "
                "keys: ",
                out.logits.defined() ? "logits" : "",
                ". For reference, the inputs it received are ", c10::Join(",", keys_of(on_device)),
                ".");
    at::Tensor batch_losses, batch_logits, batch_inputs;
    std::vector<at::Tensor> batch_labels;  // one per label name
    if (has_labels)  // the batch's mean loss (checked above) for each sample, as HF repeats it
      batch_losses = acc.gather(out.loss.detach()
                                    .to(at::kFloat)
                                    .mean()
                                    .cpu()
                                    .reshape({1})
                                    .expand({n})
                                    .contiguous())
                         .index({keep});
    // As HF's evaluation_loop: the ranks' batches may differ in length (padded collation).
    auto gather = [&](const at::Tensor& t) {
      return acc.gather(acc.pad_across_processes(t, 1, -100)).index({keep});
    };
    if (!loss_only) {
      if (out.logits.defined()) batch_logits = gather(out.logits.detach().to(at::kFloat).cpu());
      if (has_labels)
        for (const auto& name : label_names)
          batch_labels.push_back(gather(on_device.at(name).cpu()));
    }
    if (with_inputs) {
      auto input = batch.find(impl.main_input_name);
      TORCH_CHECK(input != batch.end(), "Trainer: include_for_metrics has \"inputs\", but the ",
                  prefix, " batch holds no '", impl.main_input_name,
                  "' (the model's main_input_name); its keys: ", c10::Join(", ", keys_of(batch)));
      batch_inputs = gather(input->second);
    }
    if (batch_losses.defined()) losses.push_back(batch_losses);
    if (keep_outputs) {
      if (batch_logits.defined()) logits.push_back(batch_logits);
      for (size_t i = 0; i < batch_labels.size(); ++i) labels[i].push_back(batch_labels[i]);
      if (batch_inputs.defined()) inputs.push_back(batch_inputs);
    }
    impl.call(args_, state_,
              [](auto& cb, auto& a, auto& s, auto& c) { cb.on_prediction_step(a, s, c); });
    if (per_batch_metrics && batch_logits.defined() && !batch_labels.empty())
      metrics = impl.compute_metrics({batch_logits, batch_labels[0], batch_inputs,
                                      with_losses ? batch_losses : at::Tensor(),
                                      static_cast<size_t>(batches) == last, batch_labels});
    ++batches;
  }
  std::vector<at::Tensor> all_labels;
  for (const auto& parts : labels)
    if (!parts.empty()) all_labels.push_back(concat_padded(parts));
  PredictionOutput output{
      concat_padded(logits), all_labels.empty() ? at::Tensor() : all_labels[0], {}, all_labels};
  if (!losses.empty()) {
    // As HF: with logging_nan_inf_filter, the finite losses only, if any.
    at::Tensor all = at::cat(losses).to(at::kDouble);
    const auto finite = all.isfinite();
    if (args_.logging_nan_inf_filter && finite.any().item<bool>()) all = all.index({finite});
    output.metrics[prefix + "_loss"] = all.mean().item<double>();
  }
  if (!per_batch_metrics && impl.compute_metrics && output.predictions.defined() &&
      output.label_ids.defined())
    metrics = impl.compute_metrics({output.predictions, output.label_ids, concat_padded(inputs),
                                    with_losses && !losses.empty() ? at::cat(losses) : at::Tensor(),
                                    true, output.all_label_ids});
  for (const auto& [key, value] : metrics)
    output.metrics[key.starts_with(prefix + "_") ? key : prefix + "_" + key] = value;
  // As HF's speed_metrics: the dataset's samples, and the steps a whole pass over them takes
  // (dataloader_drop_last aside).
  const double runtime = seconds_since(start);
  const auto samples = static_cast<int64_t>(loader.dataset()->size());
  const int64_t global_batch = global_batch_of(args_, acc, args_.per_device_eval_batch_size);
  output.metrics[prefix + "_runtime"] = runtime;
  output.metrics[prefix + "_samples_per_second"] = static_cast<double>(samples) / runtime;
  output.metrics[prefix + "_steps_per_second"] =
      static_cast<double>((samples + global_batch - 1) / global_batch) / runtime;
  return output;
}

}  // namespace mixprec::train
