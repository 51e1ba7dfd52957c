// Fuzzes TrainingArguments from YAML text (--config run.yaml).
#include "fuzz_util.h"
#include "mixprec/train/training_args.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mixprec::fuzz::expect_clear_error_or_success([&] {
    auto args = mixprec::train::TrainingArguments::from_yaml(
        std::string(mixprec::fuzz::as_text(data, size)));
    const std::string saved = args.to_json();
    if (mixprec::train::TrainingArguments::from_json(saved).to_json() != saved)
      mixprec::fuzz::finding("round trip", saved.c_str());
  });
  return 0;
}
