#include "mixprec/models/cross_entropy.h"

#include <torch/autograd.h>

namespace mixprec::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct CrossEntropy : torch::autograd::Function<CrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& targets, int64_t ignore_index) {
    auto valid = targets.ne(ignore_index);
    auto safe = targets.masked_fill(valid.logical_not(), 0).unsqueeze(1);  // (N, 1)
    auto log_probs = at::log_softmax(logits, /*dim=*/1);
    auto nll = log_probs.gather(1, safe).squeeze(1).neg_();
    auto count = valid.sum();  // a tensor: no host sync
    ctx->save_for_backward({log_probs, safe, valid, count});
    return nll.mul_(valid).sum().div_(count);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto saved = ctx->get_saved_variables();
    const auto& log_probs = saved[0];
    // d loss / d logits = (softmax - one_hot(target)) * grad / count on the rows that count.
    auto scale = saved[2].to(log_probs.scalar_type()).mul_(grad_outputs[0] / saved[3]).unsqueeze(1);
    auto grad = log_probs.exp().mul_(scale);
    grad.scatter_add_(1, saved[1], scale.neg());
    return {grad, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                         int64_t ignore_index) {
  TORCH_CHECK(logits.dim() == 2 && at::isFloatingType(logits.scalar_type()),
              "cross_entropy: logits must be floating (N, C), got ", logits.scalar_type(),
              " of shape ", logits.sizes());
  TORCH_CHECK(
      targets.dim() == 1 && targets.size(0) == logits.size(0) && targets.scalar_type() == at::kLong,
      "cross_entropy: targets must be int64 (N) with N = ", logits.size(0), ", got ",
      targets.scalar_type(), " of shape ", targets.sizes());
  return CrossEntropy::apply(logits, targets, ignore_index);
}

}  // namespace mixprec::models
