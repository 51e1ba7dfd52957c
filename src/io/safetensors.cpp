#include "mixprec/io/safetensors.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <system_error>
#include <vector>

namespace mixprec::io {

namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors stores little-endian data; this reader copies bytes as they are");

using nlohmann::json;

// The Python package refuses headers above 100 MB; so do we, before allocating one.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DtypeName {
  const char* name;
  at::ScalarType type;
};

constexpr DtypeName kDtypes[] = {
    {"F64", at::kDouble},
    {"F32", at::kFloat},
    {"F16", at::kHalf},
    {"BF16", at::kBFloat16},
    {"F8_E4M3", at::kFloat8_e4m3fn},
    {"F8_E5M2", at::kFloat8_e5m2},
    {"I64", at::kLong},
    {"I32", at::kInt},
    {"I16", at::kShort},
    {"I8", at::kChar},
    {"U64", at::kUInt64},
    {"U32", at::kUInt32},
    {"U16", at::kUInt16},
    {"U8", at::kByte},
    {"BOOL", at::kBool},
};

std::optional<at::ScalarType> dtype_from_name(const std::string& name) {
  for (const auto& d : kDtypes)
    if (name == d.name) return d.type;
  return std::nullopt;
}

const char* name_from_dtype(at::ScalarType type) {
  for (const auto& d : kDtypes)
    if (type == d.type) return d.name;
  return nullptr;
}

std::string where(const std::filesystem::path& path) {
  return "safetensors file '" + path.string() + "': ";
}

// One tensor entry of the header, validated.
struct Entry {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin;
  uint64_t end;
};

struct Header {
  uint64_t data_start = 0;  // byte offset of the data section in the file
  std::vector<Entry> entries;
  std::map<std::string, std::string> metadata;
};

Header read_header(const std::filesystem::path& path, std::ifstream& file) {
  const std::string at = where(path);
  std::error_code ec;
  const uint64_t file_size = std::filesystem::file_size(path, ec);
  TORCH_CHECK(!ec, at, "cannot read its size: ", ec.message());
  TORCH_CHECK(file_size >= 8, at, "file is ", file_size,
              " bytes, shorter than the 8-byte header length");

  unsigned char len_bytes[8];
  file.read(reinterpret_cast<char*>(len_bytes), 8);
  TORCH_CHECK(file, at, "cannot read the 8-byte header length");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  TORCH_CHECK(header_len <= kMaxHeaderBytes, at, "header length ", header_len,
              " is larger than the limit of ", kMaxHeaderBytes, " bytes");
  TORCH_CHECK(header_len <= file_size - 8, at, "header length ", header_len,
              " runs past the end of the file (", file_size, " bytes)");

  std::string text(header_len, '\0');
  file.read(text.data(), static_cast<std::streamsize>(header_len));
  TORCH_CHECK(file, at, "cannot read the ", header_len, "-byte header");
  json header;
  try {
    header = json::parse(text);
  } catch (const json::parse_error& e) {
    TORCH_CHECK(false, at, "header is not valid JSON: ", e.what());
  }
  TORCH_CHECK(header.is_object(), at, "header is not a JSON object but ", header.type_name());

  Header out;
  out.data_start = 8 + header_len;
  const uint64_t data_size = file_size - out.data_start;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      TORCH_CHECK(value.is_object(), at, "__metadata__ is not an object of strings");
      for (const auto& [k, v] : value.items()) {
        TORCH_CHECK(v.is_string(), at, "__metadata__ value of '", k, "' is a ", v.type_name(),
                    ", expected a string");
        out.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string in = at + "tensor '" + name + "': ";
    TORCH_CHECK(value.is_object(), in, "entry is a ", value.type_name(), ", expected an object");
    TORCH_CHECK(value.contains("dtype") && value["dtype"].is_string(), in,
                "missing string field 'dtype'");
    TORCH_CHECK(value.contains("shape") && value["shape"].is_array(), in,
                "missing array field 'shape'");
    TORCH_CHECK(value.contains("data_offsets") && value["data_offsets"].is_array() &&
                    value["data_offsets"].size() == 2,
                in, "missing field 'data_offsets' (expected [begin, end])");
    Entry e;
    e.name = name;
    const auto dtype_name = value["dtype"].get<std::string>();
    const auto dtype = dtype_from_name(dtype_name);
    TORCH_CHECK(dtype, in, "unknown dtype '", dtype_name, "'");
    e.dtype = *dtype;
    // Element count with an overflow guard: a count beyond the data size is already wrong.
    uint64_t numel = 1;
    bool overflow = false;
    for (const auto& d : value["shape"]) {
      TORCH_CHECK(d.is_number_unsigned(), in, "shape ", value["shape"].dump(),
                  " has an entry that is not a non-negative integer");
      const auto n = d.get<uint64_t>();
      TORCH_CHECK(n <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), in,
                  "shape entry ", n, " is too large");
      e.shape.push_back(static_cast<int64_t>(n));
      if (n != 0 && numel > std::numeric_limits<uint64_t>::max() / n) overflow = true;
      numel *= n;
    }
    const uint64_t element_size = c10::elementSize(e.dtype);
    if (numel > std::numeric_limits<uint64_t>::max() / element_size) overflow = true;
    for (const auto& o : value["data_offsets"])
      TORCH_CHECK(o.is_number_unsigned(), in, "data_offsets ", value["data_offsets"].dump(),
                  " are not non-negative integers");
    e.begin = value["data_offsets"][0].get<uint64_t>();
    e.end = value["data_offsets"][1].get<uint64_t>();
    TORCH_CHECK(e.begin <= e.end && e.end <= data_size, in, "data_offsets [", e.begin, ", ", e.end,
                "] are out of range of the ", data_size, "-byte data section");
    TORCH_CHECK(!overflow && e.end - e.begin == numel * element_size, in, "data_offsets [", e.begin,
                ", ", e.end, "] hold ", e.end - e.begin, " bytes, but shape ",
                value["shape"].dump(), " of ", dtype_name, " needs ",
                overflow ? std::string("more than 2^64") : std::to_string(numel * element_size));
    out.entries.push_back(std::move(e));
  }

  // The tensors must tile the data section exactly, in some order (as the Python package checks).
  std::vector<const Entry*> by_offset;
  for (const auto& e : out.entries) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t expected = 0;
  for (const Entry* e : by_offset) {
    TORCH_CHECK(e->begin >= expected, at, "tensor '", e->name, "' at data_offsets [", e->begin,
                ", ", e->end, "] overlaps the previous tensor, which ends at ", expected);
    TORCH_CHECK(e->begin == expected, at, "tensor '", e->name, "' at data_offsets [", e->begin,
                ", ", e->end, "] leaves a gap: the previous tensor ends at ", expected);
    expected = e->end;
  }
  TORCH_CHECK(expected == data_size, at, "the tensors cover ", expected, " of the ", data_size,
              " data bytes (the data section must hold exactly the tensors)");
  return out;
}

