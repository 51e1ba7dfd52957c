#include "mixprec/log/logging.h"

#include <array>
#include <atomic>
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

}  // namespace mixprec::log
