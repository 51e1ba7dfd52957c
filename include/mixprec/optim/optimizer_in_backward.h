#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <string_view>
#include <vector>

namespace mixprec::optim {

/// Runs `optimizer`'s update of each parameter inside the backward, as soon as the backward has
/// accumulated that parameter's gradient, and frees the gradient right after. The twin of
/// PyTorch's recipe "fuse the optimizer step into the backward pass"
/// (`Tensor.register_post_accumulate_grad_hook` calling a step and `zero_grad`): the gradients of
/// all parameters never live at once, which lowers the peak memory of a step by up to one copy of
/// the parameters (fp32 gradients of fp32 master weights in mixed precision).
///
/// The optimizer keeps its state, options and LR scheduler; the loop calls neither `step()` nor
/// `zero_grad()`:
/// ```
/// mixprec::optim::AdamW optimizer(model->parameters(), AdamWOptions(3e-4).fused(true));
/// mixprec::optim::OptimizerInBackward in_backward(optimizer);
/// for (...) {
///   model->forward(ids, labels).loss.backward();  // updates the parameters
///   scheduler.step();
/// }
/// ```
/// Each update is `optimizer.step()` while only that parameter has a gradient, so it is the same
/// arithmetic as one `step()` after the whole backward for optimizers that update each parameter
/// on its own (AdamW, SGD, ...), not for ones that look at all gradients at once (LBFGS), and
/// bit for bit except where the update draws random numbers (stochastic rounding draws its seeds
/// in the backward's order). Each such step looks at every parameter, which costs nothing next
/// to the update for the hundreds of parameter tensors of a transformer, but grows as their
/// square.
///
/// Not compatible with what needs every gradient before any update: gradient clipping, gradient
/// accumulation, a GradScaler (fp16's skipped steps) and data parallel's all-reduce; mixprec's
/// versions of them (`clip_grad_norm_`, the Accelerator's clipping, accumulation and fp16,
/// `GradScaler::step`, `dist::GradientReducer`) say so in an error. An Accelerator in fp32 or
/// bf16 without accumulation trains with it as without it (its numerics monitor sees no gradients).
/// The parameters must be on one device. Frozen parameters get a hook too, for when they thaw; a
/// parameter group added later gets none. The optimizer must outlive this object; its hooks are
/// removed when it is destroyed.
class OptimizerInBackward {
 public:
  /// Fails if a parameter already has a gradient (call `optimizer.zero_grad()` first) or already
  /// has a post-accumulate-grad hook.
  explicit OptimizerInBackward(torch::optim::Optimizer& optimizer);
  ~OptimizerInBackward();
  OptimizerInBackward(const OptimizerInBackward&) = delete;
  OptimizerInBackward& operator=(const OptimizerInBackward&) = delete;

 private:
  std::vector<at::Tensor> parameters_;
};

/// Whether the backward updates `parameter` itself (it has a post-accumulate-grad hook, as
/// `OptimizerInBackward` sets): what runs after the backward, a GradScaler's inf/NaN check or
/// data parallel's all-reduce, would come too late for it.
bool updated_in_backward(const at::Tensor& parameter);

/// Fails, naming `user` and the parameter, if the backward updates one of `parameters` itself;
/// `why` ends the message: what `user` needed the gradient for. Checks only while an
/// `OptimizerInBackward` exists (a hook of the user's own is not its business), and then costs
/// one pointer test per parameter: the Accelerator and the GradScaler call it every step.
void check_not_updated_in_backward(const std::vector<at::Tensor>& parameters, std::string_view user,
                                   std::string_view why);
/// The `why` of every clip's check.
inline constexpr std::string_view kClippingNeedsTheGradient =
    "which applies and frees its gradient before clipping can see it";
/// The same for every parameter of `optimizer`, numbered across its groups, or of `module`.
void check_not_updated_in_backward(const torch::optim::Optimizer& optimizer, std::string_view user,
                                   std::string_view why);
void check_not_updated_in_backward(const torch::nn::Module& module, std::string_view user,
                                   std::string_view why);

}  // namespace mixprec::optim
