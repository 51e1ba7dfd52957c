#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

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

/// huggingface_hub's parse_size_to_int: "10GB", "500MB", "0.5KB" as bytes (units of 1000:
/// KB, MB, GB, TB). Anything else is an error that names it.
int64_t parse_size(const std::string& size);

/// Writes `tensors` into `dir` as Hugging Face's save_pretrained does (huggingface_hub's
/// split_torch_state_dict_into_shards, then safetensors): all in `model.safetensors` when
/// they fit in `max_shard_bytes`; else shards filled in order, a new one started when the
/// next tensor would not fit and a tensor larger than the limit alone in one, named
/// `model-00001-of-00003.safetensors`, ..., beside the index `model.safetensors.index.json`
/// ({"metadata": {"total_size": bytes}, "weight_map": {name: file}}). The files are written
/// under other names first and then renamed into place, the index last, so that a save that
/// fails or is killed leaves the earlier model whole (but for the moment of the renames when
/// as many shards of the same names replace it); then the model files an earlier save left
/// that this one did not write are removed. Returns the names of the files written.
std::vector<std::string> save_sharded_safetensors(
    const std::filesystem::path& dir,
    const std::vector<std::pair<std::string, at::Tensor>>& tensors, int64_t max_shard_bytes);

/// Reads what save_sharded_safetensors (or HF's save_pretrained) wrote in `dir`:
/// `model.safetensors`, else the shards that `model.safetensors.index.json` lists. A shard
/// missing, or a tensor the index places in a shard that lacks it, is an error that names both.
TensorMap load_sharded_safetensors(const std::filesystem::path& dir);
/// The shards that a `*.safetensors.index.json` lists, beside it (paths inside its folder).
TensorMap load_safetensors_index(const std::filesystem::path& index_file);

/// Writes `contents` to `path` atomically (temporary file, fsync, rename):
/// a reader sees the old file or the new one, never half of one.
void write_file_atomically(const std::filesystem::path& path, const std::string& contents);

/// Reads a whole file; an error names it when it cannot be read.
std::string read_file(const std::filesystem::path& path);

}  // namespace mixprec::io
