// fsync of a folder, so that a rename or a new file in it survives a crash (io/ only).
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <filesystem>

namespace mixprec::io::detail {

inline void fsync_dir(const std::filesystem::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;  // best effort: the data itself was fsynced
  ::fsync(fd);
  ::close(fd);
}

}  // namespace mixprec::io::detail
