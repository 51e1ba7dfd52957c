#include "mixprec/io/checkpoint.h"

#include "mixprec/log/logging.h"
#include "mixprec/log/tracker.h"
#include "mixprec/optim/adamw.h"

#include "io/file.h"

#include <fcntl.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <tuple>

namespace mixprec::io {

namespace {

using json = nlohmann::json;

using detail::fsync_dir;

std::string hex(uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof(buf), "%08x", v);
  return buf;
}

// CRC-32C of a file's bytes, read in pieces: enough to catch a damaged or truncated file.
std::string checksum(const std::filesystem::path& file) {
  uint32_t crc = 0;
  detail::InputFile(file).read_all(
      1 << 20, [&](const char* data, size_t n) { crc = log::crc32c(data, n, crc); });
  return hex(crc);
}

template <typename S>
void put_adam_like(const S& s, const std::string& prefix, TensorMap& out) {
  if constexpr (std::is_same_v<std::decay_t<decltype(s.step())>, int64_t>)
    out[prefix + "step"] = at::tensor(static_cast<double>(s.step()), at::kDouble);
  else
    out[prefix + "step"] = s.step();
  out[prefix + "exp_avg"] = s.exp_avg();
  out[prefix + "exp_avg_sq"] = s.exp_avg_sq();
  if (s.max_exp_avg_sq().defined()) out[prefix + "max_exp_avg_sq"] = s.max_exp_avg_sq();
}

at::Tensor take(const TensorMap& state, const std::string& key, const at::Tensor& like,
                const std::string& source) {
  auto it = state.find(key);
  TORCH_CHECK(it != state.end(), source, ": missing optimizer state '", key, "'");
  TORCH_CHECK(!like.defined() || it->second.sizes() == like.sizes(), source, ": optimizer state '",
              key, "' has shape ", it->second.sizes(), ", the parameter ", like.sizes());
  // A copy: the state must not alias the tensors it came from.
  return like.defined() ? it->second.to(like.options(), /*non_blocking=*/false, /*copy=*/true)
                        : it->second.clone();
}

// `fused`: mixprec's AdamW keeps `step` on the param's device, as PyTorch's load_state_dict
// places it for a fused group; in float32 either way, the dtype its steps make.
template <typename S>
std::unique_ptr<S> get_adam_like(const TensorMap& state, const std::string& prefix,
                                 const at::Tensor& param, const std::string& source,
                                 bool fused = false) {
  auto s = std::make_unique<S>();
  s->exp_avg(take(state, prefix + "exp_avg", param, source));
  s->exp_avg_sq(take(state, prefix + "exp_avg_sq", param, source));
  if (state.count(prefix + "max_exp_avg_sq"))
    s->max_exp_avg_sq(take(state, prefix + "max_exp_avg_sq", param, source));
  // LibTorch counts steps in an int64, mixprec's AdamW in a tensor, as PyTorch does.
  const at::Tensor step = take(state, prefix + "step", {}, source);
  if constexpr (std::is_same_v<std::decay_t<decltype(s->step())>, int64_t>) {
    TORCH_CHECK(step.numel() == 1, source, ": optimizer state '", prefix, "step' has shape ",
                step.sizes(), ", expected one value");
    const double value = step.item<double>();
    TORCH_CHECK(value >= 0 && value < 0x1p63 && std::floor(value) == value, source,
                ": optimizer state '", prefix, "step' is ", value, ", expected a step count");
    s->step(static_cast<int64_t>(value));
  } else {
    TORCH_CHECK(step.numel() == 1, source, ": optimizer state '", prefix, "step' has shape ",
                step.sizes(), ", expected one value");
    s->step(step.reshape({}).to(fused ? param.device() : at::Device(at::kCPU), at::kFloat));
  }
  return s;
}

enum class Kind { kSgd, kAdam, kTorchAdamW, kMixprecAdamW };

Kind kind_of(const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer)) return Kind::kSgd;
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer)) return Kind::kAdam;
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer)) return Kind::kTorchAdamW;
  if (dynamic_cast<const optim::AdamW*>(&optimizer)) return Kind::kMixprecAdamW;
  TORCH_CHECK(false, "saving the state of optimizer ", typeid(optimizer).name(),
              " is not supported; supported: torch::optim::SGD, Adam, AdamW, "
              "mixprec::optim::AdamW");
}

