#include "mixprec/optim/clip_grad.h"

#include "mixprec/optim/optimizer_in_backward.h"

#include <ATen/ATen.h>

#include <cmath>
#include <optional>
#include <set>
#include <span>

#include "kernels/isa.h"
#include "optim/kernels/grad_norm.h"

namespace mixprec::optim {

namespace {

void check_finite(double norm, double norm_type, bool error_if_nonfinite) {
  TORCH_CHECK(!error_if_nonfinite || std::isfinite(norm), "The total norm of order ", norm_type,
              " for gradients from `parameters` is non-finite, so it cannot be clipped. To "
              "disable this error and scale the gradients by the non-finite norm anyway, set "
              "`error_if_nonfinite=false`");
}

// The 2-norm of contiguous fp32 CPU gradients by this CPU's kernels, clipping
// them; nothing where they do not apply.
std::optional<double> clip_fp32_cpu(const std::vector<at::Tensor>& grads, double max_norm,
                                    bool error_if_nonfinite) {
#ifdef MIXPREC_HAVE_X86_KERNELS
  using SumOfSquares = double (*)(const std::vector<std::span<float>>&);
  using Scale = void (*)(const std::vector<std::span<float>>&, float);
  const auto [sum_of_squares, scale] =
      mixprec::kernels::for_this_cpu<std::pair<SumOfSquares, Scale>>(
          {kernels::avx512::sum_of_squares, kernels::avx512::scale},
          {kernels::avx2::sum_of_squares, kernels::avx2::scale}, {nullptr, nullptr});
  if (!sum_of_squares) return std::nullopt;
  // A gradient listed twice (a parameter registered twice) counts twice and is scaled twice,
  // as in PyTorch: the foreach path does that; here two threads would scale it at once.
  std::set<const void*> seen;
  std::vector<std::span<float>> blocks;
  for (const auto& g : grads) {
    if (!g.device().is_cpu() || g.scalar_type() != at::kFloat || g.layout() != at::kStrided ||
        !g.is_contiguous() || !seen.insert(g.const_data_ptr()).second)
      return std::nullopt;
    float* data = g.data_ptr<float>();
    for (int64_t begin = 0; begin < g.numel(); begin += kernels::kGradNormBlock)
      blocks.emplace_back(data + begin, std::min(kernels::kGradNormBlock, g.numel() - begin));
  }
  // PyTorch's arithmetic: the norm is an fp32 tensor, and max_norm / (norm + 1e-6)
  // is reciprocal() * max_norm, in fp32.
  const auto norm = static_cast<float>(std::sqrt(sum_of_squares(blocks)));
  check_finite(norm, 2.0, error_if_nonfinite);
  const float coef = 1.0f / (norm + 1e-6f) * static_cast<float>(max_norm);
  if (!(coef >= 1.0f)) scale(blocks, coef);  // clamp(max=1) leaves the rest; NaN scales too
  return norm;
#else
  (void)grads, (void)max_norm, (void)error_if_nonfinite;
  return std::nullopt;
#endif
}

}  // namespace

double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type,
                       bool error_if_nonfinite) {
  check_not_updated_in_backward(parameters, "clip_grad_norm_", kClippingNeedsTheGradient);
  at::NoGradGuard no_grad;  // as PyTorch's (@_no_grad): gradients of a create_graph backward too
  std::vector<at::Tensor> grads;
  for (const auto& p : parameters)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (grads.empty()) return 0.0;
  if (norm_type == 2.0)
    if (const auto norm = clip_fp32_cpu(grads, max_norm, error_if_nonfinite)) return *norm;

  // torch.nn.utils.clip_grad_norm_'s math on all gradients at once (foreach ops).
  const at::Tensor norm =
      at::linalg_vector_norm(at::stack(at::_foreach_norm(grads, norm_type)), norm_type);
  const double norm_value = norm.item<double>();
  check_finite(norm_value, norm_type, error_if_nonfinite);
  // Python's max_norm / tensor is reciprocal() * max_norm (Tensor.__rtruediv__); C++'s would
  // round max_norm to a bf16/fp16 norm's dtype first.
  at::_foreach_mul_(grads, at::clamp_max((norm + 1e-6).reciprocal() * max_norm, 1.0));
  return norm_value;
}

}  // namespace mixprec::optim
