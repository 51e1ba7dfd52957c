#include "mixprec/amp/grad_scaler.h"

#include "mixprec/log/numerics_monitor.h"
#include "mixprec/optim/optimizer_in_backward.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <cmath>

namespace mixprec::amp {

namespace {

constexpr const char* kFix =
    "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the "
    "iteration.";

// The per-device copy of a 0-dim tensor, made once per call (PyTorch's
// _MultiDeviceReplicator). A copy even on the tensor's own device: a product saved for
// backward must not be the scale that update() changes in place.
class PerDevice {
 public:
  explicit PerDevice(at::Tensor master) : master_(std::move(master)) {}
  const at::Tensor& get(const at::Device& device) {
    for (auto& [d, t] : copies_)
      if (d == device) return t;
    copies_.emplace_back(device, master_.to(device, /*non_blocking=*/true, /*copy=*/true));
    return copies_.back().second;
  }
  std::vector<std::pair<at::Device, at::Tensor>> take() { return std::move(copies_); }

 private:
  at::Tensor master_;
  std::vector<std::pair<at::Device, at::Tensor>> copies_;
};

}  // namespace

GradScaler::GradScaler(GradScalerOptions options)
    : options_(options), init_scale_(options.init_scale), hysteresis_left_(options.hysteresis) {
  if (!options_.enabled) return;
  TORCH_CHECK(options_.growth_factor > 1.0, "The growth factor must be > 1.0.");
  TORCH_CHECK(options_.backoff_factor < 1.0, "The backoff factor must be < 1.0.");
  TORCH_CHECK(options_.init_scale > 0, "Invalid init_scale: ", options_.init_scale,
              " (expected > 0)");
  TORCH_CHECK(options_.growth_interval >= 1, "Invalid growth_interval: ", options_.growth_interval,
              " (expected >= 1)");
  TORCH_CHECK(options_.hysteresis >= 1, "Invalid hysteresis: ", options_.hysteresis,
              " (expected >= 1)");
  if (options_.min_scale && options_.max_scale) {
    TORCH_CHECK(*options_.min_scale <= *options_.max_scale, "Invalid min_scale ",
                *options_.min_scale, " > max_scale ", *options_.max_scale);
  }
}

void GradScaler::lazy_init(const at::Device& device) {
  auto opts = at::TensorOptions().device(device);
  scale_ = at::full({}, init_scale_, opts.dtype(at::kFloat));
  growth_tracker_ = at::full({}, init_growth_tracker_, opts.dtype(at::kInt));
}

void GradScaler::check_initialized(const char* funcname) const {
  TORCH_CHECK(scale_.defined(), "Attempted ", funcname, " but _scale is None.  ", kFix);
}

at::Tensor GradScaler::scale(const at::Tensor& outputs) {
  if (!options_.enabled) return outputs;
  if (!scale_.defined()) lazy_init(outputs.device());
  return outputs * scale_.to(outputs.device(), /*non_blocking=*/true);
}

std::vector<at::Tensor> GradScaler::scale(const std::vector<at::Tensor>& outputs) {
  if (!options_.enabled) return outputs;
  std::vector<at::Tensor> scaled;
  scaled.reserve(outputs.size());
  if (outputs.empty()) return scaled;
  if (!scale_.defined()) lazy_init(outputs.front().device());
  PerDevice per_device(scale_);
  for (const auto& t : outputs) scaled.push_back(t * per_device.get(t.device()));
  return scaled;
}

std::vector<std::pair<at::Device, at::Tensor>> GradScaler::unscale_grads(
    torch::optim::Optimizer& optimizer, const at::Tensor& inv_scale, bool allow_fp16) {
  PerDevice per_device_inv_scale(inv_scale);
  PerDevice per_device_found_inf(at::zeros({}, scale_.options().dtype(at::kFloat)));
  // device -> dtype -> grads, in first-seen order, as PyTorch groups them.
  std::vector<
      std::pair<at::Device, std::vector<std::pair<at::ScalarType, std::vector<at::Tensor>>>>>
      groups;
  at::NoGradGuard no_grad;
  for (auto& group : optimizer.param_groups()) {
    for (auto& param : group.params()) {
      if (!param.grad().defined()) continue;
      at::Tensor grad = param.grad();
      TORCH_CHECK(allow_fp16 || grad.scalar_type() != at::kHalf,
                  "Attempting to unscale FP16 gradients.");
      if (grad.is_sparse()) {
        if (grad.scalar_type() == at::kHalf) {
          grad = grad.coalesce();
          param.mutable_grad() = grad;
        }
        grad = grad._values();
      }
      auto device_it = std::find_if(groups.begin(), groups.end(),
                                    [&](const auto& g) { return g.first == grad.device(); });
      if (device_it == groups.end()) device_it = groups.insert(groups.end(), {grad.device(), {}});
      auto& per_dtype = device_it->second;
      auto dtype_it = std::find_if(per_dtype.begin(), per_dtype.end(),
                                   [&](const auto& g) { return g.first == grad.scalar_type(); });
      if (dtype_it == per_dtype.end())
        dtype_it = per_dtype.insert(per_dtype.end(), {grad.scalar_type(), {}});
      dtype_it->second.push_back(grad);
    }
  }
  for (auto& [device, per_dtype] : groups) {
    for (auto& [dtype, grads] : per_dtype) {
      at::Tensor found_inf = per_device_found_inf.get(device);
      at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf,
                                                     per_device_inv_scale.get(device));
    }
  }
  return per_device_found_inf.take();
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled) return;
  check_initialized("unscale_");
  auto& state = per_optimizer_states_[&optimizer];
  TORCH_CHECK(state.stage != Stage::kUnscaled,
              "unscale_() has already been called on this optimizer since the last update().");
  TORCH_CHECK(state.stage != Stage::kStepped, "unscale_() is being called after step().");
  monitor_gradients(optimizer);
  // Reciprocal in double, as PyTorch does, so that 1/scale rounds once.
  at::Tensor inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
  state.found_inf_per_device = unscale_grads(optimizer, inv_scale, /*allow_fp16=*/false);
  state.stage = Stage::kUnscaled;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled) {
    optimizer.step();
    return true;
  }
  check_initialized("step");
  // The hooks would update with the scaled gradient, before the inf/NaN check could skip it.
  optim::check_not_updated_in_backward(optimizer, "GradScaler::step",
                                       "before an inf/NaN check could skip the update; a "
                                       "GradScaler cannot be used with it");
  auto& state = per_optimizer_states_[&optimizer];
  TORCH_CHECK(state.stage != Stage::kStepped,
              "step() has already been called since the last update().");

  auto* amp_aware = dynamic_cast<SupportsAmpScaling*>(&optimizer);
  if (amp_aware != nullptr && amp_aware->step_supports_amp_scaling()) {
    // The optimizer unscales and skips by itself: only check for inf/NaN here.
    if (state.stage == Stage::kReady) {
      monitor_gradients(optimizer);
      state.found_inf_per_device =
          unscale_grads(optimizer, at::ones({}, scale_.options()), /*allow_fp16=*/true);
    }
    at::Tensor found_inf = at::zeros({}, scale_.options());
    for (const auto& [device, t] : state.found_inf_per_device)
      found_inf = found_inf + t.to(scale_.device(), /*non_blocking=*/true);
    amp_aware->grad_scale =
        state.stage == Stage::kUnscaled ? std::nullopt : std::optional<at::Tensor>(scale_);
    // Per-device flags add up past 1, but the fused kernels skip only on
    // exactly 1 (PyTorch passes the sum and so misses a two-device overflow).
    found_inf = (found_inf > 0).to(at::kFloat);
    amp_aware->found_inf = found_inf;
    optimizer.step();
    amp_aware->grad_scale.reset();
    amp_aware->found_inf.reset();
    state.stage = Stage::kStepped;
    // Returning whether it stepped reads found_inf on the host: one sync per
    // step, where PyTorch returns the optimizer's result without it.
    return found_inf.item<float>() == 0.0f;
  }

  if (state.stage == Stage::kReady) unscale_(optimizer);
  TORCH_CHECK(!state.found_inf_per_device.empty(),
              "No inf checks were recorded for this optimizer.");
  double found = 0;
  for (const auto& [device, t] : state.found_inf_per_device) found += t.item<double>();
  const bool stepped = found == 0;
  if (stepped) optimizer.step();
  state.stage = Stage::kStepped;
  return stepped;
}

