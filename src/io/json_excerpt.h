// JSON values quoted in error messages (train/ and data/ only).
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace mixprec::io::detail {

/// Whether `j` nests arrays or objects more than `levels` deep (recursion bounded by `levels`).
inline bool nested_deeper_than(const nlohmann::json& j, int levels) {
  if (!j.is_structured()) return false;
  if (levels == 0) return true;
  for (const auto& item : j)
    if (nested_deeper_than(item, levels - 1)) return true;
  return false;
}

/// `j` as JSON text, cut to about `max_chars` (at a whole UTF-8 character, then "..."); bytes
/// that are not UTF-8 shown as U+FFFD. A value nested too deep for dump()'s recursion (a
/// hostile file) is named by its type only.
inline std::string json_excerpt(const nlohmann::json& j, size_t max_chars) {
  constexpr int kLevels = 64;
  if (nested_deeper_than(j, kLevels))
    return std::string("<") + j.type_name() + " nested deeper than 64 levels>";
  std::string s = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (s.size() <= max_chars) return s;
  size_t cut = max_chars - 3;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;
  return s.substr(0, cut) + "...";
}

}  // namespace mixprec::io::detail
