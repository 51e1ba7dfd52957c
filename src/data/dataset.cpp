#include "mixprec/data/dataset.h"

#include "mixprec/io/safetensors.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

namespace mixprec::data {

namespace {

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

bool is_blank(std::string_view text) {
  return text.find_first_not_of(" \t\r\n") == std::string_view::npos;
}

// One CSV record (RFC 4180) and the line it starts on.
struct CsvRecord {
  std::vector<std::string> fields;
  int line = 0;
};

// Fields separated by commas, records by \n or \r\n; a field in double quotes
// may hold commas, newlines and "" (one quote). Blank lines are skipped.
std::vector<CsvRecord> parse_csv(const std::string& path, const std::string& text) {
  std::vector<CsvRecord> records;
  size_t i = text.rfind("\xEF\xBB\xBF", 0) == 0 ? 3 : 0;  // a UTF-8 byte order mark
  const size_t n = text.size();
  int line = 1;
  auto at_newline = [&](size_t k) {
    return k < n && (text[k] == '\n' || (text[k] == '\r' && k + 1 < n && text[k + 1] == '\n'));
  };
  auto skip_newline = [&] {
    i += text[i] == '\r' ? 2 : 1;
    ++line;
  };
  while (i < n) {
    if (at_newline(i)) {  // a blank line
      skip_newline();
      continue;
    }
    CsvRecord record{{}, line};
    while (true) {
      std::string field;
      if (i < n && text[i] == '"') {
        const int quote_line = line;
        ++i;
        while (true) {
          TORCH_CHECK(i < n, path, ":", quote_line, ": unterminated quoted field");
          if (text[i] == '"') {
            if (i + 1 < n && text[i + 1] == '"') {
              field += '"';
              i += 2;
              continue;
            }
            ++i;
            break;
          }
          if (text[i] == '\n') ++line;
          field += text[i++];
        }
        TORCH_CHECK(i == n || text[i] == ',' || at_newline(i), path, ":", line,
                    ": expected a comma or the end of the line after a closing quote, got '",
                    text[i], "'");
      } else {
        while (i < n && text[i] != ',' && !at_newline(i)) field += text[i++];
      }
      record.fields.push_back(std::move(field));
      if (i < n && text[i] == ',') {
        ++i;
        continue;
      }
      if (i < n) skip_newline();
      break;
    }
    records.push_back(std::move(record));
  }
  return records;
}

// A CSV file's records, the header first; an error when there is nothing.
std::vector<CsvRecord> read_csv(const std::string& path) {
  const std::string text = io::read_file(path);
  TORCH_CHECK(!is_blank(text), path, ": empty file");
  auto records = parse_csv(path, text);
  TORCH_CHECK(!records.empty(), path, ": empty file");
  return records;
}

// Where `name` stands in the header, or an error listing the columns there are.
size_t column_index(const std::string& path, const std::vector<std::string>& header,
                    const std::string& name) {
  const auto it = std::find(header.begin(), header.end(), name);
  TORCH_CHECK(it != header.end(), path, ": no column '", name,
              "' in the header; columns found: ", join(header));
  return static_cast<size_t>(it - header.begin());
}

// A label as read: a JSON integer or string, or CSV text (either).
struct RawRow {
  enum class Kind { kInt, kString, kText };
  std::string text;
  Kind kind = Kind::kText;
  std::string label;  // as written (JSON strings unquoted)
  int line = 0;
};

std::optional<int64_t> parse_int(std::string_view s) {
  while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
  while (!s.empty() && s.back() == ' ') s.remove_suffix(1);
  if (!s.empty() && s.front() == '+') s.remove_prefix(1);
  int64_t value = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return value;
}

constexpr int64_t kMaxClassId = std::numeric_limits<int32_t>::max();

std::shared_ptr<ClassificationDataset> from_rows(const std::string& path,
                                                 const std::vector<RawRow>& rows,
                                                 const std::string& label_field,
                                                 const EncodeFn& encode, int64_t max_length,
                                                 std::optional<int64_t> num_labels) {
  TORCH_CHECK(!rows.empty(), path, ": no data rows");
  TORCH_CHECK(encode, "ClassificationDataset: no encode function given");
  TORCH_CHECK(max_length > 0, "ClassificationDataset: invalid max_length ", max_length,
              " (expected > 0)");
  TORCH_CHECK(!num_labels || *num_labels > 0, "ClassificationDataset: invalid num_labels ",
              *num_labels, " (expected > 0)");
  using Kind = RawRow::Kind;
  const RawRow& first = rows.front();
  // The first row decides: integer class ids, or class names.
  const bool ints =
      first.kind == Kind::kInt || (first.kind == Kind::kText && parse_int(first.label));
  std::vector<at::Tensor> input_ids;
  std::vector<int64_t> labels;
  std::vector<std::string> names;
  std::map<std::string, int64_t> ids;
  int64_t max_id = -1;
  for (const auto& row : rows) {
    const std::string where = path + ":" + std::to_string(row.line) + ": " + label_field + ": ";
    const std::string shown = row.kind == Kind::kString ? "\"" + row.label + "\"" : row.label;
    int64_t id = 0;
    if (ints) {
      auto value = row.kind == Kind::kString ? std::nullopt : parse_int(row.label);
      TORCH_CHECK(value, where, "expected an integer class id (as on line ", first.line, "), got ",
                  shown);
      id = *value;
      TORCH_CHECK(id >= 0, where, "class id ", id, " is out of range (expected >= 0)");
      // The class count comes from the largest id: keep it a sane size.
      TORCH_CHECK(num_labels || id < kMaxClassId, where, "class id ", id,
                  " is out of range (expected < ", kMaxClassId, "; or pass num_labels)");
      TORCH_CHECK(!num_labels || id < *num_labels, where, "class id ", id, " is out of range [0, ",
                  *num_labels, ")");
    } else {
      TORCH_CHECK(row.kind != Kind::kInt, where, "expected a string class name (as on line ",
                  first.line, "), got ", shown);
      auto [it, inserted] = ids.emplace(row.label, static_cast<int64_t>(names.size()));
      if (inserted) names.push_back(row.label);
      id = it->second;
      TORCH_CHECK(!num_labels || id < *num_labels, where, "class name ", shown, " is class #",
                  id + 1, " but num_labels is ", *num_labels);
    }
    max_id = std::max(max_id, id);
    auto tokens = encode(row.text);
    if (static_cast<int64_t>(tokens.size()) > max_length) tokens.resize(max_length);
    input_ids.push_back(at::tensor(at::ArrayRef<int64_t>(tokens), at::kLong));
    labels.push_back(id);
  }
  const int64_t n = num_labels ? *num_labels : ints ? max_id + 1 : names.size();
  return std::make_shared<ClassificationDataset>(std::move(input_ids), std::move(labels),
                                                 std::move(names), n);
}

}  // namespace

TensorDataset::TensorDataset(std::map<std::string, at::Tensor> tensors)
    : tensors_(std::move(tensors)) {
  TORCH_CHECK(!tensors_.empty(), "TensorDataset: no tensors given");
  const auto& [first_name, first] = *tensors_.begin();
  for (const auto& [name, t] : tensors_) {
    TORCH_CHECK(t.defined() && t.dim() >= 1, "TensorDataset: tensor '", name,
                "' must have at least one dimension (samples on dim 0)");
    TORCH_CHECK(t.size(0) == first.size(0), "TensorDataset: tensor '", name, "' has ", t.size(0),
                " samples but '", first_name, "' has ", first.size(0),
                " (all must agree on dim 0)");
  }
  size_ = static_cast<size_t>(first.size(0));
}

Example TensorDataset::get(size_t index) const {
  TORCH_CHECK(index < size_, "TensorDataset: index ", index, " out of range for size ", size_);
  Example example;
  for (const auto& [name, t] : tensors_) example[name] = t.select(0, static_cast<int64_t>(index));
  return example;
}

// The largest batch (of one tensor) TensorDataset::get_batch copies row by row, on one thread:
// about a core's L2, where index_select's dispatch and index tensor cost more than the copy;
// larger gathers take index_select, which splits them across threads.
constexpr size_t kRowCopyBytes = size_t{256} << 10;

std::optional<Batch> TensorDataset::get_batch(const std::vector<size_t>& indices) const {
  for (size_t i : indices)
    TORCH_CHECK(i < size_, "TensorDataset: index ", i, " out of range for size ", size_);
  Batch batch;
  at::Tensor index;  // for index_select, made once
  for (const auto& [name, t] : tensors_) {
    // Inside the digits MLP's Trainer step, its 16 KB batch took 9-10 us row by row against
    // 12-20 us by index_select.
    const size_t row_bytes =
        c10::multiply_integers(t.sizes().begin() + 1, t.sizes().end()) * t.element_size();
    if (t.is_cpu() && t.layout() == at::kStrided && t.is_contiguous() && !t.requires_grad() &&
        !t.is_conj() && !t.is_neg() && !t.is_quantized() && !t._is_zerotensor() && row_bytes > 0 &&
        indices.size() <= kRowCopyBytes / row_bytes) {
      auto sizes = t.sizes().vec();
      sizes[0] = static_cast<int64_t>(indices.size());
      at::Tensor rows = at::empty(sizes, t.options());
      const auto* from = static_cast<const char*>(t.const_data_ptr());
      auto* to = static_cast<char*>(rows.mutable_data_ptr());
      for (size_t k = 0; k < indices.size(); ++k)
        std::memcpy(to + k * row_bytes, from + indices[k] * row_bytes, row_bytes);
      batch[name] = std::move(rows);
      continue;
    }
    if (!index.defined())
      index = at::tensor(std::vector<int64_t>(indices.begin(), indices.end()), at::kLong);
    batch[name] = t.index_select(0, index.to(t.device()));
  }
  return batch;
}

Subset::Subset(DatasetPtr dataset, std::vector<size_t> indices)
    : dataset_(std::move(dataset)), indices_(std::move(indices)) {
  TORCH_CHECK(dataset_, "Subset: no dataset given");
  const size_t n = dataset_->size();
  for (size_t i : indices_)
    TORCH_CHECK(i < n, "Subset: index ", i, " out of range for a dataset of size ", n);
}

Example Subset::get(size_t index) const {
  TORCH_CHECK(index < indices_.size(), "Subset: index ", index, " out of range for size ",
              indices_.size());
  return dataset_->get(indices_[index]);
}

std::optional<Batch> Subset::get_batch(const std::vector<size_t>& indices) const {
  std::vector<size_t> mapped;
  mapped.reserve(indices.size());
  for (size_t i : indices) {
    TORCH_CHECK(i < indices_.size(), "Subset: index ", i, " out of range for size ",
                indices_.size());
    mapped.push_back(indices_[i]);
  }
  return dataset_->get_batch(mapped);
}

std::vector<std::shared_ptr<Subset>> random_split(const DatasetPtr& dataset,
                                                  const std::vector<double>& lengths,
                                                  uint64_t seed) {
  TORCH_CHECK(dataset, "random_split: no dataset given");
  TORCH_CHECK(!lengths.empty(), "random_split: no lengths given");
  const size_t n = dataset->size();
  const double total = std::accumulate(lengths.begin(), lengths.end(), 0.0);
  std::vector<size_t> counts;
  // PyTorch's rule: lengths summing to 1 (within isclose's 1e-9) are fractions.
  if (std::abs(total - 1.0) <= 1e-9 && total <= 1.0) {
    for (double fraction : lengths) {
      TORCH_CHECK(fraction >= 0 && fraction <= 1, "random_split: fraction ", fraction,
                  " is not between 0 and 1");
      counts.push_back(static_cast<size_t>(std::floor(static_cast<double>(n) * fraction)));
    }
    const size_t remainder = n - std::accumulate(counts.begin(), counts.end(), size_t{0});
    for (size_t i = 0; i < remainder; ++i) ++counts[i % counts.size()];
  } else {
    for (double length : lengths) {
      TORCH_CHECK(length >= 0 && std::floor(length) == length, "random_split: length ", length,
                  " is not a whole number of samples (or fractions summing to 1)");
      counts.push_back(static_cast<size_t>(length));
    }
    TORCH_CHECK(std::accumulate(counts.begin(), counts.end(), size_t{0}) == n,
                "random_split: sum of input lengths (", total,
                ") does not equal the length of the input dataset (", n, ")");
  }
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto perm = at::randperm(static_cast<int64_t>(n), generator, at::kLong);
  const int64_t* p = perm.data_ptr<int64_t>();
  std::vector<std::shared_ptr<Subset>> subsets;
  size_t offset = 0;
  for (size_t count : counts) {
    subsets.push_back(
        std::make_shared<Subset>(dataset, std::vector<size_t>(p + offset, p + offset + count)));
    offset += count;
  }
  return subsets;
}

std::pair<std::shared_ptr<Subset>, std::shared_ptr<Subset>> train_test_split(
    const DatasetPtr& dataset, double test_fraction, uint64_t seed) {
  TORCH_CHECK(dataset, "train_test_split: no dataset given");
  TORCH_CHECK(test_fraction > 0 && test_fraction < 1, "train_test_split: invalid test_fraction ",
              test_fraction, " (expected between 0 and 1)");
  const size_t n = dataset->size();
  const auto n_test = static_cast<size_t>(std::ceil(test_fraction * static_cast<double>(n)));
  TORCH_CHECK(n_test < n, "train_test_split: test_fraction ", test_fraction, " of ", n,
              " samples leaves none for training");
  auto parts =
      random_split(dataset, {static_cast<double>(n - n_test), static_cast<double>(n_test)}, seed);
  return {parts[0], parts[1]};
}

LanguageModelingDataset::LanguageModelingDataset(at::Tensor tokens, int64_t block_size)
    : block_size_(block_size) {
  TORCH_CHECK(block_size > 0, "LanguageModelingDataset: invalid block_size ", block_size,
              " (expected > 0)");
  TORCH_CHECK(tokens.defined() && tokens.dim() == 1 &&
                  at::isIntegralType(tokens.scalar_type(), /*includeBool=*/false),
              "LanguageModelingDataset: expected a 1-D integer tensor of token ids, got ",
              tokens.defined() ? tokens.toString() : "an undefined tensor", " of shape ",
              tokens.defined() ? tokens.sizes() : at::IntArrayRef{});
  tokens_ = tokens.to(at::kLong).contiguous();
  num_blocks_ = tokens_.size(0) / block_size;
  TORCH_CHECK(num_blocks_ > 0, "LanguageModelingDataset: ", tokens_.size(0),
              " tokens are fewer than one block of block_size ", block_size);
}

LanguageModelingDataset::LanguageModelingDataset(const std::vector<int64_t>& tokens,
                                                 int64_t block_size)
    : LanguageModelingDataset(at::tensor(at::ArrayRef<int64_t>(tokens), at::kLong), block_size) {}

std::shared_ptr<LanguageModelingDataset> LanguageModelingDataset::from_text_file(
    const std::string& path, const EncodeFn& encode, int64_t block_size) {
  TORCH_CHECK(encode, "LanguageModelingDataset: no encode function given");
  return std::make_shared<LanguageModelingDataset>(encode(load_text_file(path)), block_size);
}

Example LanguageModelingDataset::get(size_t index) const {
  TORCH_CHECK(static_cast<int64_t>(index) < num_blocks_, "LanguageModelingDataset: index ", index,
              " out of range for size ", num_blocks_);
  const int64_t start = static_cast<int64_t>(index) * block_size_;
  auto block = tokens_.slice(0, start, start + block_size_);  // (block_size)
  return {{"input_ids", block.clone()}, {"labels", block.clone()}};
}

ClassificationDataset::ClassificationDataset(std::vector<at::Tensor> input_ids,
                                             std::vector<int64_t> labels,
                                             std::vector<std::string> label_names,
                                             int64_t num_labels)
    : input_ids_(std::move(input_ids)),
      labels_(std::move(labels)),
      label_names_(std::move(label_names)),
      num_labels_(num_labels) {
  TORCH_CHECK(input_ids_.size() == labels_.size(), "ClassificationDataset: ", input_ids_.size(),
              " texts but ", labels_.size(), " labels");
  for (int64_t label : labels_)
    TORCH_CHECK(label >= 0 && label < num_labels_, "ClassificationDataset: label ", label,
                " out of range [0, ", num_labels_, ")");
}

std::shared_ptr<TensorDataset> TensorDataset::from_csv(const std::string& path,
                                                       const std::string& label_column) {
  const auto records = read_csv(path);
  const auto& header = records.front().fields;
  const size_t label_index = column_index(path, header, label_column);
  TORCH_CHECK(records.size() > 1, path, ": no data rows");
  TORCH_CHECK(header.size() > 1, path, ": no feature columns besides '", label_column, "'");
  std::vector<float> features;
  std::vector<int64_t> labels;
  for (size_t r = 1; r < records.size(); ++r) {
    const auto& record = records[r];
    TORCH_CHECK(record.fields.size() == header.size(), path, ":", record.line, ": expected ",
                header.size(), " columns (as in the header), got ", record.fields.size());
    for (size_t c = 0; c < header.size(); ++c) {
      const std::string& cell = record.fields[c];
      double value = 0;
      const auto [end, error] = std::from_chars(cell.data(), cell.data() + cell.size(), value);
      const bool ok = error == std::errc() && end == cell.data() + cell.size() && !cell.empty();
      TORCH_CHECK(ok && std::isfinite(value), path, ":", record.line, ": column '", header[c],
                  "': expected a number, got '", cell, "'");
      if (c != label_index) {
        features.push_back(static_cast<float>(value));
      } else {
        TORCH_CHECK(value >= 0 && value == std::floor(value) && value < 1e15, path, ":",
                    record.line, ": column '", header[c],
                    "': expected a class id (0, 1, ...), got '", cell, "'");
        labels.push_back(static_cast<int64_t>(value));
      }
    }
  }
  const auto n = static_cast<int64_t>(labels.size());
  return std::make_shared<TensorDataset>(std::map<std::string, at::Tensor>{
      {"inputs", at::tensor(features).reshape({n, -1})}, {"labels", at::tensor(labels)}});
}

std::shared_ptr<ClassificationDataset> ClassificationDataset::from_csv(
    const std::string& path, const std::string& text_column, const std::string& label_column,
    const EncodeFn& encode, int64_t max_length, std::optional<int64_t> num_labels) {
  const auto records = read_csv(path);
  const auto& header = records.front().fields;
  const size_t text_index = column_index(path, header, text_column);
  const size_t label_index = column_index(path, header, label_column);
  std::vector<RawRow> rows;
  for (size_t r = 1; r < records.size(); ++r) {
    const auto& record = records[r];
    TORCH_CHECK(record.fields.size() == header.size(), path, ":", record.line, ": expected ",
                header.size(), " columns (as in the header), got ", record.fields.size());
    rows.push_back(
        {record.fields[text_index], RawRow::Kind::kText, record.fields[label_index], record.line});
  }
  return from_rows(path, rows, "label column '" + label_column + "'", encode, max_length,
                   num_labels);
}

std::shared_ptr<ClassificationDataset> ClassificationDataset::from_jsonl(
    const std::string& path, const std::string& text_key, const std::string& label_key,
    const EncodeFn& encode, int64_t max_length, std::optional<int64_t> num_labels) {
  const std::string text = io::read_file(path);
  TORCH_CHECK(!is_blank(text), path, ": empty file");
  std::istringstream lines(text);
  std::string line;
  std::vector<RawRow> rows;
  for (int lineno = 1; std::getline(lines, line); ++lineno) {
    if (is_blank(line)) continue;
    const std::string where = path + ":" + std::to_string(lineno) + ": ";
    nlohmann::json object;
    try {
      object = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      TORCH_CHECK(false, where, "malformed JSON (", e.what(), ")");
    }
    TORCH_CHECK(object.is_object(), where, "expected a JSON object, got ", object.type_name());
    auto get = [&](const std::string& key) -> const nlohmann::json& {
      if (!object.contains(key)) {
        std::vector<std::string> keys;
        for (const auto& item : object.items()) keys.push_back(item.key());
        TORCH_CHECK(false, where, "no key '", key, "'; keys found: ", join(keys));
      }
      return object.at(key);
    };
    const auto& text_value = get(text_key);
    TORCH_CHECK(text_value.is_string(), where, "key '", text_key, "' must be a string, got ",
                text_value.dump());
    const auto& label = get(label_key);
    RawRow row{text_value.get<std::string>(), RawRow::Kind::kInt, "", lineno};
    if (label.is_number_integer()) {
      row.label = label.dump();
    } else if (label.is_string()) {
      row.kind = RawRow::Kind::kString;
      row.label = label.get<std::string>();
    } else {
      TORCH_CHECK(false, where, "label key '", label_key,
                  "' must be an integer class id or a string class name, got ", label.dump());
    }
    rows.push_back(std::move(row));
  }
  return from_rows(path, rows, "label key '" + label_key + "'", encode, max_length, num_labels);
}

Example ClassificationDataset::get(size_t index) const {
  TORCH_CHECK(index < input_ids_.size(), "ClassificationDataset: index ", index,
              " out of range for size ", input_ids_.size());
  return {{"input_ids", input_ids_[index]},
          {"labels", at::scalar_tensor(labels_[index], at::kLong)}};
}

std::map<std::string, int64_t> ClassificationDataset::label_to_id() const {
  std::map<std::string, int64_t> ids;
  for (size_t i = 0; i < label_names_.size(); ++i) ids[label_names_[i]] = static_cast<int64_t>(i);
  return ids;
}

std::string load_text_file(const std::string& path) {
  std::string text = io::read_file(path);
  TORCH_CHECK(!text.empty(), path, ": empty file");
  return text;
}

}  // namespace mixprec::data
