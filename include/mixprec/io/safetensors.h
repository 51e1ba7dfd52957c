#pragma once

#include <ATen/core/Tensor.h>

#include <filesystem>
#include <map>
#include <string>

namespace mixprec::io {

/// Reads every tensor of a safetensors file (https://github.com/huggingface/safetensors)
/// into CPU tensors, keyed by name.
///
/// ```
/// auto tensors = mixprec::io::load_safetensors("model.safetensors");
/// at::Tensor wte = tensors.at("transformer.wte.weight");  // (V, C)
/// ```
///
/// Dtypes: F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I64, I32, I16, I8, U64, U32, U16, U8, BOOL.
/// The file is validated as strictly as the Python `safetensors` package does: a file shorter
/// than 8 bytes, a header length past the end of the file or above 100 MB, malformed JSON, an
/// unknown dtype, data_offsets outside the data or not equal to shape * element size, and
/// tensors whose byte ranges overlap or leave gaps are all errors (c10::Error) that name the
/// file and the problem. Nothing is allocated before its size has been checked against the file.
std::map<std::string, at::Tensor> load_safetensors(const std::filesystem::path& path);

/// The `__metadata__` entry of a safetensors file (empty when absent).
std::map<std::string, std::string> load_safetensors_metadata(const std::filesystem::path& path);

/// Writes `tensors` (any device, any layout: they are copied to contiguous CPU memory) and the
/// string `metadata` as a safetensors file that Python's `safetensors.torch.load_file` reads.
/// The write is atomic: the bytes go to `path` + ".tmp", are fsync'ed, then renamed over `path`.
void save_safetensors(const std::filesystem::path& path,
                      const std::map<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace mixprec::io
