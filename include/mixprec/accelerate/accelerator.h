#pragma once

#include "mixprec/accelerate/profiler.h"
#include "mixprec/amp/autocast.h"
#include "mixprec/amp/grad_scaler.h"
#include "mixprec/data/dataloader.h"
#include "mixprec/dist/process_group.h"
#include "mixprec/log/numerics_monitor.h"
#include "mixprec/log/tracker.h"
#include "mixprec/models/model_output.h"
#include "mixprec/optim/lr_scheduler.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <chrono>
#include <concepts>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mixprec::io {
class CheckpointWriter;
}  // namespace mixprec::io

namespace mixprec::accelerate {

/// Accelerate's ProjectConfiguration, less its project_dir (AcceleratorOptions::project_dir).
struct ProjectConfiguration {
  /// save_state() without a folder saves into project_dir/checkpoints/checkpoint_{iteration},
  /// and load_state() without one loads the newest of those.
  bool automatic_checkpoint_naming = false;
  /// With automatic naming, save_state() then deletes the oldest checkpoint_N folders to keep
  /// at most this many (>= 1), the new one included, once it is written (Accelerate deletes
  /// them before, and any other entries of the folder too). Unset: keeps all.
  std::optional<int64_t> total_limit = std::nullopt;
  /// The number of the next automatically named checkpoint; every save_state() adds 1.
  int64_t iteration = 0;
  /// save_state() and save_model() write on each node's local main process, not only on the
  /// main process (for nodes that do not share a file system).
  bool save_on_each_node = false;
};

/// Accelerate's AutocastKwargs: how mixed precision's autocast runs.
struct AutocastKwargs {
  bool enabled = true;
  std::optional<bool> cache_enabled = std::nullopt;  // unset: as it is (torch's: on)
};

/// Options of `Accelerator`, with HF Accelerate's defaults.
struct AcceleratorOptions {
  /// "no", "fp16" (autocast fp16 + GradScaler, unless scaler.enabled is false) or "bf16"
  /// (autocast bf16). Unset, as Accelerate's: the ACCELERATE_MIXED_PRECISION environment
  /// variable (`accelerate launch --mixed_precision`), else "no".
  std::optional<std::string> mixed_precision = std::nullopt;
  /// Unset: ACCELERATE_GRADIENT_ACCUMULATION_STEPS (which `accelerate launch` exports with
  /// DeepSpeed), else 1. A value given wins, as Accelerate's GradientAccumulationPlugin does
  /// (its plain argument loses to the variable).
  std::optional<int64_t> gradient_accumulation_steps = std::nullopt;
  /// Accelerate's GradientAccumulationPlugin: `accumulate()` at the end of a prepared loader
  /// makes a sync step, whatever the count (false: the window goes on into the next pass).
  bool sync_with_dataloader = true;
  /// Data parallel: the models passed to accumulate() all-reduce their gradients after every
  /// micro-step's backward, not only on sync steps (the optimizer still steps on sync steps
  /// only; no_sync() still wins). More
  /// communication, the same result up to rounding: Accelerate's memory saving is FSDP's,
  /// whose unsynced gradients are unsharded.
  bool sync_each_batch = false;
  /// Stay on the CPU even when CUDA is available; so does ACCELERATE_USE_CPU set true (as
  /// Accelerate reads it).
  bool cpu = false;
  /// The GradScaler's options for fp16 (Accelerate's GradScalerKwargs). `.enabled = false`:
  /// fp16 autocast without loss scaling (and scaler() is null).
  amp::GradScalerOptions scaler = {};
  /// Prepared models' forwards and autocast() with fp16/bf16 (`.enabled = false`: fp32 unless
  /// the caller's own autocast is on).
  AutocastKwargs autocast = {};
  /// The prepared scheduler steps only when its optimizers did.
  bool step_scheduler_with_optimizer = true;
  /// false: each process gets batch_size samples, and the scheduler steps
  /// num_processes times per optimizer step, as in Accelerate. true: a prepared
  /// loader's batch_size is the batch of all processes together (each gets
  /// batch_size / num_processes), and the scheduler steps once.
  bool split_batches = false;
  /// How a shuffled prepared loader without a seed orders each pass (Accelerate's
  /// DataLoaderConfiguration). false, Accelerate's default: torch's RandomSampler, a new
  /// random order each pass (ShuffleOrder::kRandomSampler; in data parallel from a generator
  /// seeded at prepare from torch's). true: randperm(seed + epoch), seed = data_seed or torch's
  /// initial seed (SeedableRandomSampler; the HF Trainer's default).
  bool use_seedable_sampler = false;
  std::optional<uint64_t> data_seed = std::nullopt;
  /// Data parallel: the generators every prepared loader's pass sets, as it starts, to the
  /// main process's state (Accelerate's rng_types): "torch" (torch's CPU generator, so that
  /// dropout and the like draw alike on every process), "cuda" (this process's GPU's) and
  /// "generator" (a shuffle generator given in the loader's options; one prepare_data_loader
  /// makes is seeded alike on every process whatever this says).
  std::vector<std::string> rng_types = {"generator"};
  /// Data parallel (under torchrun): DDP's options (Accelerate's DistributedDataParallelKwargs):
  /// bucket size, find_unused_parameters, broadcast_buffers, and the dtype gradients are
  /// all-reduced in (`{.compression = dist::GradientCompression::kBf16}`).
  dist::GradientReducerOptions ddp = {};
  /// Data parallel: how long a collective waits for the other processes before it fails
  /// (Accelerate's InitProcessGroupKwargs.timeout). Unset: as it is, torch's 30 minutes unless
  /// an earlier Accelerator set it (the process group is the process's).
  std::optional<std::chrono::milliseconds> timeout = std::nullopt;
  /// Trackers for `log()`: "tensorboard", "jsonl" (Accelerate's log_with).
  std::vector<std::string> log_with = {};
  /// Trackers of one's own (Accelerate's GeneralTracker instances in log_with), beside
  /// log_with's: on the main process, init_trackers() takes them, log() logs to them and
  /// end_training() flushes them.
  std::vector<std::shared_ptr<log::Tracker>> custom_trackers = {};
  /// Where `init_trackers(name)` puts them (project_dir/name), and automatically named
  /// checkpoints (project_dir/checkpoints).
  std::string project_dir = ".";
  ProjectConfiguration project_config = {};
  /// Watches the numerics of the first prepared model (a mixprec extra, off
  /// by default): its figures go to the trackers at the inspected steps.
  std::optional<log::NumericsMonitorOptions> numerics_monitor = std::nullopt;
  /// profile()'s options when it is given none (Accelerate's ProfileKwargs handler).
  std::optional<ProfileKwargs> profile = std::nullopt;
};

/// Accelerate's GradientState: whether this micro-step syncs (steps the
/// optimizer), and where the active prepared data loader stands. As in Accelerate, the active
/// loader is the one whose pass began last and has not ended: a pass of another loader inside
/// it (an evaluation on the training loader's last batch) leaves the outer loader's flags as
/// they were when it ends. Outside every pass, end_of_dataloader is false.
struct GradientState {
  bool sync_gradients = true;
  bool end_of_dataloader = false;
  /// Samples at the end of this process's last batch that only pad the
  /// processes to equal shares, dropped by gather_for_metrics; 0 outside the
  /// prepared loader's last batch. (Accelerate's `remainder` counts the samples
  /// to keep at the start of the last gathered batches instead: the same samples.)
  int64_t num_padding_samples = 0;
  int64_t num_steps = 1;
};

/// An object the Accelerator saves and loads with its state (Accelerate's
/// `register_for_checkpointing`): it gives its state as JSON text.
class Checkpointable {
 public:
  virtual ~Checkpointable() = default;
  virtual std::string state_dict() const = 0;
  virtual void load_state_dict(const std::string& json) = 0;
};

/// Accelerate's save_state pre-hook: `hook(models, weights, output_dir)`, before save_state()
/// writes the models. `weights` holds each prepared model's state (detached), in order: the hook
/// may change them or drop some (those left are saved as model, model_1, ... in their order),
/// and write files of its own into `output_dir`. That is the folder being written, which the
/// commit renames into place (Accelerate passes the final folder): its files join the atomic
/// commit and the checksums; it takes files, not folders. Hooks registered on a Trainer's
/// accelerator apply to its checkpoints too.
using SaveStateHook = std::function<void(const std::vector<std::shared_ptr<torch::nn::Module>>&,
                                         std::vector<std::map<std::string, at::Tensor>>&,
                                         const std::filesystem::path&)>;
/// Accelerate's load_state pre-hook: `hook(models, input_dir)`, before load_state() loads the
/// models. Those it leaves in `models` load from model, model_1, ... in their order, so a hook
/// that loads a model itself removes it.
using LoadStateHook = std::function<void(std::vector<std::shared_ptr<torch::nn::Module>>&,
                                         const std::filesystem::path&)>;

/// torch.utils.hooks.RemovableHandle: remove() unregisters the hook (later calls do nothing).
class RemovableHandle {
 public:
  explicit RemovableHandle(std::function<void()> remove) : remove_(std::move(remove)) {}
  void remove() {
    if (remove_) std::exchange(remove_, nullptr)();
  }

