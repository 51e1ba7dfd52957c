// Fuzzes TrainingArguments from JSON text (types, unknown keys, validation).
#include "fuzz_util.h"
#include "mixprec/train/training_args.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mixprec::fuzz::expect_clear_error_or_success([&] {
    auto args = mixprec::train::TrainingArguments::from_json(
        std::string(mixprec::fuzz::as_text(data, size)));
    // What was accepted is written as training_args.json and read back the same.
    const std::string saved = args.to_json();
    if (mixprec::train::TrainingArguments::from_json(saved).to_json() != saved)
      mixprec::fuzz::finding("round trip", saved.c_str());
  });
  return 0;
}
