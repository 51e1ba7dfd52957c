#pragma once

#include <ATen/core/Tensor.h>

namespace mixprec::models {

/// What a model's forward returns, as Hugging Face models do: `loss` when
/// labels were given (undefined otherwise) and `logits`.
struct ModelOutput {
  at::Tensor loss;
  at::Tensor logits;
};

}  // namespace mixprec::models
