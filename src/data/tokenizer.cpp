#include "mixprec/data/tokenizer.h"

#include "mixprec/io/safetensors.h"

#include "io/json_excerpt.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <limits>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace mixprec::data {
namespace {

using nlohmann::json;

// ---------------------------------------------------------------- UTF-8 and Unicode classes

struct CodeRange {
  char32_t first, last;
};
#include "unicode_ranges.inc"

constexpr char32_t kInvalid = 0xFFFFFFFF;  // a byte that starts no valid UTF-8 sequence

// Decodes the code point at s[i]; returns its length in bytes. An invalid
// sequence decodes as one byte of kInvalid, so any byte string can be encoded.
size_t next_code_point(std::string_view s, size_t i, char32_t& cp) {
  auto b = static_cast<unsigned char>(s[i]);
  size_t len = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xE ? 3 : (b >> 3) == 0x1E ? 4 : 0;
  if (len == 0 || i + len > s.size()) {
    cp = kInvalid;
    return 1;
  }
  cp = len == 1 ? b : len == 2 ? (b & 0x1F) : len == 3 ? (b & 0x0F) : (b & 0x07);
  for (size_t k = 1; k < len; ++k) {
    auto c = static_cast<unsigned char>(s[i + k]);
    if ((c >> 6) != 0x2) {
      cp = kInvalid;
      return 1;
    }
    cp = (cp << 6) | (c & 0x3F);
  }
  // Overlong forms, surrogates and values past U+10FFFF are not text either.
  static constexpr char32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMin[len] || (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) {
    cp = kInvalid;
    return 1;
  }
  return len;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

template <size_t N>
bool in_ranges(const CodeRange (&ranges)[N], char32_t cp) {
  auto it = std::upper_bound(std::begin(ranges), std::end(ranges), cp,
                             [](char32_t c, const CodeRange& r) { return c < r.first; });
  return it != std::begin(ranges) && cp <= std::prev(it)->last;
}

bool is_letter(char32_t cp) { return cp != kInvalid && in_ranges(kLetters, cp); }
bool is_number(char32_t cp) { return cp != kInvalid && in_ranges(kNumbers, cp); }
// Unicode White_Space, which is what \s matches in the Oniguruma regex `tokenizers` runs.
bool is_space(char32_t cp) {
  return (cp >= 0x9 && cp <= 0xD) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// ---------------------------------------------------------------- GPT-2's pre-tokenizer

// Splits `text` as GPT-2's regex does:
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// A hand-written scanner: the first alternative that matches at a position wins,
// and every quantifier is greedy with nothing after it to backtrack for, except
// \s+(?!\S), which gives back the last space before a non-space.
std::vector<std::string_view> gpt2_split(std::string_view text) {
  std::vector<char32_t> cps;
  std::vector<size_t> starts;  // byte offset of each code point, plus the end
  for (size_t i = 0; i < text.size();) {
    char32_t cp;
    starts.push_back(i);
    i += next_code_point(text, i, cp);
    cps.push_back(cp);
  }
  starts.push_back(text.size());
  const size_t n = cps.size();
  auto cls = [&](size_t k) { return k < n ? cps[k] : kInvalid; };
  std::vector<std::string_view> words;
  size_t i = 0;
  while (i < n) {
    size_t end = i;
    // 's 't 'm 'd 're 've 'll (case-sensitive, as GPT-2's pattern)
    if (cps[i] == U'\'') {
      char32_t a = cls(i + 1), b = cls(i + 2);
      if (a == U's' || a == U't' || a == U'm' || a == U'd') {
        end = i + 2;
      } else if ((a == U'r' && b == U'e') || (a == U'v' && b == U'e') || (a == U'l' && b == U'l')) {
        end = i + 3;
      }
    }
    if (end == i) {
      size_t j = (cps[i] == U' ' && i + 1 < n) ? i + 1 : i;  // the optional leading space
      char32_t c = cps[j];
      bool (*same)(char32_t) = nullptr;
      if (is_letter(c)) {
        same = is_letter;
      } else if (is_number(c)) {
        same = is_number;
      } else if (!is_space(c)) {
        same = [](char32_t x) { return !is_space(x) && !is_letter(x) && !is_number(x); };
      }
      if (same) {
        end = j + 1;
        while (end < n && same(cps[end])) ++end;
      }
    }
    if (end == i) {  // whitespace: \s+(?!\S) or \s+
      end = i + 1;
      while (end < n && is_space(cps[end])) ++end;
      if (end < n && end - i >= 2) --end;
    }
    words.push_back(text.substr(starts[i], starts[end] - starts[i]));
    i = end;
  }
  return words;
}

// ---------------------------------------------------------------- byte <-> unicode

// GPT-2's bytes_to_unicode(): printable bytes stand for themselves, the other 68
// are shifted to U+0100.. so every byte is a visible character in vocab.json.
struct ByteMap {
  std::array<std::string, 256> byte_to_utf8;
  std::array<int, 324> code_to_byte;  // -1 where no byte maps to the code point
  ByteMap() {
    code_to_byte.fill(-1);
    char32_t shifted = 256;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      char32_t cp = printable ? static_cast<char32_t>(b) : shifted++;
      append_utf8(byte_to_utf8[b], cp);
      code_to_byte[cp] = b;
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap map;
  return map;
}

// ---------------------------------------------------------------- special tokens

// Leftmost match of any of `tokens` in text at or after `from`, the longest on a
// tie (what `tokenizers` does with its Aho-Corasick LeftmostLongest matcher).
// Returns (position, index into tokens); position == npos when none. `next`
// caches each token's next occurrence across calls, so a long text is searched
// once per token rather than once per match.
template <typename Tokens, typename Content>
std::pair<size_t, size_t> find_special(std::string_view text, size_t from, const Tokens& tokens,
                                       Content content, std::vector<size_t>& next) {
  constexpr size_t npos = std::string_view::npos, unset = npos - 1;
  if (next.size() != tokens.size()) next.assign(tokens.size(), unset);
  size_t best = npos, which = 0;
  for (size_t t = 0; t < tokens.size(); ++t) {
    const std::string& s = content(tokens[t]);
    if (next[t] == unset || (next[t] != npos && next[t] < from)) next[t] = text.find(s, from);
    size_t pos = next[t];
    if (pos < best || (pos == best && pos != npos && s.size() > content(tokens[which]).size())) {
      best = pos;
      which = t;
    }
  }
  return {best, which};
}

// ---------------------------------------------------------------- tokenizer.json helpers

[[noreturn]] void fail(const std::string& source, const std::string& key, const std::string& what) {
  throw std::runtime_error(source + ": key '" + key + "': " + what);
}

std::string shown(const json& j) { return io::detail::json_excerpt(j, 60); }

const json& need(const json& obj, const char* key, const std::string& path,
                 const std::string& source) {
  auto it = obj.find(key);
  if (it == obj.end()) {
    throw std::runtime_error(source + ": missing key '" + (path.empty() ? "" : path + ".") + key +
                             "'");
  }
  return *it;
}

// A string field that must be `expected` (or null/absent when allowed).
void expect_type(const json& obj, const char* key, const std::string& path,
                 const std::string& expected, const std::string& source, bool nullable) {
  std::string full = path.empty() ? key : path + "." + key;
  if (!obj.contains(key) || obj[key].is_null()) {
    if (!nullable) fail(source, full, "expected \"" + expected + "\", got null");
    return;
  }
  const json& j = obj[key];
  if (!j.is_object() || !j.contains("type") || j["type"] != expected) {
    fail(source, full + ".type",
         "unsupported: expected \"" + expected + "\"" + (nullable ? " or null" : "") + ", got " +
             shown(j.is_object() && j.contains("type") ? j["type"] : j));
  }
}

bool optional_bool(const json& obj, const char* key, const std::string& path, bool fallback,
                   const std::string& source) {
  if (!obj.contains(key) || obj[key].is_null()) return fallback;
  if (!obj[key].is_boolean())
    fail(source, path + "." + key, "expected a boolean, got " + shown(obj[key]));
  return obj[key].get<bool>();
}

}  // namespace

// ================================================================= ByteTokenizer

ByteTokenizer::ByteTokenizer(std::vector<std::string> special_tokens)
    : special_(std::move(special_tokens)) {
  for (size_t i = 0; i < special_.size(); ++i) {
    if (special_[i].empty()) {
      throw std::invalid_argument("ByteTokenizer: special token " + std::to_string(i) +
                                  " is empty");
    }
    for (size_t k = 0; k < i; ++k) {
      if (special_[k] == special_[i]) {
        throw std::invalid_argument("ByteTokenizer: special token \"" + special_[i] +
                                    "\" given twice");
      }
    }
  }
}

std::vector<int64_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int64_t> ids;
  ids.reserve(text.size());
  std::vector<size_t> next;  // find_special's cache
  size_t i = 0;
  while (i < text.size()) {
    auto [pos, which] = find_special(
        text, i, special_, [](const std::string& s) -> auto& { return s; }, next);
    size_t stop = std::min(pos, text.size());
    for (; i < stop; ++i) ids.push_back(static_cast<unsigned char>(text[i]));
    if (pos == std::string_view::npos) break;
    ids.push_back(256 + static_cast<int64_t>(which));
    i = pos + special_[which].size();
  }
  return ids;
}

std::string ByteTokenizer::decode(const std::vector<int64_t>& ids) const {
  std::string text;
  for (int64_t id : ids) {
    if (id >= 0 && id < 256) {
      text += static_cast<char>(id);
    } else {
      text += id_to_token(id);  // throws for ids out of range
    }
  }
  return text;
}

int64_t ByteTokenizer::vocab_size() const { return 256 + static_cast<int64_t>(special_.size()); }

std::optional<int64_t> ByteTokenizer::token_to_id(std::string_view token) const {
  for (size_t i = 0; i < special_.size(); ++i) {
    if (special_[i] == token) return 256 + static_cast<int64_t>(i);
  }
  if (token.size() == 1) return static_cast<unsigned char>(token[0]);
  return std::nullopt;
}

std::string ByteTokenizer::id_to_token(int64_t id) const {
  if (id < 0 || id >= vocab_size()) {
    throw std::out_of_range("ByteTokenizer: id " + std::to_string(id) + " out of range [0, " +
                            std::to_string(vocab_size()) + ")");
  }
  return id < 256 ? std::string(1, static_cast<char>(id)) : special_[id - 256];
}

// ================================================================= BPETokenizer

BPETokenizer BPETokenizer::from_file(const std::string& path) {
  std::string text;
  try {
    text = io::read_file(path);
  } catch (const c10::Error& e) {  // this class's errors are std::runtime_error
    throw std::runtime_error(std::string(e.what_without_backtrace()) + " (tokenizer file)");
  }
  return from_json(text, path);
}

BPETokenizer BPETokenizer::from_json(std::string_view text, const std::string& source) {
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    throw std::runtime_error(source + ": invalid JSON: " + e.what());
  }
  if (!root.is_object()) {
    throw std::runtime_error(source + ": expected a JSON object at the top, got " + shown(root));
  }
  BPETokenizer tok;

  // Model: BPE with vocab and merges, none of the options byte-level BPE doesn't use.
  const json& model = need(root, "model", "", source);
  if (!model.is_object()) fail(source, "model", "expected an object, got " + shown(model));
  const json& type = need(model, "type", "model", source);
  if (type != "BPE")
    fail(source, "model.type", "unsupported: expected \"BPE\", got " + shown(type));
  if (model.contains("dropout") && !model["dropout"].is_null()) {
    fail(source, "model.dropout", "unsupported: expected null, got " + shown(model["dropout"]));
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(key) && !model[key].is_null() && model[key] != "") {
      fail(source, std::string("model.") + key,
           "unsupported: expected null or \"\", got " + shown(model[key]));
    }
  }
  if (optional_bool(model, "byte_fallback", "model", false, source)) {
    fail(source, "model.byte_fallback", "unsupported: expected false, got true");
  }
  tok.ignore_merges_ = optional_bool(model, "ignore_merges", "model", false, source);

