#include "mixprec/accelerate/accelerator.h"

#include "mixprec/io/checkpoint.h"
#include "mixprec/io/safetensors.h"
#include "mixprec/log/logging.h"
#include "mixprec/optim/clip_grad.h"
#include "mixprec/optim/optimizer_in_backward.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/cuda.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/utils.h>
#include <torch/version.h>
#if __has_include(<ATen/DeviceAccelerator.h>)
#include <ATen/DeviceAccelerator.h>
#endif

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>

#ifdef __GLIBC__
#include <malloc.h>
#endif

namespace mixprec::accelerate {

void detail::Shared::unscale(torch::optim::Optimizer& optimizer, OptimizerFlags& flags) {
  if (!scaler || flags.unscaled) return;
  scaler->unscale_(optimizer);
  flags.unscaled = true;
}

namespace {

// glibc hands the freed activations of each step back to the OS and maps them again on the
// next one (page faults cost ~25% of a small GPT-2 step here, and made its time bimodal).
// Serving every block from the heap and keeping up to 1 GiB of freed memory there lets each
// step reuse the last one's memory, as PyTorch's caching allocators do on accelerators; peak
// RSS stays the same. Not mmap at all: glibc maps blocks over 32 MiB whatever the threshold
// (a large GPT-2's fp32 logits: 3-5% of a bf16 step in faults alone). Left alone when the
// user tunes malloc through the environment.
void keep_freed_memory_for_reuse() {
#ifdef __GLIBC__
  static std::once_flag once;
  std::call_once(once, [] {
    for (const char* name :
         {"MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"})
      if (std::getenv(name) != nullptr) return;
    mallopt(M_MMAP_MAX, 0);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
  });
#endif
}

// Again at each save: project_configuration() may have changed it since.
void check_total_limit(const ProjectConfiguration& project, const char* where) {
  TORCH_CHECK(project.total_limit.value_or(1) >= 1, where,
              ": project_config.total_limit must be >= 1, got ", project.total_limit.value_or(1));
}

// What `accelerate launch` passes its processes, which Accelerate reads where the code leaves a
// choice unset: the variable's value, none when unset or empty.
std::optional<std::string> launch_setting(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

// The settings the code left unset, from the launcher's variables as Accelerate takes them.
void fill_from_launcher(AcceleratorOptions& options) {
  if (!options.mixed_precision) {
    options.mixed_precision = launch_setting("ACCELERATE_MIXED_PRECISION").value_or("no");
    TORCH_CHECK(*options.mixed_precision == "no" || *options.mixed_precision == "fp16" ||
                    *options.mixed_precision == "bf16",
                "Accelerator: unknown mixed_precision '", *options.mixed_precision,
                "' in ACCELERATE_MIXED_PRECISION; expected \"no\", \"fp16\" or \"bf16\"");
  }
  if (!options.gradient_accumulation_steps) {
    const auto steps = launch_setting("ACCELERATE_GRADIENT_ACCUMULATION_STEPS");
    size_t used = 0;
    try {
      options.gradient_accumulation_steps = steps ? std::stoll(*steps, &used) : 1;
    } catch (const std::logic_error&) {  // not a number, or out of range
    }
    TORCH_CHECK(
        !steps || (used == steps->size() && used > 0 && *options.gradient_accumulation_steps >= 1),
        "Accelerator: ACCELERATE_GRADIENT_ACCUMULATION_STEPS is '", steps.value_or(""),
        "', expected an integer >= 1");
  }
  // Accelerate's str_to_bool.
  if (const auto cpu = launch_setting("ACCELERATE_USE_CPU")) {
    std::string v = *cpu;
    std::ranges::transform(v, v.begin(), [](unsigned char c) { return std::tolower(c); });
    const bool yes = v == "y" || v == "yes" || v == "t" || v == "true" || v == "on" || v == "1";
    const bool no = v == "n" || v == "no" || v == "f" || v == "false" || v == "off" || v == "0";
    TORCH_CHECK(yes || no, "Accelerator: ACCELERATE_USE_CPU is '", *cpu,
                "', expected a truth value (y, yes, t, true, on, 1 or n, no, f, false, off, 0)");
    options.cpu = options.cpu || yes;
  }
}

}  // namespace

Accelerator::Accelerator(AcceleratorOptions options) : shared_(std::make_shared<detail::Shared>()) {
  fill_from_launcher(options);
  const std::string& mp = *options.mixed_precision;
  TORCH_CHECK(mp == "no" || mp == "fp16" || mp == "bf16", "Accelerator: unknown mixed_precision '",
              mp, "'; expected \"no\", \"fp16\" or \"bf16\"");
  check_total_limit(options.project_config, "Accelerator");
  TORCH_CHECK(*options.gradient_accumulation_steps >= 1,
              "Accelerator: gradient_accumulation_steps must be >= 1, got ",
              *options.gradient_accumulation_steps);
  for (const auto& type : options.rng_types) {
    TORCH_CHECK(type == "torch" || type == "cuda" || type == "generator",
                "Accelerator: rng_types' '", type,
                "' is not one of \"torch\", \"cuda\", \"generator\"");
    TORCH_CHECK(type != "cuda" || torch::cuda::is_available(),
                "Accelerator: can't synchronize CUDA seeds (rng_types' \"cuda\") without CUDA");
  }
  shared_->group = dist::ProcessGroup::from_environment();
  if (shared_->group && options.timeout) shared_->group->set_timeout(*options.timeout);
  // One GPU per process of a machine, as Accelerate's cuda:{local_process_index}.
  shared_->device =
      (!options.cpu && torch::cuda::is_available())
          ? c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(
                                        (shared_->group ? shared_->group->local_rank() : 0) %
                                        torch::cuda::device_count()))
          : c10::Device(c10::kCPU);
  // And the current device, as Accelerate's torch.cuda.set_device: what user code allocates on
  // "cuda" lands on this process's GPU.
  if (shared_->device.is_cuda())
    c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(shared_->device);
  if (mp == "fp16") {
    shared_->autocast_dtype = c10::kHalf;
    // Without the scaler (Accelerate's GradScalerKwargs(enabled=False)), small fp16 gradients
    // underflow: the user's choice, as in Accelerate.
    if (options.scaler.enabled) shared_->scaler = std::make_unique<amp::GradScaler>(options.scaler);
  } else if (mp == "bf16") {
    shared_->autocast_dtype = c10::kBFloat16;
  }
  shared_->gradient_state.num_steps = *options.gradient_accumulation_steps;
  shared_->options = std::move(options);
  if (shared_->device.is_cpu()) keep_freed_memory_for_reuse();
}

std::shared_ptr<dist::GradientReducer> Accelerator::distribute(torch::nn::Module& module) {
  auto& group = shared_->group;
  if (!group) return nullptr;
  at::NoGradGuard no_grad;
  for (auto& tensor : module.parameters()) group->broadcast_(tensor);
  for (auto& tensor : module.buffers()) group->broadcast_(tensor);
  std::vector<at::Tensor> trained;
  for (const auto& p : module.parameters())
    if (p.requires_grad()) trained.push_back(p);
  if (trained.empty()) return nullptr;  // as Accelerate: nothing to all-reduce, no DDP
  return std::make_shared<dist::GradientReducer>(std::move(trained), group, shared_->options.ddp,
                                                 module.buffers());
}

void Accelerator::watch_numerics(torch::nn::Module& module) {
  // The first prepared model's, also the first after free_memory() (until then, the last
  // run's figures stay readable).
  if (shared_->options.numerics_monitor && shared_->models.size() == 1)
    shared_->monitor = std::make_shared<log::NumericsMonitor>(module.named_parameters().pairs(),
                                                              *shared_->options.numerics_monitor);
}

AcceleratedOptimizer Accelerator::prepare_one(torch::optim::Optimizer& optimizer) {
  return AcceleratedOptimizer(optimizer, shared_);
}

AcceleratedScheduler Accelerator::prepare_one(optim::LRScheduler& scheduler) {
  shared_->schedulers.push_back(&scheduler);
  return AcceleratedScheduler(scheduler, shared_);
}

PreparedDataLoader Accelerator::prepare_data_loader(data::DatasetPtr dataset,
                                                    data::DataLoaderOptions options,
                                                    data::CollateFn collate) {
  auto loader = std::make_shared<data::DataLoader>(
      std::move(dataset), prepared_loader_options(std::move(options)), std::move(collate));
  shared_->loaders.push_back(loader);
  return PreparedDataLoader(loader, shared_);
}

data::DataLoaderOptions Accelerator::prepared_loader_options(data::DataLoaderOptions options) {
  options.num_replicas = static_cast<size_t>(num_processes());
  options.rank = static_cast<size_t>(process_index());
  options.sharding = data::Sharding::kBatchSamplerShard;
  if (shared_->options.split_batches) {
    // Step k then sees batch k of the one-process loader, in contiguous slices, as in Accelerate.
    TORCH_CHECK(options.batch_size % options.num_replicas == 0,
                "Accelerator: to use a DataLoader in split_batches mode, the batch size (",
                options.batch_size, ") needs to be a round multiple of the number of processes (",
                options.num_replicas, ").");
    options.batch_size /= options.num_replicas;
  }
  // The main process's seeds, so that the processes shuffle alike.
  auto main_process_seed = [&](int64_t seed) {
    at::Tensor value = at::scalar_tensor(seed, at::kLong);
    if (shared_->group) shared_->group->broadcast_(value);
    return static_cast<uint64_t>(value.item<int64_t>());
  };
  if (options.shuffle && !options.seed && !options.generator) {
    const auto& o = shared_->options;
    // SeedableRandomSampler: torch.random.initial_seed(). A length-grouped order is one of
    // seed + epoch here, so it takes that seed too (HF's LengthGroupedSampler, which Accelerate
    // leaves as it is, draws from torch's generator).
    if ((o.use_seedable_sampler || options.group_by_length) &&
        options.shuffle_order == data::ShuffleOrder::kSeedPlusEpoch)
      options.seed = main_process_seed(
          o.data_seed ? static_cast<int64_t>(*o.data_seed)
                      : static_cast<int64_t>(at::detail::getDefaultCPUGenerator().current_seed()));
    else  // Accelerate's default
      options.shuffle_order = data::ShuffleOrder::kRandomSampler;
  }
  // A RandomSampler in data parallel gets a generator seeded from the main process's torch
  // generator (which Accelerate synchronizes at each pass), else each process would draw its own
  // order and their shards would overlap.
  if (options.shuffle && options.shuffle_order == data::ShuffleOrder::kRandomSampler &&
      !options.generator && num_processes() > 1)
    options.generator = at::make_generator<at::CPUGeneratorImpl>(
        main_process_seed(static_cast<int64_t>(data::draw_seed())));
  return options;
}

PreparedDataLoader::PreparedDataLoader(std::shared_ptr<data::DataLoader> loader,
                                       std::shared_ptr<detail::Shared> shared)
    : loader_(std::move(loader)),
      shared_(std::move(shared)),
      position_(std::make_shared<detail::LoaderPosition>()) {}

PreparedDataLoader Accelerator::skip_first_batches(const PreparedDataLoader& loader,
                                                   size_t num_batches) const {
  TORCH_CHECK(num_batches <= loader.loader_->size(),
              "Accelerator::skip_first_batches: ", num_batches, " batches to skip, but a pass has ",
              loader.loader_->size());
  PreparedDataLoader skipping = loader;
  skipping.position_ = std::make_shared<detail::LoaderPosition>();  // a loader of its own
  skipping.skip_batches_ = num_batches;
  return skipping;
}

namespace {

// Accelerate's synchronize_rng_states, as each pass of a prepared loader starts: the main
// process's states. ("generator", the loader's shuffle generator: one prepare_data_loader made
// is seeded alike already, one the caller gave may not be.)
void synchronize_rng_states(const detail::Shared& shared, const data::DataLoader& loader) {
  if (!shared.group) return;
  for (const auto& type : shared.options.rng_types) {
    if (type == "generator" && !loader.options().generator) continue;
    at::Generator generator =
        type == "generator" ? *loader.options().generator
        : type == "torch"   ? at::detail::getDefaultCPUGenerator()
                            : at::globalContext().defaultGenerator(
                                  shared.device.is_cuda() ? shared.device : c10::Device(c10::kCUDA));
    std::lock_guard<std::mutex> lock(generator.mutex());
    at::Tensor state = generator.get_state();
    shared.group->broadcast_(state);
    generator.set_state(state);
  }
}

}  // namespace

void detail::Shared::show_active_loader() {
  const auto active = loaders_in_pass.empty() ? nullptr : loaders_in_pass.back().lock();
  gradient_state.end_of_dataloader = active && active->end_of_dataloader;
  gradient_state.num_padding_samples = active ? active->num_padding_samples : 0;
}

PreparedDataLoader::Iterator PreparedDataLoader::begin() {
  synchronize_rng_states(*shared_, *loader_);
  *position_ = {};
  shared_->loaders_in_pass.push_back(position_);
  shared_->show_active_loader();
  Iterator it;
  it.owner_ = this;
  it.it_ = loader_->begin_from(skip_batches_);
  it.load();
  return it;
}

PreparedDataLoader::Iterator PreparedDataLoader::end() {
  Iterator it;
  it.owner_ = this;
  it.it_ = loader_->end();
  return it;
}

PreparedDataLoader::Iterator& PreparedDataLoader::Iterator::operator++() {
  ++it_;
  load();
  return *this;
}

// Takes the batch the loader is at, onto the device, and tells the gradient
// state whether it is the last one.
void PreparedDataLoader::Iterator::load() {
  auto& loader = *owner_->loader_;
  batch_.clear();
  auto& shared = *owner_->shared_;
  auto& position = *owner_->position_;
  if (it_ == loader.end()) {  // the pass is over: the next one is the next epoch
    loader.set_epoch(loader.epoch() + 1);
    // As Accelerate's _remove_dataloader: the loader leaves the stack (with loaders gone).
    std::erase_if(shared.loaders_in_pass, [&](const std::weak_ptr<detail::LoaderPosition>& p) {
      const auto alive = p.lock();
      return !alive || alive.get() == &position;
    });
    shared.show_active_loader();
    return;
  }
  for (const auto& [key, t] : *it_) batch_[key] = t.to(shared.device);
  position.end_of_dataloader = loader.batches_yielded() == static_cast<int64_t>(loader.size());
  position.num_padding_samples =
      position.end_of_dataloader ? static_cast<int64_t>(loader.num_padding_samples()) : 0;
  shared.show_active_loader();
}

void Accelerator::register_for_checkpointing(Checkpointable& object) {
  shared_->custom_objects.push_back(&object);
}

namespace {

// The n-th file of a kind: "model.safetensors", "model_1.safetensors", ... as Accelerate names
// them.
std::string nth(const std::string& stem, size_t n, const std::string& extension) {
  return (n == 0 ? stem : stem + "_" + std::to_string(n)) + extension;
}

}  // namespace

// Automatically named checkpoints: checkpoint_0, checkpoint_1, ... as Accelerate names them.
constexpr const char* kCheckpointPrefix = "checkpoint_";
// How prepared loaders share the data among the processes, as dataloader_N.json records it.
constexpr const char* kSharding = "batch_sampler_shard";

std::filesystem::path Accelerator::checkpoints_dir() const {
  return std::filesystem::path(shared_->options.project_dir) / "checkpoints";
}

std::filesystem::path Accelerator::save_state(const std::optional<std::string>& dir_name,
                                              const std::map<std::string, std::string>& extra_files,
                                              bool models_only) {
  using nlohmann::json;
  auto& project = shared_->options.project_config;
  check_total_limit(project, "Accelerator::save_state");
  std::filesystem::path dir;
  if (dir_name) {
    dir = *dir_name;
  } else {
    TORCH_CHECK(project.automatic_checkpoint_naming,
                "Accelerator::save_state: no folder given, and "
                "project_config.automatic_checkpoint_naming is off");
    const auto root = checkpoints_dir();
    dir = root / (kCheckpointPrefix + std::to_string(project.iteration));
    TORCH_CHECK(!std::filesystem::exists(dir), "Accelerator::save_state: checkpoint folder ",
                dir.string(), " (iteration ", project.iteration,
                ") already exists; set project_configuration().iteration to the number to go on "
                "from");
  }
  // Every process has looked for an automatically named folder before the main one makes it.
  if (shared_->group) wait_for_everyone();
  // Every process's generators, gathered to the main process that writes.
  std::vector<io::TensorMap> rng_states;
  if (!models_only) {
    io::TensorMap own = io::rng_state();
    if (shared_->group) {
      for (const auto& [name, state] : own) {
        at::Tensor all = shared_->group->all_gather(state.unsqueeze(0));
        rng_states.resize(static_cast<size_t>(all.size(0)));
        for (int64_t r = 0; r < all.size(0); ++r) rng_states[static_cast<size_t>(r)][name] = all[r];
      }
    } else {
      rng_states.push_back(own);
    }
  }
  main_process_writes("Accelerator::save_state", [&] {
    if (!dir_name) io::remove_unfinished_checkpoints(checkpoints_dir(), kCheckpointPrefix);
    io::CheckpointWriter writer(dir);
    std::vector<io::TensorMap> weights;  // detached, as state_dict() gives them
    for (const auto& model : shared_->models) {
      weights.push_back(io::module_state(*model));
      for (auto& [name, tensor] : weights.back()) tensor = tensor.detach();
    }
    // A copy: a hook may remove itself.
    for (const auto& [id, hook] : std::map(shared_->save_state_hooks))
      hook(shared_->models, weights, writer.dir());
    for (size_t i = 0; i < weights.size(); ++i)
      writer.write_tensors(nth("model", i, ".safetensors"), weights[i]);
    if (!models_only) write_training_state(writer, rng_states);
    for (const auto& [name, text] : extra_files) writer.write_text(name, text);
    writer.commit();
    // The oldest go once the new one is whole (Accelerate deletes them before writing it).
    // Never the new one, even when a lower iteration was set by hand.
    if (!dir_name && project.total_limit) {
      auto saved = io::checkpoints(checkpoints_dir(), kCheckpointPrefix);
      std::erase_if(saved,
                    [&](const auto& old) { return std::filesystem::equivalent(old.second, dir); });
      const auto others = static_cast<size_t>(*project.total_limit) - 1;  // limit >= 1, above
      for (size_t i = 0; i + others < saved.size(); ++i) io::remove_old_checkpoint(saved[i].second);
    }
  });
  ++project.iteration;
  return dir;
}

void Accelerator::write_training_state(io::CheckpointWriter& writer,
                                       const std::vector<io::TensorMap>& rng_states) const {
  using nlohmann::json;
  for (size_t i = 0; i < shared_->optimizers.size(); ++i) {
    const auto state = io::optimizer_state(*shared_->optimizers[i].first);
    writer.write_tensors(nth("optimizer", i, ".safetensors"), state.tensors);
    writer.write_text(nth("optimizer", i, ".json"), state.groups_json);
  }
  for (size_t i = 0; i < shared_->schedulers.size(); ++i) {
    const auto state = shared_->schedulers[i]->state_dict();
    writer.write_text(nth("scheduler", i, ".json"),
                      json{{"last_epoch", state.last_epoch}, {"base_lrs", state.base_lrs}}.dump(1));
  }
  if (shared_->scaler)
    writer.write_text("scaler.json", json(shared_->scaler->state_dict()).dump(1));
  for (size_t r = 0; r < rng_states.size(); ++r)
    writer.write_tensors("random_states_" + std::to_string(r) + ".safetensors", rng_states[r]);
  for (size_t i = 0; i < shared_->custom_objects.size(); ++i)
    writer.write_text(nth("custom_checkpoint", i, ".json"),
                      shared_->custom_objects[i]->state_dict());
  for (size_t i = 0; i < shared_->loaders.size(); ++i) {
    const auto& loader = *shared_->loaders[i];
    json state = loader.state();
    // The seedable order's seed (torch's initial seed, maybe another in a resumed run).
    if (loader.options().seed) state["seed"] = *loader.options().seed;
    state["sharding"] = kSharding;
    state["batch_size"] = loader.options().batch_size;
    writer.write_text(nth("dataloader", i, ".json"), state.dump());
  }
  writer.write_text("accelerator.json", json{{"step", shared_->step},
                                             {"num_processes", num_processes()},
                                             {"mixed_precision", *shared_->options.mixed_precision}}
                                            .dump(1));
}

// save_state(models_only) writes no accelerator.json; every other save does.
bool Accelerator::holds_models_only(const std::filesystem::path& dir) {
  return !std::filesystem::exists(dir / "accelerator.json");
}

void Accelerator::load_state(const std::optional<std::string>& dir_name, bool models_only,
                             bool strict) {
  using nlohmann::json;
  std::filesystem::path dir;
  if (dir_name) {
    dir = *dir_name;
    io::verify_checkpoint(dir);
  } else {
    auto& project = shared_->options.project_config;
    TORCH_CHECK(project.automatic_checkpoint_naming,
                "Accelerator::load_state: no folder given, and "
                "project_config.automatic_checkpoint_naming is off");
    const auto root = checkpoints_dir();
    const auto last = io::last_good_checkpoint(root, kCheckpointPrefix);
    TORCH_CHECK(last, "Accelerator::load_state: no checkpoint_N folder in ", root.string());
    dir = *last;
    // The next save goes after every folder there, a damaged newer one included.
    project.iteration = io::checkpoints(root, kCheckpointPrefix).back().first + 1;
  }
  auto read_json = [&](const std::string& name) {
    const auto file = dir / name;
    try {
      return json::parse(io::read_file(file));
    } catch (const json::exception& e) {
      TORCH_CHECK(false, file.string(), ": malformed JSON: ", e.what());
    }
  };
  // Before any model changes.
  TORCH_CHECK(models_only || !holds_models_only(dir), "Accelerator::load_state: ", dir.string(),
              " holds the models only (saved with models_only, the Trainer's save_only_model); "
              "load_state(dir, /*models_only=*/true) loads them");
  auto models = shared_->models;
  for (const auto& [id, hook] : std::map(shared_->load_state_hooks)) hook(models, dir);
  for (size_t i = 0; i < models.size(); ++i) {
    const auto file = dir / nth("model", i, ".safetensors");
    io::load_module_state(*models[i], io::load_safetensors(file), file.string(), strict);
  }
  if (models_only) return;
  for (size_t i = 0; i < shared_->optimizers.size(); ++i) {
    const auto file = dir / nth("optimizer", i, ".safetensors");
    io::OptimizerState state{io::load_safetensors(file),
                             io::read_file(dir / nth("optimizer", i, ".json"))};
    io::load_optimizer_state(*shared_->optimizers[i].first, state, file.string());
  }
  for (size_t i = 0; i < shared_->schedulers.size(); ++i) {
    const std::string name = nth("scheduler", i, ".json");
    const json state = read_json(name);
    try {
      shared_->schedulers[i]->load_state_dict(
          {state.at("last_epoch").get<int64_t>(), state.at("base_lrs").get<std::vector<double>>()});
    } catch (const json::exception& e) {
      TORCH_CHECK(false, (dir / name).string(), ": ", e.what());
    }
  }
  if (shared_->scaler) {
    const json state = read_json("scaler.json");
    std::map<std::string, double> values;
    TORCH_CHECK(state.is_object(), (dir / "scaler.json").string(), ": expected an object");
    for (const auto& [key, value] : state.items()) {
      TORCH_CHECK(value.is_number(), (dir / "scaler.json").string(), ": '", key,
                  "' expects a number, got ", value.dump());
      values[key] = value.get<double>();
    }
    shared_->scaler->load_state_dict(values);
  }
  // A run with more processes than the one saved finds no file for the new ones: Accelerate
  // skips it with a message (an error on those processes alone would leave the others waiting).
  const auto rng_file = dir / ("random_states_" + std::to_string(process_index()) + ".safetensors");
  if (std::filesystem::exists(rng_file))
    io::load_rng_state(io::load_safetensors(rng_file), rng_file.string());
  else
    MIXPREC_WARN(
        "Accelerator::load_state: no ", rng_file.string(),
        " (saved with fewer processes); this process's random generators are not restored");
  for (size_t i = 0; i < shared_->custom_objects.size(); ++i) {
    const auto file = dir / nth("custom_checkpoint", i, ".json");
    const std::string text = io::read_file(file);
    try {
      shared_->custom_objects[i]->load_state_dict(text);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, file.string(), ": ", e.what_without_backtrace());
    } catch (const std::exception& e) {
      TORCH_CHECK(false, file.string(), ": ", e.what());
    }
  }
  const json accelerator_state = read_json("accelerator.json");
  for (size_t i = 0; i < shared_->loaders.size(); ++i) {
    const std::string name = nth("dataloader", i, ".json");
    try {
      const json state = read_json(name);
      const auto position = state.get<data::DataLoaderState>();
      try {
        shared_->loaders[i]->load_state(position);
      } catch (const c10::Error& e) {
        TORCH_CHECK(false, (dir / name).string(), ": ", e.what_without_backtrace());
      }
      if (state.contains("seed")) shared_->loaders[i]->set_seed(state.at("seed").get<uint64_t>());
      // Mid-epoch, the batches done stand for other samples when the processes together took
      // another batch, or shared the data otherwise. (split_batches keeps the batch of all.)
      // A checkpoint that does not record the sharding had DistributedSampler's.
      const auto& loader = *shared_->loaders[i];
      const auto batch_size = static_cast<int64_t>(loader.options().batch_size);
      const int64_t saved_processes =
          accelerator_state.is_object() ? accelerator_state.value("num_processes", num_processes())
                                        : num_processes();
      const int64_t saved_batch_size = state.value("batch_size", batch_size);
      const auto saved_sharding = state.value("sharding", std::string("distributed_sampler"));
      if (position.batches_yielded > 0 &&
          (saved_batch_size * saved_processes != batch_size * num_processes() ||
           (std::max(saved_processes, num_processes()) > 1 && saved_sharding != kSharding)))
        MIXPREC_WARN("Accelerator::load_state: ", (dir / name).string(),
                     " stopped mid-epoch with batches of ", saved_batch_size, " on each of ",
                     saved_processes, " process(es), sharded as ", saved_sharding,
                     "; this run has batches of ", batch_size, " on each of ", num_processes(),
                     ", sharded as ", kSharding,
                     ", so the rest of the epoch can repeat or skip samples");
    } catch (const json::exception& e) {
      TORCH_CHECK(false, (dir / name).string(), ": ", e.what());
    }
  }
  const json step =
      accelerator_state.is_object() ? accelerator_state.value("step", json(0)) : json();
  TORCH_CHECK(step.is_number_integer() && step.get<int64_t>() >= 0,
              (dir / "accelerator.json").string(), ": expected {\"step\": integer >= 0}, got ",
              accelerator_state.dump());
  shared_->step = step.get<int64_t>();
}

