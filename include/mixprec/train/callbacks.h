#pragma once

#include "mixprec/train/training_args.h"

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}
namespace mixprec::optim {
class LRScheduler;
}
namespace mixprec::data {
class DataLoader;
}

namespace mixprec::train {

using Metrics = std::map<std::string, double>;

/// `transformers.TrainerState`: where training stands; saved as
/// trainer_state.json in every checkpoint, in HF's format (TrainerState.load_from_json reads it).
struct TrainerState {
  double epoch = 0;
  int64_t global_step = 0;
  int64_t max_steps = 0;
  int64_t logging_steps = 500;
  int64_t eval_steps = 500;
  int64_t save_steps = 500;
  std::optional<int64_t> train_batch_size = std::nullopt;
  int64_t num_train_epochs = 0;
  int64_t num_input_tokens_seen = 0;
  double total_flos = 0;
  /// Each entry: the logged values plus "step" (and "epoch").
  std::vector<Metrics> log_history = {};
  std::optional<double> best_metric = std::nullopt;
  std::optional<int64_t> best_global_step = std::nullopt;
  std::optional<std::string> best_model_checkpoint = std::nullopt;
  bool is_local_process_zero = true;
  bool is_world_process_zero = true;
  /// HF's stateful_callbacks: each exportable callback's state by its name (TrainerControl's
  /// too), as JSON text: an object, or a list of them for several callbacks of one name.
  std::map<std::string, std::string> stateful_callbacks = {};

  std::string to_json() const;
  /// Reads trainer_state.json; `source` names it in errors.
  static TrainerState from_json(const std::string& text, const std::string& source);
};

/// `transformers.TrainerControl`: flags callbacks set to steer the loop.
struct TrainerControl {
  bool should_training_stop = false;
  bool should_epoch_stop = false;
  bool should_save = false;
  bool should_evaluate = false;
  bool should_log = false;
};

/// HF's ExportableState: what a resumed run needs of a callback (EarlyStoppingCallback's patience
/// counter), as JSON text {"args": {...}, "attributes": {...}} under the callback's name.
struct CallbackState {
  std::string name;  // the key in trainer_state.json's stateful_callbacks: HF's class name
  std::string json;
};

/// The keyword arguments HF's Trainer gives every event: its model (the module given to it,
/// unwrapped), during train() its optimizer, lr_scheduler and train_dataloader, and from the
/// first evaluation or prediction on the loader of the last; null where there is none (before
/// and after train(), the first three are local to it).
struct CallbackKwargs {
  torch::nn::Module* model = nullptr;
  torch::optim::Optimizer* optimizer = nullptr;
  optim::LRScheduler* lr_scheduler = nullptr;
  data::DataLoader* train_dataloader = nullptr;
  data::DataLoader* eval_dataloader = nullptr;
};

/// `transformers.TrainerCallback`: hooks on the Trainer's events; each may
/// change `control`, and reach the training objects through `kwargs()`:
///
/// ```
/// struct LogLr : TrainerCallback {
///   void on_step_end(const TrainingArguments&, TrainerState& state, TrainerControl&) override {
///     std::cout << state.global_step << " " << kwargs().lr_scheduler->get_last_lr()[0] << "\n";
///   }
/// };
/// ```
class TrainerCallback {
 public:
  virtual ~TrainerCallback() = default;
  /// HF's **kwargs of the event being called; all null outside an event.
  const CallbackKwargs& kwargs() const { return kwargs_; }

  virtual void on_init_end(const TrainingArguments&, TrainerState&, TrainerControl&) {}
  virtual void on_train_begin(const TrainingArguments&, TrainerState&, TrainerControl&) {}
  virtual void on_train_end(const TrainingArguments&, TrainerState&, TrainerControl&) {}
  virtual void on_epoch_begin(const TrainingArguments&, TrainerState&, TrainerControl&) {}
  virtual void on_epoch_end(const TrainingArguments&, TrainerState&, TrainerControl&) {}
  virtual void on_step_begin(const TrainingArguments&, TrainerState&, TrainerControl&) {}
  virtual void on_pre_optimizer_step(const TrainingArguments&, TrainerState&, TrainerControl&) {}
  virtual void on_optimizer_step(const TrainingArguments&, TrainerState&, TrainerControl&) {}
  virtual void on_substep_end(const TrainingArguments&, TrainerState&, TrainerControl&) {}
  virtual void on_step_end(const TrainingArguments&, TrainerState&, TrainerControl&) {}
  virtual void on_evaluate(const TrainingArguments&, TrainerState&, TrainerControl&,
                           const Metrics& /*metrics*/) {}
  virtual void on_predict(const TrainingArguments&, TrainerState&, TrainerControl&,
                          const Metrics& /*metrics*/) {}
  virtual void on_save(const TrainingArguments&, TrainerState&, TrainerControl&) {}
  virtual void on_log(const TrainingArguments&, TrainerState&, TrainerControl&,
                      const Metrics& /*logs*/) {}
  virtual void on_prediction_step(const TrainingArguments&, TrainerState&, TrainerControl&) {}

  /// HF's ExportableState.state(): saved in every checkpoint's trainer_state.json (the states
  /// of this run's callbacks only). None (the default): the callback keeps no state across a
  /// resume.
  virtual std::optional<CallbackState> state() const { return std::nullopt; }
  /// What state() saved, given back on a resume with restore_callback_states_from_checkpoint,
  /// in the callback's place. (HF makes a new callback from the state's args, sets its
  /// attributes, and moves it to the end of the list.) The default warns that it is not loaded.
  virtual void load_state(const std::string& json);

 private:
  friend class Trainer;  // sets kwargs_ before each event
  CallbackKwargs kwargs_;
};

/// `transformers.EarlyStoppingCallback`: stops training when the metric for
/// the best model has not improved by more than `threshold` for `patience`
/// evaluations. Needs metric_for_best_model and an eval strategy.
class EarlyStoppingCallback : public TrainerCallback {
 public:
  explicit EarlyStoppingCallback(int64_t patience = 1, double threshold = 0.0)
      : patience_(patience), threshold_(threshold) {}
  void on_train_begin(const TrainingArguments& args, TrainerState&, TrainerControl&) override;
  void on_evaluate(const TrainingArguments& args, TrainerState& state, TrainerControl& control,
                   const Metrics& metrics) override;
  /// HF's: {"args": {"early_stopping_patience", "early_stopping_threshold"},
  /// "attributes": {"early_stopping_patience_counter"}}.
  std::optional<CallbackState> state() const override;
  void load_state(const std::string& json) override;
  int64_t patience_counter() const { return counter_; }

 private:
  int64_t patience_;
  double threshold_;
  int64_t counter_ = 0;
};

}  // namespace mixprec::train
