// Loads what tests/reference/*.py wrote into tests/reference/data/.
#pragma once

#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

namespace mixprec::testing {

inline nlohmann::json load_reference(const std::string& file) {
  const std::string path = std::string(MIXPREC_REFERENCE_DIR) + "/" + file;
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path);
  return nlohmann::json::parse(in);
}

}  // namespace mixprec::testing
