#include "mixprec/models/linear.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>

#include <optional>

#include "kernels/onednn_linear.h"

namespace mixprec::models {
namespace {

using mixprec::kernels::onednn_linear;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// (..., in) -> (..., out) sizes.
std::vector<int64_t> output_sizes(const at::Tensor& x, int64_t out) {
  auto sizes = x.sizes().vec();
  sizes.back() = out;
  return sizes;
}

// a b by oneDNN where it takes them (the transposed operands of a weight gradient without a
// copy), else, and with create_graph, by LibTorch's mm.
at::Tensor gemm(const at::Tensor& a, const at::Tensor& b) {
  if (!at::GradMode::is_enabled() && mixprec::kernels::onednn_mm_takes(a, b))
    return mixprec::kernels::onednn_mm(a, b);
  return a.mm(b);
}

struct OnednnLinear : torch::autograd::Function<OnednnLinear> {
  // bias as an optional: autograd::Function takes no undefined tensors.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, bool in_out) {
    const auto w = in_out ? weight.t() : weight;  // (out, in)
    auto y = onednn_linear(x.reshape({-1, x.size(-1)}).contiguous(), w,
                           bias ? bias->contiguous() : at::Tensor());
    ctx->save_for_backward({x, weight});
    ctx->saved_data["in_out"] = in_out;
    ctx->saved_data["bias"] = bias.has_value();
    // Not a view: a custom Function's view outputs refuse in-place ops.
    return at::_unsafe_view(y, output_sizes(x, w.size(0)));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &weight = saved[1];
    const auto x2 = x.reshape({-1, x.size(-1)});
    const bool in_out = ctx->saved_data["in_out"].toBool();
    const auto gy = grad_outputs[0].reshape({-1, grad_outputs[0].size(-1)}).contiguous();
    const auto w_t = in_out ? weight : weight.t();  // (in, out)
    at::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) {
      // With create_graph, LibTorch's mm, which autograd can differentiate again.
      dx = at::GradMode::is_enabled() ? gy.mm(w_t.t()) : onednn_linear(gy, w_t, {});
      dx = dx.view(x.sizes());
    }
    if (ctx->needs_input_grad(1)) dw = in_out ? gemm(x2.t(), gy) : gemm(gy.t(), x2);
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2)) db = gy.sum(0);
    return {dx, dw, db, at::Tensor()};
  }
};

}  // namespace

bool linear_uses_onednn() { return mixprec::kernels::onednn_linear_available(); }

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                  WeightLayout layout) {
  const bool in_out = layout == WeightLayout::kInOut;
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 2 && x.size(-1) == weight.size(in_out ? 0 : 1),
              "linear: x of shape ", x.sizes(), " does not fit a weight of shape ", weight.sizes(),
              in_out ? " stored (in, out)" : " stored (out, in)");
  const int64_t out = weight.size(in_out ? 1 : 0);
  // One op for LibTorch's profiler and the numerics monitor, whichever path runs.
  at::RecordFunction guard(at::RecordScope::FUNCTION);
  guard.before("mixprec::linear");
  // Under CPU autocast to bf16, autocast's own casts (a weight's is cached for the region) are
  // made here, so that the bf16 operands can take oneDNN as fp32 ones do outside autocast;
  // LibTorch's op, where it runs instead, finds them cast.
  const bool autocast = at::autocast::is_autocast_enabled(at::kCPU);
  const auto cpu_fp32_or_bf16 = [](const at::Tensor& t) {
    return !t.defined() ||
           (t.is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16));
  };
  const bool cast = autocast && at::autocast::get_autocast_dtype(at::kCPU) == at::kBFloat16 &&
                    cpu_fp32_or_bf16(x) && cpu_fp32_or_bf16(weight) && cpu_fp32_or_bf16(bias);
  const auto operand = [&](const at::Tensor& t) {
    return cast && t.defined() ? at::autocast::cached_cast(at::kBFloat16, t, c10::DeviceType::CPU)
                               : t;
  };
  const auto x1 = operand(x), w1 = operand(weight), b1 = operand(bias);
  const auto maybe_bias = b1.defined() ? std::optional(b1) : std::nullopt;
  at::Tensor y;
  if (x1.dim() >= 2 && (!autocast || cast) &&
      mixprec::kernels::onednn_linear_takes(x1, in_out ? w1.t() : w1, b1)) {
    y = OnednnLinear::apply(x1, w1, maybe_bias, in_out);
  } else if (!in_out) {
    y = at::linear(x1, w1, maybe_bias);
  } else {
    const auto x2 = x1.reshape({-1, x1.size(-1)});
    y = (b1.defined() ? at::addmm(b1, x2, w1) : at::mm(x2, w1)).view(output_sizes(x1, out));
  }
  if (guard.isActive() && guard.needsOutputs()) guard.setOutputs(std::vector<c10::IValue>{y});
  return y;
}

}  // namespace mixprec::models
