#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace mixprec::optim {

/// torch.nn.utils.clip_grad_norm_: scales the gradients of `parameters` in
/// place so that their total `norm_type`-norm is at most `max_norm`, and
/// returns that norm before clipping (parameters without a gradient are
/// skipped; none at all gives 0). The same math as PyTorch's: the clip
/// coefficient max_norm / (norm + 1e-6), clamped to 1, in the gradients' dtype. A parameter
/// updated in the backward (`OptimizerInBackward`), whose gradient is gone, is an error.
///
/// fp32 gradients on the CPU with norm_type 2 take one pass to measure and one
/// to scale (none where nothing is clipped), in fixed blocks summed in double,
/// so the norm does not depend on the thread count; LibTorch's version costs
/// two ops per tensor, about 15% of a small model's step. Other gradients take
/// the foreach ops torch.nn.utils uses.
double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                       double norm_type = 2.0, bool error_if_nonfinite = false);

}  // namespace mixprec::optim
