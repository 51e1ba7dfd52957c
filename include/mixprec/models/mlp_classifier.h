#pragma once

#include "mixprec/models/model_output.h"

#include <torch/nn.h>

#include <cstdint>
#include <map>
#include <string>

namespace mixprec::models {

/// Options of `MLPClassifier`.
struct MLPClassifierOptions {
  int64_t in_features = 64;  // 8x8 digits
  int64_t hidden = 256;
  int64_t num_labels = 10;
  double dropout = 0.0;
};

/// A classifier for fixed-size inputs (images as pixel vectors, features): two
/// hidden layers with ReLU, then logits. Follows the ModelOutput contract, so
/// the Trainer takes it as it is.
///
/// ```
/// mixprec::models::MLPClassifier model(MLPClassifierOptions{.in_features = 64, .num_labels = 10});
/// auto out = model->forward({{"pixels", x /* (B, 64) */}, {"labels", y /* (B) */}});
/// out.loss;    // cross-entropy, fp32
/// out.logits;  // (B, 10)
/// ```
class MLPClassifierImpl : public torch::nn::Module {
 public:
  explicit MLPClassifierImpl(MLPClassifierOptions options = {});
  /// (B, in_features) -> (B, num_labels) logits.
  at::Tensor forward(const at::Tensor& inputs);
  /// A batch with "pixels" (or "inputs") and, optionally, "labels": the loss
  /// is defined only with labels.
  ModelOutput forward(const std::map<std::string, at::Tensor>& batch);

 private:
  MLPClassifierOptions options_;
  torch::nn::Linear fc1_{nullptr}, fc2_{nullptr}, out_{nullptr};
  torch::nn::Dropout dropout_{nullptr};
};
TORCH_MODULE(MLPClassifier);

}  // namespace mixprec::models
