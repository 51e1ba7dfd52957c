#include "kernels/onednn_linear.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <exception>
#include <optional>

namespace mixprec::kernels {
namespace {

// The op TorchInductor's CPU fusions call. Called boxed: its C++ signature changed across
// LibTorch versions, its schema did not.
const c10::OperatorHandle* linear_pointwise_op() {
  static const auto op = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  return op ? &*op : nullptr;
}

// A LibTorch built without oneDNN registers no kernel for the op.
bool onednn_linear_runs() {
  static const bool runs = [] {
    if (!at::hasMKLDNN() || linear_pointwise_op() == nullptr) return false;
    try {
      const auto x = at::arange(1, 5, at::kFloat).view({2, 2});  // (1 2; 3 4)
      const auto y = onednn_linear(x, x, at::ones({2}));         // x x^T + 1
      return at::equal(y, at::tensor({6.f, 12.f, 12.f, 26.f}).view({2, 2}));
    } catch (const std::exception&) {  // c10::Error, or oneDNN's own
      return false;
    }
  }();
  return runs;
}

}  // namespace

bool onednn_linear_available() {
  return onednn_linear_runs() && at::globalContext().userEnabledMkldnn();
}

bool onednn_linear_takes(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  const auto fp32_cpu = [](const at::Tensor& t) {
    return t.is_cpu() && t.layout() == at::kStrided && t.scalar_type() == at::kFloat;
  };
  return x.dim() >= 1 && x.numel() > 0 && fp32_cpu(x) && w.dim() == 2 && w.numel() > 0 &&
         w.size(1) == x.size(-1) && fp32_cpu(w) && w.is_non_overlapping_and_dense() &&
         (!bias.defined() || (bias.dim() == 1 && bias.size(0) == w.size(0) && fp32_cpu(bias))) &&
         onednn_linear_available();
}

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  torch::jit::Stack stack{x,
                          w,
                          bias.defined() ? c10::IValue(bias) : c10::IValue(),
                          c10::IValue("none"),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()),
                          c10::IValue()};
  linear_pointwise_op()->callBoxed(&stack);
  return std::move(stack[0]).toTensor();
}

}  // namespace mixprec::kernels