  const json& vocab = need(model, "vocab", "model", source);
  if (!vocab.is_object()) fail(source, "model.vocab", "expected an object, got " + shown(vocab));
  int64_t max_id = -1;
  for (const auto& [token, id] : vocab.items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0) {
      fail(source, "model.vocab." + token, "expected an id >= 0, got " + shown(id));
    }
    if (token.empty()) fail(source, "model.vocab", "holds an empty token");
    tok.vocab_.emplace(token, id.get<int64_t>());
    max_id = std::max(max_id, id.get<int64_t>());
  }

  const json& merges = need(model, "merges", "model", source);
  if (!merges.is_array()) fail(source, "model.merges", "expected an array, got " + shown(merges));
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const json& m = merges[rank];
    std::string key = "model.merges[" + std::to_string(rank) + "]";
    std::string left, right;
    if (m.is_string()) {  // "a b", the format of tokenizers < 0.20 and of merges.txt
      const std::string& s = m.get_ref<const std::string&>();
      size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
        fail(source, key, "expected \"left right\" with one space, got " + shown(m));
      }
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      fail(source, key, "expected \"left right\" or [\"left\", \"right\"], got " + shown(m));
    }
    int64_t ids[3];
    const std::string parts[3] = {left, right, left + right};
    for (int k = 0; k < 3; ++k) {
      auto it = tok.vocab_.find(parts[k]);
      if (it == tok.vocab_.end()) {
        fail(source, key, "token \"" + parts[k] + "\" is not in model.vocab");
      }
      ids[k] = it->second;
    }
    // The first of two equal merges wins, as in `tokenizers`.
    tok.merges_.emplace(std::pair{ids[0], ids[1]}, std::pair{static_cast<int64_t>(rank), ids[2]});
  }

  if (model.contains("unk_token") && !model["unk_token"].is_null()) {
    const json& unk = model["unk_token"];
    auto it = unk.is_string() ? tok.vocab_.find(unk.get<std::string>()) : tok.vocab_.end();
    if (it == tok.vocab_.end()) {
      fail(source, "model.unk_token", "expected null or a token of model.vocab, got " + shown(unk));
    }
    tok.unk_id_ = it->second;
  }

  // Pipeline around the model: GPT-2's, nothing else.
  if (root.contains("normalizer") && !root["normalizer"].is_null()) {
    const json& normalizer = root["normalizer"];
    fail(source, "normalizer.type",
         "unsupported: expected null, got " +
             shown(normalizer.is_object() ? normalizer.value("type", json()) : normalizer));
  }
  expect_type(root, "pre_tokenizer", "", "ByteLevel", source, false);
  const json& pre = root["pre_tokenizer"];
  tok.add_prefix_space_ = optional_bool(pre, "add_prefix_space", "pre_tokenizer", true, source);
  tok.use_regex_ = optional_bool(pre, "use_regex", "pre_tokenizer", true, source);
  expect_type(root, "decoder", "", "ByteLevel", source, true);
  // The ByteLevel post-processor only adjusts offsets, which encode() doesn't return.
  expect_type(root, "post_processor", "", "ByteLevel", source, true);

  // Added tokens: matched in the raw text before the pre-tokenizer runs.
  if (root.contains("added_tokens") && !root["added_tokens"].is_null()) {
    const json& added = root["added_tokens"];
    if (!added.is_array()) fail(source, "added_tokens", "expected an array, got " + shown(added));
    for (size_t k = 0; k < added.size(); ++k) {
      std::string path = "added_tokens[" + std::to_string(k) + "]";
      const json& a = added[k];
      if (!a.is_object()) fail(source, path, "expected an object, got " + shown(a));
      const json& id = need(a, "id", path, source);
      const json& content = need(a, "content", path, source);
      if (!id.is_number_integer() || id.get<int64_t>() < 0) {
        fail(source, path + ".id", "expected an id >= 0, got " + shown(id));
      }
      if (!content.is_string() || content.get_ref<const std::string&>().empty()) {
        fail(source, path + ".content", "expected a non-empty string, got " + shown(content));
      }
      for (const char* flag : {"single_word", "lstrip", "rstrip"}) {
        if (optional_bool(a, flag, path, false, source)) {
          fail(source, path + "." + flag, "unsupported: expected false, got true");
        }
      }
      tok.added_.push_back({content.get<std::string>(), id.get<int64_t>()});
      max_id = std::max(max_id, id.get<int64_t>());
    }
  }

  // The id table is as long as the largest id: ids must number the tokens the
  // file holds (as every tokenizer.json does), so its size is bounded by the file.
  size_t tokens = tok.vocab_.size();
  for (const auto& added : tok.added_) tokens += !tok.vocab_.count(added.content);
  if (max_id >= 0 && static_cast<uint64_t>(max_id) >= tokens) {
    throw std::runtime_error(source + ": id " + std::to_string(max_id) + " is past the " +
                             std::to_string(tokens) +
                             " tokens of model.vocab and added_tokens (ids must number them "
                             "from 0)");
  }
  const auto size = static_cast<size_t>(max_id + 1);
  tok.id_to_token_.assign(size, "");
  for (const auto& [token, id] : tok.vocab_) tok.id_to_token_[id] = token;
  tok.is_added_.assign(size, false);
  for (const AddedToken& a : tok.added_) {
    tok.id_to_token_[a.id] = a.content;
    tok.is_added_[a.id] = true;
  }
  return tok;
}

