#pragma once

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <string>
#include <string_view>

namespace mixprec::log {

/// How much mixprec says, as transformers.utils.logging's verbosity (Python's logging levels):
/// warnings from kWarning on, info messages (the Trainer's "***** Running training *****"
/// summary, the checkpoints it saves and deletes) from kInfo on.
enum class Level : int { kDebug = 10, kInfo = 20, kWarning = 30, kError = 40, kCritical = 50 };

/// set_verbosity's level; before any, the environment's MIXPREC_VERBOSITY (as transformers reads
/// TRANSFORMERS_VERBOSITY), else kWarning.
Level get_verbosity();
void set_verbosity(Level level);
/// "debug" (or transformers' "detail"), "info", "warning", "error" or "critical"; another name is
/// an error that lists them.
Level level_from_name(std::string_view name);
inline bool enabled(Level level) { return get_verbosity() <= level; }

void write_info(const std::string& message);
/// Python's repr of a float: the fewest digits that read back, fixed notation for exponents -4
/// to 15 ("3.0", "0.0001"), scientific otherwise ("1e-05", "1.5e+16"); "nan", "inf", "-inf".
/// For messages that print a value as HF's do.
std::string python_repr(double value);
/// The message, made as c10::str makes it, and a newline to stderr, when kInfo is enabled.
template <typename... Args>
void info(const Args&... args) {
  if (enabled(Level::kInfo)) write_info(c10::str(args...));
}

}  // namespace mixprec::log

/// TORCH_WARN (LibTorch's warning handler, which users and tests can capture), when mixprec's
/// verbosity lets warnings through; MIXPREC_WARN_ONCE as TORCH_WARN_ONCE.
#define MIXPREC_WARN(...) MIXPREC_WARN_WITH(TORCH_WARN, __VA_ARGS__)
#define MIXPREC_WARN_ONCE(...) MIXPREC_WARN_WITH(TORCH_WARN_ONCE, __VA_ARGS__)
#define MIXPREC_WARN_WITH(warn, ...)                                \
  do {                                                              \
    if (::mixprec::log::enabled(::mixprec::log::Level::kWarning)) { \
      warn(__VA_ARGS__);                                            \
    }                                                               \
  } while (false)