void Accelerator::save_model(const torch::nn::Module& model, const std::string& save_directory,
                             const std::string& max_shard_size) const {
  const int64_t max_shard_bytes = io::parse_size(max_shard_size);
  const std::filesystem::path dir(save_directory);
  TORCH_CHECK(!std::filesystem::exists(dir) || std::filesystem::is_directory(dir),
              "Accelerator::save_model: ", dir.string(), " should be a folder, not a file");
  main_process_writes("Accelerator::save_model", [&] {
    std::filesystem::create_directories(dir);
    io::save_sharded_safetensors(dir, io::untied_module_state(model), max_shard_bytes);
  });
}

void Accelerator::main_process_writes(const char* what, const std::function<void()>& write) const {
  std::exception_ptr failure;
  std::string message;
  if (should_save()) {
    try {
      write();
    } catch (const c10::Error& e) {
      failure = std::current_exception();
      message = e.what_without_backtrace();
    } catch (const std::exception& e) {
      failure = std::current_exception();
      message = e.what();
    } catch (...) {
      failure = std::current_exception();
    }
    if (failure && message.empty()) message = "an error without a message";
  }
  if (shared_->group)
    for (const auto& failed : gather_object({message}))
      if (message.empty()) message = failed;
  if (failure) std::rethrow_exception(failure);
  TORCH_CHECK(message.empty(), what, ": ",
              shared_->options.project_config.save_on_each_node ? "a node's" : "the",
              " main process failed: ", message);
}

