#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mixprec::data {

/// One sample: named tensors, e.g. {"input_ids": (T) int64, "labels": () int64}.
using Example = std::map<std::string, at::Tensor>;
/// Samples collated along a new first dimension, e.g. {"input_ids": (B, T),
/// "attention_mask": (B, T), "labels": (B) or (B, T)}.
using Batch = std::map<std::string, at::Tensor>;
/// Text -> token ids (e.g. a tokenizer's encode).
using EncodeFn = std::function<std::vector<int64_t>(std::string_view)>;

/// A map-style dataset (`torch.utils.data.Dataset`): `size()` samples, read by
/// index. `get` must be safe to call from several threads at once (the
/// DataLoader's prefetch workers do).
class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual size_t size() const = 0;
  virtual Example get(size_t index) const = 0;
  /// The samples at `indices` as `collate()` would batch them, where the dataset can gather
  /// them at once (PyTorch's `__getitems__`); nullopt: the loader reads them one by one. The
  /// DataLoader asks only when it collates with the default `collate()`.
  virtual std::optional<Batch> get_batch(const std::vector<size_t>& /*indices*/) const {
    return std::nullopt;
  }
};
using DatasetPtr = std::shared_ptr<const Dataset>;

/// Named tensors indexed on their first dimension (`torch.utils.data.TensorDataset`).
///
/// ```
/// auto ds = std::make_shared<TensorDataset>(
///     std::map<std::string, at::Tensor>{{"pixels", x /* (N, 64) */}, {"labels", y /* (N) */}});
/// ds->get(3);  // {"pixels": (64), "labels": ()}
/// ```
class TensorDataset : public Dataset {
 public:
  explicit TensorDataset(std::map<std::string, at::Tensor> tensors);
  /// A CSV table of numbers with a header row: `label_column` (integer class
  /// ids) becomes "labels" (N) int64, every other column a feature of
  /// "inputs" (N, F) fp32. A cell that is not a number is an error naming the
  /// line and the column.
  static std::shared_ptr<TensorDataset> from_csv(const std::string& path,
                                                 const std::string& label_column);
  size_t size() const override { return size_; }
  Example get(size_t index) const override;
  /// Each tensor's rows at once (copied row by row up to 256 KB, else one index_select), where
  /// get() + collate() select and stack sample by sample.
  std::optional<Batch> get_batch(const std::vector<size_t>& indices) const override;
  const std::map<std::string, at::Tensor>& tensors() const { return tensors_; }

 private:
  std::map<std::string, at::Tensor> tensors_;
  size_t size_ = 0;
};

/// The samples of `dataset` at `indices`, in that order (`torch.utils.data.Subset`).
class Subset : public Dataset {
 public:
  Subset(DatasetPtr dataset, std::vector<size_t> indices);
  size_t size() const override { return indices_.size(); }
  Example get(size_t index) const override;
  std::optional<Batch> get_batch(const std::vector<size_t>& indices) const override;
  const std::vector<size_t>& indices() const { return indices_; }
  const DatasetPtr& dataset() const { return dataset_; }

 private:
  DatasetPtr dataset_;
  std::vector<size_t> indices_;
};

/// Splits `dataset` into non-overlapping subsets, as
/// `torch.utils.data.random_split(dataset, lengths,
/// generator=torch.Generator().manual_seed(seed))`, with the same indices.
/// `lengths` are sample counts summing to the dataset's size, or fractions
/// summing to 1 (the remainder of the rounded-down counts then goes one by one
/// to the first subsets, as PyTorch does).
std::vector<std::shared_ptr<Subset>> random_split(const DatasetPtr& dataset,
                                                  const std::vector<double>& lengths,
                                                  uint64_t seed);

/// {train, test}: `ceil(test_fraction * size)` samples for test (scikit-learn's
/// rounding), the rest for train, by `random_split(dataset, {n_train, n_test}, seed)`.
std::pair<std::shared_ptr<Subset>, std::shared_ptr<Subset>> train_test_split(
    const DatasetPtr& dataset, double test_fraction, uint64_t seed);

/// A token-id sequence cut into blocks of `block_size` tokens, the remainder
/// dropped (HF's `group_texts`). Sample i: {"input_ids": (block_size) int64,
/// "labels": (block_size) int64} with labels equal to input_ids (the model
/// shifts them).
class LanguageModelingDataset : public Dataset {
 public:
  LanguageModelingDataset(at::Tensor tokens, int64_t block_size);  // tokens: (N) integer
  LanguageModelingDataset(const std::vector<int64_t>& tokens, int64_t block_size);
  /// Reads `path` (load_text_file), encodes the whole text, cuts it into blocks.
  static std::shared_ptr<LanguageModelingDataset> from_text_file(const std::string& path,
                                                                 const EncodeFn& encode,
                                                                 int64_t block_size);
  size_t size() const override { return static_cast<size_t>(num_blocks_); }
  Example get(size_t index) const override;
  int64_t block_size() const { return block_size_; }

 private:
  at::Tensor tokens_;  // (N) int64
  int64_t block_size_;
  int64_t num_blocks_;
};

/// Texts with one class label each, read from a CSV or JSONL file. Sample i:
/// {"input_ids": (T_i) int64, at most max_length tokens, "labels": () int64}.
///
/// Labels are integers (class ids) or strings (class names, given ids in
/// first-seen order: `label_names()[id]`); the first row decides which, and
/// every other row must agree. With `num_labels`, ids must lie in
/// [0, num_labels) and there may be at most that many names.
///
/// ```
/// auto train = ClassificationDataset::from_csv("reviews.csv", "text", "sentiment",
///                                              tokenizer_encode, /*max_length=*/128);
/// train->label_names();  // {"pos", "neg"}: "pos" is 0
/// ```
class ClassificationDataset : public Dataset {
 public:
  /// A CSV file with a header row, RFC 4180 quoting ("a ""quoted"", field",
  /// newlines inside quotes), columns chosen by name.
  static std::shared_ptr<ClassificationDataset> from_csv(
      const std::string& path, const std::string& text_column, const std::string& label_column,
      const EncodeFn& encode, int64_t max_length, std::optional<int64_t> num_labels = std::nullopt);
  /// One JSON object per line (blank lines skipped), keys chosen by name.
  static std::shared_ptr<ClassificationDataset> from_jsonl(
      const std::string& path, const std::string& text_key, const std::string& label_key,
      const EncodeFn& encode, int64_t max_length, std::optional<int64_t> num_labels = std::nullopt);
  /// From token ids already made: each (T_i) int64, labels in [0, num_labels).
  ClassificationDataset(std::vector<at::Tensor> input_ids, std::vector<int64_t> labels,
                        std::vector<std::string> label_names, int64_t num_labels);

  size_t size() const override { return input_ids_.size(); }
  Example get(size_t index) const override;
  /// Class names by id when the labels were strings; empty when they were ints.
  const std::vector<std::string>& label_names() const { return label_names_; }
  /// The inverse of label_names().
  std::map<std::string, int64_t> label_to_id() const;
  /// num_labels when given, else the number of names, else the largest id + 1.
  int64_t num_labels() const { return num_labels_; }

 private:
  std::vector<at::Tensor> input_ids_;  // each (T_i) int64
  std::vector<int64_t> labels_;
  std::vector<std::string> label_names_;
  int64_t num_labels_ = 0;
};

/// The whole file as a string; an error when it is missing or empty.
std::string load_text_file(const std::string& path);

}  // namespace mixprec::data