 private:
  std::function<void()> remove_;
};

namespace detail {

struct OptimizerFlags {
  bool unscaled = false;  // this step's gradients were unscaled (by clipping)
  bool step_was_skipped = false;
};

struct LoaderPosition {
  bool end_of_dataloader = false;
  int64_t num_padding_samples = 0;
};

// What an Accelerator and the objects it prepared share.
struct Shared {
  AcceleratorOptions options;
  c10::Device device{c10::kCPU};
  std::optional<c10::ScalarType> autocast_dtype;
  std::unique_ptr<amp::GradScaler> scaler;  // fp16 with the scaler enabled only
  GradientState gradient_state;
  int64_t step = 0;  // micro-steps into the accumulation window
  std::vector<std::pair<torch::optim::Optimizer*, std::shared_ptr<OptimizerFlags>>> optimizers;
  std::shared_ptr<dist::ProcessGroup> group;  // null in a single process
  // What save_state() saves, in the order prepare() saw it.
  std::vector<std::shared_ptr<torch::nn::Module>> models;
  std::vector<optim::LRScheduler*> schedulers;
  std::vector<Checkpointable*> custom_objects;
  std::vector<std::shared_ptr<data::DataLoader>> loaders;
  // The prepared loaders in a pass, the active one last (Accelerate's dataloader_references,
  // weak as theirs).
  std::vector<std::weak_ptr<LoaderPosition>> loaders_in_pass;
  std::vector<std::shared_ptr<log::Tracker>> trackers;  // main process only
  std::shared_ptr<log::NumericsMonitor> monitor;        // when asked for
  bool trigger = false;                                 // set_trigger() on this process
  std::map<int64_t, SaveStateHook> save_state_hooks;    // by registration, as Accelerate's
  std::map<int64_t, LoadStateHook> load_state_hooks;
  int64_t next_hook_id = 0;

