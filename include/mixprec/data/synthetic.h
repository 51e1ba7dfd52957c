#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace mixprec::data {

/// Options of `make_regression`: y = x @ weight + bias + noise * N(0, 1).
struct MakeRegressionOptions {
  int64_t n_samples = 100;
  int64_t n_features = 8;
  int64_t n_targets = 1;
  double noise = 0.0;
  uint64_t seed = 0;
};

/// A linear regression task with known answers, the same for the same options.
struct RegressionTask {
  at::Tensor x;       // (N, F) fp32, N(0, 1)
  at::Tensor y;       // (N, n_targets) fp32
  at::Tensor weight;  // (F, n_targets) fp32, N(0, 1)
  at::Tensor bias;    // (n_targets) fp32, N(0, 1)
};
RegressionTask make_regression(const MakeRegressionOptions& options = {});

/// Options of `make_classification`: Gaussian blobs around one center per class.
struct MakeClassificationOptions {
  int64_t n_samples = 100;
  int64_t n_features = 8;
  int64_t n_classes = 2;
  double class_sep = 3.0;  // scale of the centers; larger is easier
  double noise = 1.0;      // standard deviation around a center
  uint64_t seed = 0;
};

/// A classification task: labels cycle through the classes (balanced) in a
/// shuffled order, x = centers[label] + noise * N(0, 1).
struct ClassificationTask {
  at::Tensor x;        // (N, F) fp32
  at::Tensor labels;   // (N) int64 in [0, n_classes)
  at::Tensor centers;  // (n_classes, F) fp32
};
ClassificationTask make_classification(const MakeClassificationOptions& options = {});

}  // namespace mixprec::data