AcceleratedOptimizer::AcceleratedOptimizer(torch::optim::Optimizer& optimizer,
                                           std::shared_ptr<detail::Shared> shared)
    : optimizer_(&optimizer),
      flags_(std::make_shared<detail::OptimizerFlags>()),
      shared_(std::move(shared)) {
  shared_->optimizers.emplace_back(optimizer_, flags_);
}

void AcceleratedOptimizer::step() {
  if (!shared_->gradient_state.sync_gradients) return;
  if (shared_->scaler) {
    flags_->step_was_skipped = !shared_->scaler->step(*optimizer_);
    shared_->scaler->update();
  } else {
    optimizer_->step();
    flags_->step_was_skipped = false;
  }
  flags_->unscaled = false;
  // One monitored step per step of the first optimizer.
  if (shared_->monitor && !shared_->optimizers.empty() &&
      shared_->optimizers.front().first == optimizer_) {
    const auto logs = shared_->monitor->end_step(
        shared_->scaler ? shared_->scaler->get_scale() : 1.0, flags_->step_was_skipped);
    if (!logs.empty())
      for (auto& tracker : shared_->trackers)
        tracker->log(logs, shared_->monitor->records().back().step);
  }
}

void AcceleratedOptimizer::zero_grad(bool set_to_none) {
  if (shared_->gradient_state.sync_gradients) optimizer_->zero_grad(set_to_none);
}

