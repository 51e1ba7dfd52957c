// Fuzzes the safetensors reader (header length, JSON header, offsets, dtypes,
// shapes) on whole files' bytes.
#include "fuzz_util.h"
#include "mixprec/io/safetensors.h"

#include <ATen/ATen.h>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mixprec::fuzz::expect_clear_error_or_success([&] {
    std::map<std::string, std::string> metadata;
    const auto tensors =
        mixprec::io::parse_safetensors(mixprec::fuzz::as_text(data, size), "fuzz", &metadata);
    // What loaded must be usable: read every element.
    for (const auto& [name, t] : tensors)
      if (t.numel() > 0 && t.scalar_type() != at::kBool) (void)t.to(at::kDouble).sum().item();
  });
  return 0;
}