// A param group's hyperparameters under the names of PyTorch's state_dict()["param_groups"].
// How the optimizer computes (fused, stochastic rounding) is left out: that stays as configured.
json hyperparameters(Kind kind, const torch::optim::OptimizerOptions& options) {
  json group = {{"lr", options.get_lr()}};
  auto adam_like = [&](const auto& o) {
    group["betas"] = {std::get<0>(o.betas()), std::get<1>(o.betas())};
    group["eps"] = o.eps();
    group["weight_decay"] = o.weight_decay();
    group["amsgrad"] = o.amsgrad();
  };
  switch (kind) {
    case Kind::kSgd: {
      const auto& o = static_cast<const torch::optim::SGDOptions&>(options);
      group["momentum"] = o.momentum();
      group["dampening"] = o.dampening();
      group["weight_decay"] = o.weight_decay();
      group["nesterov"] = o.nesterov();
      break;
    }
    case Kind::kAdam:
      adam_like(static_cast<const torch::optim::AdamOptions&>(options));
      break;
    case Kind::kTorchAdamW:
      adam_like(static_cast<const torch::optim::AdamWOptions&>(options));
      break;
    case Kind::kMixprecAdamW: {
      const auto& o = static_cast<const optim::AdamWOptions&>(options);
      adam_like(o);
      group["maximize"] = o.maximize();
      break;
    }
  }
  return group;
}

// `group`'s hyperparameters set on `options`, as PyTorch's load_state_dict replaces them; one
// the group lacks (checkpoints before 2026-12-06 hold lr only) stays as it is.
void set_hyperparameters(Kind kind, const json& group, torch::optim::OptimizerOptions& options,
                         const std::string& where) {
  auto number = [&](const char* key, auto set) {
    if (!group.contains(key)) return;
    TORCH_CHECK(group[key].is_number(), where, ": '", key, "' expects a number, got ",
                group[key].dump());
    set(group[key].get<double>());
  };
  auto boolean = [&](const char* key, auto set) {
    if (!group.contains(key)) return;
    TORCH_CHECK(group[key].is_boolean(), where, ": '", key, "' expects a boolean, got ",
                group[key].dump());
    set(group[key].get<bool>());
  };
  auto adam_like = [&](auto& o) {
    if (group.contains("betas")) {
      const json& b = group["betas"];
      TORCH_CHECK(b.is_array() && b.size() == 2 && b[0].is_number() && b[1].is_number(), where,
                  ": 'betas' expects two numbers, got ", b.dump());
      o.betas({b[0].get<double>(), b[1].get<double>()});
    }
    number("eps", [&](double v) { o.eps(v); });
    number("weight_decay", [&](double v) { o.weight_decay(v); });
    boolean("amsgrad", [&](bool v) { o.amsgrad(v); });
    // What the optimizers' constructors refuse (betas of 1 would divide by 0 at the next step).
    const auto [beta1, beta2] = o.betas();
    TORCH_CHECK(0 <= beta1 && beta1 < 1 && 0 <= beta2 && beta2 < 1, where, ": invalid betas [",
                beta1, ", ", beta2, "], expected each in [0, 1)");
    TORCH_CHECK(o.eps() >= 0, where, ": invalid eps ", o.eps());
    TORCH_CHECK(o.weight_decay() >= 0, where, ": invalid weight_decay ", o.weight_decay());
  };
  switch (kind) {
    case Kind::kSgd: {
      auto& o = static_cast<torch::optim::SGDOptions&>(options);
      number("momentum", [&](double v) { o.momentum(v); });
      number("dampening", [&](double v) { o.dampening(v); });
      number("weight_decay", [&](double v) { o.weight_decay(v); });
      boolean("nesterov", [&](bool v) { o.nesterov(v); });
      TORCH_CHECK(o.momentum() >= 0, where, ": invalid momentum ", o.momentum());
      TORCH_CHECK(o.weight_decay() >= 0, where, ": invalid weight_decay ", o.weight_decay());
      TORCH_CHECK(!o.nesterov() || (o.momentum() > 0 && o.dampening() == 0), where,
                  ": Nesterov momentum requires a momentum and zero dampening");
      break;
    }
    case Kind::kAdam:
      adam_like(static_cast<torch::optim::AdamOptions&>(options));
      break;
    case Kind::kTorchAdamW:
      adam_like(static_cast<torch::optim::AdamWOptions&>(options));
      break;
    case Kind::kMixprecAdamW: {
      auto& o = static_cast<optim::AdamWOptions&>(options);
      adam_like(o);
      boolean("maximize", [&](bool v) { o.maximize(v); });
      break;
    }
  }
  TORCH_CHECK(group["lr"].get<double>() >= 0, where, ": invalid learning rate ",
              group["lr"].dump());
  options.set_lr(group["lr"].get<double>());
}

