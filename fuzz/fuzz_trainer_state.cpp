// Fuzzes TrainerState from trainer_state.json; what loads must save and load
// back to the same text.
#include "fuzz_util.h"
#include "mixprec/train/callbacks.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using mixprec::train::TrainerState;
  mixprec::fuzz::expect_clear_error_or_success([&] {
    const auto state =
        TrainerState::from_json(std::string(mixprec::fuzz::as_text(data, size)), "fuzz");
    const std::string saved = state.to_json();
    if (TrainerState::from_json(saved, "saved").to_json() != saved)
      mixprec::fuzz::finding("round trip", saved.c_str());
  });
  return 0;
}