  int64_t num_processes() const { return group ? group->world_size() : 1; }
  void unscale(torch::optim::Optimizer& optimizer, OptimizerFlags& flags);
  // gradient_state's end_of_dataloader and padding: the active loader's.
  void show_active_loader();
};

// Accelerate's convert_outputs_to_fp32 (recursive_apply): through tuples, pairs, vectors,
// optionals and maps' values; anything else passes unchanged. Declared first, so that each
// finds the others whatever the nesting.
inline at::Tensor to_fp32(at::Tensor t);
inline models::ModelOutput to_fp32(models::ModelOutput out);
template <typename T>
T to_fp32(T other);
template <typename A, typename B>
std::pair<A, B> to_fp32(std::pair<A, B> p);
template <typename... Ts>
std::tuple<Ts...> to_fp32(std::tuple<Ts...> ts);
template <typename T, typename... R>
std::vector<T, R...> to_fp32(std::vector<T, R...> ts);
template <typename T>
std::optional<T> to_fp32(std::optional<T> t);
template <typename K, typename V, typename... R>
std::map<K, V, R...> to_fp32(std::map<K, V, R...> m);
template <typename K, typename V, typename... R>
std::unordered_map<K, V, R...> to_fp32(std::unordered_map<K, V, R...> m);

inline at::Tensor to_fp32(at::Tensor t) {
  if (t.defined() && (t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16))
    return t.to(at::kFloat);
  return t;
}
inline models::ModelOutput to_fp32(models::ModelOutput out) {
  return {to_fp32(std::move(out.loss)), to_fp32(std::move(out.logits))};
}
template <typename T>
T to_fp32(T other) {
  return other;
}
template <typename A, typename B>
std::pair<A, B> to_fp32(std::pair<A, B> p) {
  return {to_fp32(std::move(p.first)), to_fp32(std::move(p.second))};
}
template <typename... Ts>
std::tuple<Ts...> to_fp32(std::tuple<Ts...> ts) {
  return std::apply([](auto&&... t) { return std::tuple<Ts...>(to_fp32(std::move(t))...); },
                    std::move(ts));
}
template <typename T, typename... R>
std::vector<T, R...> to_fp32(std::vector<T, R...> ts) {
  std::vector<T, R...> out;  // built anew: vector<bool>'s or const elements take no assignment
  out.reserve(ts.size());
  for (auto&& t : ts) out.push_back(to_fp32(static_cast<T>(std::move(t))));
  return out;
}
template <typename T>
std::optional<T> to_fp32(std::optional<T> t) {
  if (t) t = to_fp32(std::move(*t));
  return t;
}
template <typename K, typename V, typename... R>
std::map<K, V, R...> to_fp32(std::map<K, V, R...> m) {
  for (auto& [key, value] : m) value = to_fp32(std::move(value));
  return m;
}
template <typename K, typename V, typename... R>
std::unordered_map<K, V, R...> to_fp32(std::unordered_map<K, V, R...> m) {
  for (auto& [key, value] : m) value = to_fp32(std::move(value));
  return m;
}

// The tensors of a forward's outputs, which DDP's find_unused_parameters searches from: through
// the same containers.
inline void collect_tensors(const at::Tensor& t, std::vector<at::Tensor>& out);
inline void collect_tensors(const models::ModelOutput& o, std::vector<at::Tensor>& out);
template <typename T>
void collect_tensors(const T&, std::vector<at::Tensor>&);
template <typename A, typename B>
void collect_tensors(const std::pair<A, B>& p, std::vector<at::Tensor>& out);
template <typename... Ts>
void collect_tensors(const std::tuple<Ts...>& ts, std::vector<at::Tensor>& out);
template <typename T, typename... R>
void collect_tensors(const std::vector<T, R...>& ts, std::vector<at::Tensor>& out);
template <typename T>
void collect_tensors(const std::optional<T>& t, std::vector<at::Tensor>& out);
template <typename K, typename V, typename... R>
void collect_tensors(const std::map<K, V, R...>& m, std::vector<at::Tensor>& out);
template <typename K, typename V, typename... R>
void collect_tensors(const std::unordered_map<K, V, R...>& m, std::vector<at::Tensor>& out);

inline void collect_tensors(const at::Tensor& t, std::vector<at::Tensor>& out) {
  if (t.defined()) out.push_back(t);
}
inline void collect_tensors(const models::ModelOutput& o, std::vector<at::Tensor>& out) {
  collect_tensors(o.loss, out);
  collect_tensors(o.logits, out);
}
template <typename T>
void collect_tensors(const T&, std::vector<at::Tensor>&) {}  // holds none we know of
template <typename A, typename B>
void collect_tensors(const std::pair<A, B>& p, std::vector<at::Tensor>& out) {
  collect_tensors(p.first, out);
  collect_tensors(p.second, out);
}
template <typename... Ts>
void collect_tensors(const std::tuple<Ts...>& ts, std::vector<at::Tensor>& out) {
  std::apply([&](const auto&... t) { (collect_tensors(t, out), ...); }, ts);
}
template <typename T, typename... R>
void collect_tensors(const std::vector<T, R...>& ts, std::vector<at::Tensor>& out) {
  for (const auto& t : ts) collect_tensors(t, out);
}
template <typename T>
void collect_tensors(const std::optional<T>& t, std::vector<at::Tensor>& out) {
  if (t) collect_tensors(*t, out);
}
template <typename K, typename V, typename... R>
void collect_tensors(const std::map<K, V, R...>& m, std::vector<at::Tensor>& out) {
  for (const auto& [key, value] : m) collect_tensors(value, out);
}
template <typename K, typename V, typename... R>
void collect_tensors(const std::unordered_map<K, V, R...>& m, std::vector<at::Tensor>& out) {
  for (const auto& [key, value] : m) collect_tensors(value, out);
}

}  // namespace detail

/// A module handle (`torch::nn::ModuleHolder` or `std::shared_ptr<Module>`).
template <typename M>
concept ModuleHandle = requires(M m) {
  { m->parameters() } -> std::convertible_to<std::vector<at::Tensor>>;
  m->to(c10::Device(c10::kCPU));
};

/// A model prepared by an Accelerator: with fp16/bf16, calling it runs `forward`
/// under the accelerator's autocast and returns the outputs in fp32 (Accelerate's
/// `convert_outputs_to_fp32`, through tuples, pairs, vectors, optionals and
/// maps); `->` reaches the module itself. Unlike Accelerate, which patches the
/// module's own `forward`, only calls through this wrapper (or `run`) get
/// them: C++ cannot patch a method, so the module called directly
/// (`model->forward`, `unwrap_model(model)`) runs as it would unprepared
/// (under `accelerator.autocast()` for the mixed precision). In data
/// parallel, a forward with gradients arms the gradient all-reduce of the
/// backward that follows, as DDP's forward does, unless it runs under
/// `no_sync(model)` or, on an accumulation step, `accumulate(model)`.
template <ModuleHandle M>
class PreparedModel {
 public:
  PreparedModel(M module, std::shared_ptr<detail::Shared> shared,
                std::shared_ptr<dist::GradientReducer> reducer)
      : module_(std::move(module)), shared_(std::move(shared)), reducer_(std::move(reducer)) {}

