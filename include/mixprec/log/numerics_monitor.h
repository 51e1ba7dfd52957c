#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace mixprec::log {

namespace detail {
struct ActivationWatch;
}

/// How the values of one tensor, multiplied by a loss scale, fit fp16
/// (round to nearest even). Exponents are of the unscaled values.
struct Fp16Range {
  int64_t numel = 0;
  int64_t zeros = 0;      // exactly zero already
  int64_t underflow = 0;  // non-zero, but x·scale rounds to zero in fp16
  int64_t subnormal = 0;  // x·scale rounds to an fp16 subnormal (< 2^-14: fewer significant bits)
  int64_t overflow = 0;   // x·scale rounds to ±inf in fp16 (|x·scale| >= 65520), or x is inf/NaN
  /// floor(log2 |x|) of the largest and of the smallest non-zero finite |x|; NaN when there is
  /// none.
  double max_exponent = NAN;
  double min_exponent = NAN;

  double underflow_fraction() const { return fraction(underflow); }
  double overflow_fraction() const { return fraction(overflow); }
  double fraction(int64_t count) const {
    return numel > 0 ? static_cast<double>(count) / static_cast<double>(numel) : 0.0;
  }
  /// Adds another tensor's figures (counts add, exponents widen).
  void merge(const Fp16Range& other);
};

/// The fp16 figures of `x · scale` (any floating dtype and device; one host sync).
Fp16Range fp16_range(const at::Tensor& x, double scale = 1.0);

/// Options of `NumericsMonitor`.
struct NumericsMonitorOptions {
  /// Inspect step 1 and every `every_n_steps`-th step (N, 2N, ...); steps in
  /// between cost nothing but one scale read.
  int64_t every_n_steps = 100;
  /// The scale gradients are checked at when no GradScaler is in use (fp32
  /// and bf16 runs): 1 asks "what would fp16 without loss scaling lose?".
  double scale_without_scaler = 1.0;
  /// How many tensors the summary names in each list.
  int64_t summary_top_k = 5;
};

/// What one inspected step saw.
struct NumericsRecord {
  int64_t step = 0;      // the optimizer step (1-based)
  double scale = 1.0;    // the loss scale its gradients were computed at
  bool skipped = false;  // the scaler skipped this step
  /// Per parameter tensor, in the model's order.
  std::vector<std::pair<std::string, Fp16Range>> gradients;
  /// Outputs of the forward's matmul-class ops (those autocast runs in 16
  /// bits), per op name ("aten::addmm"), outermost calls only.
  std::vector<std::pair<std::string, Fp16Range>> activations;
};

/// One point of the loss-scale history (every step, inspected or not).
struct ScalePoint {
  int64_t step = 0;
  double scale = 1.0;  // after the step's update
  bool skipped = false;
};

/// Watches the numerics of a training run: per parameter tensor, how many
/// gradient elements would underflow or overflow fp16 at the current loss
/// scale and their exponent range; the same for the forward's matmul-class
/// outputs; the loss-scale history. Off unless created; an option of
/// `GradScaler`, `Accelerator` and `Trainer` (`numerics_monitor_steps`).
///
/// ```
/// NumericsMonitor monitor(model->named_parameters().pairs(), {.every_n_steps = 10});
/// GradScaler scaler({.monitor = &monitor});  // records and ends each step
/// ... train ...
/// std::cerr << monitor.summary();
/// ```
///
/// Without a scaler, call per step: `record_gradients()` after backward, then
/// `end_step()` after the optimizer step. Activations are seen on the thread
/// that created the monitor (and called `end_step`), in forwards run with
/// gradients enabled; the watch is armed only for inspected steps.
///
/// In an fp16 run the gradients already went through fp16: what underflowed
/// is zero by then (`zeros`), so `underflow` mostly counts values computed in
/// fp32 (LayerNorm, biases). fp32 and bf16 runs show what fp16 would lose.
class NumericsMonitor {
 public:
  explicit NumericsMonitor(std::vector<std::pair<std::string, at::Tensor>> named_parameters,
                           NumericsMonitorOptions options = {});
  ~NumericsMonitor();
  NumericsMonitor(const NumericsMonitor&) = delete;
  NumericsMonitor& operator=(const NumericsMonitor&) = delete;

  /// The step being trained now (1-based), and whether it is inspected.
  int64_t current_step() const { return step_ + 1; }
  bool inspects(int64_t step) const;

  /// Records the gradients of the current step, as held: multiplied by
  /// `scale` (the GradScaler's, before unscaling; nullopt without a scaler).
  /// Does nothing on steps not inspected, or when already recorded.
  void record_gradients(const std::vector<at::Tensor>& parameters,
                        std::optional<double> scale = std::nullopt);
  void record_gradients(std::optional<double> scale = std::nullopt);

  /// Ends the current step: `scale` after the update, whether it was skipped.
  /// Returns the step's figures as scalars to log ("numerics/...", empty when
  /// the step was not inspected) and arms the watch for the next step.
  std::map<std::string, double> end_step(double scale = 1.0, bool skipped = false);

  const std::vector<NumericsRecord>& records() const { return records_; }
  const std::vector<ScalePoint>& scale_history() const { return scale_history_; }
  const NumericsMonitorOptions& options() const { return options_; }

  /// End-of-training summary in plain words ("h.0.attn.c_attn.weight: 12% of
  /// gradient elements underflow fp16 at scale 2^10").
  std::string summary() const;

 private:
  void arm();
  void disarm();

  NumericsMonitorOptions options_;
  std::vector<std::pair<std::string, at::Tensor>> named_parameters_;
  int64_t step_ = 0;  // steps ended
  std::optional<NumericsRecord> pending_;
  std::unique_ptr<detail::ActivationWatch> watch_;
  std::vector<NumericsRecord> records_;
  std::vector<ScalePoint> scale_history_;
};

/// A loss scale as the summaries print it: "2^k" when it is a power of two, else as %g.
std::string power_of_two(double x);

}  // namespace mixprec::log