AcceleratedScheduler::AcceleratedScheduler(optim::LRScheduler& scheduler,
                                           std::shared_ptr<detail::Shared> shared)
    : scheduler_(&scheduler), shared_(std::move(shared)) {}

void AcceleratedScheduler::step() {
  if (!shared_->options.step_scheduler_with_optimizer) {
    scheduler_->step();
    return;
  }
  if (!shared_->gradient_state.sync_gradients) return;
  // A scheduler waits for its own optimizer's skipped step; one whose optimizer was not
  // prepared, for any (Accelerate's rule).
  const auto own = std::ranges::find(shared_->optimizers, &scheduler_->optimizer(),
                                     [](const auto& entry) { return entry.first; });
  if (own != shared_->optimizers.end()
          ? own->second->step_was_skipped
          : std::ranges::any_of(shared_->optimizers,
                                [](const auto& e) { return e.second->step_was_skipped; }))
    return;
  // Without split_batches each process saw a whole batch: the schedule, made
  // for the number of single-process batches, advances once per process.
  const int64_t steps = shared_->options.split_batches ? 1 : shared_->num_processes();
  for (int64_t i = 0; i < steps; ++i) scheduler_->step();
}

void Accelerator::backward(const at::Tensor& loss, const BackwardOptions& options) {
  // Dividing by 1 changes nothing, but costs an op and an autograd node a step.
  const int64_t steps = shared_->gradient_state.num_steps;
  // optim::OptimizerInBackward's hooks would update inside this backward: at every micro-batch,
  // and in fp16 with the scaled gradient, before any inf/NaN check. Checked on the models too:
  // with the hooks, the loop has no reason to prepare the optimizer.
  if (steps > 1 || shared_->scaler) {
    const std::string_view why =
        shared_->scaler ? "which applies its scaled gradient before the GradScaler can unscale it "
                          "or skip the step on an inf/NaN (fp16)"
                        : "which updates it at every micro-batch instead of once per "
                          "gradient_accumulation_steps";
    for (const auto& model : shared_->models)
      optim::check_not_updated_in_backward(*model, "Accelerator::backward (a prepared model)", why);
    for (const auto& [optimizer, flags] : shared_->optimizers)
      optim::check_not_updated_in_backward(*optimizer,
                                           "Accelerator::backward (a prepared optimizer)", why);
  }
  at::Tensor scaled = steps == 1 ? loss : loss / steps;
  // LibTorch would take an empty list for every leaf.
  TORCH_CHECK(!options.inputs || !options.inputs->empty(),
              "Accelerator::backward: `inputs` argument to `backward()` cannot be empty.");
  if (shared_->scaler) scaled = shared_->scaler->scale(scaled);
  if (options.inputs)
    scaled.backward({}, options.retain_graph, options.create_graph,
                    at::TensorList(*options.inputs));
  else
    scaled.backward({}, options.retain_graph, options.create_graph);
  // Complete (and all-reduced) gradients, still scaled: what fp16 held.
  if (shared_->monitor && shared_->gradient_state.sync_gradients)
    shared_->monitor->record_gradients(shared_->scaler ? std::optional(shared_->scaler->get_scale())
                                                       : std::nullopt);
}