  template <typename... Args>
  auto operator()(Args&&... args) {
    return run([&] { return module_->forward(std::forward<Args>(args)...); });
  }
  /// Runs `forward()` (any call of the model) as operator() runs `forward`:
  /// for models whose entry point has another name or signature.
  template <typename F>
  auto run(F&& forward) {
    if (reducer_) reducer_->before_forward();
    auto outputs = [&] {
      std::optional<amp::Autocast> autocast;
      if (shared_->autocast_dtype)
        autocast.emplace(shared_->device.type(), *shared_->autocast_dtype,
                         shared_->options.autocast.enabled,
                         shared_->options.autocast.cache_enabled);
      // As Accelerate, which converts under its mixed precision only (a pure bf16 model's
      // outputs stay bf16).
      if (!shared_->autocast_dtype) return forward();
      return detail::to_fp32(forward());
    }();
    if (reducer_) {
      std::vector<at::Tensor> tensors;
      if (reducer_->options().find_unused_parameters) detail::collect_tensors(outputs, tensors);
      // Whether the backward all-reduces is the model's require_backward_grad_sync, which
      // accumulate(model) and no_sync(model) set, as DDP's.
      reducer_->after_forward(/*sync_gradients=*/true, tensors);
    }
    return outputs;
  }
  auto operator->() { return module_.operator->(); }
  /// The module as the user gave it (a handle: copies share the module).
  M unwrap() const { return module_; }

 private:
  friend class Accelerator;  // accumulate, no_sync
  M module_;
  std::shared_ptr<detail::Shared> shared_;
  std::shared_ptr<dist::GradientReducer> reducer_;  // null in one process, or nothing trained
};

/// An optimizer prepared by an Accelerator: `step()` and `zero_grad()` act on
/// sync steps only; in fp16, `step()` goes through the GradScaler and knows
/// whether it was skipped.
class AcceleratedOptimizer {
 public:
  AcceleratedOptimizer(torch::optim::Optimizer& optimizer, std::shared_ptr<detail::Shared> shared);
  void step();
  void zero_grad(bool set_to_none = true);
  bool step_was_skipped() const { return flags_->step_was_skipped; }
  torch::optim::Optimizer& optimizer() const { return *optimizer_; }
  torch::optim::Optimizer* operator->() const { return optimizer_; }

 private:
  torch::optim::Optimizer* optimizer_;
  std::shared_ptr<detail::OptimizerFlags> flags_;
  std::shared_ptr<detail::Shared> shared_;
};

/// A scheduler prepared by an Accelerator: it does not advance on an
/// accumulation step nor on a step its own optimizer skipped (any prepared
/// optimizer's, if its own was not prepared): no "scheduler before optimizer"
/// drift after an fp16 overflow.
class AcceleratedScheduler {
 public:
  AcceleratedScheduler(optim::LRScheduler& scheduler, std::shared_ptr<detail::Shared> shared);
  void step();
  const std::vector<double>& get_last_lr() const { return scheduler_->get_last_lr(); }
  optim::LRScheduler& scheduler() const { return *scheduler_; }

 private:
  optim::LRScheduler* scheduler_;
  std::shared_ptr<detail::Shared> shared_;
};

/// A data loader prepared by an Accelerator: this process's shard of the
/// data, batches on the accelerator's device, and the gradient state kept up
/// to date (end_of_dataloader on the last batch, which also ends an
/// accumulation window, and its padding for gather_for_metrics). As in
/// Accelerate, each pass that runs to its end moves to the next epoch (and,
/// with use_seedable_sampler, shuffle order) by itself; set_epoch() sets it. Its position is saved
/// and restored with the accelerator's state. `Accelerator::skip_first_batches` gives a view of it
/// that starts each pass further in.
class PreparedDataLoader {
 public:
  PreparedDataLoader(std::shared_ptr<data::DataLoader> loader,
                     std::shared_ptr<detail::Shared> shared);

  class Iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = data::Batch;
    using difference_type = std::ptrdiff_t;
    const data::Batch& operator*() const { return batch_; }
    const data::Batch* operator->() const { return &batch_; }
    Iterator& operator++();
    bool operator==(const Iterator& other) const { return it_ == other.it_; }

   private:
    friend class PreparedDataLoader;
    void load();
    PreparedDataLoader* owner_ = nullptr;
    data::DataLoader::Iterator it_;
    data::Batch batch_;
  };
  Iterator begin();
  Iterator end();
  void set_epoch(int64_t epoch) { loader_->set_epoch(epoch); }
  /// Batches a pass yields: the epoch's, less those skipped.
  size_t size() const { return loader_->size() - skip_batches_; }
  data::DataLoader& loader() const { return *loader_; }

 private:
  friend class Accelerator;  // skip_first_batches
  std::shared_ptr<data::DataLoader> loader_;
  std::shared_ptr<detail::Shared> shared_;
  // This loader's end_of_dataloader and padding (Accelerate's DataLoaderShard's own), which
  // the gradient state shows while the loader is the active one.
  std::shared_ptr<detail::LoaderPosition> position_;
  size_t skip_batches_ = 0;
};

