#include "mixprec/log/numerics_monitor.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <sstream>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

namespace mixprec::log {

void Fp16Range::merge(const Fp16Range& other) {
  numel += other.numel;
  zeros += other.zeros;
  underflow += other.underflow;
  subnormal += other.subnormal;
  overflow += other.overflow;
  // fmax/fmin ignore a NaN side, so "none" widens to the other's value.
  max_exponent = std::fmax(max_exponent, other.max_exponent);
  min_exponent = std::fmin(min_exponent, other.min_exponent);
}

Fp16Range fp16_range(const at::Tensor& x, double scale) {
  at::NoGradGuard no_grad;
  Fp16Range r;
  r.numel = x.numel();
  if (r.numel == 0) return r;
  const at::Tensor v = x.detach().to(at::kFloat);
  // The cast itself decides: fp16's rounding, not thresholds re-derived here.
  const at::Tensor h = (scale == 1.0 ? v : v * scale).to(at::kHalf);
  const at::Tensor nonzero = v != 0;
  const at::Tensor finite = at::isfinite(v);
  const at::Tensor abs = v.abs();
  constexpr double kSmallestNormal = 6.103515625e-05;  // 2^-14
  const at::Tensor figures =
      at::stack({(v == 0).sum().to(at::kDouble), (nonzero & (h == 0)).sum().to(at::kDouble),
                 ((h != 0) & (h.abs() < kSmallestNormal)).sum().to(at::kDouble),
                 at::logical_not(at::isfinite(h)).sum().to(at::kDouble),
                 at::where(finite, abs, 0).max().to(at::kDouble),
                 at::where(finite & nonzero, abs, std::numeric_limits<float>::infinity())
                     .min()
                     .to(at::kDouble)})
          .cpu();
  const double* f = figures.const_data_ptr<double>();
  r.zeros = static_cast<int64_t>(f[0]);
  r.underflow = static_cast<int64_t>(f[1]);
  r.subnormal = static_cast<int64_t>(f[2]);
  r.overflow = static_cast<int64_t>(f[3]);
  if (f[4] > 0) r.max_exponent = std::ilogb(f[4]);
  if (std::isfinite(f[5])) r.min_exponent = std::ilogb(f[5]);
  return r;
}

namespace {

// The ops autocast runs in 16 bits (ATen's lower_precision_fp lists, the
// matmul class; mv and addmv on CUDA only): their outputs are the activations fp16 must hold.
bool watched(const char* name) {
  static const std::unordered_set<std::string_view> ops = {
      "aten::mm",
      "aten::addmm",
      "aten::bmm",
      "aten::baddbmm",
      "aten::addbmm",
      "aten::matmul",
      "aten::linear",
      "mixprec::linear",  // GPT-2's layers (models/linear.h): its oneDNN path calls no aten GEMM
      "aten::mv",
      "aten::addmv",
      "aten::conv1d",
      "aten::conv2d",
      "aten::conv3d",
      "aten::conv_transpose1d",
      "aten::conv_transpose2d",
      "aten::conv_transpose3d",
      "aten::convolution",
      "aten::_convolution",
      "aten::scaled_dot_product_attention",
      "aten::_scaled_dot_product_flash_attention_for_cpu",
  };
  return ops.contains(name);
}

std::string percent(double fraction) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), fraction < 0.001 && fraction > 0 ? "%.2g%%" : "%.1f%%",
                100 * fraction);
  return buf;
}

}  // namespace

