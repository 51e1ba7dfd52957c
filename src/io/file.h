// Files read and synced with errors that name them (io/ only).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>

namespace mixprec::io::detail {

/// fsync of a folder, so that a rename or a new file in it survives a crash;
/// best effort: the data itself was fsynced.
void fsync_dir(const std::filesystem::path& dir);

/// A file open for reading. Opening a missing file or a folder is an error
/// that names it, as is every failed read.
class InputFile {
 public:
  explicit InputFile(const std::filesystem::path& path);
  ~InputFile();
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  /// The size of a regular file; none for a pipe or a /proc file (whose size reads 0),
  /// which only read_all can read.
  std::optional<uint64_t> size() const { return size_; }
  /// Exactly `size` bytes from `offset`.
  void read_at(char* out, uint64_t size, uint64_t offset) const;
  /// Every byte to the end, in pieces of at most `piece_size`. Once per file: it reads on from
  /// where the last read_all or contents stopped (read_at moves nothing).
  void read_all(size_t piece_size, const std::function<void(const char*, size_t)>& consume);
  /// read_all into one string.
  std::string contents();

 private:
  std::string name_;
  int fd_;
  std::optional<uint64_t> size_;
};

}  // namespace mixprec::io::detail