/// HF Accelerate's `Accelerator`: mixed precision, gradient accumulation and
/// clipping for a plain training loop, changed in three lines.
///
/// ```
/// mixprec::Accelerator accelerator({.mixed_precision = "fp16"});
/// auto [model, optimizer, scheduler] = accelerator.prepare(net, adamw, lr_scheduler);
/// for (auto& [x, y] : batches) {
///   auto guard = accelerator.accumulate(model);
///   auto loss = torch::nn::functional::cross_entropy(model(x), y);
///   accelerator.backward(loss);
///   optimizer.step();
///   scheduler.step();
///   optimizer.zero_grad();
/// }
/// ```
///
/// The optimizer and scheduler given to `prepare` must outlive what it returns.
class Accelerator {
 public:
  explicit Accelerator(AcceleratorOptions options = {});

  template <typename... Ts>
  auto prepare(Ts&&... objects) {
    if constexpr (sizeof...(Ts) == 1)
      return prepare_one(std::forward<Ts>(objects)...);
    else
      return std::tuple{prepare_one(std::forward<Ts>(objects))...};
  }
  template <ModuleHandle M>
  PreparedModel<M> prepare_one(M model) {
    model->to(shared_->device);
    if constexpr (requires { model.ptr(); })
      shared_->models.push_back(model.ptr());
    else
      shared_->models.push_back(model);
    auto reducer = distribute(*model);
    watch_numerics(*model);
    return PreparedModel<M>(std::move(model), shared_, std::move(reducer));
  }
  AcceleratedOptimizer prepare_one(torch::optim::Optimizer& optimizer);
  /// Accelerate's prepare(dataloader): a DataLoader of `dataset` with this
  /// process's rank and the number of processes filled into `options` (and,
  /// with split_batches, batch_size divided among the processes), sharded as
  /// Accelerate's BatchSamplerShard. A shuffled loader without a seed or generator
  /// shuffles as Accelerate's (use_seedable_sampler above): the same orders, for the same
  /// torch seed, as Python's.
  PreparedDataLoader prepare_data_loader(data::DatasetPtr dataset,
                                         data::DataLoaderOptions options = {},
                                         data::CollateFn collate = {});
  /// The options prepare_data_loader gives its loader, for a loader made by hand (the
  /// Trainer's: it steps its own schedule, so registers no loader). With several processes, for
  /// a shuffled loader without a seed or generator, every process must call it (the main
  /// process's seed is broadcast).
  data::DataLoaderOptions prepared_loader_options(data::DataLoaderOptions options);
  AcceleratedScheduler prepare_one(optim::LRScheduler& scheduler);

  /// Accelerate's skip_first_batches: `loader` (the same loader: its epoch and position are
  /// shared) with each pass starting at batch `num_batches` of the epoch, e.g. to go on from
  /// a step count mid-epoch; the skipped batches are not read. A position that load_state()
  /// restored further in wins, so a script that loads a state and also skips the steps it
  /// had done (Accelerate's examples, whose loaders need the skip) does not skip twice.
  PreparedDataLoader skip_first_batches(const PreparedDataLoader& loader, size_t num_batches) const;

  /// `Tensor::backward`'s options, which Accelerate's backward(loss, **kwargs) passes on.
  struct BackwardOptions {
    std::optional<bool> retain_graph = std::nullopt;  // unset: as create_graph
    bool create_graph = false;
    /// Only these get gradients (unset: every leaf that needs one).
    std::optional<std::vector<at::Tensor>> inputs = std::nullopt;
  };
  /// Divides the loss by gradient_accumulation_steps and back-propagates it,
  /// scaled by the GradScaler in fp16.
  void backward(const at::Tensor& loss, const BackwardOptions& options);
  void backward(const at::Tensor& loss) { backward(loss, BackwardOptions{}); }

  /// Accelerate's no_sync(model): while the guard lives, the backward passes of
  /// `model`'s forwards keep their gradients on each process (no all-reduce; DDP's
  /// no_sync), to accumulate them by hand. A no-op in one process.
  class GradSyncGuard {  // sets DDP's require_backward_grad_sync while it lives
   public:
    ~GradSyncGuard() {
      if (reducer_) reducer_->set_require_backward_grad_sync(previous_);
    }
    GradSyncGuard(GradSyncGuard&& other) noexcept
        : reducer_(std::move(other.reducer_)), previous_(other.previous_) {
      other.reducer_ = nullptr;
    }
    GradSyncGuard& operator=(GradSyncGuard&&) = delete;

   private:
    friend class Accelerator;
    GradSyncGuard(std::shared_ptr<dist::GradientReducer> reducer, bool sync)
        : reducer_(std::move(reducer)) {
      if (!reducer_) return;
      previous_ = reducer_->require_backward_grad_sync();
      reducer_->set_require_backward_grad_sync(sync);
    }
    std::shared_ptr<dist::GradientReducer> reducer_;
    bool previous_ = true;
  };
  /// Accelerate's accumulate(*models): guard for one micro-step of gradient accumulation. It
  /// sets sync_gradients for the step (every gradient_accumulation_steps-th, and the last batch
  /// of the active prepared loader), and on the other steps keeps the gradients of `models`
  /// on each process while it lives (no_sync; not with sync_each_batch). As in Accelerate,
  /// the models not passed all-reduce on every backward: pass the models trained in the loop.
  /// Guards (this one, no_sync's) must end in the reverse order of their making, as Python's
  /// `with` blocks do: a guard made before an earlier one ends (say, reassigning a
  /// std::optional with emplace) restores the wrong state.
  class AccumulateGuard {
   public:
    AccumulateGuard(AccumulateGuard&&) = default;
    ~AccumulateGuard() {  // last in, first out: a model passed twice ends as it was
      while (!no_sync_.empty()) no_sync_.pop_back();
    }

