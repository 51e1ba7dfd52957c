// What every fuzz target checks: a reader given any bytes either succeeds or
// throws a clear error of its own (c10::Error from TORCH_CHECK, or a
// std::runtime_error with a message). A raw JSON/YAML library exception, a
// std::logic_error from the standard library (out_of_range, length_error) or
// bad_alloc escaping a reader is a finding: the fuzzer stops with it.
#pragma once

#include <c10/util/Exception.h>
#include <sys/mman.h>
#include <unistd.h>
#include <yaml-cpp/exceptions.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>

namespace mixprec::fuzz {

[[noreturn]] inline void finding(const char* kind, const char* what) {
  std::fprintf(stderr, "FUZZ FINDING: %s escaped a reader: %s\n", kind, what);
  std::abort();
}

template <typename F>
void expect_clear_error_or_success(F&& reader) {
  try {
    reader();
  } catch (const c10::Error&) {
  } catch (const nlohmann::json::exception& e) {
    finding("nlohmann::json exception", e.what());
  } catch (const YAML::Exception& e) {
    finding("YAML::Exception", e.what());
  } catch (const std::bad_alloc& e) {
    finding("std::bad_alloc", e.what());
  } catch (const std::logic_error& e) {
    finding("std::logic_error", e.what());
  } catch (const std::runtime_error&) {
  }
}

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

/// An in-memory file holding `bytes`, for readers that take a path: its name
/// is /proc/self/fd/N. Nothing touches the disk.
class MemoryFile {
 public:
  explicit MemoryFile(std::string_view bytes) : fd_(::memfd_create("fuzz", 0)) {
    if (fd_ < 0) finding("setup", "memfd_create failed");
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::write(fd_, bytes.data() + done, bytes.size() - done);
      if (n <= 0) finding("setup", "write to memfd failed");
      done += static_cast<size_t>(n);
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~MemoryFile() { ::close(fd_); }
  MemoryFile(const MemoryFile&) = delete;
  MemoryFile& operator=(const MemoryFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  int fd_;
  std::string path_;
};

}  // namespace mixprec::fuzz
