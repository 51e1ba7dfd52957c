#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>

namespace mixprec::models {

/// `torch.utils.checkpoint.checkpoint` for a function of one tensor: runs `function(input)`
/// without keeping its activations for the backward, and runs it again in the backward to get
/// its gradients. A transformer block then keeps only its input: one more forward buys back
/// the memory of its saved tensors (and, under autocast, of its 16-bit weight copies).
///
/// As in PyTorch, the recompute runs under the forward's autocast state (a bf16 forward is
/// recomputed in bf16) and, with `preserve_rng_state`, from the forward's CPU RNG state and
/// the input's device's (dropout drops the same values), so the gradients are those of the
/// plain call.
///
/// `parameters` are the tensors that `function` uses besides `input` and that need gradients
/// (a module's `parameters()`; duplicates count once). A tensor the function uses but that is
/// not listed gets no gradient. The gradients flow through the returned tensor's graph, as any
/// op's inputs do, so accumulation into `.grad`, hooks that run after it (c10d's reducer) and
/// clipping see them once. Hooks registered on a parameter itself (`register_hook`) run twice:
/// in the recompute's `grad()` and again in the outer backward. Unlike PyTorch's reentrant
/// variant, the output needs gradients when the parameters do, even if the input does not. No
/// double backward (`create_graph`): that is an error here. The recompute swaps the global RNG
/// states for its duration, as PyTorch's `fork_rng`: another thread drawing random numbers
/// meanwhile would see them.
///
/// ```
/// // By value: the function is kept until the backward.
/// x = activation_checkpoint([block](const at::Tensor& h) { return block->forward(h); }, x,
///                           block->parameters());
/// ```
at::Tensor activation_checkpoint(std::function<at::Tensor(const at::Tensor&)> function,
                                 const at::Tensor& input, at::TensorList parameters,
                                 bool preserve_rng_state = true);

/// A model that can checkpoint its layers (HF's `supports_gradient_checkpointing`). The Trainer
/// calls it for `TrainingArguments::activation_checkpointing`.
class SupportsActivationCheckpointing {
 public:
  virtual ~SupportsActivationCheckpointing() = default;
  /// HF's `activation_checkpointing_enable`: in training mode, checkpoint every
  /// `every_n_layers`-th layer (layers 0, n, 2n, ...); the others keep their activations.
  /// `preserve_rng_state` is `activation_checkpoint`'s (torch.utils.checkpoint's).
  virtual void activation_checkpointing_enable(int64_t every_n_layers = 1,
                                               bool preserve_rng_state = true) = 0;
  virtual void activation_checkpointing_disable() = 0;
  /// HF's `is_gradient_checkpointing`.
  virtual bool is_activation_checkpointing() const = 0;
};

}  // namespace mixprec::models
