#include "mixprec/log/logging.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <utility>

namespace mixprec::log {

namespace {

// transformers' names; its "detail" is debug with the file and line (here debug).
constexpr std::array<std::pair<std::string_view, Level>, 6> kLevels{
    {{"detail", Level::kDebug},
     {"debug", Level::kDebug},
     {"info", Level::kInfo},
     {"warning", Level::kWarning},
     {"error", Level::kError},
     {"critical", Level::kCritical}}};

Level from_environment() {
  const char* name = std::getenv("MIXPREC_VERBOSITY");
  if (name == nullptr || *name == '\0') return Level::kWarning;
  for (const auto& [n, level] : kLevels)
    if (n == name) return level;
  // As transformers with a bad TRANSFORMERS_VERBOSITY: a warning, and the default.
  TORCH_WARN("MIXPREC_VERBOSITY '", name,
             "' is not one of detail, debug, info, warning, error, critical; using warning");
  return Level::kWarning;
}

std::atomic<int>& verbosity() {
  static std::atomic<int> level{static_cast<int>(from_environment())};
  return level;
}

}  // namespace

Level get_verbosity() { return static_cast<Level>(verbosity().load()); }

void set_verbosity(Level level) { verbosity() = static_cast<int>(level); }

Level level_from_name(std::string_view name) {
  for (const auto& [n, level] : kLevels)
    if (n == name) return level;
  TORCH_CHECK(false, "log level '", name,
              "' is not one of \"detail\", \"debug\", \"info\", \"warning\", \"error\", "
              "\"critical\"");
}

void write_info(const std::string& message) { std::fprintf(stderr, "%s\n", message.c_str()); }

std::string python_repr(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  char buffer[40];
  const std::string shortest(  // "-d.ddde+XX"
      buffer,
      std::to_chars(buffer, buffer + sizeof(buffer), value, std::chars_format::scientific).ptr);
  const size_t e = shortest.find('e');
  const int exponent = std::stoi(shortest.substr(e + 1));
  std::string digits = shortest.substr(0, e);
  const bool negative = digits[0] == '-';
  std::erase(digits, '-');
  std::erase(digits, '.');
  std::string out = negative ? "-" : "";
  if (exponent >= -4 && exponent < 16) {
    const auto whole = static_cast<size_t>(exponent + 1);
    if (exponent < 0)
      out += "0." + std::string(static_cast<size_t>(-exponent - 1), '0') + digits;
    else if (digits.size() <= whole)
      out += digits + std::string(whole - digits.size(), '0') + ".0";
    else
      out += digits.substr(0, whole) + "." + digits.substr(whole);
  } else {
    char tail[16];
    std::snprintf(tail, sizeof(tail), "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    out += digits.substr(0, 1) + (digits.size() > 1 ? "." + digits.substr(1) : "") + tail;
  }
  return out;
}

}  // namespace mixprec::log
