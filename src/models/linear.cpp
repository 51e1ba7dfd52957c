#include "mixprec/models/linear.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/autograd.h>

#include <optional>

#include "kernels/onednn_linear.h"

namespace mixprec::models {
namespace {

using mixprec::kernels::onednn_linear;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct OnednnLinear : torch::autograd::Function<OnednnLinear> {
  // bias as an optional: autograd::Function takes no undefined tensors.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, bool in_out) {
    const auto x2 = x.reshape({-1, x.size(-1)}).contiguous();  // (M, in)
    auto y = onednn_linear(x2, in_out ? weight.t() : weight, bias.value_or(at::Tensor()));
    ctx->save_for_backward({x, weight});
    ctx->saved_data["in_out"] = in_out;
    ctx->saved_data["bias"] = bias.has_value();
    auto sizes = x.sizes().vec();
    sizes.back() = y.size(1);
    return y.view(sizes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &weight = saved[1];
    const auto x2 = x.reshape({-1, x.size(-1)});
    const bool in_out = ctx->saved_data["in_out"].toBool();
    const auto gy = grad_outputs[0].reshape({-1, grad_outputs[0].size(-1)}).contiguous();
    at::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0))
      dx = onednn_linear(gy, in_out ? weight : weight.t(), {}).view(x.sizes());
    if (ctx->needs_input_grad(1)) dw = in_out ? x2.t().mm(gy) : gy.t().mm(x2);
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2)) db = gy.sum(0);
    return {dx, dw, db, at::Tensor()};
  }
};

}  // namespace

bool linear_uses_onednn() { return mixprec::kernels::onednn_linear_available(); }

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                  WeightLayout layout) {
  const bool in_out = layout == WeightLayout::kInOut;
  const auto fp32_cpu = [](const at::Tensor& t) {
    return !t.defined() ||
           (t.is_cpu() && t.layout() == at::kStrided && t.scalar_type() == at::kFloat);
  };
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 2 && x.size(-1) == weight.size(in_out ? 0 : 1),
              "linear: x of shape ", x.sizes(), " does not fit a weight of shape ", weight.sizes(),
              in_out ? " stored (in, out)" : " stored (out, in)");
  if (x.dim() >= 2 && x.numel() > 0 && fp32_cpu(x) && fp32_cpu(weight) && fp32_cpu(bias) &&
      !at::autocast::is_autocast_enabled(at::kCPU) && linear_uses_onednn())
    return OnednnLinear::apply(x, weight, bias.defined() ? std::optional(bias) : std::nullopt,
                               in_out);
  if (!in_out) return at::linear(x, weight, bias.defined() ? std::optional(bias) : std::nullopt);
  auto sizes = x.sizes().vec();
  sizes.back() = weight.size(1);
  const auto x2 = x.reshape({-1, x.size(-1)});
  return (bias.defined() ? at::addmm(bias, x2, weight) : at::mm(x2, weight)).view(sizes);
}

}  // namespace mixprec::models
