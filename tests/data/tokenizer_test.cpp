// Tokenizers of mixprec::data. The BPE tests replay the ids Hugging Face
// `tokenizers` gives (tests/reference/tokenizer_reference.py).
#include "mixprec/data/tokenizer.h"

#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

namespace {

using mixprec::data::BPETokenizer;
using mixprec::data::ByteTokenizer;
using nlohmann::json;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << "cannot open " << path;
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

const std::string kTokenizerPath = std::string(MIXPREC_REFERENCE_DIR) + "/tokenizer.json";

const json& reference_json() {
  static const json j = json::parse(read_file(kTokenizerPath));
  return j;
}

const json& reference_cases() {
  static const json j =
      json::parse(read_file(std::string(MIXPREC_REFERENCE_DIR) + "/tokenizer_cases.json"));
  return j;
}

// Runs `fn` and checks it throws with `expected` somewhere in the message.
void expect_error(const std::function<void()>& fn, const std::string& expected) {
  try {
    fn();
    ADD_FAILURE() << "no exception; expected one saying: " << expected;
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos)
        << "message: " << e.what() << "\nexpected to contain: " << expected;
  }
}

// ---------------------------------------------------------------- ByteTokenizer

TEST(ByteTokenizer, BytesAreIds) {
  ByteTokenizer tok;
  EXPECT_EQ(tok.vocab_size(), 256);
  EXPECT_EQ(tok.encode("Hi!"), (std::vector<int64_t>{72, 105, 33}));
  EXPECT_EQ(tok.encode("\xc3\xa9"), (std::vector<int64_t>{0xC3, 0xA9}));  // é, two bytes
  EXPECT_TRUE(tok.encode("").empty());
}

TEST(ByteTokenizer, SpecialTokens) {
  ByteTokenizer tok({"<|endoftext|>", "<|end|>"});
  EXPECT_EQ(tok.vocab_size(), 258);
  EXPECT_EQ(tok.encode("a<|endoftext|>b<|end|>"), (std::vector<int64_t>{97, 256, 98, 257}));
  EXPECT_EQ(tok.encode("<|end|>x<|endoftext|><|end|><|end|>y<|endoftext|>"),
            (std::vector<int64_t>{257, 120, 256, 257, 257, 121, 256}));
  EXPECT_EQ(tok.token_to_id("<|end|>"), 257);
  EXPECT_EQ(tok.token_to_id("a"), 97);
  EXPECT_EQ(tok.token_to_id("ab"), std::nullopt);
  EXPECT_EQ(tok.id_to_token(256), "<|endoftext|>");
  EXPECT_EQ(tok.id_to_token(98), "b");
  // The longest of two specials starting at the same place wins.
  ByteTokenizer nested({"<|a", "<|ab|>"});
  EXPECT_EQ(nested.encode("<|ab|><|a"), (std::vector<int64_t>{257, 256}));
}

TEST(ByteTokenizer, RoundTripsAnyBytes) {
  ByteTokenizer tok({"<|endoftext|>"});
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  const std::string text = all + "<|endoftext|>" + "\xff\xfe not UTF-8 \xc3";
  EXPECT_EQ(tok.decode(tok.encode(text)), text);
}

TEST(ByteTokenizer, BadInput) {
  ByteTokenizer tok({"<|endoftext|>"});
  expect_error([&] { tok.decode({72, 257}); }, "ByteTokenizer: id 257 out of range [0, 257)");
  expect_error([&] { tok.id_to_token(-1); }, "id -1 out of range");
  expect_error([] { ByteTokenizer({"x", ""}); }, "special token 1 is empty");
  expect_error([] { ByteTokenizer({"x", "x"}); }, "special token \"x\" given twice");
}

// ---------------------------------------------------------------- BPETokenizer vs `tokenizers`

TEST(BPETokenizer, LoadsReference) {
  auto tok = BPETokenizer::from_file(kTokenizerPath);
  EXPECT_EQ(tok.vocab_size(), 1000);
  EXPECT_FALSE(tok.add_prefix_space());
  EXPECT_EQ(tok.token_to_id("<|endoftext|>"), 0);
  EXPECT_EQ(tok.id_to_token(0), "<|endoftext|>");
  EXPECT_EQ(tok.token_to_id("\xc4\xa0"),  // "Ġ", a space, as tokenizers numbers it
            reference_json()["model"]["vocab"]["\xc4\xa0"].get<int64_t>());
  EXPECT_EQ(tok.token_to_id("no such token"), std::nullopt);
}

