#include "mixprec/io/safetensors.h"

#include "io/file.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <torch/version.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <regex>
#include <set>

namespace mixprec::io {

namespace {

using json = nlohmann::json;

// A header this large is not a tensor index; refuse before reading it (the
// Rust reference implementation caps it at 100 MB too).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DType {
  const char* name;
  at::ScalarType type;
};
// In the order of the reference writer, which lays tensors out by this order, then by name, so
// that every tensor's data is aligned (the enum order of the Rust crate's Dtype, reversed).
constexpr DType kDTypes[] = {
    {"U64", at::kUInt64},
    {"I64", at::kLong},
    {"F64", at::kDouble},
    {"C64", at::kComplexFloat},
    {"F32", at::kFloat},
    {"U32", at::kUInt32},
    {"I32", at::kInt},
    {"BF16", at::kBFloat16},
    {"F16", at::kHalf},
    {"U16", at::kUInt16},
    {"I16", at::kShort},
    {"F8_E5M2FNUZ", at::kFloat8_e5m2fnuz},
    {"F8_E4M3FNUZ", at::kFloat8_e4m3fnuz},
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 7)
    {"F8_E8M0", at::kFloat8_e8m0fnu},
#endif
    {"F8_E4M3", at::kFloat8_e4m3fn},
    {"F8_E5M2", at::kFloat8_e5m2},
    {"I8", at::kChar},
    {"U8", at::kByte},
    {"BOOL", at::kBool},
};

at::ScalarType dtype_from_name(const std::string& name, const std::string& where) {
  for (const auto& d : kDTypes)
    if (name == d.name) return d.type;
  TORCH_CHECK(false, where, ": unsupported dtype '", name, "'");
}

// The position of `type` in kDTypes.
size_t dtype_rank(at::ScalarType type, const std::string& where) {
  for (size_t i = 0; i < std::size(kDTypes); ++i)
    if (type == kDTypes[i].type) return i;
  TORCH_CHECK(false, where, ": dtype ", type, " cannot be stored in safetensors");
}

}  // namespace

std::string read_file(const std::filesystem::path& path) {
  return detail::InputFile(path).contents();
}

void write_file_atomically(const std::filesystem::path& path, const std::string& contents) {
  const std::filesystem::path tmp = path.string() + ".tmp." + std::to_string(::getpid());
  {
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    TORCH_CHECK(fd >= 0, tmp.string(), ": cannot create: ", std::strerror(errno));
    size_t written = 0;
    while (written < contents.size()) {
      const ssize_t n = ::write(fd, contents.data() + written, contents.size() - written);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int err = errno;
        ::close(fd);
        std::filesystem::remove(tmp);
        TORCH_CHECK(false, tmp.string(), ": write failed: ", std::strerror(err));
      }
      written += static_cast<size_t>(n);
    }
    const int err = ::fsync(fd) == 0 ? 0 : errno;
    ::close(fd);
    if (err != 0) {
      std::filesystem::remove(tmp);
      TORCH_CHECK(false, tmp.string(), ": fsync failed: ", std::strerror(err));
    }
  }
  std::error_code renamed;
  std::filesystem::rename(tmp, path, renamed);
  if (renamed) {
    std::filesystem::remove(tmp);
    TORCH_CHECK(false, "cannot move ", tmp.string(), " to ", path.string(), ": ",
                renamed.message());
  }
  // The rename itself is durable once the folder is synced.
  detail::fsync_dir(path.has_parent_path() ? path.parent_path() : ".");
}

