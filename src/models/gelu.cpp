#include "mixprec/models/gelu.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>

#include "kernels/isa.h"
#include "models/kernels/gelu_tanh.h"

namespace mixprec::models {
namespace {

using Forward = void (*)(const at::Tensor&, const at::Tensor&);
using Backward = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&);
struct Kernel {
  const char* name;
  Forward forward;
  Backward backward;
};

const Kernel& cpu_kernel() {
  static const Kernel kernel = []() -> Kernel {
    const Kernel none{"libtorch", nullptr, nullptr};
#ifdef MIXPREC_HAVE_X86_KERNELS
    return mixprec::kernels::for_this_cpu<Kernel>(
        {"avx512", kernels::avx512::gelu_tanh_forward, kernels::avx512::gelu_tanh_backward},
        {"avx2", kernels::avx2::gelu_tanh_forward, kernels::avx2::gelu_tanh_backward}, none);
#else
    return none;
#endif
  }();
  return kernel;
}

struct GeluTanh : torch::autograd::Function<GeluTanh> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
    RECORD_FUNCTION("mixprec::gelu_tanh", std::vector<c10::IValue>());
    const auto input = x.contiguous();
    auto y = at::empty_like(input, at::MemoryFormat::Contiguous);
    cpu_kernel().forward(input, y);
    ctx->save_for_backward({input});
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    RECORD_FUNCTION("mixprec::gelu_tanh_backward", std::vector<c10::IValue>());
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "mixprec::models::gelu_tanh is differentiable once: its backward does not "
                "record a graph (create_graph=true)");
    const auto x = ctx->get_saved_variables()[0];
    const auto dy = grad_outputs[0].contiguous();
    auto dx = at::empty_like(x, at::MemoryFormat::Contiguous);
    cpu_kernel().backward(dy, x, dx);
    return {dx};
  }
};

}  // namespace

at::Tensor gelu_tanh(const at::Tensor& x) {
  const auto dtype = x.scalar_type();
  if (!x.is_cpu() || cpu_kernel().forward == nullptr ||
      (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf))
    return at::gelu(x, "tanh");
  return GeluTanh::apply(x);
}

const char* gelu_tanh_cpu_kernel() { return cpu_kernel().name; }

}  // namespace mixprec::models
