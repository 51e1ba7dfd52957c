#pragma once

#include "mixprec/data/dataset.h"

#include <cstdint>
#include <functional>
#include <vector>

namespace mixprec::data {

/// Examples -> one Batch.
using CollateFn = std::function<Batch(const std::vector<Example>&)>;

/// Options of `collate`. The pad ids are HF's DataCollatorWithPadding defaults
/// (a tokenizer's pad id is often 0) and PyTorch's cross-entropy ignore_index.
struct CollateOptions {
  int64_t pad_token_id = 0;           // every padded key but "labels"
  int64_t label_pad_token_id = -100;  // "labels" sequences
};

/// The default collate function: stacks the tensors of each key along a new
/// first dimension (every example must have the same keys). Tensors of one key
/// whose shapes differ must be 1-D integer sequences; they are padded on the
/// right to the longest in the batch. When "input_ids" were padded and the
/// examples have no "attention_mask", one is added: (B, T) int64, 1 on real
/// tokens, 0 on padding.
///
/// ```
/// collate({{{"input_ids", ids_of_3}, {"labels", at::tensor(1)}},
///          {{"input_ids", ids_of_5}, {"labels", at::tensor(0)}}});
/// // {"input_ids": (2, 5), "attention_mask": (2, 5), "labels": (2)}
/// ```
Batch collate(const std::vector<Example>& examples, const CollateOptions& options = {});

}  // namespace mixprec::data
