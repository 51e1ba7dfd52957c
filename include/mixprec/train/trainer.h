#pragma once

#include "mixprec/accelerate/accelerator.h"
#include "mixprec/data/dataloader.h"
#include "mixprec/models/model_output.h"
#include "mixprec/train/callbacks.h"
#include "mixprec/train/training_args.h"

#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace mixprec::train {

/// What compute_metrics gets: the model's logits and the labels of the whole
/// evaluation set, concatenated along dim 0 (other dims padded with -100 where
/// batches differ, as HF does). With TrainingArguments::batch_eval_metrics, those of one batch.
struct EvalPrediction {
  at::Tensor predictions;
  at::Tensor label_ids;
  /// With include_for_metrics "inputs": the batches' main input (the model's main_input_name),
  /// gathered from all processes as the logits are (with batch_eval_metrics too, where HF passes
  /// the whole batch of this process).
  at::Tensor inputs;
  /// With include_for_metrics "loss": each sample's batch loss (fp32), as HF repeats it.
  at::Tensor losses;
  /// HF's compute_result keyword: false on all but the last batch with batch_eval_metrics, whose
  /// metrics are the evaluation's (the others' are not used); always true otherwise.
  bool compute_result = true;
  /// Each label name's labels, in TrainingArguments::label_names' order (HF's label_ids is their
  /// tuple when there are several); label_ids is the first.
  std::vector<at::Tensor> all_label_ids = {};
};
using ComputeMetrics = std::function<Metrics(const EvalPrediction&)>;

struct TrainOutput {
  int64_t global_step = 0;
  double training_loss = 0;
  Metrics
      metrics;  // train_runtime, train_samples_per_second, train_steps_per_second, train_loss, ...
  /// SIGINT or SIGTERM when one stopped training at a step boundary (a
  /// checkpoint of that step was saved); 0 when training ran to its end.
  int stopped_by_signal = 0;
};

struct PredictionOutput {
  at::Tensor predictions;
  at::Tensor label_ids;  // the first label name's; all_label_ids holds each one's
  Metrics metrics;       // test_loss, test_<metric>, ...
  std::vector<at::Tensor> all_label_ids = {};
};

/// HF's model.main_input_name: the batch key of a model's main input, for include_for_metrics
/// "inputs" ("input_ids" when the model has no `main_input_name` member).
template <typename M>
std::string main_input_name_of(const M& model) {
  if constexpr (requires { std::string(model->main_input_name()); })
    return std::string(model->main_input_name());
  else if constexpr (requires { std::string(model->main_input_name); })
    return std::string(model->main_input_name);
  else
    return "input_ids";
}

/// How the Trainer runs a model on a batch. A model whose `forward(batch)`
/// takes the batch gets it; otherwise `forward(input_ids, labels)` (HF's
/// contract, e.g. GPT2LMHeadModel).
using BatchForward = std::function<models::ModelOutput(const data::Batch&)>;
/// HF's `compute_loss_func(outputs, labels, num_items_in_batch)`: the loss from the output of the
/// model run without its labels, the labels (undefined when a training batch holds none; an
/// evaluation batch without labels gets no loss, as HF's) and num_items_in_batch (the labels other
/// than -100 of the whole accumulation window, on all processes with
/// average_tokens_across_devices; a causal LM's labels[..., 1:], see set_num_items_forward). Its
/// loss counts as scaled for the window already: the Trainer does not divide it by the window's
/// length.
using ComputeLoss =
    std::function<at::Tensor(const models::ModelOutput& outputs, const at::Tensor& labels,
                             std::optional<int64_t> num_items_in_batch)>;
/// A causal LM's forward with HF's `num_items_in_batch`: the label tokens (labels[..., 1:] other
/// than -100) of the whole accumulation window, for a loss that is their sum divided by it.
using NumItemsForward =
    std::function<models::ModelOutput(const data::Batch&, int64_t num_items_in_batch)>;

/// HF's LabelSmoother (TrainingArguments::label_smoothing_factor): per label other than -100,
/// (1 - epsilon) x the cross-entropy of `logits` (..., C) with it plus epsilon x the mean over the
/// C classes of -log p, summed and divided by the number of such labels, or by `num_items` (HF's
/// num_items_in_batch) when given. With `shift_labels` (a causal LM), position t predicts
/// labels[t + 1]. In fp32 whatever the logits' dtype.
at::Tensor label_smoothed_loss(const at::Tensor& logits, const at::Tensor& labels, double epsilon,
                               bool shift_labels, std::optional<int64_t> num_items = std::nullopt);

