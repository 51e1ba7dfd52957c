#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mixprec::log {
class NumericsMonitor;
}

namespace mixprec::amp {

/// Options of `GradScaler`. The defaults are `torch.amp.GradScaler`'s; the
/// last four fields go beyond PyTorch and are off by default.
struct GradScalerOptions {
  double init_scale = 65536.0;  // 2**16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  bool enabled = true;
  /// The scale never backs off below this; an inf/NaN found while the scale is
  /// already there is an error instead of an endless run of skipped steps.
  std::optional<double> min_scale = std::nullopt;
  /// The scale never grows above this.
  std::optional<double> max_scale = std::nullopt;
  /// DeepSpeed's hysteresis: overflows tolerated (step skipped, scale kept)
  /// before the scale backs off; refilled when the scale grows. 1 = PyTorch.
  int64_t hysteresis = 1;
  /// Records the (still scaled) gradients of its inspected steps before they
  /// are unscaled, and ends each step in update() with the new scale. Not
  /// owned: it must outlive the scaler.
  log::NumericsMonitor* monitor = nullptr;
};

/// An optimizer whose step() unscales gradients and skips itself on inf/NaN,
/// given the scaler's `grad_scale` and `found_inf` (PyTorch's
/// `_step_supports_amp_scaling`, e.g. fused AdamW). `GradScaler::step` then
/// does no separate unscale pass.
class SupportsAmpScaling {
 public:
  virtual ~SupportsAmpScaling() = default;
  virtual bool step_supports_amp_scaling() const = 0;

  /// Set by `GradScaler::step` for the duration of one `step()`: the scale to
  /// divide gradients by (unset when they are already unscaled), and a 0-dim
  /// fp32 tensor that is non-zero when an inf/NaN was found.
  std::optional<at::Tensor> grad_scale;
  std::optional<at::Tensor> found_inf;
};

/// Dynamic loss scaling, the twin of `torch.amp.GradScaler` (2.13).
///
/// ```
/// mixprec::amp::GradScaler scaler;
/// scaler.scale(loss).backward();
/// scaler.step(optimizer);   // unscales, skips the step on inf/NaN
/// scaler.update();          // backs off on inf/NaN, grows after growth_interval clean steps
/// ```
///
/// Where PyTorch takes a `device` argument (default "cuda"), the scale tensor
/// here lives on the device of the first tensor passed to `scale()`.
class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  /// Multiplies `outputs` by the scale. Returned unchanged when disabled.
  at::Tensor scale(const at::Tensor& outputs);
  std::vector<at::Tensor> scale(const std::vector<at::Tensor>& outputs);

  /// Divides the optimizer's gradients by the scale and records whether any is
  /// inf/NaN. Optional: step() does it when not done yet (once per step).
  void unscale_(torch::optim::Optimizer& optimizer);

  /// Unscales (unless done) and calls `optimizer.step()` unless an inf/NaN was
  /// found. Returns whether the optimizer stepped.
  bool step(torch::optim::Optimizer& optimizer);

  /// Updates the scale from the inf/NaN checks of this iteration, or sets it to
  /// `new_scale`. Call once per iteration, after step() for every optimizer.
  void update(std::optional<double> new_scale = std::nullopt);
  void update(const at::Tensor& new_scale);

  /// The current scale (1.0 when disabled). Synchronises with the device.
  double get_scale() const;
  /// The scale tensor itself, undefined before the first scale().
  const at::Tensor& scale_tensor() const { return scale_; }
  int64_t get_growth_tracker() const;

  double get_growth_factor() const { return options_.growth_factor; }
  void set_growth_factor(double factor) { options_.growth_factor = factor; }
  double get_backoff_factor() const { return options_.backoff_factor; }
  void set_backoff_factor(double factor) { options_.backoff_factor = factor; }
  int64_t get_growth_interval() const { return options_.growth_interval; }
  void set_growth_interval(int64_t interval) { options_.growth_interval = interval; }
  bool is_enabled() const { return options_.enabled; }
  const GradScalerOptions& options() const { return options_; }

  /// PyTorch's keys: scale, growth_factor, backoff_factor, growth_interval,
  /// _growth_tracker (plus _hysteresis_left when hysteresis > 1). Empty when
  /// disabled.
  std::map<std::string, double> state_dict() const;
  void load_state_dict(const std::map<std::string, double>& state);

 private:
  enum class Stage { kReady, kUnscaled, kStepped };
  struct OptimizerState {
    Stage stage = Stage::kReady;
    std::vector<std::pair<at::Device, at::Tensor>> found_inf_per_device;
  };

  void lazy_init(const at::Device& device);
  void check_initialized(const char* funcname) const;
  std::vector<std::pair<at::Device, at::Tensor>> unscale_grads(torch::optim::Optimizer& optimizer,
                                                               const at::Tensor& inv_scale,
                                                               bool allow_fp16);
  bool uses_extensions() const;
  void update_with_extensions(const at::Tensor& found_inf);
  void monitor_gradients(torch::optim::Optimizer& optimizer);
  void end_step();

  GradScalerOptions options_;
  double init_scale_;
  int64_t init_growth_tracker_ = 0;
  int64_t hysteresis_left_;
  at::Tensor scale_;           // () fp32
  at::Tensor growth_tracker_;  // () int32
  std::unordered_map<const torch::optim::Optimizer*, OptimizerState> per_optimizer_states_;
};

}  // namespace mixprec::amp
