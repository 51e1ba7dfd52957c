#include "mixprec/models/mlp_classifier.h"

#include <c10/util/Exception.h>

namespace mixprec::models {

MLPClassifierImpl::MLPClassifierImpl(MLPClassifierOptions options) : options_(options) {
  TORCH_CHECK(options.in_features > 0 && options.hidden > 0 && options.num_labels > 1,
              "MLPClassifier: invalid sizes in_features=", options.in_features,
              " hidden=", options.hidden, " num_labels=", options.num_labels);
  fc1_ = register_module("fc1", torch::nn::Linear(options.in_features, options.hidden));
  fc2_ = register_module("fc2", torch::nn::Linear(options.hidden, options.hidden));
  out_ = register_module("out", torch::nn::Linear(options.hidden, options.num_labels));
  dropout_ = register_module("dropout", torch::nn::Dropout(options.dropout));
}

at::Tensor MLPClassifierImpl::forward(const at::Tensor& inputs) {
  TORCH_CHECK(inputs.dim() == 2 && inputs.size(1) == options_.in_features,
              "MLPClassifier: expected inputs of shape (B, ", options_.in_features, "), got ",
              inputs.sizes());
  auto x = dropout_(torch::relu(fc1_(inputs)));
  x = dropout_(torch::relu(fc2_(x)));
  return out_(x);
}

ModelOutput MLPClassifierImpl::forward(const std::map<std::string, at::Tensor>& batch) {
  auto inputs = batch.find("pixels");
  if (inputs == batch.end()) inputs = batch.find("inputs");
  TORCH_CHECK(inputs != batch.end(), "MLPClassifier: the batch has no \"pixels\" or \"inputs\"");
  ModelOutput out;
  out.logits = forward(inputs->second);
  if (auto labels = batch.find("labels"); labels != batch.end())
    out.loss = torch::nn::functional::cross_entropy(out.logits, labels->second);
  return out;
}

}  // namespace mixprec::models