bool amsgrad_of(Kind kind, const torch::optim::OptimizerOptions& options) {
  switch (kind) {
    case Kind::kSgd:
      return false;
    case Kind::kAdam:
      return static_cast<const torch::optim::AdamOptions&>(options).amsgrad();
    case Kind::kTorchAdamW:
      return static_cast<const torch::optim::AdamWOptions&>(options).amsgrad();
    case Kind::kMixprecAdamW:
      return static_cast<const optim::AdamWOptions&>(options).amsgrad();
  }
  return false;
}

}  // namespace

TensorMap module_state(const torch::nn::Module& module) {
  TensorMap state;
  for (const auto& item : module.named_parameters()) state[item.key()] = item.value();
  for (const auto& item : module.named_buffers()) state[item.key()] = item.value();
  return state;
}

namespace {

// What a tied weight's names share: the data, as the same view. Tensors without data (empty,
// or meta) tie to nothing.
using TiedKey = std::tuple<const void*, std::vector<int64_t>, std::vector<int64_t>, at::ScalarType,
                           std::string>;
std::optional<TiedKey> tied_key(const at::Tensor& t) {
  if (!t.defined() || t.numel() == 0 || t.data_ptr() == nullptr) return std::nullopt;
  return TiedKey(t.data_ptr(), t.sizes().vec(), t.strides().vec(), t.scalar_type(),
                 t.device().str());
}

void collect_untied(const torch::nn::Module& module, const std::string& prefix,
                    std::vector<std::pair<std::string, at::Tensor>>& state,
                    std::set<TiedKey>& seen) {
  auto add = [&](const std::string& name, const at::Tensor& t) {
    if (!t.defined()) return;
    const auto key = tied_key(t);
    if (!key || seen.insert(*key).second) state.emplace_back(prefix + name, t.detach());
  };
  for (const auto& p : module.named_parameters(/*recurse=*/false)) add(p.key(), p.value());
  for (const auto& b : module.named_buffers(/*recurse=*/false)) add(b.key(), b.value());
  for (const auto& child : module.named_children())
    collect_untied(*child.value(), prefix + child.key() + ".", state, seen);
}

}  // namespace

std::vector<std::pair<std::string, at::Tensor>> untied_module_state(
    const torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> state;
  std::set<TiedKey> seen;
  collect_untied(module, "", state, seen);
  return state;
}