   private:
    friend class Accelerator;
    AccumulateGuard() = default;
    std::vector<GradSyncGuard> no_sync_;
  };
  template <ModuleHandle... Ms>
  [[nodiscard]] AccumulateGuard accumulate(const PreparedModel<Ms>&... models) {
    AccumulateGuard guard;
    if (!begin_accumulation_step() && !shared_->options.sync_each_batch)
      (guard.no_sync_.push_back(GradSyncGuard(models.reducer_, false)), ...);
    return guard;
  }
  template <ModuleHandle M>
  [[nodiscard]] GradSyncGuard no_sync(const PreparedModel<M>& model) const {
    return GradSyncGuard(model.reducer_, false);
  }
  /// Accelerate's trigger_sync_in_backward(model): the next backward of `model` all-reduces,
  /// though its forward ran where gradients stay local (no_sync, or accumulate(model) on an
  /// accumulation step). A no-op in one process. With `ddp.find_unused_parameters` it is an
  /// error: it has no outputs to search from (Accelerate's then takes every parameter as
  /// unused).
  template <ModuleHandle M>
  [[nodiscard]] GradSyncGuard trigger_sync_in_backward(const PreparedModel<M>& model) const {
    TORCH_CHECK(!model.reducer_ || !model.reducer_->options().find_unused_parameters,
                "Accelerator::trigger_sync_in_backward: not with ddp.find_unused_parameters, "
                "which needs the outputs of the forward that the backward follows");
    if (model.reducer_) model.reducer_->prepare_for_backward();
    return GradSyncGuard(model.reducer_, true);
  }
  bool sync_gradients() const { return shared_->gradient_state.sync_gradients; }
  const GradientState& gradient_state() const { return shared_->gradient_state; }
  GradientState& gradient_state() { return shared_->gradient_state; }