bool Accelerator::begin_accumulation_step() {
  auto& state = shared_->gradient_state;
  if (shared_->options.sync_with_dataloader && state.end_of_dataloader) {
    shared_->step = 0;
    state.sync_gradients = true;
  } else {
    ++shared_->step;
    state.sync_gradients = shared_->step % state.num_steps == 0;
  }
  return state.sync_gradients;
}

void Accelerator::unscale_gradients() {
  for (auto& [optimizer, flags] : shared_->optimizers) shared_->unscale(*optimizer, *flags);
}

void Accelerator::unscale_gradients(torch::optim::Optimizer& optimizer) {
  if (!shared_->scaler) return;
  const auto prepared = std::ranges::find(shared_->optimizers, &optimizer,
                                          &decltype(shared_->optimizers)::value_type::first);
  TORCH_CHECK(prepared != shared_->optimizers.end(),
              "Accelerator::unscale_gradients: the optimizer was not prepared by this "
              "accelerator");
  shared_->unscale(optimizer, *prepared->second);
}

namespace {

// What both clips do first: the gradients must be whole and still there, then unscaled.
void prepare_to_clip(Accelerator& accelerator, const std::vector<at::Tensor>& parameters,
                     const char* caller) {
  TORCH_CHECK(accelerator.sync_gradients(), caller,
              " on a gradient accumulation step: the gradients are not complete yet. Clip when "
              "accelerator.sync_gradients() is true.");
  optim::check_not_updated_in_backward(parameters, caller, optim::kClippingNeedsTheGradient);
  accelerator.unscale_gradients();
}

}  // namespace

