#pragma once

#include <ATen/core/Tensor.h>

#include <filesystem>
#include <map>
#include <string>
#include <string_view>

namespace mixprec::io {

/// Tensors by name, in name order (safetensors stores them sorted).
using TensorMap = std::map<std::string, at::Tensor>;

/// Reads a .safetensors file (Hugging Face's format: an 8-byte little-endian
/// header length, a JSON header of {name: {dtype, shape, data_offsets}}, then
/// the raw data). Nothing in the file is executed. Every claim of the header
/// is checked against the file before anything is allocated; a bad file is an
/// error that names the file, the tensor and the problem.
TensorMap load_safetensors(const std::filesystem::path& path,
                           std::map<std::string, std::string>* metadata = nullptr);

/// load_safetensors on a file's bytes already in memory; `source` names them in errors.
TensorMap parse_safetensors(std::string_view bytes, const std::string& source,
                            std::map<std::string, std::string>* metadata = nullptr);

/// Writes `tensors` (contiguous copies of them, on the CPU) as .safetensors,
/// atomically: a temporary file beside `path`, fsync'd, then renamed over it.
/// Python's `safetensors.torch.load_file` reads the result.
void save_safetensors(const std::filesystem::path& path, const TensorMap& tensors,
                      const std::map<std::string, std::string>& metadata = {});

/// Writes `contents` to `path` atomically (temporary file, fsync, rename):
/// a reader sees the old file or the new one, never half of one.
void write_file_atomically(const std::filesystem::path& path, const std::string& contents);

/// Reads a whole file; an error names it when it cannot be read.
std::string read_file(const std::filesystem::path& path);

}  // namespace mixprec::io