IncompatibleKeys load_module_state(torch::nn::Module& module, const TensorMap& state,
                                   const std::string& source, bool strict) {
  IncompatibleKeys skipped;
  std::set<std::string> expected;
  at::NoGradGuard no_grad;
  // A tied weight (one tensor under two names) may be saved under one of them only, as
  // Accelerate's save_model and HF's save_pretrained do.
  std::set<TiedKey> saved;  // the tensors the file has under some name
  for (const auto& item : module.named_parameters())
    if (const auto key = tied_key(item.value()); key && state.count(item.key())) saved.insert(*key);
  for (const auto& item : module.named_buffers())
    if (const auto key = tied_key(item.value()); key && state.count(item.key())) saved.insert(*key);
  std::map<TiedKey, std::string> loaded;  // each tied tensor: the first of its names loaded
  auto load = [&](const std::string& name, at::Tensor& target) {
    expected.insert(name);
    auto it = state.find(name);
    const auto key = tied_key(target);
    if (it == state.end() && key && saved.count(*key)) return;  // saved under another name
    if (it == state.end() && !strict) {
      skipped.missing_keys.push_back(name);
      return;
    }
    TORCH_CHECK(it != state.end(), source, ": missing '", name, "' (shape ", target.sizes(), ")");
    TORCH_CHECK(it->second.sizes() == target.sizes(), source, ": '", name, "' has shape ",
                it->second.sizes(), ", the model expects ", target.sizes());
    TORCH_CHECK(it->second.is_floating_point() == target.is_floating_point(), source, ": '", name,
                "' is ", it->second.scalar_type(), ", the model holds ", target.scalar_type());
    if (key) {
      const auto [first, inserted] = loaded.emplace(*key, name);
      TORCH_CHECK(
          inserted || at::equal(it->second.to(target.device(), target.scalar_type()), target),
          source, ": '", name, "' and '", first->second,
          "' are one tensor in the model (tied), but the file holds different values");
    }
    target.copy_(it->second);
  };
  for (auto& item : module.named_parameters()) load(item.key(), item.value());
  for (auto& item : module.named_buffers()) load(item.key(), item.value());
  for (const auto& [name, tensor] : state) {
    if (!strict && !expected.count(name)) skipped.unexpected_keys.push_back(name);
    TORCH_CHECK(!strict || expected.count(name), source, ": unexpected '", name, "' (shape ",
                tensor.sizes(), "): the model has no such parameter or buffer");
  }
  return skipped;
}

OptimizerState optimizer_state(const torch::optim::Optimizer& optimizer) {
  const Kind kind = kind_of(optimizer);
  OptimizerState out;
  json groups = json::array();
  size_t index = 0;
  for (const auto& group : optimizer.param_groups()) {
    json saved = hyperparameters(kind, group.options());
    saved["params"] = group.params().size();
    groups.push_back(std::move(saved));
    for (const auto& param : group.params()) {
      const std::string prefix = "state." + std::to_string(index++) + ".";
      auto it = optimizer.state().find(param.unsafeGetTensorImpl());
      if (it == optimizer.state().end()) continue;  // never stepped
      const auto& s = *it->second;
      switch (kind) {
        case Kind::kSgd: {
          const auto& sgd = static_cast<const torch::optim::SGDParamState&>(s);
          if (sgd.momentum_buffer().defined())
            out.tensors[prefix + "momentum_buffer"] = sgd.momentum_buffer();
          out.tensors[prefix + "present"] = at::ones({}, at::kBool);
          break;
        }
        case Kind::kAdam:
          put_adam_like(static_cast<const torch::optim::AdamParamState&>(s), prefix, out.tensors);
          break;
        case Kind::kTorchAdamW:
          put_adam_like(static_cast<const torch::optim::AdamWParamState&>(s), prefix, out.tensors);
          break;
        case Kind::kMixprecAdamW:
          put_adam_like(static_cast<const optim::AdamWParamState&>(s), prefix, out.tensors);
          break;
      }
    }
  }
  out.groups_json = json{{"param_groups", groups}}.dump(1);
  return out;
}

