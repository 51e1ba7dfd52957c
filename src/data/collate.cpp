#include "mixprec/data/collate.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace mixprec::data {

namespace {

// Pads 1-D integer sequences on the right to the longest: (B, T_max).
at::Tensor pad_sequences(const std::vector<at::Tensor>& sequences, int64_t pad) {
  int64_t longest = 0;
  for (const auto& s : sequences) longest = std::max(longest, s.size(0));
  auto out =
      at::full({static_cast<int64_t>(sequences.size()), longest}, pad, sequences.front().options());
  for (size_t b = 0; b < sequences.size(); ++b)
    out[static_cast<int64_t>(b)].narrow(0, 0, sequences[b].size(0)).copy_(sequences[b]);
  return out;
}

}  // namespace

Batch collate(const std::vector<Example>& examples, const CollateOptions& options) {
  TORCH_CHECK(!examples.empty(), "collate: no examples given");
  const Example& first = examples.front();
  Batch batch;
  bool padded_input_ids = false;
  for (const auto& [key, first_value] : first) {
    std::vector<at::Tensor> values;
    values.reserve(examples.size());
    size_t differs = 0;  // the first example whose shape differs from example 0's
    for (size_t i = 0; i < examples.size(); ++i) {
      auto it = examples[i].find(key);
      TORCH_CHECK(it != examples[i].end(), "collate: example ", i, " has no key '", key,
                  "' (example 0 has it)");
      TORCH_CHECK(it->second.defined(), "collate: example ", i, " key '", key,
                  "' is an undefined tensor");
      if (differs == 0 && it->second.sizes() != first_value.sizes()) differs = i;
      values.push_back(it->second);
    }
    if (differs == 0) {
      batch[key] = at::stack(values);  // (B, ...)
      continue;
    }
    for (const auto& v : values) {
      TORCH_CHECK(v.dim() == 1 && at::isIntegralType(v.scalar_type(), /*includeBool=*/false),
                  "collate: key '", key, "' has shape ", first_value.sizes(), " in example 0 but ",
                  values[differs].sizes(), " in example ", differs,
                  "; only 1-D integer sequences can be padded (got ", v.dim(), "-D ",
                  v.scalar_type(), ")");
    }
    const int64_t pad = key == "labels" ? options.label_pad_token_id : options.pad_token_id;
    batch[key] = pad_sequences(values, pad);  // (B, T)
    padded_input_ids = padded_input_ids || key == "input_ids";
  }
  for (size_t i = 1; i < examples.size(); ++i) {
    TORCH_CHECK(examples[i].size() == first.size(), "collate: example ", i, " has ",
                examples[i].size(), " keys but example 0 has ", first.size());
  }
  if (padded_input_ids && !batch.count("attention_mask")) {
    std::vector<at::Tensor> masks;
    for (const auto& example : examples)
      masks.push_back(at::ones({example.at("input_ids").size(0)}, at::kLong));
    batch["attention_mask"] = pad_sequences(masks, 0);  // (B, T)
  }
  return batch;
}

}  // namespace mixprec::data
