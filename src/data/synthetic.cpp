#include "mixprec/data/synthetic.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

namespace mixprec::data {

RegressionTask make_regression(const MakeRegressionOptions& o) {
  TORCH_CHECK(o.n_samples > 0 && o.n_features > 0 && o.n_targets > 0,
              "make_regression: invalid sizes n_samples=", o.n_samples,
              " n_features=", o.n_features, " n_targets=", o.n_targets, " (expected > 0)");
  TORCH_CHECK(o.noise >= 0, "make_regression: invalid noise ", o.noise, " (expected >= 0)");
  auto g = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  auto opts = at::TensorOptions().dtype(at::kFloat);
  RegressionTask task;
  task.weight = at::randn({o.n_features, o.n_targets}, g, opts);  // (F, n_targets)
  task.bias = at::randn({o.n_targets}, g, opts);                  // (n_targets)
  task.x = at::randn({o.n_samples, o.n_features}, g, opts);       // (N, F)
  auto noise = at::randn({o.n_samples, o.n_targets}, g, opts);
  task.y = at::addmm(task.bias, task.x, task.weight) + o.noise * noise;  // (N, n_targets)
  return task;
}

ClassificationTask make_classification(const MakeClassificationOptions& o) {
  TORCH_CHECK(o.n_samples > 0 && o.n_features > 0 && o.n_classes > 1,
              "make_classification: invalid sizes n_samples=", o.n_samples,
              " n_features=", o.n_features, " n_classes=", o.n_classes,
              " (expected > 0, > 0, > 1)");
  TORCH_CHECK(o.noise >= 0, "make_classification: invalid noise ", o.noise, " (expected >= 0)");
  auto g = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  auto opts = at::TensorOptions().dtype(at::kFloat);
  ClassificationTask task;
  task.centers = o.class_sep * at::randn({o.n_classes, o.n_features}, g, opts);  // (C, F)
  auto order = at::randperm(o.n_samples, g, at::kLong);
  task.labels = order.remainder(o.n_classes);  // (N), balanced
  task.x = task.centers.index_select(0, task.labels) +
           o.noise * at::randn({o.n_samples, o.n_features}, g, opts);  // (N, F)
  return task;
}

}  // namespace mixprec::data
