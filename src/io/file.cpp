#include "io/file.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

namespace mixprec::io::detail {

void fsync_dir(const std::filesystem::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

InputFile::InputFile(const std::filesystem::path& path)
    : name_(path.string()), fd_(::open(path.c_str(), O_RDONLY | O_CLOEXEC)) {
  TORCH_CHECK(fd_ >= 0, name_, ": cannot open (", std::strerror(errno), ")");
  struct stat st {};
  const bool stated = ::fstat(fd_, &st) == 0;
  const int err = errno;
  if (!stated || S_ISDIR(st.st_mode)) {
    ::close(fd_);  // the destructor does not run for a constructor that throws
    TORCH_CHECK(stated, name_, ": cannot stat (", std::strerror(err), ")");
    TORCH_CHECK(false, name_, ": is a directory, expected a file");
  }
  if (S_ISREG(st.st_mode) && st.st_size > 0) size_ = static_cast<uint64_t>(st.st_size);
}

InputFile::~InputFile() { ::close(fd_); }

void InputFile::read_at(char* out, uint64_t size, uint64_t offset) const {
  while (size > 0) {
    const ssize_t n = ::pread(fd_, out, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, name_, ": read failed at byte ", offset, " (",
                n == 0 ? "the file is shorter than it was" : std::strerror(errno), ")");
    out += n, size -= static_cast<uint64_t>(n), offset += static_cast<uint64_t>(n);
  }
}

void InputFile::read_all(size_t piece_size,
                         const std::function<void(const char*, size_t)>& consume) {
  std::vector<char> piece(piece_size);
  for (uint64_t offset = 0;;) {
    const ssize_t n = ::read(fd_, piece.data(), piece.size());
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n >= 0, name_, ": read failed at byte ", offset, " (", std::strerror(errno), ")");
    if (n == 0) return;
    consume(piece.data(), static_cast<size_t>(n));
    offset += static_cast<uint64_t>(n);
  }
}

std::string InputFile::contents() {
  std::string all;
  if (size_) all.reserve(*size_);
  read_all(1 << 16, [&](const char* data, size_t n) { all.append(data, n); });
  return all;
}

}  // namespace mixprec::io::detail
