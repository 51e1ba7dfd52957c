// Fuzzes the CSV and JSONL classification readers: the first byte picks the
// format, the rest is the file (columns/keys "text" and "label").
#include "fuzz_util.h"
#include "mixprec/data/dataset.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using mixprec::data::ClassificationDataset;
  if (size == 0) return 0;
  const bool csv = data[0] & 1;
  mixprec::fuzz::MemoryFile file(mixprec::fuzz::as_text(data + 1, size - 1));
  auto encode = [](std::string_view text) {
    return std::vector<int64_t>(text.begin(), text.end());
  };
  mixprec::fuzz::expect_clear_error_or_success([&] {
    auto dataset = csv ? ClassificationDataset::from_csv(file.path(), "text", "label", encode, 8)
                       : ClassificationDataset::from_jsonl(file.path(), "text", "label", encode, 8);
    for (size_t i = 0; i < dataset->size(); ++i) (void)dataset->get(i);
  });
  return 0;
}