TEST(BPETokenizer, MatchesTokenizers) {
  auto tok = BPETokenizer::from_file(kTokenizerPath);
  ASSERT_GE(reference_cases()["cases"].size(), 10u);
  for (const json& c : reference_cases()["cases"]) {
    const std::string text = c["text"];
    const auto ids = tok.encode(text);
    EXPECT_EQ(ids, c["ids"].get<std::vector<int64_t>>()) << "text: " << c["text"];
    EXPECT_EQ(tok.decode(ids), text);
  }
}

TEST(BPETokenizer, MatchesTokenizersWithPrefixSpace) {
  json j = reference_json();
  j["pre_tokenizer"]["add_prefix_space"] = true;
  auto tok = BPETokenizer::from_json(j.dump());
  EXPECT_TRUE(tok.add_prefix_space());
  for (const json& c : reference_cases()["cases_add_prefix_space"]) {
    EXPECT_EQ(tok.encode(c["text"].get<std::string>()), c["ids"].get<std::vector<int64_t>>())
        << "text: " << c["text"];
  }
}

TEST(BPETokenizer, MergesAsStrings) {
  // tokenizers < 0.20 (and GPT-2's merges.txt) write a merge as "a b".
  json j = reference_json();
  for (json& m : j["model"]["merges"]) m = m[0].get<std::string>() + " " + m[1].get<std::string>();
  auto pairs = BPETokenizer::from_file(kTokenizerPath);
  auto strings = BPETokenizer::from_json(j.dump());
  for (const json& c : reference_cases()["cases"]) {
    EXPECT_EQ(strings.encode(c["text"].get<std::string>()),
              pairs.encode(c["text"].get<std::string>()));
  }
}

// unk_token, ignore_merges and use_regex on a vocab small enough to follow by hand, as
// tokenizers encodes and decodes it (tests/reference/tokenizer_reference.py).
TEST(BPETokenizer, SmallVocabOptions) {
  const json& small = reference_cases()["small_vocab"];
  ASSERT_EQ(small["cases"].size(), 3u);
  for (const json& c : small["cases"]) {
    json j = small["tokenizer"];
    j["model"]["ignore_merges"] = c["ignore_merges"];  // a word in the vocab taken whole
    j["pre_tokenizer"]["use_regex"] = c["use_regex"];  // false: the whole text is one word
    EXPECT_EQ(BPETokenizer::from_json(j.dump()).encode(c["text"].get<std::string>()),
              c["ids"].get<std::vector<int64_t>>())
        << c.dump();
  }
  EXPECT_EQ(BPETokenizer::from_json(small["tokenizer"].dump())
                .decode(small["decode"]["ids"].get<std::vector<int64_t>>()),
            small["decode"]["text"].get<std::string>());
}

TEST(BPETokenizer, RoundTripsInvalidUtf8) {
  auto tok = BPETokenizer::from_file(kTokenizerPath);
  const std::string text = "ok \xff\xfe\xc3 \xe2\x82 end\xf0";
  EXPECT_EQ(tok.decode(tok.encode(text)), text);
}

// ---------------------------------------------------------------- bad tokenizer.json

void expect_load_error(const std::function<void(json&)>& edit, const std::string& expected) {
  json j = reference_json();
  edit(j);
  expect_error([&] { BPETokenizer::from_json(j.dump(), "tok.json"); }, expected);
}

