#pragma once

#include <ATen/core/Tensor.h>

namespace mixprec::models {

/// What every mixprec model's forward returns (the subset of HF's `ModelOutput` that training
/// needs): the loss when labels were given, and the logits.
struct ModelOutput {
  at::Tensor loss;    ///< 0-dim fp32; undefined without labels
  at::Tensor logits;  ///< (B, T, V) for a causal LM, in autocast's dtype under autocast
};

}  // namespace mixprec::models
