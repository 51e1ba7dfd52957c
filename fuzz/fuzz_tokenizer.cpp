// Fuzzes the tokenizer.json reader (byte-level BPE); a tokenizer that loads
// must encode text and decode its own ids without an error.
#include "fuzz_util.h"
#include "mixprec/data/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using mixprec::data::BPETokenizer;
  std::optional<BPETokenizer> tokenizer;
  mixprec::fuzz::expect_clear_error_or_success(
      [&] { tokenizer = BPETokenizer::from_json(mixprec::fuzz::as_text(data, size), "fuzz"); });
  if (!tokenizer) return 0;
  const std::string text = "Hello world, it's 2024!  \xC3\xA9t\xC3\xA9 <|endoftext|> \xFF\n";
  try {
    (void)tokenizer->decode(tokenizer->encode(text));
  } catch (const std::exception& e) {
    mixprec::fuzz::finding("an error encoding/decoding with a tokenizer that loaded", e.what());
  }
  return 0;
}