/// transformers' enable_full_determinism: set_seed(seed), then deterministic algorithms only
/// (LibTorch's error for an op without one, or its warning with `warn_only`), cuDNN deterministic
/// and not benchmarking, and the environment that deterministic cuBLAS needs
/// (CUBLAS_WORKSPACE_CONFIG=:16:8, CUDA_LAUNCH_BLOCKING=1). The Trainer calls it instead of
/// set_seed with TrainingArguments::full_determinism. It changes the whole process, as HF's.
void enable_full_determinism(uint64_t seed, bool warn_only = false);

template <typename M>
BatchForward forward_on_batches(M model) {
  if constexpr (requires(const data::Batch& b) {
                  { model->forward(b) } -> std::convertible_to<models::ModelOutput>;
                }) {
    return [model](const data::Batch& b) mutable { return model->forward(b); };
  } else {
    return [model](const data::Batch& b) mutable -> models::ModelOutput {
      auto labels = b.find("labels");
      return model->forward(b.at("input_ids"), labels == b.end() ? at::Tensor() : labels->second);
    };
  }
}

/// `transformers.Trainer`: trains `model` on `train_dataset` as `args` say,
/// through an Accelerator (mixed precision, accumulation, clipping, data
/// parallel under torchrun), with evaluation, logging, checkpoints and
/// callbacks on HF's schedule.
///
/// ```
/// mixprec::TrainingArguments args;
/// args.output_dir = "results"; args.eval_strategy = "epoch"; args.fp16 = true;
/// mixprec::Trainer trainer(model, args, train, validation, accuracy);
/// trainer.train();
/// ```
///
/// A model whose parameters are bf16 (`model->to(torch::kBFloat16)`) trains
/// pure bf16: AdamW (unfused) with stochastic rounding, floating inputs cast
/// to bf16 (Lightning's "bf16-true").
///
/// Checkpoints are `output_dir/checkpoint-N/`: model.safetensors,
/// optimizer/scheduler/scaler/RNG state (safetensors + JSON, no pickle),
/// trainer_state.json and training_args.json in HF's format.
class Trainer {
 public:
  template <accelerate::ModuleHandle M>
  Trainer(M model, TrainingArguments args, data::DatasetPtr train_dataset,
          data::DatasetPtr eval_dataset = nullptr, ComputeMetrics compute_metrics = {},
          std::vector<std::shared_ptr<TrainerCallback>> callbacks = {},
          data::CollateFn data_collator = {}, ComputeLoss compute_loss_func = {})
      : Trainer(module_of(model), forward_on_batches(model), std::move(args),
                std::move(train_dataset), std::move(eval_dataset), std::move(compute_metrics),
                std::move(callbacks), std::move(data_collator), std::move(compute_loss_func)) {
    set_main_input_name(main_input_name_of(model));
    // As HF's Trainer for a model whose forward takes loss kwargs (GPT2LMHeadModel's
    // **kwargs): every label token of an accumulation window weighs the same in the update,
    // whichever micro-batch holds it.
    if constexpr (
        !requires(const data::Batch& b) { model->forward(b); } &&
        requires(const at::Tensor& t, std::optional<int64_t> n) {
          { model->forward(t, t, n) } -> std::convertible_to<models::ModelOutput>;
        }) {
      set_num_items_forward([model](const data::Batch& b, int64_t num_items) mutable {
        return model->forward(b.at("input_ids"), b.at("labels"), num_items);
      });
    }
  }

  Trainer(std::shared_ptr<torch::nn::Module> module, BatchForward forward, TrainingArguments args,
          data::DatasetPtr train_dataset, data::DatasetPtr eval_dataset,
          ComputeMetrics compute_metrics, std::vector<std::shared_ptr<TrainerCallback>> callbacks,
          data::CollateFn data_collator, ComputeLoss compute_loss_func = {});
  ~Trainer();

  /// Runs the model through `forward` with HF's num_items_in_batch (a causal LM's label tokens
  /// of an accumulation window), as the constructor from a model does for a model whose
  /// `forward(input_ids, labels, std::optional<int64_t> num_items_in_batch)` takes it (GPT-2).
  /// Such a model is the Trainer's causal LM: label_smoothing_factor shifts its labels too, and
  /// a compute_loss_func gets its labels[..., 1:] counted. (HF tells a causal LM by its class or
  /// loss_type, and also reads a collator's "shift_labels"; mixprec by this call only.)
  void set_num_items_forward(NumItemsForward forward);