std::vector<int64_t> BPETokenizer::encode(std::string_view text) const {
  std::vector<int64_t> ids;
  std::vector<size_t> next;  // find_special's cache
  size_t i = 0;
  while (i < text.size()) {
    auto [pos, which] = find_special(
        text, i, added_, [](const AddedToken& a) -> auto& { return a.content; }, next);
    size_t stop = std::min(pos, text.size());
    if (stop > i) encode_segment(text.substr(i, stop - i), ids);
    if (pos == std::string_view::npos) break;
    ids.push_back(added_[which].id);
    i = pos + added_[which].content.size();
  }
  return ids;
}

// One piece of text between added tokens: prefix space, regex split, byte map, BPE.
void BPETokenizer::encode_segment(std::string_view text, std::vector<int64_t>& ids) const {
  std::string prefixed;
  if (add_prefix_space_ && text.front() != ' ') {
    prefixed = " " + std::string(text);
    text = prefixed;
  }
  const ByteMap& map = byte_map();
  std::vector<std::string_view> words;
  if (use_regex_) {
    words = gpt2_split(text);
  } else {
    words.push_back(text);
  }
  std::string mapped;
  for (std::string_view word : words) {
    mapped.clear();
    for (char c : word) mapped += map.byte_to_utf8[static_cast<unsigned char>(c)];
    encode_word(mapped, ids);
  }
}

