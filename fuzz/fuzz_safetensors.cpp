// Fuzzes the safetensors reader (header length, JSON header, offsets, dtypes,
// shapes) on whole files' bytes, through both paths: parse_safetensors on the
// bytes in memory and load_safetensors on a file, which reads each tensor
// straight from it. Both must load the same or refuse the same.
#include "fuzz_util.h"
#include "mixprec/io/safetensors.h"

#include <ATen/ATen.h>

#include <cstring>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes = mixprec::fuzz::as_text(data, size);
  bool parsed = false;
  mixprec::io::TensorMap tensors;
  std::map<std::string, std::string> metadata;
  mixprec::fuzz::expect_clear_error_or_success([&] {
    tensors = mixprec::io::parse_safetensors(bytes, "fuzz", &metadata);
    parsed = true;
    // What loaded must be usable: read every element.
    for (const auto& [name, t] : tensors)
      if (t.numel() > 0 && t.scalar_type() != at::kBool) (void)t.to(at::kDouble).sum().item();
  });

  const mixprec::fuzz::MemoryFile file(bytes);
  bool loaded = false;
  mixprec::fuzz::expect_clear_error_or_success([&] {
    std::map<std::string, std::string> file_metadata;
    const auto from_file = mixprec::io::load_safetensors(file.path(), &file_metadata);
    loaded = true;
    if (!parsed) mixprec::fuzz::finding("paths disagree", "only the file loaded");
    if (file_metadata != metadata || from_file.size() != tensors.size())
      mixprec::fuzz::finding("paths disagree", "metadata or tensor count");
    for (const auto& [name, t] : from_file) {
      const auto it = tensors.find(name);
      if (it == tensors.end() || t.scalar_type() != it->second.scalar_type() ||
          t.sizes() != it->second.sizes() ||  // bytes, not values: NaN != NaN
          (t.nbytes() > 0 && std::memcmp(t.data_ptr(), it->second.data_ptr(), t.nbytes()) != 0))
        mixprec::fuzz::finding("paths disagree", name.c_str());
    }
  });
  if (parsed && !loaded) mixprec::fuzz::finding("paths disagree", "only the bytes loaded");
  return 0;
}
