#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace mixprec::models {

/// NEFTune (Jain et al. 2023, "Noisy Embeddings Improve Instruction Finetuning"), as HF's
/// forward hook: `embeddings` (B, T, C) plus noise uniform in +-alpha / sqrt(T * C), drawn from
/// the default generator with HF's ops (so a seeded run draws what HF's draws).
at::Tensor add_neftune_noise(const at::Tensor& embeddings, double alpha);

/// A model whose input embeddings (HF's `get_input_embeddings()`) get NEFTune noise while it is
/// in training mode. The Trainer sets it for `TrainingArguments::neftune_noise_alpha` during
/// `train()` and gives back the previous value after, also when train() throws (HF's
/// activate/deactivate_neftune; HF's leaves its hook after an error).
class SupportsNEFTune {
 public:
  virtual ~SupportsNEFTune() = default;
  /// nullopt: no noise.
  virtual void set_neftune_noise_alpha(std::optional<double> alpha) = 0;
  virtual std::optional<double> neftune_noise_alpha() const = 0;
};

}  // namespace mixprec::models
