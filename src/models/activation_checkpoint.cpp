#include "mixprec/models/activation_checkpoint.h"

#include "mixprec/amp/autocast.h"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <mutex>
#include <optional>
#include <unordered_set>
#include <utility>
#include <vector>

namespace mixprec::models {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What the backward needs to run the function again as the forward ran it.
struct Recompute : torch::CustomClassHolder {
  struct AutocastState {
    bool enabled;
    c10::ScalarType dtype;
  };
  std::function<at::Tensor(const at::Tensor&)> function;
  AutocastState cpu_autocast{};
  std::optional<AutocastState> cuda_autocast;  // where LibTorch has CUDA
  bool autocast_cache_enabled = true;
  std::vector<std::pair<at::Generator, at::Tensor>> rng_states;  // generator, state at the forward
};

Recompute::AutocastState autocast_state(c10::DeviceType device) {
  return {at::autocast::is_autocast_enabled(device), at::autocast::get_autocast_dtype(device)};
}

at::Tensor state_of(at::Generator& generator) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void set_state(at::Generator& generator, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

// Sets the generators to the forward's states for its lifetime, as PyTorch's fork_rng.
class ForkedRng {
 public:
  explicit ForkedRng(const Recompute& r) {
    for (auto [generator, state] : r.rng_states) {
      saved_.emplace_back(generator, state_of(generator));
      set_state(generator, state);
    }
  }
  ~ForkedRng() {
    for (auto& [generator, state] : saved_) set_state(generator, state);
  }
  ForkedRng(const ForkedRng&) = delete;
  ForkedRng& operator=(const ForkedRng&) = delete;

 private:
  std::vector<std::pair<at::Generator, at::Tensor>> saved_;
};

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  // Runs without grad mode (autograd's custom functions do): nothing is saved but the input.
  static at::Tensor forward(AutogradContext* ctx, c10::intrusive_ptr<Recompute> recompute,
                            const at::Tensor& input, at::TensorList parameters) {
    variable_list to_save = {input};
    to_save.insert(to_save.end(), parameters.begin(), parameters.end());
    ctx->save_for_backward(to_save);
    auto output = recompute->function(input);
    TORCH_CHECK(output.defined(), "activation_checkpoint: the function returned no tensor");
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(std::move(recompute));
    return output;
  }

  // Gradients for (recompute, input, parameters...): the first is not a tensor.
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    // The inner grad() below makes no graph of the gradients (as PyTorch's reentrant variant).
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "activation_checkpoint: no double backward (create_graph=true) through a "
                "checkpointed function");
    auto recompute =
        c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data.at("recompute").toCapsule());
    // The graph's edges, as the saved tensors: the input, then the parameters.
    const auto saved = ctx->get_saved_variables();
    variable_list grads(1 + saved.size());
    auto input = saved[0].detach();
    input.requires_grad_(ctx->needs_input_grad(0));
    at::Tensor output;
    {
      ForkedRng rng(*recompute);
      // The outermost autocast region (unless the backward runs inside one): its casts go on exit.
      const auto& r = *recompute;
      amp::Autocast cpu(c10::DeviceType::CPU, r.cpu_autocast.dtype, r.cpu_autocast.enabled,
                        r.autocast_cache_enabled);
      std::optional<amp::Autocast> cuda;
      if (r.cuda_autocast)
        cuda.emplace(c10::DeviceType::CUDA, r.cuda_autocast->dtype, r.cuda_autocast->enabled,
                     r.autocast_cache_enabled);
      at::AutoGradMode grad_mode(true);
      output = recompute->function(input);
    }
    // The inputs whose gradients are wanted, and where each goes in `grads`.
    variable_list wrt;
    std::vector<size_t> slot;
    if (input.requires_grad()) {
      wrt.push_back(input);
      slot.push_back(1);
    }
    for (size_t i = 1; i < saved.size(); ++i) {
      if (!ctx->needs_input_grad(i)) continue;
      wrt.push_back(saved[i]);
      slot.push_back(1 + i);
    }
    if (wrt.empty()) return grads;
    TORCH_CHECK(output.requires_grad(),
                "activation_checkpoint: the recomputed output does not require grad: the "
                "function used neither the input nor the parameters it was given");
    auto g = torch::autograd::grad({output}, wrt, {grad_outputs[0]}, /*retain_graph=*/false,
                                   /*create_graph=*/false, /*allow_unused=*/true);
    for (size_t i = 0; i < g.size(); ++i) grads[slot[i]] = std::move(g[i]);
    return grads;
  }
};

}  // namespace

at::Tensor activation_checkpoint(std::function<at::Tensor(const at::Tensor&)> function,
                                 const at::Tensor& input, at::TensorList parameters,
                                 bool preserve_rng_state) {
  TORCH_CHECK(function, "activation_checkpoint: no function given");
  TORCH_CHECK(input.defined(), "activation_checkpoint: the input is an undefined tensor");
  auto recompute = c10::make_intrusive<Recompute>();
  recompute->function = std::move(function);
  recompute->cpu_autocast = autocast_state(c10::DeviceType::CPU);
  if (at::hasCUDA()) recompute->cuda_autocast = autocast_state(c10::DeviceType::CUDA);
  recompute->autocast_cache_enabled = at::autocast::is_autocast_cache_enabled();
  if (preserve_rng_state) {
    auto cpu = at::detail::getDefaultCPUGenerator();
    recompute->rng_states.emplace_back(cpu, state_of(cpu));
    if (!input.is_cpu()) {
      auto device = at::globalContext().defaultGenerator(input.device());
      recompute->rng_states.emplace_back(device, state_of(device));
    }
  }
  // LibTorch's Module::parameters() keeps duplicates (tied weights): each must be an input once,
  // or its gradient would be accumulated once per copy.
  std::vector<at::Tensor> unique;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& p : parameters)
    if (p.defined() && seen.insert(p.unsafeGetTensorImpl()).second) unique.push_back(p);
  return CheckpointFunction::apply(std::move(recompute), input, at::TensorList(unique));
}

}  // namespace mixprec::models