double Accelerator::clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                                    double norm_type) {
  prepare_to_clip(*this, parameters, "Accelerator::clip_grad_norm_");
  return optim::clip_grad_norm_(parameters, max_norm, norm_type);
}

void Accelerator::clip_grad_value_(const std::vector<at::Tensor>& parameters, double clip_value) {
  prepare_to_clip(*this, parameters, "Accelerator::clip_grad_value_");
  torch::nn::utils::clip_grad_value_(parameters, clip_value);
}

std::optional<amp::Autocast> Accelerator::autocast(
    const std::optional<AutocastKwargs>& handler) const {
  if (!shared_->autocast_dtype) return std::nullopt;
  const AutocastKwargs& kwargs = handler.value_or(shared_->options.autocast);
  return std::optional<amp::Autocast>(std::in_place, shared_->device.type(),
                                      shared_->autocast_dtype, kwargs.enabled,
                                      kwargs.cache_enabled);
}

bool Accelerator::optimizer_step_was_skipped() const {
  for (const auto& [optimizer, flags] : shared_->optimizers)
    if (flags->step_was_skipped) return true;
  return false;
}

void Accelerator::print_line(const std::string& line) const {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

void Accelerator::wait_for_everyone() const {
  if (shared_->group) shared_->group->barrier();
}

Profiler Accelerator::profile(const std::function<void(Profiler&)>& body,
                              std::optional<ProfileKwargs> kwargs) {
  if (!kwargs) kwargs = shared_->options.profile.value_or(ProfileKwargs{});
  const std::optional<std::string> dir = kwargs->output_trace_dir;
  Profiler profiler(std::move(*kwargs));
  try {
    body(profiler);
  } catch (...) {
    try {
      profiler.stop();                   // as torch's __exit__: on_trace_ready too
    } catch (const std::exception& e) {  // the body's error is the one to see
      MIXPREC_WARN("Accelerator::profile: stopping the profiler after an error failed: ", e.what());
    }
    throw;
  }
  profiler.stop();
  if (!dir) return profiler;
  std::error_code error;
  std::filesystem::create_directories(*dir, error);
  TORCH_CHECK(!error, "Accelerator::profile: cannot make output_trace_dir ", *dir, ": ",
              error.message());
  // Accelerate's PROFILE_PATTERN_NAME.
  profiler.export_chrome_trace(
      (std::filesystem::path(*dir) / ("profile_" + std::to_string(process_index()) + ".json"))
          .string());
  wait_for_everyone();
  return profiler;
}

at::Tensor Accelerator::gather(const at::Tensor& tensor) const {
  if (!shared_->group) return tensor;
  // A 0-dim tensor gathers to one value per process, as in Accelerate.
  return shared_->group->all_gather(tensor.dim() == 0 ? tensor.reshape({1}) : tensor);
}

// Each process drops the padding at the end of its own last batch: a mask
// travels with the data, since the padding of several processes does not sit
// together at the end of what is gathered.
at::Tensor Accelerator::gather_for_metrics(const at::Tensor& tensor) const {
  const auto& state = shared_->gradient_state;
  const int64_t padding = state.end_of_dataloader ? state.num_padding_samples : 0;
  if (tensor.dim() == 0) return gather(tensor);  // a value per process: no sample to drop
  if (!shared_->group) return padding > 0 ? tensor.slice(0, 0, tensor.size(0) - padding) : tensor;
  const at::Tensor keep = at::arange(tensor.size(0)) < (tensor.size(0) - padding);
  const at::Tensor all_keep = gather(keep.to(at::kByte)).to(at::kBool);
  return gather(tensor).index({all_keep.to(tensor.device())});
}

Accelerator::GoesFirstGuard::GoesFirstGuard(const Accelerator& accelerator, bool first)
    : accelerator_(accelerator), first_(first), exceptions_(std::uncaught_exceptions()) {
  if (!first_) accelerator_.wait_for_everyone();
}

// Not when the block threw, as Accelerate's; and a failed barrier must not leave a destructor.
Accelerator::GoesFirstGuard::~GoesFirstGuard() {
  if (!first_ || std::uncaught_exceptions() > exceptions_) return;
  try {
    accelerator_.wait_for_everyone();
  } catch (const std::exception& e) {
    // Whatever the verbosity: the next collective fails because of it.
    TORCH_WARN("Accelerator::main_process_first: the other processes did not reach the barrier (",
               e.what(), "); the processes are out of step, and the next collective will fail");
  }
}

bool Accelerator::check_trigger() {
  at::Tensor raised = at::scalar_tensor(shared_->trigger ? 1 : 0, at::kLong).reshape({1});
  if (shared_->group) shared_->group->all_reduce_(raised);
  if (raised.item<int64_t>() == 0) return false;
  shared_->trigger = false;
  return true;
}

at::Tensor Accelerator::pad_across_processes(const at::Tensor& tensor, int64_t dim,
                                             const at::Scalar& pad_index, bool pad_first) const {
  const int64_t ndim = tensor.dim();
  if (!shared_->group) return tensor;
  const at::Tensor ndims = shared_->group->all_gather(at::full({1}, ndim, at::kLong));
  TORCH_CHECK((ndims == ndim).all().item<bool>(),
              "Accelerator::pad_across_processes: the processes' tensors have different numbers "
              "of dimensions: ",
              ndims);
  if (dim >= ndim || dim < -ndim) return tensor;
  if (dim < 0) dim += ndim;
  const int64_t longest =
      shared_->group->all_gather(at::full({1}, tensor.size(dim), at::kLong)).max().item<int64_t>();
  if (tensor.size(dim) == longest) return tensor;
  auto sizes = tensor.sizes().vec();
  sizes[static_cast<size_t>(dim)] = longest;
  at::Tensor padded = at::full(sizes, pad_index, tensor.options());
  const int64_t start = pad_first ? longest - tensor.size(dim) : 0;
  padded.narrow(dim, start, tensor.size(dim)).copy_(tensor);
  return padded;
}

std::vector<std::string> Accelerator::gather_object(const std::vector<std::string>& objects) const {
  if (!shared_->group) return objects;
  // Lengths, then bytes, each padded to the longest process's.
  std::vector<int64_t> lengths;
  std::string bytes;
  for (const auto& object : objects) {
    lengths.push_back(static_cast<int64_t>(object.size()));
    bytes += object;
  }
  auto gather_padded = [&](at::Tensor local) {
    const at::Tensor sizes = shared_->group->all_gather(at::full({1}, local.numel(), at::kLong));
    at::Tensor padded = at::zeros({sizes.max().item<int64_t>()}, local.options());
    padded.narrow(0, 0, local.numel()).copy_(local);
    return std::pair(shared_->group->all_gather(padded.unsqueeze(0)), sizes);
  };
  const auto [all_lengths, counts] = gather_padded(at::tensor(lengths, at::kLong).reshape({-1}));
  at::Tensor local_bytes = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  if (!bytes.empty()) std::memcpy(local_bytes.data_ptr(), bytes.data(), bytes.size());
  const at::Tensor all_bytes = gather_padded(local_bytes).first;
  std::vector<std::string> gathered;
  for (int64_t r = 0; r < all_lengths.size(0); ++r) {
    const auto* data = all_bytes[r].data_ptr<uint8_t>();
    int64_t offset = 0;
    for (int64_t i = 0; i < counts[r].item<int64_t>(); ++i) {
      const int64_t n = all_lengths[r][i].item<int64_t>();
      gathered.push_back(n == 0 ? std::string()
                                : std::string(reinterpret_cast<const char*>(data) + offset,
                                              static_cast<size_t>(n)));
      offset += n;
    }
  }
  return gathered;
}

Accelerator::Share Accelerator::share(size_t size, bool apply_padding) const {
  const auto n = static_cast<size_t>(num_processes()), i = static_cast<size_t>(process_index());
  const size_t quotient = size / n, remainder = size % n;
  const size_t begin = i * quotient + std::min(i, remainder);
  const size_t end = begin + quotient + (i < remainder ? 1 : 0);
  return {begin, end, apply_padding ? quotient + (remainder > 0 ? 1 : 0) : end - begin};
}

at::Tensor Accelerator::split_between_processes(const at::Tensor& inputs,
                                                bool apply_padding) const {
  TORCH_CHECK(inputs.dim() > 0,
              "Accelerator::split_between_processes: a 0-dim tensor has no "
              "samples to split");
  if (num_processes() == 1) return inputs;
  const auto [begin, end, padded] = share(static_cast<size_t>(inputs.size(0)), apply_padding);
  at::Tensor part = inputs.slice(0, static_cast<int64_t>(begin), static_cast<int64_t>(end));
  if (part.size(0) == static_cast<int64_t>(padded)) return part;
  const at::Tensor last = inputs.narrow(0, inputs.size(0) - 1, 1);
  auto sizes = last.sizes().vec();
  sizes[0] = static_cast<int64_t>(padded) - part.size(0);
  return at::cat({part, last.expand(sizes)});
}

at::Tensor Accelerator::reduce(const at::Tensor& tensor, const std::string& reduction) const {
  TORCH_CHECK(
      reduction == "sum" || reduction == "mean" || reduction == "max" || reduction == "none",
      "Accelerator::reduce: unknown reduction '", reduction,
      "'; expected \"sum\", \"mean\", \"max\" or \"none\"");
  // As Accelerate's: in one process, the tensor as it is (an integer mean stays an integer);
  // in several, the mean divides in place, which torch refuses for integers.
  at::Tensor result = tensor.clone();
  if (!shared_->group) return result;
  shared_->group->all_reduce_(result, reduction == "max");
  return reduction == "mean" ? result.div_(num_processes()) : result;
}

void Accelerator::init_trackers(const std::string& project_name,
                                const std::optional<log::Config>& config) {
  if (!is_main_process()) return;
  // As Accelerate's, a second call adds its trackers to those open; every open tracker
  // stores the config.
  auto named =
      log::make_trackers(shared_->options.log_with,
                         std::filesystem::path(shared_->options.project_dir) / project_name);
  shared_->trackers.insert(shared_->trackers.end(), std::make_move_iterator(named.begin()),
                           std::make_move_iterator(named.end()));
  shared_->trackers.insert(shared_->trackers.end(), shared_->options.custom_trackers.begin(),
                           shared_->options.custom_trackers.end());
  if (config)
    for (auto& tracker : shared_->trackers) tracker->store_init_configuration(*config);
}

RemovableHandle Accelerator::register_save_state_pre_hook(SaveStateHook hook) {
  const int64_t id = shared_->next_hook_id++;
  shared_->save_state_hooks.emplace(id, std::move(hook));
  return RemovableHandle([shared = std::weak_ptr(shared_), id] {
    if (auto alive = shared.lock()) alive->save_state_hooks.erase(id);
  });
}

RemovableHandle Accelerator::register_load_state_pre_hook(LoadStateHook hook) {
  const int64_t id = shared_->next_hook_id++;
  shared_->load_state_hooks.emplace(id, std::move(hook));
  return RemovableHandle([shared = std::weak_ptr(shared_), id] {
    if (auto alive = shared.lock()) alive->load_state_hooks.erase(id);
  });
}

void Accelerator::log(const std::map<std::string, double>& values, int64_t step) {
  for (auto& tracker : shared_->trackers) tracker->log(values, step);
}

void Accelerator::log_text(const std::map<std::string, std::string>& values, int64_t step) {
  for (auto& tracker : shared_->trackers) tracker->log_text(values, step);
}

log::Tracker* Accelerator::get_tracker(const std::string& name) const {
  if (shared_->trackers.empty()) return nullptr;
  std::vector<std::string> names;
  for (const auto& tracker : shared_->trackers) names.push_back(tracker->name());
  const auto found = std::ranges::find(names, name);
  TORCH_CHECK(found != names.end(), "Accelerator::get_tracker: ", name,
              " is not an available tracker stored inside the Accelerator (open: ",
              c10::Join(", ", names), ")");
  return shared_->trackers[static_cast<size_t>(found - names.begin())].get();
}

void Accelerator::end_training() {
  for (auto& tracker : shared_->trackers) tracker->flush();
  shared_->trackers.clear();
}

void Accelerator::free_memory() {
  shared_->models.clear();
  shared_->optimizers.clear();
  shared_->schedulers.clear();
  shared_->loaders.clear();
  shared_->step = 0;
  clear_device_cache();
}

void clear_device_cache() {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 9)
  if (at::accelerator::getAccelerator(/*checked=*/false)) at::accelerator::emptyCache();
#endif
}