void load_optimizer_state(torch::optim::Optimizer& optimizer, const OptimizerState& state,
                          const std::string& source) {
  const Kind kind = kind_of(optimizer);
  json root;
  try {
    root = json::parse(state.groups_json);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, source, ": malformed optimizer state: ", e.what());
  }
  TORCH_CHECK(root.is_object() && root.contains("param_groups") && root["param_groups"].is_array(),
              source, ": malformed optimizer state: expected {\"param_groups\": [...]}");
  const json& groups = root["param_groups"];
  auto& param_groups = optimizer.param_groups();
  TORCH_CHECK(groups.size() == param_groups.size(), source, ": ", groups.size(),
              " param groups in the checkpoint, ", param_groups.size(), " in the optimizer");
  // Check every group before changing anything: on a copy of its options first.
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> checked;
  for (size_t g = 0; g < param_groups.size(); ++g) {
    const json& group = groups[g];
    TORCH_CHECK(group.is_object() && group.contains("lr") && group["lr"].is_number() &&
                    group.contains("params") && group["params"].is_number_unsigned(),
                source, ": param group ", g, ": expected {\"lr\": number, \"params\": count}, got ",
                group.dump());
    TORCH_CHECK(group["params"].get<uint64_t>() == param_groups[g].params().size(), source,
                ": param group ", g, " holds ", group["params"].get<uint64_t>(),
                " parameters in the checkpoint, ", param_groups[g].params().size(),
                " in the optimizer");
    checked.push_back(param_groups[g].options().clone());
    set_hyperparameters(kind, group, *checked.back(),
                        source + ": param group " + std::to_string(g));
  }
  // Every state is read before the optimizer changes, so a bad one leaves it as it was.
  std::vector<std::pair<c10::TensorImpl*, std::unique_ptr<torch::optim::OptimizerParamState>>>
      states;  // null: no state (never stepped)
  size_t index = 0;
  for (size_t g = 0; g < param_groups.size(); ++g) {
    const auto& group = param_groups[g];
    // The amsgrad the group will have: its stepped parameters need their max_exp_avg_sq.
    const bool amsgrad = amsgrad_of(kind, *checked[g]);
    for (const auto& param : group.params()) {
      const std::string prefix = "state." + std::to_string(index++) + ".";
      auto& [key, s] = states.emplace_back(param.unsafeGetTensorImpl(), nullptr);
      const bool present = std::any_of(state.tensors.begin(), state.tensors.end(),
                                       [&](auto& kv) { return kv.first.starts_with(prefix); });
      if (!present) continue;
      TORCH_CHECK(!amsgrad || state.tensors.count(prefix + "max_exp_avg_sq"), source,
                  ": missing optimizer state '", prefix, "max_exp_avg_sq': param group ", g,
                  " uses amsgrad");
      switch (kind) {
        case Kind::kSgd: {
          auto sgd = std::make_unique<torch::optim::SGDParamState>();
          if (state.tensors.count(prefix + "momentum_buffer"))
            sgd->momentum_buffer(take(state.tensors, prefix + "momentum_buffer", param, source));
          s = std::move(sgd);
          break;
        }
        case Kind::kAdam:
          s = get_adam_like<torch::optim::AdamParamState>(state.tensors, prefix, param, source);
          break;
        case Kind::kTorchAdamW:
          s = get_adam_like<torch::optim::AdamWParamState>(state.tensors, prefix, param, source);
          break;
        case Kind::kMixprecAdamW:
          s = get_adam_like<optim::AdamWParamState>(
              state.tensors, prefix, param, source,
              static_cast<const optim::AdamWOptions&>(group.options()).fused());
          break;
      }
    }
  }
  for (size_t g = 0; g < param_groups.size(); ++g)  // in place: references to them stay valid
    set_hyperparameters(kind, groups[g], param_groups[g].options(), source);
  for (auto& [key, s] : states) {
    if (s)
      optimizer.state()[key] = std::move(s);
    else
      optimizer.state().erase(key);
  }
}

TensorMap rng_state() {
  TensorMap state;
  state["cpu"] = at::detail::getDefaultCPUGenerator().get_state();
  const auto cuda_devices =
      at::globalContext().hasCUDA() ? at::detail::getCUDAHooks().deviceCount() : 0;
  for (c10::DeviceIndex d = 0; d < cuda_devices; ++d)
    state["cuda." + std::to_string(d)] =
        at::detail::getCUDAHooks().getDefaultGenerator(d).get_state();
  return state;
}