std::ifstream open_for_reading(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  TORCH_CHECK(file, where(path), "cannot open for reading: ", std::strerror(errno));
  return file;
}

void write_all(int fd, const void* data, size_t size, const std::filesystem::path& tmp) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, where(tmp), "write failed: ", std::strerror(errno));
    p += n;
    size -= static_cast<size_t>(n);
  }
}

}  // namespace

std::map<std::string, at::Tensor> load_safetensors(const std::filesystem::path& path) {
  auto file = open_for_reading(path);
  const Header header = read_header(path, file);
  std::map<std::string, at::Tensor> tensors;
  for (const auto& e : header.entries) {
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
    file.seekg(static_cast<std::streamoff>(header.data_start + e.begin));
    file.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(e.end - e.begin));
    TORCH_CHECK(file, where(path), "cannot read the data of tensor '", e.name, "'");
    tensors.emplace(e.name, std::move(t));
  }
  return tensors;
}

std::map<std::string, std::string> load_safetensors_metadata(const std::filesystem::path& path) {
  auto file = open_for_reading(path);
  return read_header(path, file).metadata;
}

void save_safetensors(const std::filesystem::path& path,
                      const std::map<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  // Contiguous CPU copies, laid out in name order.
  std::vector<at::Tensor> data;
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    TORCH_CHECK(!name.empty() && name != "__metadata__", where(path), "invalid tensor name '", name,
                "'");
    TORCH_CHECK(tensor.defined(), where(path), "tensor '", name, "' is undefined");
    const char* dtype = name_from_dtype(tensor.scalar_type());
    TORCH_CHECK(dtype, where(path), "tensor '", name, "' has dtype ", tensor.scalar_type(),
                ", which safetensors cannot store");
    at::Tensor t = tensor.detach().to(at::kCPU).contiguous();
    const uint64_t bytes = t.nbytes();
    header[name] = {
        {"dtype", dtype}, {"shape", t.sizes().vec()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(std::move(t));
  }
  // Pad the header with spaces to a multiple of 8 bytes, as the Python writer does, so the
  // data section starts aligned.
  std::string text = header.dump();
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');
  unsigned char len_bytes[8];
  uint64_t len = text.size();
  for (int i = 0; i < 8; ++i, len >>= 8) len_bytes[i] = static_cast<unsigned char>(len & 0xff);

  // Atomic: write path.tmp, fsync, rename over path, fsync the folder.
  std::filesystem::path tmp = path;
  tmp += ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, where(tmp), "cannot open for writing: ", std::strerror(errno));
  try {
    write_all(fd, len_bytes, 8, tmp);
    write_all(fd, text.data(), text.size(), tmp);
    for (const auto& t : data) write_all(fd, t.data_ptr(), t.nbytes(), tmp);
    TORCH_CHECK(::fsync(fd) == 0, where(tmp), "fsync failed: ", std::strerror(errno));
  } catch (...) {
    ::close(fd);
    std::filesystem::remove(tmp);
    throw;
  }
  TORCH_CHECK(::close(fd) == 0, where(tmp), "close failed: ", std::strerror(errno));
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) std::filesystem::remove(tmp);
  TORCH_CHECK(!ec, where(path), "cannot rename ", tmp.string(), " to it: ", ec.message());
  const auto dir = path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {  // best effort: the rename itself is already atomic
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
}

}  // namespace mixprec::io
