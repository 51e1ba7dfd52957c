#include "mixprec/models/neftune.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace mixprec::models {

at::Tensor add_neftune_noise(const at::Tensor& embeddings, double alpha) {
  TORCH_CHECK(embeddings.dim() == 3, "NEFTune: the embeddings must be (B, T, C), got shape ",
              embeddings.sizes());
  // HF's ops: alpha / torch.sqrt(torch.tensor(T * C)) is a float32 tensor (a scalar divided by a
  // tensor is its reciprocal times the scalar), which uniform_ reads as a number.
  const auto dims = at::scalar_tensor(embeddings.size(1) * embeddings.size(2), at::kLong);
  const double magnitude = (at::sqrt(dims).reciprocal() * alpha).item<double>();
  return embeddings + at::zeros_like(embeddings).uniform_(-magnitude, magnitude);
}

}  // namespace mixprec::models