namespace {

// One tensor of a safetensors header: where its bytes lie in the data that follows the header.
struct Entry {
  std::string name;
  at::ScalarType type;
  std::vector<int64_t> shape;
  uint64_t begin, end;
};

// The header's length from a file's first bytes (`first` holds at least 8 of its `file_size`).
uint64_t header_length(std::string_view first, uint64_t file_size, const std::string& file) {
  TORCH_CHECK(file_size >= 8, file, ": too short for a safetensors file (", file_size,
              " bytes; the header length alone takes 8)");
  uint64_t header_size = 0;
  std::memcpy(&header_size, first.data(), 8);  // little-endian, as x86 and ARM store it
  TORCH_CHECK(header_size <= kMaxHeaderBytes && header_size <= file_size - 8, file,
              ": header length ", header_size, " runs past the end of the file (", file_size,
              " bytes)");
  return header_size;
}

// The tensors that the JSON `header` places in `data_size` bytes of data, checked: every claim
// against the data, and the tensors tiling it. Metadata goes into `metadata` if given.
std::vector<Entry> parse_header(std::string_view header_text, uint64_t data_size,
                                const std::string& file,
                                std::map<std::string, std::string>* metadata) {
  // Each name once: a JSON object may repeat one, and a parser keeps one of the two.
  std::set<std::string> names;
  const json::parser_callback_t reject_repeated_names = [&](int depth, json::parse_event_t event,
                                                            json& parsed) {
    if (depth == 1 && event == json::parse_event_t::key)
      TORCH_CHECK(names.insert(parsed.get<std::string>()).second, file, ": the header names '",
                  parsed.get<std::string>(), "' twice");
    return true;
  };
  json header;
  try {
    header = json::parse(header_text.begin(), header_text.end(), reject_repeated_names);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, file, ": malformed JSON header: ", e.what());
  }
  TORCH_CHECK(header.is_object(), file, ": the header is not a JSON object");
  std::vector<Entry> entries;
  for (const auto& [name, entry] : header.items()) {
    const std::string where = file + ": tensor '" + name + "'";
    if (name == "__metadata__") {
      if (entry.is_null()) continue;  // as the reference reader
      TORCH_CHECK(entry.is_object(), file, ": __metadata__ is not an object");
      for (const auto& [key, value] : entry.items()) {
        TORCH_CHECK(value.is_string(), file, ": __metadata__ '", key, "' is not a string");
        if (metadata) (*metadata)[key] = value.get<std::string>();
      }
      continue;
    }
    TORCH_CHECK(entry.is_object() && entry.contains("dtype") && entry.contains("shape") &&
                    entry.contains("data_offsets"),
                where, ": expected {dtype, shape, data_offsets}, got ", entry.dump());
    TORCH_CHECK(entry["dtype"].is_string(), where, ": dtype is not a string");
    const at::ScalarType type = dtype_from_name(entry["dtype"].get<std::string>(), where);
    const json& shape_json = entry["shape"];
    const json& offsets = entry["data_offsets"];
    TORCH_CHECK(shape_json.is_array(), where, ": shape is not a list");
    TORCH_CHECK(offsets.is_array() && offsets.size() == 2 && offsets[0].is_number_unsigned() &&
                    offsets[1].is_number_unsigned(),
                where, ": data_offsets must be two non-negative integers, got ", offsets.dump());
    std::vector<int64_t> shape;
    uint64_t numel = 1;
    for (const auto& d : shape_json) {
      TORCH_CHECK(d.is_number_unsigned(), where, ": shape ", shape_json.dump(),
                  " holds a non-integer or negative size");
      const uint64_t size = d.get<uint64_t>();
      // Checked against the data below; stop overflow before that.
      TORCH_CHECK(size == 0 || numel <= data_size / size, where, ": shape ", shape_json.dump(),
                  " needs more data than the file holds");
      TORCH_CHECK(size <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), where,
                  ": shape ", shape_json.dump(), " has a size above int64's range");
      numel *= size;
      shape.push_back(static_cast<int64_t>(size));
    }
    const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
    TORCH_CHECK(begin <= end && end <= data_size, where, ": data_offsets [", begin, ", ", end,
                "] lie outside the data (", data_size, " bytes)");
    const uint64_t expected = numel * c10::elementSize(type);
    TORCH_CHECK(end - begin == expected, where, ": data_offsets span ", end - begin,
                " bytes, but shape ", shape_json.dump(), " of ", entry["dtype"].get<std::string>(),
                " takes ", expected);
    entries.push_back({name, type, std::move(shape), begin, end});
  }
  // The tensors tile the data, without gaps or overlaps, as the reference reader requires; so
  // what is allocated below adds up to the file's size.
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return std::pair(a.begin, a.end) < std::pair(b.begin, b.end);
  });
  uint64_t covered = 0;
  for (const Entry& e : entries) {
    TORCH_CHECK(e.begin == covered, file, ": tensor '", e.name, "': data_offsets [", e.begin, ", ",
                e.end, "] ",
                e.begin < covered ? "overlap another tensor's data, which ends at byte "
                                  : "leave a gap after the data before it, which ends at byte ",
                covered);
    covered = e.end;
  }
  TORCH_CHECK(covered == data_size, file, ": the tensors' data ends at byte ", covered, " of ",
              data_size, "; the rest belongs to no tensor");

  return entries;
}

// The tensors of `entries`, each filled by read(out, bytes, offset in the data).
TensorMap make_tensors(std::vector<Entry>& entries,
                       const std::function<void(char*, uint64_t, uint64_t)>& read) {
  TensorMap tensors;
  for (Entry& e : entries) {
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.type));
    if (e.end > e.begin) read(static_cast<char*>(t.data_ptr()), e.end - e.begin, e.begin);
    tensors.emplace(std::move(e.name), std::move(t));
  }
  return tensors;
}

}  // namespace

