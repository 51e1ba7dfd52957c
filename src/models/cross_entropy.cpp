#include "mixprec/models/cross_entropy.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>

#include "kernels/isa.h"
#include "models/kernels/cross_entropy.h"

namespace mixprec::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using Forward = void (*)(const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&,
                         const at::Tensor&);
using Backward = void (*)(const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&, float,
                          const at::Tensor&);
struct Kernel {
  Forward forward = nullptr;
  Backward backward = nullptr;
};

Kernel cpu_kernel() {
#ifdef MIXPREC_HAVE_X86_KERNELS
  return mixprec::kernels::for_this_cpu<Kernel>(
      {kernels::avx512::cross_entropy_forward, kernels::avx512::cross_entropy_backward},
      {kernels::avx2::cross_entropy_forward, kernels::avx2::cross_entropy_backward}, {});
#else
  return {};
#endif
}

// The CPU kernels: two passes over the logits, nothing (N, C) kept but the logits themselves.
struct FusedCrossEntropy : torch::autograd::Function<FusedCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& targets, int64_t ignore_index, int64_t divisor) {
    RECORD_FUNCTION("mixprec::cross_entropy", std::vector<c10::IValue>());
    const int64_t N = logits.size(0);
    const auto fp32 = logits.options().dtype(at::kFloat);
    auto lse = at::empty({N}, fp32), loss = at::empty({N}, fp32);
    cpu_kernel().forward(logits, targets, ignore_index, lse, loss);
    double sum = 0;  // in row order: the same bits whatever the threads
    const auto* l = loss.const_data_ptr<float>();
    for (int64_t i = 0; i < N; ++i) sum += l[i];
    ctx->save_for_backward({logits, targets, lse});
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["divisor"] = divisor;
    return at::scalar_tensor(sum / static_cast<double>(divisor), fp32);  // NaN if divisor is 0
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    RECORD_FUNCTION("mixprec::cross_entropy_backward", std::vector<c10::IValue>());
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "mixprec::models::cross_entropy is differentiable once: its backward does not "
                "record a graph (create_graph=true)");
    const auto saved = ctx->get_saved_variables();
    const auto& logits = saved[0];
    const double divisor = static_cast<double>(ctx->saved_data["divisor"].toInt());
    const auto scale = static_cast<float>(grad_outputs[0].item<double>() / divisor);
    auto grad = at::empty_like(logits);
    cpu_kernel().backward(logits, saved[1], ctx->saved_data["ignore_index"].toInt(), saved[2],
                          scale, grad);
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Elsewhere (fp64, other devices, CPUs without AVX2): LibTorch's ops, in the logits' dtype.
struct CrossEntropy : torch::autograd::Function<CrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& targets, int64_t ignore_index,
                            std::optional<int64_t> num_items) {
    auto valid = targets.ne(ignore_index);
    auto safe = targets.masked_fill(valid.logical_not(), 0).unsqueeze(1);  // (N, 1)
    auto log_probs = at::log_softmax(logits, /*dim=*/1);
    auto nll = log_probs.gather(1, safe).squeeze(1).neg_();
    // The divisor, a tensor: counting the valid rows needs no host sync.
    auto count = num_items ? at::scalar_tensor(*num_items, targets.options()) : valid.sum();
    ctx->save_for_backward({log_probs, safe, valid, count});
    // masked_fill, not a multiply: an ignored row's nll may be inf (-inf in its class 0).
    return nll.masked_fill_(valid.logical_not(), 0).sum().div_(count);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto saved = ctx->get_saved_variables();
    const auto& log_probs = saved[0];
    // d loss / d logits = (softmax - one_hot(target)) * grad / divisor on the rows that count.
    // where, not a multiply: with every row ignored, grad / 0 is inf, and PyTorch's gradient 0.
    auto scale =
        at::where(saved[2], grad_outputs[0] / saved[3], 0).to(log_probs.scalar_type()).unsqueeze(1);
    auto grad = log_probs.exp().mul_(scale);
    grad.scatter_add_(1, saved[1], scale.neg());
    return {grad, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index,
                         std::optional<int64_t> num_items) {
  TORCH_CHECK(!num_items || *num_items >= 0, "cross_entropy: num_items is ", *num_items,
              ", expected >= 0");
  TORCH_CHECK(logits.dim() == 2 && at::isFloatingType(logits.scalar_type()),
              "cross_entropy: logits must be floating (N, C), got ", logits.scalar_type(),
              " of shape ", logits.sizes());
  TORCH_CHECK(
      targets.dim() == 1 && targets.size(0) == logits.size(0) && targets.scalar_type() == at::kLong,
      "cross_entropy: targets must be int64 (N) with N = ", logits.size(0), ", got ",
      targets.scalar_type(), " of shape ", targets.sizes());
  int64_t count = 0;       // rows that count; read only on the CPU
  if (targets.is_cpu()) {  // elsewhere, reading them would wait for the device
    const auto contiguous = targets.contiguous();
    const auto* t = contiguous.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < targets.numel(); ++i) {
      if (t[i] == ignore_index) continue;
      TORCH_CHECK(t[i] >= 0 && t[i] < logits.size(1), "cross_entropy: target ", t[i], " of row ", i,
                  " is out of range [0, ", logits.size(1), ")");
      ++count;
    }
  }
  const auto dtype = logits.scalar_type();
  const bool kernel_dtype = dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
  if (logits.is_cpu() && targets.is_cpu() && kernel_dtype && cpu_kernel().forward != nullptr)
    return FusedCrossEntropy::apply(logits.contiguous(), targets.contiguous(), ignore_index,
                                    num_items.value_or(count));
  const auto upcast = at::isReducedFloatingType(dtype) ? logits.to(at::kFloat) : logits;
  return CrossEntropy::apply(upcast, targets, ignore_index, num_items);
}

}  // namespace mixprec::models