  /// Unscales the gradients of the prepared optimizers (once per step), then
  /// clips as torch::nn::utils does. Returns the total norm before clipping.
  double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                         double norm_type = 2.0);
  void clip_grad_value_(const std::vector<at::Tensor>& parameters, double clip_value);
  /// Unscales now (fp16), e.g. to inspect gradients; a no-op otherwise.
  void unscale_gradients();
  /// The same for one prepared optimizer's gradients only (Accelerate's
  /// unscale_gradients(optimizer)). As unscale_gradients(), once per step: a second call does
  /// nothing, where torch's GradScaler, which Accelerate calls, would refuse it. With fp16, an
  /// optimizer this accelerator did not prepare is an error.
  void unscale_gradients(torch::optim::Optimizer& optimizer);
  void unscale_gradients(const AcceleratedOptimizer& optimizer) {
    unscale_gradients(optimizer.optimizer());
  }

  /// Autocast as the accelerator is configured, or as `handler` says (Accelerate's
  /// autocast(autocast_handler): `{.enabled = false}` turns it off inside a region). Nothing
  /// for mixed_precision "no", whatever the handler, as Accelerate's.
  [[nodiscard]] std::optional<amp::Autocast> autocast(
      const std::optional<AutocastKwargs>& handler = std::nullopt) const;

  /// Whether the last optimizer step was skipped for an inf/NaN gradient.
  bool optimizer_step_was_skipped() const;
  /// The GradScaler, or null unless mixed_precision is "fp16" with the scaler enabled.
  amp::GradScaler* scaler() const { return shared_->scaler.get(); }
  /// The numerics monitor of the first prepared model; null unless
  /// `numerics_monitor` was set.
  log::NumericsMonitor* numerics_monitor() const { return shared_->monitor.get(); }

  const std::string& mixed_precision() const { return *shared_->options.mixed_precision; }
  /// gradient_state().num_steps, which the loss is divided by and the
  /// micro-steps are counted against (Accelerate's property).
  int64_t gradient_accumulation_steps() const { return shared_->gradient_state.num_steps; }
  c10::Device device() const { return shared_->device; }
  int64_t num_processes() const { return shared_->num_processes(); }
  int64_t process_index() const { return shared_->group ? shared_->group->rank() : 0; }
  int64_t local_process_index() const { return shared_->group ? shared_->group->local_rank() : 0; }
  bool is_main_process() const { return process_index() == 0; }
  bool is_local_main_process() const { return local_process_index() == 0; }
  bool is_last_process() const { return process_index() == num_processes() - 1; }
  /// Whether save_state() and save_model() write on this process: the main one, or each node's
  /// with project_config.save_on_each_node (HF's TrainingArguments.should_save).
  bool should_save() const {
    return shared_->options.project_config.save_on_each_node ? is_local_main_process()
                                                             : is_main_process();
  }
  /// Accelerate's on_main_process, on_local_main_process, on_last_process, on_process and
  /// on_local_process decorators: `function()` runs on that process only.
  template <typename F>
  void on_main_process(F&& function) const {
    if (is_main_process()) std::forward<F>(function)();
  }
  template <typename F>
  void on_local_main_process(F&& function) const {
    if (is_local_main_process()) std::forward<F>(function)();
  }
  template <typename F>
  void on_last_process(F&& function) const {
    if (is_last_process()) std::forward<F>(function)();
  }
  template <typename F>
  void on_process(int64_t process_index, F&& function) const {
    if (this->process_index() == process_index) std::forward<F>(function)();
  }
  template <typename F>
  void on_local_process(int64_t local_process_index, F&& function) const {
    if (this->local_process_index() == local_process_index) std::forward<F>(function)();
  }
  /// Prints once per machine (the local main process), as Accelerate does; the
  /// arguments are streamed one after the other, with no separator added.
  template <typename... Args>
  void print(const Args&... args) const {
    if (!is_local_main_process()) return;
    std::ostringstream line;
    (line << ... << args);
    print_line(line.str());
  }
  /// A barrier across the processes.
  void wait_for_everyone() const;
  /// Accelerate's profile(): runs `body` under a Profiler of `kwargs` (else the options'
  /// `profile`, else the defaults: every step recorded), then stops it and, with
  /// output_trace_dir, writes its last trace there as profile_{process_index}.json and waits
  /// for every process. Returns the stopped profiler, for key_averages() and table(). If body
  /// throws, the profiler stops (on_trace_ready runs, as on torch's `__exit__`) and the error
  /// goes on, nothing written.
  Profiler profile(const std::function<void(Profiler&)>& body,
                   std::optional<ProfileKwargs> kwargs = std::nullopt);
  /// Guard of main_process_first(): a process that goes first waits for the others when
  /// the guard ends; the others wait for it when the guard begins.
  class GoesFirstGuard {
   public:
    ~GoesFirstGuard();
    GoesFirstGuard(const GoesFirstGuard&) = delete;
    GoesFirstGuard& operator=(const GoesFirstGuard&) = delete;

   private:
    friend class Accelerator;
    GoesFirstGuard(const Accelerator& accelerator, bool first);
    const Accelerator& accelerator_;
    bool first_;
    int exceptions_;  // in flight when it began
  };
  /// Accelerate's main_process_first(): the main process runs the guarded block (e.g. to
  /// make a cache the others then read) before the other processes run it. Every process
  /// must hold one.
  [[nodiscard]] GoesFirstGuard main_process_first() const {
    return GoesFirstGuard(*this, is_main_process());
  }
  /// The same with each machine's local main process going first.
  [[nodiscard]] GoesFirstGuard local_main_process_first() const {
    return GoesFirstGuard(*this, is_local_main_process());
  }
  /// Accelerate's set_trigger(): raises this process's flag, e.g. to stop early on a
  /// condition only one process saw. check_trigger() (every process must call it) says
  /// whether any process raised it since, and then lowers it everywhere.
  void set_trigger() { shared_->trigger = true; }
  bool check_trigger();

  /// Gathers `tensor` from every process along dim 0.
  at::Tensor gather(const at::Tensor& tensor) const;
  /// gather(), less the samples that padded the last batch of the prepared
  /// data loader to an even split.
  at::Tensor gather_for_metrics(const at::Tensor& tensor) const;
  /// Sums ("sum"), averages ("mean") or takes the maximum ("max") of `tensor` over the
  /// processes. "none" sums too, as Accelerate's (its all-reduce is a sum unless "max"). As
  /// Accelerate's, one process gets `tensor` back as it is, and "mean" divides in place, so an
  /// integer tensor's mean is an error with several processes.
  at::Tensor reduce(const at::Tensor& tensor, const std::string& reduction = "sum") const;
  /// Accelerate's pad_across_processes: `tensor` padded along `dim` to the longest of the
  /// processes' tensors (every process must call it), with `pad_index` after the data, or
  /// before it with pad_first. Unchanged when `dim` is beyond the tensor's dims, as in
  /// Accelerate. The dtype stays the tensor's.
  at::Tensor pad_across_processes(const at::Tensor& tensor, int64_t dim = 0,
                                  const at::Scalar& pad_index = 0, bool pad_first = false) const;
  /// accelerate.utils.gather_object, for text: every process's `objects`, concatenated in
  /// process order (serialize other objects first, e.g. as JSON).
  std::vector<std::string> gather_object(const std::vector<std::string>& objects) const;
  /// Accelerate's split_between_processes: this process's contiguous share of `inputs`,
  /// the first size % num_processes() processes taking one more; with apply_padding, a
  /// short share is padded with copies of the last element, so that all are as long (for
  /// gather()). All of `inputs` in one process.
  template <typename T>
  std::vector<T> split_between_processes(const std::vector<T>& inputs,
                                         bool apply_padding = false) const {
    if (num_processes() == 1) return inputs;
    const auto [begin, end, padded] = share(inputs.size(), apply_padding);
    std::vector<T> part(inputs.begin() + static_cast<std::ptrdiff_t>(begin),
                        inputs.begin() + static_cast<std::ptrdiff_t>(end));
    if (part.size() < padded) part.resize(padded, inputs.back());
    return part;
  }
  /// The same along dim 0 of a tensor (padded with copies of its last row).
  at::Tensor split_between_processes(const at::Tensor& inputs, bool apply_padding = false) const;

  /// Saves everything prepared (models, optimizers, schedulers), the
  /// GradScaler, every process's random number generators and the registered
  /// objects into `dir`, atomically: safetensors for tensors, JSON for the
  /// rest, nothing that runs code when loaded (Accelerate's save_state).
  /// `extra_files` (name -> text) go into the same folder, in the same commit.
  /// Without `dir`, with project_config.automatic_checkpoint_naming, the folder is
  /// project_dir/checkpoints/checkpoint_{iteration} (an error if it exists), and the oldest
  /// ones then go to keep total_limit; a `dir` given is used (Accelerate ignores it then).
  /// Every save adds 1 to the iteration. Returns the folder. In data parallel every process
  /// must see the same folder (a shared file system), as the Trainer's checkpoints need.
  /// `models_only` saves the prepared models and `extra_files` alone (the Trainer's
  /// save_only_model), which load_state() cannot resume from.
  std::filesystem::path save_state(const std::optional<std::string>& dir = std::nullopt,
                                   const std::map<std::string, std::string>& extra_files = {},
                                   bool models_only = false);
  /// Restores what save_state wrote, after checking its checksums; a missing
  /// or damaged file, or a state that does not fit what was prepared, is an
  /// error that names the file. Without `dir`, with automatic checkpoint naming, the
  /// newest undamaged checkpoint_N, and the next save is N+1 (beyond the newest folder).
  /// `models_only` loads the prepared models alone (what save_state(models_only) wrote).
  /// `strict` false (Accelerate's load_state(dir, strict=False), passed to torch's
  /// load_state_dict) skips a model's tensors that one side lacks, silently as there.
  void load_state(const std::optional<std::string>& dir = std::nullopt, bool models_only = false,
                  bool strict = true);
  /// Whether `dir` is what save_state(models_only) wrote: the models and extra files alone.
  static bool holds_models_only(const std::filesystem::path& dir);
  /// Accelerate's register_save_state_pre_hook (SaveStateHook). The hooks run on the process
  /// that writes, in the order they were registered (Accelerate's run on every process).
  RemovableHandle register_save_state_pre_hook(SaveStateHook hook);
  /// Accelerate's register_load_state_pre_hook (LoadStateHook), on every process.
  RemovableHandle register_load_state_pre_hook(LoadStateHook hook);
  /// Automatic checkpoint naming's settings; its iteration may be set.
  ProjectConfiguration& project_configuration() { return shared_->options.project_config; }
  /// The number of the next automatically named checkpoint (Accelerate's save_iteration).
  int64_t save_iteration() const { return shared_->options.project_config.iteration; }
  /// Accelerate's save_model: the model's state dict (parameters and buffers) in
  /// `save_directory`, as HF names it: `model.safetensors`, or shards of at most
  /// `max_shard_size` ("10GB", "500MB": units of 1000 bytes, as huggingface_hub's) named
  /// `model-00001-of-00002.safetensors` with `model.safetensors.index.json`. A tensor that
  /// is also under an earlier name (a tied weight: the same data, dtype and view) is saved
  /// under that name only (Accelerate drops any later tensor of the same storage, views
  /// too, and sizes shards by storage). Files of an earlier save that this one does not
  /// write are removed. The main process writes; every process must call it.
  void save_model(const torch::nn::Module& model, const std::string& save_directory,
                  const std::string& max_shard_size = "10GB") const;
  template <ModuleHandle M>
  void save_model(const M& model, const std::string& save_directory,
                  const std::string& max_shard_size = "10GB") const {
    save_model(*model, save_directory, max_shard_size);
  }
  template <ModuleHandle M>
  void save_model(const PreparedModel<M>& model, const std::string& save_directory,
                  const std::string& max_shard_size = "10GB") const {
    save_model(*model.unwrap(), save_directory, max_shard_size);
  }
  /// Saves and loads `object` with the state; it must outlive the accelerator's use of it.
  void register_for_checkpointing(Checkpointable& object);

  /// Opens the trackers of `log_with` in project_dir/project_name, and takes the
  /// custom_trackers (main process only). Each stores `config`, the run's hyperparameters, when
  /// given (TensorBoard's hparams and an hparams.yml, a JSONL line).
  void init_trackers(const std::string& project_name,
                     const std::optional<log::Config>& config = std::nullopt);
  /// Logs scalars to every tracker, at `step` (main process only).
  void log(const std::map<std::string, double>& values, int64_t step);
  /// Logs text to every tracker, at `step` (Accelerate's log with str values; main process
  /// only).
  void log_text(const std::map<std::string, std::string>& values, int64_t step);
  /// The open tracker of that name ("tensorboard", "jsonl", or a custom tracker's name()), as
  /// Accelerate's get_tracker: a name not among the open trackers is an error. With none open
  /// (before init_trackers, or not the main process), null where Accelerate gives a blank
  /// tracker that does nothing.
  log::Tracker* get_tracker(const std::string& name) const;
  /// Flushes and closes the trackers.
  void end_training();
  /// Accelerate's free_memory(): forgets every prepared model, optimizer, scheduler and
  /// data loader (save_state() saves none of them after it), and restarts the accumulation
  /// count; the numerics monitor, if any, moves to the next prepared model. What was prepared
  /// before must not be used with it again. Objects registered for
  /// checkpointing stay registered, as in Accelerate. Then clears the device cache.
  void free_memory();

  template <ModuleHandle M>
  static M unwrap_model(const PreparedModel<M>& model) {
    return model.unwrap();
  }

 private:
  // Data parallel: makes every rank start from rank 0's parameters and
  // buffers, and returns the module's gradient reducer (null in one process).
  std::shared_ptr<dist::GradientReducer> distribute(torch::nn::Module& module);
  void watch_numerics(torch::nn::Module& module);
  void print_line(const std::string& line) const;
  struct Share {
    size_t begin, end, padded_size;
  };
  Share share(size_t size, bool apply_padding) const;
  std::filesystem::path checkpoints_dir() const;
  // Accelerate's _do_sync: counts the micro-step and sets sync_gradients; returns it.
  bool begin_accumulation_step();
  // Runs `write` on the main process (each node's with project_config.save_on_each_node); then
  // every process learns whether one failed, and throws if so (a barrier would leave the others
  // waiting out the process group's timeout).
  void main_process_writes(const char* what, const std::function<void()>& write) const;
  // What save_state() writes besides the models and its extra files: what a resume needs.
  void write_training_state(io::CheckpointWriter& writer,
                            const std::vector<std::map<std::string, at::Tensor>>& rng_states) const;

  std::shared_ptr<detail::Shared> shared_;
};

