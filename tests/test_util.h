// Helpers shared by the test suites.
#pragma once

#include <c10/util/Exception.h>

#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

namespace mixprec::testing {

/// What tests/reference/NAME.py wrote into tests/reference/data/.
inline nlohmann::json load_reference(const std::string& file) {
  const std::string path = std::string(MIXPREC_REFERENCE_DIR) + "/" + file;
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path);
  return nlohmann::json::parse(in);
}

/// The message of the c10::Error that f throws, without the backtrace.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}

}  // namespace mixprec::testing