void load_rng_state(const TensorMap& state, const std::string& source) {
  auto it = state.find("cpu");
  TORCH_CHECK(it != state.end(), source, ": no 'cpu' generator state");
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(it->second);
  const auto cuda_devices =
      at::globalContext().hasCUDA() ? at::detail::getCUDAHooks().deviceCount() : 0;
  for (c10::DeviceIndex d = 0; d < cuda_devices; ++d) {
    auto cuda = state.find("cuda." + std::to_string(d));
    if (cuda == state.end()) continue;
    at::Generator cuda_generator = at::detail::getCUDAHooks().getDefaultGenerator(d);
    std::lock_guard<std::mutex> cuda_lock(cuda_generator.mutex());
    cuda_generator.set_state(cuda->second);
  }
}

CheckpointWriter::CheckpointWriter(std::filesystem::path final_dir)
    : final_dir_(std::move(final_dir)) {
  // "out/checkpoint-5/" names the folder, not a file in it: without this the temporary folder
  // would go inside the final one.
  final_dir_ = final_dir_.lexically_normal();  // "out/." is "out/": not a folder inside it
  if (!final_dir_.has_filename()) final_dir_ = final_dir_.parent_path();
  TORCH_CHECK(!final_dir_.empty(), "CheckpointWriter: no folder name given");
  TORCH_CHECK(
      final_dir_.has_filename() && final_dir_.filename() != "." && final_dir_.filename() != "..",
      "CheckpointWriter: cannot replace '", final_dir_.string(),
      "', which holds its own temporary folder; name a folder inside it");
  tmp_dir_ = final_dir_.string() + ".tmp-" + std::to_string(::getpid());
  std::filesystem::remove_all(tmp_dir_);
  std::filesystem::create_directories(tmp_dir_);
}

CheckpointWriter::~CheckpointWriter() {
  if (!committed_) {
    std::error_code ignored;
    std::filesystem::remove_all(tmp_dir_, ignored);
  }
}

void CheckpointWriter::write_text(const std::string& name, const std::string& text) {
  write_file_atomically(tmp_dir_ / name, text);
}

void CheckpointWriter::write_tensors(const std::string& name, const TensorMap& tensors) {
  save_safetensors(tmp_dir_ / name, tensors);
}

namespace {

// A checkpoint's checksums.json: an object of {file: checksum}, else an error naming it.
json read_manifest(const std::filesystem::path& manifest) {
  json sums;
  try {
    sums = json::parse(read_file(manifest));
  } catch (const json::exception& e) {
    TORCH_CHECK(false, manifest.string(), ": malformed: ", e.what());
  }
  TORCH_CHECK(sums.is_object(), manifest.string(), ": expected an object of {file: checksum}, got ",
              sums.type_name());
  return sums;
}

// The files of an earlier checkpoint in `dir`, which its manifest names: a new save replaces
// them whole (kept, an older save's optimizer or random states would be loaded with the new
// weights). Only the manifest itself without one (a folder of the user's). A manifest that
// cannot be read tells the checkpoint's files from the rest no more: an error, not a guess.
std::set<std::string> checkpoint_files(const std::filesystem::path& dir) {
  std::set<std::string> names{"checksums.json"};
  const auto manifest = dir / "checksums.json";
  if (!std::filesystem::exists(manifest)) return names;
  try {
    const json sums = read_manifest(manifest);  // named: items() only refers to it
    for (const auto& [name, sum] : sums.items()) names.insert(name);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "CheckpointWriter: ", e.what_without_backtrace(),
                "; so the earlier checkpoint's files cannot be told from the rest of ",
                dir.string(), ", and nothing was replaced. Remove it to save there.");
  }
  return names;
}

