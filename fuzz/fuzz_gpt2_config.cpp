// Fuzzes the GPT-2 config.json reader.
#include "fuzz_util.h"
#include "mixprec/models/gpt2.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mixprec::fuzz::MemoryFile file(mixprec::fuzz::as_text(data, size));
  mixprec::fuzz::expect_clear_error_or_success(
      [&] { (void)mixprec::models::GPT2Config::from_json_file(file.path()); });
  return 0;
}