TEST(BPETokenizer, BadInput) {
  expect_error([] { BPETokenizer::from_json("{\"model\": [1,,]}", "tok.json"); },
               "tok.json: invalid JSON: [json.exception.parse_error.101] parse error at line 1, "
               "column 14");
  expect_error([] { BPETokenizer::from_file("/nonexistent/tokenizer.json"); },
               "/nonexistent/tokenizer.json: cannot open (No such file or directory) (tokenizer "
               "file)");
  expect_load_error([](json& j) { j["model"]["type"] = "WordPiece"; },
                    "tok.json: key 'model.type': unsupported: expected \"BPE\", got \"WordPiece\"");
  expect_load_error(
      [](json& j) {
        j["pre_tokenizer"] = {{"type", "Metaspace"}};
      },
      "tok.json: key 'pre_tokenizer.type': unsupported: expected \"ByteLevel\", got "
      "\"Metaspace\"");
  expect_load_error([](json& j) { j["pre_tokenizer"] = nullptr; },
                    "tok.json: key 'pre_tokenizer': expected \"ByteLevel\", got null");
  expect_load_error(
      [](json& j) {
        j["normalizer"] = {{"type", "NFC"}};
      },
      "tok.json: key 'normalizer.type': unsupported: expected null, got \"NFC\"");
  expect_load_error(
      [](json& j) {
        j["decoder"] = {{"type", "WordPiece"}};
      },
      "key 'decoder.type': unsupported: expected \"ByteLevel\" or null, got "
      "\"WordPiece\"");
  expect_load_error([](json& j) { j["model"].erase("vocab"); },
                    "tok.json: missing key 'model.vocab'");
  expect_load_error([](json& j) { j.erase("model"); }, "tok.json: missing key 'model'");
  expect_load_error(
      [](json& j) {
        j["model"]["merges"][3] = {"\xc4\xa0", "zzz"};
      },
      "tok.json: key 'model.merges[3]': token \"zzz\" is not in model.vocab");
  expect_load_error([](json& j) { j["model"]["merges"][0] = "a b c"; },
                    "key 'model.merges[0]': expected \"left right\" with one space, got \"a b c\"");
  expect_load_error(
      [](json& j) { j["model"]["merges"][0] = 7; },
      "key 'model.merges[0]': expected \"left right\" or [\"left\", \"right\"], got 7");
  expect_load_error([](json& j) { j["model"]["vocab"]["a"] = "one"; },
                    "key 'model.vocab.a': expected an id >= 0, got \"one\"");
  expect_load_error([](json& j) { j["model"]["type"] = std::string(55, 'x') + "\xc3\xa9xyz"; },
                    "got \"" + std::string(55, 'x') + "...");  // é not cut in half
  expect_load_error([](json& j) { j["model"]["dropout"] = 0.1; },
                    "key 'model.dropout': unsupported: expected null, got 0.1");
  expect_load_error([](json& j) { j["added_tokens"][0]["lstrip"] = true; },
                    "key 'added_tokens[0].lstrip': unsupported: expected false, got true");
  expect_load_error([](json& j) { j["added_tokens"][0].erase("content"); },
                    "tok.json: missing key 'added_tokens[0].content'");
  expect_load_error([](json& j) { j["pre_tokenizer"]["add_prefix_space"] = "yes"; },
                    "key 'pre_tokenizer.add_prefix_space': expected a boolean, got \"yes\"");

  // Found while writing fuzz/fuzz_tokenizer.cpp: the id table was sized by the largest id
  // (any size a file claimed; INT64_MAX overflowed), a number too large for a
  // double escaped as a raw JSON error, so did a normalizer that is no object,
  // and an empty token loaded but could not be decoded.
  expect_load_error([](json& j) { j["model"]["vocab"]["a"] = int64_t{1} << 40; },
                    "tok.json: id 1099511627776 is past the 1000 tokens of model.vocab and "
                    "added_tokens (ids must number them from 0)");
  expect_load_error([](json& j) { j["model"]["vocab"]["a"] = INT64_MAX; }, "is past the");
  expect_load_error([](json& j) { j["added_tokens"][0]["id"] = 5000; },
                    "tok.json: id 5000 is past the");
  expect_error([] { BPETokenizer::from_json(R"({"model": 1e400})", "tok.json"); },
               "tok.json: invalid JSON: [json.exception.out_of_range.406] number overflow");
  expect_load_error([](json& j) { j["normalizer"] = 5; },
                    "tok.json: key 'normalizer.type': unsupported: expected null, got 5");
  expect_load_error([](json& j) { j["model"]["vocab"][""] = 3; },
                    "tok.json: key 'model.vocab': holds an empty token");

  auto tok = BPETokenizer::from_file(kTokenizerPath);
  expect_error(
      [&] {
        tok.decode({1, 1000});
      },
      "BPETokenizer: id 1000 is not in the vocab (size 1000)");
}

}  // namespace