  /// The batch key EvalPrediction::inputs comes from (include_for_metrics "inputs"), and whose
  /// size is a sample's length for train_sampling_strategy "group_by_length" (HF's: the
  /// tokenizer's first input, "input_ids"); the constructor from a model sets it to
  /// main_input_name_of(model).
  void set_main_input_name(std::string name);

  /// Trains; `resume_from_checkpoint` (or args.resume_from_checkpoint) is a
  /// checkpoint folder to continue from exactly where it was saved, or "last":
  /// the newest undamaged checkpoint of output_dir (a damaged one is skipped
  /// with a warning naming it), or a fresh start when there is none.
  ///
  /// SIGINT/SIGTERM during train() stop it at the next step boundary with a
  /// checkpoint and a message saying how to resume (a second signal kills at
  /// once). A non-finite loss without a loss scaler (fp32, bf16) stops it with
  /// an error naming the last good checkpoint: no step is taken on it.
  ///
  /// With `auto_find_batch_size`, a run that runs out of memory (LibTorch's allocator's error,
  /// CUDA's or std::bad_alloc) starts again with 0.9 x the batch size per device, as HF's.
  TrainOutput train(std::optional<std::string> resume_from_checkpoint = std::nullopt);
  /// Loss and compute_metrics on `eval_dataset` (the constructor's by
  /// default), prefixed "eval_".
  Metrics evaluate(data::DatasetPtr eval_dataset = nullptr);
  PredictionOutput predict(data::DatasetPtr test_dataset);

  void add_callback(std::shared_ptr<TrainerCallback> callback);
  /// HF's `optimizers=(optimizer, lr_scheduler)`: train() steps this optimizer, which must hold
  /// parameters of the model only, instead of making one from args (learning_rate,
  /// weight_decay, optim, adam_* are then not read, as in HF), and this schedule, which must be
  /// of that optimizer; without one, train() makes args' schedule on the optimizer. Both stay
  /// the Trainer's, so another train() goes on with them, as HF's. The optimizer's state is
  /// saved in checkpoints and resumed: it must be an SGD, Adam or AdamW (LibTorch's or
  /// mixprec's), else it is refused here. The same optimizer set again keeps the lrs it was
  /// first given, which a schedule made on it starts from (PyTorch's initial_lr).
  void set_optimizers(std::shared_ptr<torch::optim::Optimizer> optimizer,
                      std::shared_ptr<optim::LRScheduler> lr_scheduler = nullptr);
  /// HF's Trainer.log: `logs` plus the epoch go to the callbacks' on_log and into
  /// state().log_history with the step, and to the trackers tagged as HF's integrations tag
  /// them (eval_x: eval/x, test_x: test/x, others: train/x).
  void log(Metrics logs);
  /// HF's get_decay_parameter_names: the parameters weight decay applies to if trained; not
  /// those of LayerNorms, nor those whose lowercased name contains "bias", "layernorm" or
  /// "rmsnorm", or a part "norm" or ending "_norm" (a hand-written RMSNorm's).
  std::vector<std::string> get_decay_parameter_names() const;

  const TrainingArguments& args() const { return args_; }
  const TrainerState& state() const { return state_; }
  accelerate::Accelerator& accelerator() { return *accelerator_; }

 private:
  template <typename M>
  static std::shared_ptr<torch::nn::Module> module_of(const M& model) {
    if constexpr (requires { model.ptr(); })
      return model.ptr();
    else
      return model;
  }
  // train() with this batch per device, from this checkpoint (resolved, or none).
  TrainOutput train_with_batch_size(const std::optional<std::string>& resume_from_checkpoint,
                                    int64_t batch_size);
  // Writes a checkpoint of the run into output_dir/checkpoint-<global_step> (in train()); of the
  // model and the Trainer's files only with `model_only`.
  void save_checkpoint(bool model_only);
  void count_tokens_and_flos(const data::Batch& batch, int64_t flos_parameters);
  void store_flos();
  // loss_only: HF's prediction_loss_only, no logits or labels kept (nor gathered). predicting:
  // predict()'s loop, which returns the logits and labels even with batch_eval_metrics.
  PredictionOutput prediction_loop(data::DatasetPtr dataset, const std::string& prefix,
                                   bool loss_only, bool predicting);
  void rotate_checkpoints(int64_t limit, const std::filesystem::path& just_saved) const;
  void open_trackers();
  void log_in_place(Metrics& logs);
  struct Impl;
  std::unique_ptr<Impl> impl_;
  TrainingArguments args_;
  TrainerState state_;
  std::shared_ptr<accelerate::Accelerator> accelerator_;
};

}  // namespace mixprec::train

namespace mixprec {
using train::Trainer;
}  // namespace mixprec