TensorMap load_safetensors(const std::filesystem::path& path,
                           std::map<std::string, std::string>* metadata) {
  // Each tensor's bytes are read straight into it: no copy of the whole file is ever in memory.
  const std::string file = path.string();
  detail::InputFile in(path);
  if (!in.size()) return parse_safetensors(in.contents(), file, metadata);
  const uint64_t file_size = *in.size();
  char first[8] = {};
  if (file_size >= 8) in.read_at(first, 8, 0);
  const uint64_t header_size = header_length({first, 8}, file_size, file);
  std::string header(header_size, '\0');
  in.read_at(header.data(), header_size, 8);
  const uint64_t data_start = 8 + header_size;
  std::vector<Entry> entries = parse_header(header, file_size - data_start, file, metadata);
  return make_tensors(entries, [&](char* out, uint64_t size, uint64_t offset) {
    in.read_at(out, size, data_start + offset);
  });
}

TensorMap parse_safetensors(std::string_view bytes, const std::string& file,
                            std::map<std::string, std::string>* metadata) {
  const uint64_t header_size = header_length(bytes, bytes.size(), file);
  const uint64_t data_start = 8 + header_size;
  std::vector<Entry> entries =
      parse_header(bytes.substr(8, header_size), bytes.size() - data_start, file, metadata);
  return make_tensors(entries, [&](char* out, uint64_t size, uint64_t offset) {
    std::memcpy(out, bytes.data() + data_start + offset, size);
  });
}

int64_t parse_size(const std::string& size) {
  static const std::regex format(
      R"(\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([KMGTkmgt][Bb])\s*)");
  std::smatch m;
  // The length first: std::regex recurses once per character.
  TORCH_CHECK(size.size() <= 64 && std::regex_match(size, m, format), "size '", size,
              "': expected a number and a unit of KB, MB, GB or TB, as \"10GB\"");
  const std::map<char, double> units{{'K', 1e3}, {'M', 1e6}, {'G', 1e9}, {'T', 1e12}};
  // strtod, not stod: out of double's range is inf or 0 here, not std::out_of_range("stod").
  const double bytes = std::strtod(m[1].str().c_str(), nullptr) *
                       units.at(static_cast<char>(std::toupper(m[2].str()[0])));
  TORCH_CHECK(bytes < 9e18, "size '", size, "' is too large");
  return static_cast<int64_t>(bytes);  // truncated, as int() in Python
}

std::vector<std::string> save_sharded_safetensors(
    const std::filesystem::path& dir,
    const std::vector<std::pair<std::string, at::Tensor>>& tensors, int64_t max_shard_bytes) {
  std::vector<TensorMap> shards;
  TensorMap current;
  int64_t current_bytes = 0, total_bytes = 0;
  for (const auto& [name, tensor] : tensors) {
    const int64_t bytes = static_cast<int64_t>(tensor.nbytes());
    total_bytes += bytes;
    if (bytes > max_shard_bytes) {  // alone, ahead of the shard being filled
      shards.push_back({{name, tensor}});
      continue;
    }
    if (current_bytes + bytes > max_shard_bytes) {
      shards.push_back(std::move(current));
      current.clear();
      current_bytes = 0;
    }
    current[name] = tensor;
    current_bytes += bytes;
  }
  if (!current.empty()) shards.push_back(std::move(current));
  if (shards.empty()) shards.emplace_back();  // a model without tensors: an empty file
  const std::map<std::string, std::string> metadata{{"format", "pt"}};
  std::vector<std::string> written;
  for (size_t i = 0; i < shards.size(); ++i) {
    std::string name = "model.safetensors";
    if (shards.size() > 1) {
      char suffix[32];
      std::snprintf(suffix, sizeof suffix, "-%05zu-of-%05zu", i + 1, shards.size());
      name = std::string("model") + suffix + ".safetensors";
    }
    written.push_back(std::move(name));
  }
  // The long part first, under names no reader takes, so that a save that fails or is killed
  // half-way leaves the earlier model as it was.
  const std::string staged = ".staged-" + std::to_string(::getpid());
  json weight_map = json::object();
  try {
    for (size_t i = 0; i < shards.size(); ++i) {
      save_safetensors(dir / (written[i] + staged), shards[i], metadata);
      for (const auto& [tensor_name, t] : shards[i]) weight_map[tensor_name] = written[i];
    }
  } catch (...) {
    for (const auto& name : written) {
      std::error_code ignored;
      std::filesystem::remove(dir / (name + staged), ignored);
    }
    throw;
  }
  // Then the switch, in an order that leaves a whole model to read at every moment (a reader
  // takes model.safetensors before an index), but for the renames that replace as many shards
  // of the same names: an old index must not pair new shards with old ones, so it goes first.
  const auto index_file = dir / "model.safetensors.index.json";
  if (shards.size() > 1 && std::ranges::any_of(written, [&](const std::string& name) {
        return std::filesystem::exists(dir / name);
      }))
    std::filesystem::remove(index_file);
  for (const auto& name : written) std::filesystem::rename(dir / (name + staged), dir / name);
  detail::fsync_dir(dir);
  if (shards.size() > 1) {
    const json index{{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
    write_file_atomically(index_file, index.dump(2) + "\n");
    written.emplace_back("model.safetensors.index.json");
  }
  // What an earlier save left: its model files that this one did not write (an old
  // model.safetensors after the index above, which a reader would take first), and the staged
  // files of one that was killed.
  static const std::regex model_file(
      R"(model(-[0-9]{5}-of-[0-9]{5})?\.safetensors(\.index\.json)?(\.staged-[0-9]+)?(\.tmp\.[0-9]+)?)");
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && std::regex_match(name, model_file) &&
        std::ranges::find(written, name) == written.end())
      std::filesystem::remove(entry.path());
  }
  return written;
}