void GradScaler::update(std::optional<double> new_scale) {
  if (!options_.enabled) return;
  check_initialized("update");
  if (new_scale) {
    scale_.fill_(*new_scale);
  } else {
    std::vector<at::Tensor> found_infs;
    for (const auto& [opt, state] : per_optimizer_states_)
      for (const auto& [device, t] : state.found_inf_per_device)
        found_infs.push_back(t.to(scale_.device(), /*non_blocking=*/true));
    TORCH_CHECK(!found_infs.empty(), "No inf checks were recorded prior to update.");
    at::Tensor found_inf = found_infs.front().clone();
    for (size_t i = 1; i < found_infs.size(); ++i) found_inf += found_infs[i];
    if (uses_extensions()) {
      update_with_extensions(found_inf);
    } else {
      at::_amp_update_scale_(scale_, growth_tracker_, found_inf, options_.growth_factor,
                             options_.backoff_factor, options_.growth_interval);
    }
  }
  end_step();
}

// What both update()s end with: the monitor's step (with the new scale), and the step's
// per-optimizer records.
void GradScaler::end_step() {
  if (options_.monitor) {
    bool skipped = false;
    for (const auto& [opt, state] : per_optimizer_states_)
      for (const auto& [device, t] : state.found_inf_per_device) skipped |= t.item<float>() != 0;
    options_.monitor->end_step(get_scale(), skipped);
  }
  per_optimizer_states_.clear();
}

