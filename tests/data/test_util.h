// Helpers of the data tests (beside tests/test_util.h): scratch files, reference data, a toy
// encoder.
#pragma once

#include "../test_util.h"

#include <c10/util/Exception.h>

#include <unistd.h>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace data_test {

using mixprec::testing::error_of;

inline bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// A per-process scratch folder, removed at exit.
struct ScratchDir {
  std::filesystem::path path =
      std::filesystem::temp_directory_path() / ("mixprec_data_tests_" + std::to_string(::getpid()));
  ScratchDir() { std::filesystem::create_directories(path); }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

// A file with `contents` in the scratch folder; returns its path.
inline std::string write_file(const std::string& name, const std::string& contents) {
  static const ScratchDir dir;
  const auto path = (dir.path / name).string();
  std::ofstream(path, std::ios::binary) << contents;
  return path;
}

// tests/reference/data/data_loader_order.json: DataLoader and random_split
// orders printed by Python (tests/reference/data_loader_order.py).
inline const nlohmann::json& reference() {
  static const nlohmann::json data = mixprec::testing::load_reference("data_loader_order.json");
  return data;
}

// One token per byte: easy to predict in tests.
inline std::vector<int64_t> encode_bytes(std::string_view text) {
  std::vector<int64_t> ids;
  for (unsigned char c : text) ids.push_back(c);
  return ids;
}

}  // namespace data_test