// What `from` holds beside its checkpoint that `to` does not, linked (or copied where links
// cannot be made) into `to`. Links, not copies: a file still being written (a tracker's log)
// keeps all its data. Copies are synced to disk before the old folder goes.
void carry_over(const std::filesystem::path& from, const std::filesystem::path& to) {
  namespace fs = std::filesystem;
  const auto owned = checkpoint_files(from);
  bool copied = false;
  for (const auto& entry : fs::directory_iterator(from)) {
    const std::string name = entry.path().filename().string();
    const fs::path target = to / name;
    if (owned.contains(name) || fs::exists(fs::symlink_status(target))) continue;
    const auto how = fs::copy_options::recursive | fs::copy_options::copy_symlinks;
    std::error_code error;
    fs::copy(entry.path(), target, how | fs::copy_options::create_hard_links, error);
    if (error) {
      fs::remove_all(target, error);
      error.clear();
      fs::copy(entry.path(), target, how, error);
      copied = true;
    }
    TORCH_CHECK(!error, "CheckpointWriter: cannot keep ", entry.path().string(),
                " (not part of the checkpoint) in the new folder: ", error.message(),
                "; nothing was replaced. Move it out of ", from.string(), " to save there.");
  }
  if (copied) {
    const int fd = ::open(to.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    const bool synced = fd >= 0 && ::syncfs(fd) == 0;
    const int error = errno;
    if (fd >= 0) ::close(fd);
    TORCH_CHECK(synced, "CheckpointWriter: cannot sync ", to.string(), ": ", std::strerror(error));
  }
}

}  // namespace

void CheckpointWriter::commit() {
  json sums = json::object();
  for (const auto& entry : std::filesystem::directory_iterator(tmp_dir_))
    sums[entry.path().filename().string()] = checksum(entry.path());
  write_file_atomically(tmp_dir_ / "checksums.json", sums.dump(1));
  // As Accelerate's save_state, which writes its files into the folder: what else the folder
  // held (a config, logs) stays; an earlier checkpoint's own files do not.
  if (std::filesystem::exists(final_dir_)) carry_over(final_dir_, tmp_dir_);
  fsync_dir(tmp_dir_);
  // Replacing a folder of the same name: swap the two in one step where the file system can, so
  // that the final name always holds a complete folder (the old one then waits under the
  // temporary name, which remove_unfinished_checkpoints deletes should this process die).
  std::optional<std::filesystem::path> old;
  if (!std::filesystem::exists(final_dir_)) {
    std::filesystem::rename(tmp_dir_, final_dir_);
  } else if (::renameat2(AT_FDCWD, tmp_dir_.c_str(), AT_FDCWD, final_dir_.c_str(),
                         RENAME_EXCHANGE) == 0) {
    old = tmp_dir_;
  } else {
    TORCH_CHECK(errno == EINVAL || errno == ENOSYS, "CheckpointWriter: cannot move ",
                tmp_dir_.string(), " to ", final_dir_.string(), ": ", std::strerror(errno));
    // Else in two renames; a process that dies between them leaves the old folder as *.old-PID
    // beside *.tmp-PID with no final one, which remove_unfinished_checkpoints puts back.
    old = final_dir_.string() + ".old-" + std::to_string(::getpid());
    std::filesystem::rename(final_dir_, *old);
    try {
      std::filesystem::rename(tmp_dir_, final_dir_);
    } catch (...) {
      std::error_code not_back;
      std::filesystem::rename(*old, final_dir_, not_back);
      // Else both stay, as a killed writer leaves them, for the next run to put the old back.
      committed_ = static_cast<bool>(not_back);
      throw;
    }
  }
  fsync_dir(final_dir_.has_parent_path() ? final_dir_.parent_path() : ".");
  committed_ = true;
  if (old) remove_old_checkpoint(*old);  // saved already: a failure to delete is a warning
}