void GradScaler::monitor_gradients(torch::optim::Optimizer& optimizer) {
  if (!options_.monitor || !options_.monitor->inspects(options_.monitor->current_step())) return;
  std::vector<at::Tensor> parameters;
  for (const auto& group : optimizer.param_groups())
    parameters.insert(parameters.end(), group.params().begin(), group.params().end());
  options_.monitor->record_gradients(parameters, get_scale());
}

void GradScaler::update(const at::Tensor& new_scale) {
  if (!options_.enabled) return;
  check_initialized("update");
  constexpr const char* reason =
      "new_scale should be a float or a 1-element torch.cuda.FloatTensor or torch.FloatTensor "
      "with requires_grad=False.";
  TORCH_CHECK(new_scale.device().type() == scale_.device().type(), reason);
  TORCH_CHECK(new_scale.numel() == 1, reason);
  TORCH_CHECK(!new_scale.requires_grad(), reason);
  scale_.copy_(new_scale.reshape({}));
  end_step();
}

bool GradScaler::uses_extensions() const {
  return options_.min_scale || options_.max_scale || options_.hysteresis > 1;
}

// The opt-in rules read found_inf on the host: one sync per step, paid only by
// those who ask for them.
void GradScaler::update_with_extensions(const at::Tensor& found_inf) {
  const bool overflow = found_inf.item<float>() != 0.0f;
  if (overflow && options_.hysteresis > 1 && hysteresis_left_ > 1) {
    --hysteresis_left_;  // tolerated: the step was skipped, the scale stays
    growth_tracker_.zero_();
    return;
  }
  if (overflow && options_.min_scale) {
    // In the scale's fp32: a min_scale that fp32 rounds up (0.1) is where clamp_ keeps it.
    const double current = scale_.item<double>();
    TORCH_CHECK(current > static_cast<double>(static_cast<float>(*options_.min_scale)),
                "GradScaler: inf/NaN gradients with the loss scale already at min_scale (",
                *options_.min_scale,
                "); it cannot be lowered further, and every step would be skipped. The loss or "
                "the gradients are not finite at any scale: check the model, the learning rate "
                "and the data.");
  }
  at::_amp_update_scale_(scale_, growth_tracker_, found_inf, options_.growth_factor,
                         options_.backoff_factor, options_.growth_interval);
  if (!overflow && growth_tracker_.item<int>() == 0) hysteresis_left_ = options_.hysteresis;
  if (options_.min_scale || options_.max_scale)
    scale_.clamp_(options_.min_scale, options_.max_scale);
}

double GradScaler::get_scale() const {
  if (!options_.enabled) return 1.0;
  return scale_.defined() ? scale_.item<double>() : init_scale_;
}

int64_t GradScaler::get_growth_tracker() const {
  if (!options_.enabled) return 0;
  return growth_tracker_.defined() ? growth_tracker_.item<int64_t>() : init_growth_tracker_;
}

std::map<std::string, double> GradScaler::state_dict() const {
  if (!options_.enabled) return {};
  std::map<std::string, double> state{
      {"scale", get_scale()},
      {"growth_factor", options_.growth_factor},
      {"backoff_factor", options_.backoff_factor},
      {"growth_interval", static_cast<double>(options_.growth_interval)},
      {"_growth_tracker", static_cast<double>(get_growth_tracker())},
  };
  if (options_.hysteresis > 1) state["_hysteresis_left"] = static_cast<double>(hysteresis_left_);
  return state;
}

void GradScaler::load_state_dict(const std::map<std::string, double>& state) {
  if (!options_.enabled) return;
  TORCH_CHECK(!state.empty(),
              "The source state dict is empty, possibly because it was saved from a disabled "
              "instance of GradScaler.");
  auto get = [&](const char* key) {
    auto it = state.find(key);
    TORCH_CHECK(it != state.end(), "GradScaler::load_state_dict: missing key '", key, "'");
    return it->second;
  };
  // Counts come as doubles: whole numbers that fit an int64, or a clear error.
  auto count = [&](const char* key, double value) {
    TORCH_CHECK(value >= 0 && value < 0x1p63 && std::floor(value) == value,
                "GradScaler::load_state_dict: '", key, "' is ", value,
                ", expected a whole number >= 0");
    return static_cast<int64_t>(value);
  };
  const double scale = get("scale"), growth_factor = get("growth_factor"),
               backoff_factor = get("backoff_factor");
  const int64_t growth_interval = count("growth_interval", get("growth_interval"));
  const int64_t growth_tracker = count("_growth_tracker", get("_growth_tracker"));
  std::optional<int64_t> hysteresis_left;
  if (auto it = state.find("_hysteresis_left"); it != state.end())
    hysteresis_left = count("_hysteresis_left", it->second);
  init_scale_ = scale;
  if (scale_.defined()) scale_.fill_(init_scale_);
  options_.growth_factor = growth_factor;
  options_.backoff_factor = backoff_factor;
  options_.growth_interval = growth_interval;
  init_growth_tracker_ = growth_tracker;
  if (growth_tracker_.defined()) growth_tracker_.fill_(init_growth_tracker_);
  if (hysteresis_left) hysteresis_left_ = *hysteresis_left;
}

}  // namespace mixprec::amp
