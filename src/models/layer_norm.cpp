#include "mixprec/models/layer_norm.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>

#include "kernels/isa.h"
#include "models/kernels/layer_norm.h"

namespace mixprec::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using Forward = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                         const at::Tensor&, const at::Tensor&, const at::Tensor&);
using Backward = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&);
struct Kernel {
  Forward forward = nullptr;
  Backward backward = nullptr;
};

Kernel cpu_kernel() {
#ifdef MIXPREC_HAVE_X86_KERNELS
  return mixprec::kernels::for_this_cpu<Kernel>(
      {kernels::avx512::layer_norm_forward, kernels::avx512::layer_norm_backward},
      {kernels::avx2::layer_norm_forward, kernels::avx2::layer_norm_backward}, {});
#else
  return {};
#endif
}

struct FusedLayerNorm : torch::autograd::Function<FusedLayerNorm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, double eps, at::ScalarType dtype) {
    RECORD_FUNCTION("mixprec::layer_norm", std::vector<c10::IValue>());
    const auto input = x.contiguous();
    const int64_t rows = input.numel() / input.size(-1);
    auto y = at::empty(input.sizes(), input.options().dtype(dtype));
    auto mean = at::empty({rows}, input.options()), rstd = at::empty({rows}, input.options());
    const auto w = weight.contiguous();
    cpu_kernel().forward(input, w, bias.contiguous(), eps, y, mean, rstd);
    ctx->save_for_backward({input, w, mean, rstd});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    RECORD_FUNCTION("mixprec::layer_norm_backward", std::vector<c10::IValue>());
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "mixprec::models::layer_norm is differentiable once: its backward does not "
                "record a graph (create_graph=true)");
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &weight = saved[1], &mean = saved[2], &rstd = saved[3];
    auto dx = at::empty_like(x), dweight = at::empty_like(weight), dbias = at::empty_like(weight);
    cpu_kernel().backward(grad_outputs[0].contiguous(), x, mean, rstd, weight, dx, dweight, dbias);
    return {dx,
            ctx->needs_input_grad(1) ? dweight : at::Tensor(),
            ctx->needs_input_grad(2) ? dbias : at::Tensor(),
            {},
            {}};
  }
};

bool fused(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
           at::ScalarType dtype) {
  const auto fp32_cpu = [](const at::Tensor& t) {
    return t.defined() && t.is_cpu() && t.scalar_type() == at::kFloat;
  };
  const int64_t C = x.dim() >= 1 ? x.size(-1) : 0;
  return cpu_kernel().forward != nullptr && fp32_cpu(x) && fp32_cpu(weight) && fp32_cpu(bias) &&
         C > 0 && weight.dim() == 1 && weight.size(0) == C && bias.dim() == 1 &&
         bias.size(0) == C && (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf);
}

}  // namespace

at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                      double eps, at::ScalarType dtype) {
  if (!fused(x, weight, bias, dtype))
    return at::layer_norm(x, {x.size(-1)}, weight, bias, eps).to(dtype);
  return FusedLayerNorm::apply(x, weight, bias, eps, dtype);
}

}  // namespace mixprec::models