TensorMap load_sharded_safetensors(const std::filesystem::path& dir) {
  const auto single = dir / "model.safetensors", index_file = dir / "model.safetensors.index.json";
  if (std::filesystem::exists(single) || !std::filesystem::exists(index_file))
    return load_safetensors(single);  // its error names the file when neither is there
  return load_safetensors_index(index_file);
}

TensorMap load_safetensors_index(const std::filesystem::path& index_file) {
  const auto dir = index_file.parent_path();
  json index;
  try {
    index = json::parse(read_file(index_file));
  } catch (const json::exception& e) {
    TORCH_CHECK(false, index_file.string(), ": malformed JSON: ", e.what());
  }
  TORCH_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
              index_file.string(), ": expected an object with a \"weight_map\" object");
  std::map<std::string, TensorMap> shards;
  TensorMap tensors;
  for (const auto& [name, file] : index["weight_map"].items()) {
    TORCH_CHECK(file.is_string(), index_file.string(), ": the file of '", name,
                "' should be a string, got ", file.dump());
    const std::string shard = file.get<std::string>();
    const std::filesystem::path relative(shard);
    TORCH_CHECK(!shard.empty() && relative.is_relative() &&
                    std::ranges::none_of(relative,
                                         [](const auto& part) {
                                           return part == "." || part == ".." || part.empty();
                                         }),
                index_file.string(), ": shard '", shard, "' of '", name, "' is not a path inside ",
                dir.string());
    auto loaded = shards.find(shard);
    if (loaded == shards.end()) loaded = shards.emplace(shard, load_safetensors(dir / shard)).first;
    auto it = loaded->second.find(name);
    TORCH_CHECK(it != loaded->second.end(), index_file.string(), " places '", name, "' in ", shard,
                ", which does not hold it");
    tensors[name] = it->second;
  }
  return tensors;
}

void save_safetensors(const std::filesystem::path& path, const TensorMap& tensors,
                      const std::map<std::string, std::string>& metadata) {
  struct Entry {
    std::string name;
    size_t rank;
    at::Tensor data;
  };
  std::vector<Entry> entries;
  for (const auto& [name, tensor] : tensors) {
    const std::string where = path.string() + ": tensor '" + name + "'";
    TORCH_CHECK(tensor.defined(), where, " is undefined");
    entries.push_back(
        {name, dtype_rank(tensor.scalar_type(), where), tensor.detach().to(at::kCPU).contiguous()});
  }
  // As the reference writer: wider dtypes first, so every tensor's data stays aligned, then by
  // name; the header in that order, after the metadata. The same tensors give the same bytes.
  std::stable_sort(entries.begin(), entries.end(),
                   [](const Entry& a, const Entry& b) { return a.rank < b.rank; });
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& e : entries) {
    const uint64_t size = static_cast<uint64_t>(e.data.nbytes());
    header[e.name] = {{"dtype", kDTypes[e.rank].name},
                      {"shape", e.data.sizes().vec()},
                      {"data_offsets", {offset, offset + size}}};
    offset += size;
  }
  std::string text = header.dump();
  // Pad the header with spaces so the data starts 8-byte aligned, as the
  // reference writer does.
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t header_size = text.size();
  std::memcpy(out.data(), &header_size, 8);
  out += text;
  out.reserve(out.size() + offset);
  for (const auto& e : entries)
    out.append(static_cast<const char*>(e.data.data_ptr()), static_cast<size_t>(e.data.nbytes()));
  write_file_atomically(path, out);
}

}  // namespace mixprec::io