/// Accelerate's load_checkpoint_in_model: loads `checkpoint` into `model`: a .safetensors
/// file, a `*.safetensors.index.json` and its shards, or a folder that Accelerator::save_model
/// or HF's save_pretrained wrote (sharded or not). A tied weight saved under one of its names
/// loads into all (saved under several, they must hold equal values). By default stricter
/// than Accelerate's (strict=False): a missing or unexpected tensor, or a shape that does not
/// fit, is an error that names it and the file. `strict` false is Accelerate's: missing tensors
/// are left as they are, and unexpected ones are skipped with its warning.
void load_checkpoint_in_model(torch::nn::Module& model, const std::string& checkpoint,
                              bool strict = true);
template <ModuleHandle M>
void load_checkpoint_in_model(M model, const std::string& checkpoint,
                              bool strict = true) {  // a handle: shares it
  load_checkpoint_in_model(*model, checkpoint, strict);
}

/// Seeds every generator a run uses (LibTorch's CPU and CUDA generators and
/// std::rand), as accelerate.utils.set_seed does.
void set_seed(uint64_t seed);

/// accelerate.utils.clear_device_cache: returns the accelerator's cached free memory to it
/// (torch.cuda.empty_cache()). Nothing on a CPU, nor with LibTorch before 2.9.
void clear_device_cache();

}  // namespace mixprec::accelerate

namespace mixprec {
using accelerate::Accelerator;
using accelerate::AcceleratorOptions;
}  // namespace mixprec
