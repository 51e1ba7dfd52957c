#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mixprec::data {

/// Text <-> token ids. Plain std types, no LibTorch: a DataLoader turns the ids
/// into tensors.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  /// Ids of `text`; special tokens written in the text become their own ids.
  virtual std::vector<int64_t> encode(std::string_view text) const = 0;
  /// Text of `ids`, special tokens included; decode(encode(s)) == s.
  virtual std::string decode(const std::vector<int64_t>& ids) const = 0;
  /// One past the largest id.
  virtual int64_t vocab_size() const = 0;
  virtual std::optional<int64_t> token_to_id(std::string_view token) const = 0;
  /// Throws std::out_of_range for an id outside [0, vocab_size()).
  virtual std::string id_to_token(int64_t id) const = 0;
};

/// Ids 0..255 are the bytes of the text; special tokens follow from 256.
///
///   mixprec::data::ByteTokenizer tok({"<|endoftext|>"});
///   tok.encode("hi<|endoftext|>");   // {104, 105, 256}
class ByteTokenizer : public Tokenizer {
 public:
  explicit ByteTokenizer(std::vector<std::string> special_tokens = {});
  std::vector<int64_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int64_t>& ids) const override;
  int64_t vocab_size() const override;
  std::optional<int64_t> token_to_id(std::string_view token) const override;
  std::string id_to_token(int64_t id) const override;

 private:
  std::vector<std::string> special_;
};

/// Byte-level BPE as GPT-2 uses it, loaded from a Hugging Face tokenizer.json:
/// model BPE (vocab + merges), pre_tokenizer ByteLevel (GPT-2's regex split,
/// add_prefix_space, use_regex), decoder ByteLevel, added_tokens matched before
/// splitting. Gives the ids `tokenizers` gives (tests/reference/tokenizer_reference.py).
///
///   auto tok = mixprec::data::BPETokenizer::from_file("tokenizer.json");
///   std::vector<int64_t> ids = tok.encode("Hello world");
///   std::string text = tok.decode(ids);
class BPETokenizer : public Tokenizer {
 public:
  /// Throws std::runtime_error naming the file and key for anything it can't load.
  static BPETokenizer from_file(const std::string& path);
  /// `json` is the file's text; `source` names it in error messages.
  static BPETokenizer from_json(std::string_view json,
                                const std::string& source = "tokenizer.json");

  std::vector<int64_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int64_t>& ids) const override;
  int64_t vocab_size() const override;
  std::optional<int64_t> token_to_id(std::string_view token) const override;
  std::string id_to_token(int64_t id) const override;
  bool add_prefix_space() const { return add_prefix_space_; }

 private:
  struct AddedToken {
    std::string content;
    int64_t id;
  };
  BPETokenizer() = default;
  void encode_segment(std::string_view text, std::vector<int64_t>& ids) const;
  void encode_word(std::string_view word, std::vector<int64_t>& ids) const;

  std::unordered_map<std::string, int64_t> vocab_;
  std::vector<std::string> id_to_token_;  // by id; "" where no token has that id
  // (left id, right id) -> (rank, merged id)
  std::map<std::pair<int64_t, int64_t>, std::pair<int64_t, int64_t>> merges_;
  std::vector<AddedToken> added_;
  std::vector<bool> is_added_;  // by id: decoded as raw text, not through the byte map
  std::optional<int64_t> unk_id_;
  bool add_prefix_space_ = false;
  bool use_regex_ = true;
  bool ignore_merges_ = false;
};

}  // namespace mixprec::data
