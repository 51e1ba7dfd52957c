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
  const auto maybe_bias = bias.defined() ? std::optional(bias) : std::nullopt;
  at::Tensor y;
  if (x.dim() >= 2 && !at::autocast::is_autocast_enabled(at::kCPU) &&
      mixprec::kernels::onednn_linear_takes(x, in_out ? weight.t() : weight, bias)) {
    y = OnednnLinear::apply(x, weight, maybe_bias, in_out);
  } else if (!in_out) {
    y = at::linear(x, weight, maybe_bias);
  } else {
    const auto x2 = x.reshape({-1, x.size(-1)});
    y = (bias.defined() ? at::addmm(bias, x2, weight) : at::mm(x2, weight))
            .view(output_sizes(x, out));
  }
  if (guard.isActive() && guard.needsOutputs()) guard.setOutputs(std::vector<c10::IValue>{y});
  return y;
}

}  // namespace mixprec::models