void verify_checkpoint(const std::filesystem::path& dir) {
  const auto manifest = dir / "checksums.json";
  TORCH_CHECK(std::filesystem::exists(manifest), dir.string(),
              ": no checksums.json: not a complete checkpoint");
  const json sums = read_manifest(manifest);
  for (const auto& [name, sum] : sums.items()) {
    // Only files of this folder: a name must not reach elsewhere ("../x",
    // "/dev/zero") or name the folder itself.
    TORCH_CHECK(!name.empty() && name != "." && name != ".." &&
                    name.find('/') == std::string::npos && name.find('\0') == std::string::npos,
                manifest.string(), ": '", name, "' is not a file name in the checkpoint folder");
    const auto file = dir / name;
    TORCH_CHECK(std::filesystem::exists(file), file.string(), ": missing from the checkpoint");
    TORCH_CHECK(std::filesystem::is_regular_file(file), file.string(), ": not a regular file");
    TORCH_CHECK(sum.is_string() && checksum(file) == sum.get<std::string>(), file.string(),
                ": checksum mismatch: the file is damaged");
  }
}

namespace {

// <prefix>N folders of `dir` (N parsed), or the leftovers of killed writers.
std::vector<std::pair<int64_t, std::filesystem::path>> checkpoint_folders(
    const std::filesystem::path& dir, const std::string& prefix, bool unfinished) {
  TORCH_CHECK(
      std::ranges::all_of(
          prefix, [](unsigned char c) { return std::isalnum(c) != 0 || c == '-' || c == '_'; }),
      "checkpoint folder prefix '", prefix, "': expected letters, digits, '-' or '_'");
  const std::regex done(prefix + "([0-9]+)");
  const std::regex partial(prefix + "[0-9]+\\.(tmp|old)-[0-9]+");
  std::vector<std::pair<int64_t, std::filesystem::path>> found;
  if (!std::filesystem::is_directory(dir)) return found;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    std::smatch m;
    if (!entry.is_directory()) continue;
    if (unfinished && std::regex_match(name, partial))
      found.emplace_back(0, entry.path());
    else if (!unfinished && std::regex_match(name, m, done) && m[1].length() < 19)
      found.emplace_back(std::stoll(m[1]), entry.path());
  }
  std::sort(found.begin(), found.end());
  return found;
}

}  // namespace

std::vector<std::pair<int64_t, std::filesystem::path>> checkpoints(
    const std::filesystem::path& output_dir, const std::string& prefix) {
  return checkpoint_folders(output_dir, prefix, /*unfinished=*/false);
}

std::optional<std::filesystem::path> last_good_checkpoint(const std::filesystem::path& output_dir,
                                                          const std::string& prefix) {
  const auto folders = checkpoints(output_dir, prefix);
  for (auto it = folders.rbegin(); it != folders.rend(); ++it) {
    try {
      verify_checkpoint(it->second);
      return it->second;
    } catch (const c10::Error& e) {
      MIXPREC_WARN("checkpoint ", it->second.string(), " is damaged (", e.what_without_backtrace(),
                   "); falling back to the one before it");
    }
  }
  return std::nullopt;
}

int remove_unfinished_checkpoints(const std::filesystem::path& output_dir,
                                  const std::string& prefix) {
  int removed = 0;
  for (const auto& [n, path] : checkpoint_folders(output_dir, prefix, /*unfinished=*/true)) {
    // A folder moved aside to be replaced, whose replacement never came (its writer's *.tmp-PID
    // is still there, the final folder is not): it is the checkpoint. (An *.old-PID without them
    // is one a writer could not delete, perhaps rotated away since.)
    const std::string name = path.string();
    const auto dot = name.rfind('.');
    const std::filesystem::path final_dir = name.substr(0, dot);
    if (name.compare(dot, 5, ".old-") == 0 && !std::filesystem::exists(final_dir) &&
        std::filesystem::exists(final_dir.string() + ".tmp-" + name.substr(dot + 5))) {
      std::filesystem::rename(path, final_dir);
      fsync_dir(output_dir);
      MIXPREC_WARN("put back ", final_dir.string(), ", which a killed save had moved to ", name);
      continue;
    }
    std::filesystem::remove_all(path);
    ++removed;
  }
  return removed;
}

void remove_old_checkpoint(const std::filesystem::path& dir) {
  std::error_code error;
  std::filesystem::remove_all(dir, error);
  if (error)
    MIXPREC_WARN("could not delete the old checkpoint ", dir.string(), ": ", error.message());
}

}  // namespace mixprec::io