// BPE on one byte-mapped word: start from its characters, apply the merge of
// lowest rank (leftmost on a tie) until none applies.
void BPETokenizer::encode_word(std::string_view word, std::vector<int64_t>& ids) const {
  if (ignore_merges_) {
    auto it = vocab_.find(std::string(word));
    if (it != vocab_.end()) {
      ids.push_back(it->second);
      return;
    }
  }
  std::vector<int64_t> symbols;
  for (size_t i = 0; i < word.size();) {
    char32_t cp;
    size_t len = next_code_point(word, i, cp);
    auto it = vocab_.find(std::string(word.substr(i, len)));
    if (it != vocab_.end()) {
      symbols.push_back(it->second);
    } else if (unk_id_) {
      symbols.push_back(*unk_id_);
    }  // else dropped, as `tokenizers` does without an unk_token
    i += len;
  }
  while (symbols.size() > 1) {
    int64_t best_rank = std::numeric_limits<int64_t>::max(), merged = 0;
    size_t best = 0;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      auto it = merges_.find({symbols[i], symbols[i + 1]});
      if (it != merges_.end() && it->second.first < best_rank) {
        best_rank = it->second.first;
        merged = it->second.second;
        best = i;
      }
    }
    if (best_rank == std::numeric_limits<int64_t>::max()) break;
    symbols[best] = merged;
    symbols.erase(symbols.begin() + static_cast<std::ptrdiff_t>(best) + 1);
  }
  ids.insert(ids.end(), symbols.begin(), symbols.end());
}