std::string power_of_two(double x) {
  if (x > 0 && std::isfinite(x)) {
    const int e = std::ilogb(x);
    if (std::ldexp(1.0, e) == x) return "2^" + std::to_string(e);
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", x);
  return buf;
}

// The activations one monitor saw in the steps it inspects.
struct detail::ActivationWatch {
  std::vector<std::pair<std::string, Fp16Range>> by_op;  // first-seen order

  void add(const char* op, const Fp16Range& r) {
    for (auto& [name, range] : by_op)
      if (name == op) return range.merge(r);
    by_op.emplace_back(op, r);
  }
};

namespace {

// RecordFunction callbacks are plain function pointers: the watches they fill
// are found through thread-local state. One callback serves every armed watch
// of the thread, and is registered only while there is one.
struct ThreadWatches {
  std::vector<detail::ActivationWatch*> armed;
  at::CallbackHandle handle = 0;
  int depth = 0;      // nesting of watched ops: only the outermost is recorded
  bool busy = false;  // inside our own reductions
};
thread_local ThreadWatches tls_watches;

std::unique_ptr<at::ObserverContext> on_op_enter(const at::RecordFunction& fn) {
  if (!tls_watches.busy && watched(fn.name())) ++tls_watches.depth;
  return nullptr;
}

void on_op_exit(const at::RecordFunction& fn, at::ObserverContext* /*unused*/) {
  auto& t = tls_watches;
  if (t.busy || !watched(fn.name())) return;
  // Backward runs its matmuls with gradients disabled: only the forward counts.
  if (t.depth-- == 1 && at::GradMode::is_enabled()) {
    t.busy = true;
    for (const c10::IValue& out : fn.outputs())
      if (out.isTensor() && out.toTensor().defined() && out.toTensor().is_floating_point()) {
        const Fp16Range r = fp16_range(out.toTensor());
        for (auto* w : t.armed) w->add(fn.name(), r);
      }
    t.busy = false;
  }
}

}  // namespace

NumericsMonitor::NumericsMonitor(std::vector<std::pair<std::string, at::Tensor>> named_parameters,
                                 NumericsMonitorOptions options)
    : options_(options), named_parameters_(std::move(named_parameters)) {
  TORCH_CHECK(options_.every_n_steps >= 0, "NumericsMonitor: every_n_steps must be >= 0, got ",
              options_.every_n_steps);
  TORCH_CHECK(options_.scale_without_scaler > 0,
              "NumericsMonitor: scale_without_scaler must be > 0, got ",
              options_.scale_without_scaler);
  if (inspects(current_step())) arm();
}

NumericsMonitor::~NumericsMonitor() { disarm(); }

bool NumericsMonitor::inspects(int64_t step) const {
  return options_.every_n_steps > 0 && (step == 1 || step % options_.every_n_steps == 0);
}

void NumericsMonitor::arm() {
  if (!watch_) watch_ = std::make_unique<detail::ActivationWatch>();
  auto& t = tls_watches;
  if (std::find(t.armed.begin(), t.armed.end(), watch_.get()) != t.armed.end()) return;
  watch_->by_op.clear();
  if (t.armed.empty()) {
    t.depth = 0;
    t.handle = at::addThreadLocalCallback(at::RecordFunctionCallback(on_op_enter, on_op_exit)
                                              .needsOutputs(true)
                                              .scopes({at::RecordScope::FUNCTION}));
  }
  t.armed.push_back(watch_.get());
}

// Only on the thread that armed it (the watch is that thread's).
void NumericsMonitor::disarm() {
  auto& t = tls_watches;
  const auto it = std::find(t.armed.begin(), t.armed.end(), watch_.get());
  if (!watch_ || it == t.armed.end()) return;
  t.armed.erase(it);
  if (t.armed.empty()) at::removeCallback(t.handle);
}

void NumericsMonitor::record_gradients(const std::vector<at::Tensor>& parameters,
                                       std::optional<double> scale) {
  if (!inspects(current_step()) || (pending_ && !pending_->gradients.empty())) return;
  std::unordered_map<const c10::TensorImpl*, const std::string*> names;
  for (const auto& [name, p] : named_parameters_) names.emplace(p.unsafeGetTensorImpl(), &name);
  const double held = scale.value_or(1.0);
  if (!pending_) pending_.emplace();
  pending_->step = current_step();
  pending_->scale = scale.value_or(options_.scale_without_scaler);
  for (const auto i : c10::irange(parameters.size())) {
    const at::Tensor& grad = parameters[i].grad();
    if (!grad.defined()) continue;
    const auto it = names.find(parameters[i].unsafeGetTensorImpl());
    pending_->gradients.emplace_back(
        it != names.end() ? *it->second : "param." + std::to_string(i),
        fp16_range(held == 1.0 ? grad : grad.to(at::kFloat) / held, pending_->scale));
  }
}

void NumericsMonitor::record_gradients(std::optional<double> scale) {
  std::vector<at::Tensor> parameters;
  parameters.reserve(named_parameters_.size());
  for (const auto& [name, p] : named_parameters_) parameters.push_back(p);
  record_gradients(parameters, scale);
}

std::map<std::string, double> NumericsMonitor::end_step(double scale, bool skipped) {
  scale_history_.push_back({current_step(), scale, skipped});
  std::map<std::string, double> logs;
  if (inspects(current_step())) {
    NumericsRecord record = pending_ ? std::move(*pending_) : NumericsRecord{};
    pending_.reset();
    record.step = current_step();
    record.skipped = skipped;
    if (watch_) {
      record.activations = std::move(watch_->by_op);
      watch_->by_op.clear();
    }
    disarm();
    Fp16Range all;
    for (const auto& [name, r] : record.gradients) {
      all.merge(r);
      logs["numerics/grad_underflow/" + name] = r.underflow_fraction();
      logs["numerics/grad_overflow/" + name] = r.overflow_fraction();
      logs["numerics/grad_max_exponent/" + name] = r.max_exponent;
      logs["numerics/grad_min_exponent/" + name] = r.min_exponent;
    }
    if (!record.gradients.empty()) {
      logs["numerics/grad_underflow"] = all.underflow_fraction();
      logs["numerics/grad_overflow"] = all.overflow_fraction();
      logs["numerics/grad_zero"] = all.fraction(all.zeros);
      logs["numerics/grad_max_exponent"] = all.max_exponent;
      logs["numerics/grad_min_exponent"] = all.min_exponent;
    }
    for (const auto& [op, r] : record.activations) {
      logs["numerics/activation_overflow/" + op] = r.overflow_fraction();
      logs["numerics/activation_underflow/" + op] = r.underflow_fraction();
      logs["numerics/activation_max_exponent/" + op] = r.max_exponent;
      logs["numerics/activation_min_exponent/" + op] = r.min_exponent;
    }
    logs["numerics/loss_scale"] = record.scale;
    records_.push_back(std::move(record));
  }
  ++step_;
  if (inspects(current_step()))
    arm();
  else
    disarm();
  return logs;
}

std::string NumericsMonitor::summary() const {
  std::ostringstream out;
  const int64_t steps = static_cast<int64_t>(scale_history_.size());
  out << "Numerics monitor: " << records_.size() << " of " << steps
      << " steps inspected (step 1 and every " << options_.every_n_steps << ")";
  if (!scale_history_.empty()) {
    double lo = scale_history_.front().scale, hi = lo;
    int64_t skipped = 0;
    for (const auto& p : scale_history_) {
      lo = std::min(lo, p.scale);
      hi = std::max(hi, p.scale);
      skipped += p.skipped;
    }
    out << "; loss scale " << power_of_two(scale_history_.back().scale) << " at the end (range "
        << power_of_two(lo) << " .. " << power_of_two(hi) << "), " << skipped << " steps skipped";
  }
  out << ".\n";
  if (records_.empty()) return out.str();

  // Each tensor's worst inspected step, for underflow and for overflow.
  struct Worst {
    double fraction = 0;
    double scale = 1;
    int64_t step = 0;
  };
  auto list = [&](const char* title, bool gradients, auto count) {
    std::vector<std::pair<std::string, Worst>> worst;
    for (const auto& record : records_)
      for (const auto& [name, r] : gradients ? record.gradients : record.activations) {
        const double f = r.fraction(count(r));
        auto it = std::find_if(worst.begin(), worst.end(),
                               [&](const auto& w) { return w.first == name; });
        if (it == worst.end()) it = worst.insert(worst.end(), {name, {}});
        if (f > it->second.fraction) it->second = {f, record.scale, record.step};
      }
    std::erase_if(worst, [](const auto& w) { return w.second.fraction == 0; });
    std::stable_sort(worst.begin(), worst.end(), [](const auto& a, const auto& b) {
      return a.second.fraction > b.second.fraction;
    });
    out << title << (worst.empty() ? ": none\n" : ":\n");
    for (size_t i = 0; i < worst.size() && static_cast<int64_t>(i) < options_.summary_top_k; ++i)
      out << "  " << worst[i].first << ": " << percent(worst[i].second.fraction)
          << " of elements at scale " << power_of_two(worst[i].second.scale) << " (step "
          << worst[i].second.step << ")\n";
  };
  list("Gradients that underflow fp16 (worst inspected step)", true,
       [](const Fp16Range& r) { return r.underflow; });
  list("Gradients that overflow fp16", true, [](const Fp16Range& r) { return r.overflow; });
  list("Activations that overflow fp16", false, [](const Fp16Range& r) { return r.overflow; });

  Fp16Range grads, acts;
  for (const auto& record : records_) {
    for (const auto& [name, r] : record.gradients) grads.merge(r);
    for (const auto& [op, r] : record.activations) acts.merge(r);
  }
  auto range = [](const Fp16Range& r) {
    return std::isnan(r.max_exponent)
               ? std::string("none")
               : "2^" + std::to_string(static_cast<int>(r.min_exponent)) + " .. 2^" +
                     std::to_string(static_cast<int>(r.max_exponent));
  };
  out << "Exponents seen (fp16 holds 2^-24 .. 2^15 times the scale): gradients " << range(grads)
      << ", activations " << range(acts) << ".\n";
  return out.str();
}

}  // namespace mixprec::log
