// Fuzzes TrainingArguments from command-line words (HfArgumentParser's forms:
// --name value, --name=value, --no_name, dashes, lists, JSON maps). The input
// is the words separated by newlines.
#include "fuzz_util.h"
#include "mixprec/train/training_args.h"

#include <algorithm>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text = mixprec::fuzz::as_text(data, size);
  std::vector<std::string> words;
  for (size_t start = 0; start <= text.size();) {
    const size_t end = std::min(text.find('\n', start), text.size());
    words.emplace_back(text.substr(start, end - start));
    start = end + 1;
  }
  // --config (first) reads a file: the config readers have their own targets,
  // and a path such as /dev/zero would only hang.
  if (words[0] == "--config") return 0;
  mixprec::fuzz::expect_clear_error_or_success([&] {
    auto args = mixprec::train::TrainingArguments::parse_args(words);
    // What was accepted is written as training_args.json and read back the same.
    const std::string saved = args.to_json();
    if (mixprec::train::TrainingArguments::from_json(saved).to_json() != saved)
      mixprec::fuzz::finding("round trip", saved.c_str());
  });
  return 0;
}