std::string BPETokenizer::decode(const std::vector<int64_t>& ids) const {
  const ByteMap& map = byte_map();
  std::string text;
  for (int64_t id : ids) {
    const std::string checked = id_to_token(id);  // throws for an unknown id
    if (is_added_[id]) {
      text += checked;
      continue;
    }
    // ByteLevel decoder: each character back to its byte; one outside the map
    // (none in a byte-level vocab) stays as its UTF-8.
    for (size_t i = 0; i < checked.size();) {
      char32_t cp;
      size_t len = next_code_point(checked, i, cp);
      if (cp < map.code_to_byte.size() && map.code_to_byte[cp] >= 0) {
        text += static_cast<char>(map.code_to_byte[cp]);
      } else {
        text.append(checked, i, len);
      }
      i += len;
    }
  }
  return text;
}

int64_t BPETokenizer::vocab_size() const { return static_cast<int64_t>(id_to_token_.size()); }

std::optional<int64_t> BPETokenizer::token_to_id(std::string_view token) const {
  for (const AddedToken& a : added_) {
    if (a.content == token) return a.id;
  }
  auto it = vocab_.find(std::string(token));
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

std::string BPETokenizer::id_to_token(int64_t id) const {
  if (id < 0 || id >= vocab_size() || (id_to_token_[id].empty() && !is_added_[id])) {
    throw std::out_of_range("BPETokenizer: id " + std::to_string(id) +
                            " is not in the vocab (size " + std::to_string(vocab_size()) + ")");
  }
  return id_to_token_[id];
}

}  // namespace mixprec::data