void load_checkpoint_in_model(torch::nn::Module& model, const std::string& checkpoint,
                              bool strict) {
  const std::filesystem::path path(checkpoint);
  const auto tensors = std::filesystem::is_directory(path) ? io::load_sharded_safetensors(path)
                       : path.extension() == ".json"       ? io::load_safetensors_index(path)
                                                           : io::load_safetensors(path);
  const auto skipped = io::load_module_state(model, tensors, checkpoint, strict);
  if (skipped.unexpected_keys.empty()) return;
  // Accelerate's warning, with the keys as a Python set and the class as Python names it
  // (LibTorch's "torch::nn::LinearImpl" is "Linear").
  std::string name = model.name();
  if (const size_t colons = name.rfind("::"); colons != std::string::npos)
    name = name.substr(colons + 2);
  if (name.ends_with("Impl")) name.resize(name.size() - 4);
  std::vector<std::string> keys;
  for (const auto& key : skipped.unexpected_keys) keys.push_back("'" + key + "'");
  MIXPREC_WARN("Some weights of the model checkpoint at ", checkpoint,
               " were not used when initializing ", name, ": {", c10::Join(", ", keys),
               "}. This may or may not be an issue - make sure that the checkpoint does not "
               "have unnecessary parameters, or that the model definition correctly "
               "corresponds to the checkpoint.");
}

void set_seed(uint64_t seed) {
  torch::manual_seed(seed);  // CPU and every CUDA device
  std::srand(static_cast<unsigned>(seed));
}

}  // namespace mixprec::accelerate
