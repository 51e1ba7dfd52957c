#include "mixprec/data/dataset.h"

#include "data/test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <array>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>

namespace {

using namespace mixprec::data;
using data_test::encode_bytes;
using data_test::error_of;
using data_test::has;
using data_test::reference;
using data_test::write_file;

std::vector<int64_t> ids_of(const at::Tensor& t) {
  return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
}

std::shared_ptr<TensorDataset> range_dataset(int64_t n) {
  return std::make_shared<TensorDataset>(
      std::map<std::string, at::Tensor>{{"index", torch::arange(n)}});
}

TEST(TensorDataset, IndexesEveryTensorOnDimZero) {
  auto x = torch::arange(12, torch::kFloat).reshape({4, 3});
  auto y = torch::tensor({7, 8, 9, 10});
  TensorDataset ds({{"pixels", x}, {"labels", y}});
  EXPECT_EQ(ds.size(), 4u);
  auto example = ds.get(2);
  EXPECT_TRUE(torch::equal(example.at("pixels"), torch::tensor({6.0f, 7.0f, 8.0f})));
  EXPECT_EQ(example.at("labels").dim(), 0);
  EXPECT_EQ(example.at("labels").item<int64_t>(), 9);
}

TEST(TensorDataset, BadInputIsAClearError) {
  EXPECT_TRUE(has(error_of([] {
                    TensorDataset({{"a", torch::zeros({3})}, {"b", torch::zeros({4})}});
                  }),
                  "TensorDataset: tensor 'b' has 4 samples but 'a' has 3"));
  EXPECT_TRUE(has(error_of([] {
                    TensorDataset({{"a", torch::tensor(1)}});
                  }),
                  "tensor 'a' must have at least one dimension"));
  EXPECT_TRUE(has(error_of([] { TensorDataset({}); }), "TensorDataset: no tensors given"));
  EXPECT_TRUE(has(error_of([] { range_dataset(3)->get(3); }),
                  "TensorDataset: index 3 out of range for size 3"));
}

TEST(TensorDataset, FromCsvOfNumbers) {
  auto path = write_file("numbers.csv", "x0,label,x1\n0.5,1,-2\n1e-3,0,4\n");
  auto ds = TensorDataset::from_csv(path, "label");
  ASSERT_EQ(ds->size(), 2u);
  EXPECT_TRUE(
      torch::equal(ds->tensors().at("inputs"), torch::tensor({{0.5f, -2.0f}, {1e-3f, 4.0f}})));
  EXPECT_TRUE(torch::equal(ds->tensors().at("labels"), torch::tensor({1, 0}, torch::kLong)));

  // file name, contents, the error after "<path>"
  const std::vector<std::array<std::string, 3>> bad = {
      {"text.csv", "x0,label\n1,0\nabc,1\n", ":3: column 'x0': expected a number, got 'abc'"},
      {"fraction.csv", "x0,label\n1,0.5\n",
       ":2: column 'label': expected a class id (0, 1, ...), got '0.5'"},
      {"nan.csv", "x0,label\nnan,0\n", ":2: column 'x0': expected a number, got 'nan'"},
      {"nolabel.csv", "x0,x1\n1,2\n", ": no column 'label' in the header; columns found: x0, x1"},
      {"onlylabel.csv", "label\n1\n", ": no feature columns besides 'label'"},
      {"numbers_header.csv", "x0,label\n", ": no data rows"},
      {"numbers_ragged.csv", "x0,label\n1,0\n2\n",
       ":3: expected 2 columns (as in the header), got 1"},
  };
  for (const auto& [name, contents, error] : bad) {
    const auto path = write_file(name, contents);
    EXPECT_TRUE(has(error_of([&] { TensorDataset::from_csv(path, "label"); }), path + error))
        << name;
  }
}

TEST(Subset, ReadsThroughItsIndices) {
  Subset subset(range_dataset(10), {7, 2, 2});
  EXPECT_EQ(subset.size(), 3u);
  EXPECT_EQ(subset.get(0).at("index").item<int64_t>(), 7);
  EXPECT_EQ(subset.get(2).at("index").item<int64_t>(), 2);
  EXPECT_TRUE(has(error_of([] {
                    Subset(range_dataset(10), {1, 10});
                  }),
                  "Subset: index 10 out of range for a dataset of size 10"));
}

TEST(RandomSplit, EqualsPythonsIndices) {
  for (const auto& c : reference()["random_split"]) {
    SCOPED_TRACE(c.dump());
    auto parts = random_split(range_dataset(c["n"]), c["lengths"].get<std::vector<double>>(),
                              c["seed"].get<uint64_t>());
    ASSERT_EQ(parts.size(), c["indices"].size());
    for (size_t i = 0; i < parts.size(); ++i)
      EXPECT_EQ(parts[i]->indices(), c["indices"][i].get<std::vector<size_t>>());
  }
}

TEST(RandomSplit, BadLengthsAreAClearError) {
  EXPECT_TRUE(has(error_of([] {
                    random_split(range_dataset(10), {3, 6}, 0);
                  }),
                  "random_split: sum of input lengths (9) does not equal the length of the input "
                  "dataset (10)"));
  EXPECT_TRUE(has(error_of([] {
                    random_split(range_dataset(10), {2.5, 7.5}, 0);
                  }),
                  "random_split: length 2.5 is not a whole number of samples"));
}

TEST(TrainTestSplit, DisjointReproducibleAndRoundsTestUp) {
  auto ds = range_dataset(11);
  auto [train, test] = train_test_split(ds, 0.25, 3);
  EXPECT_EQ(test->size(), 3u);  // ceil(2.75)
  EXPECT_EQ(train->size(), 8u);
  std::set<size_t> all(train->indices().begin(), train->indices().end());
  all.insert(test->indices().begin(), test->indices().end());
  EXPECT_EQ(all.size(), 11u);
  auto [train2, test2] = train_test_split(ds, 0.25, 3);
  EXPECT_EQ(train2->indices(), train->indices());
  EXPECT_EQ(test2->indices(), test->indices());
  auto [train3, test3] = train_test_split(ds, 0.25, 4);
  EXPECT_NE(train3->indices(), train->indices());
  EXPECT_TRUE(has(error_of([&] { train_test_split(ds, 1.0, 0); }),
                  "train_test_split: invalid test_fraction 1 (expected between 0 and 1)"));
}

TEST(LanguageModelingDataset, CutsBlocksAndDropsTheRemainder) {
  std::vector<int64_t> tokens(23);
  std::iota(tokens.begin(), tokens.end(), 100);
  LanguageModelingDataset ds(tokens, 5);
  EXPECT_EQ(ds.size(), 4u);
  auto example = ds.get(2);
  EXPECT_EQ(ids_of(example.at("input_ids")), (std::vector<int64_t>{110, 111, 112, 113, 114}));
  EXPECT_TRUE(torch::equal(example.at("labels"), example.at("input_ids")));
  // The sample is a copy: changing it leaves the dataset alone.
  example.at("labels").fill_(-100);
  EXPECT_EQ(ds.get(2).at("labels")[0].item<int64_t>(), 110);
  EXPECT_TRUE(has(error_of([] {
                    LanguageModelingDataset(std::vector<int64_t>{1, 2, 3}, 4);
                  }),
                  "LanguageModelingDataset: 3 tokens are fewer than one block of block_size 4"));
  EXPECT_TRUE(has(error_of([] { LanguageModelingDataset(torch::zeros({4}), 2); }),
                  "expected a 1-D integer tensor of token ids"));
}

TEST(LanguageModelingDataset, FromTextFile) {
  auto path = write_file("lm.txt", "abcdefg");
  auto ds = LanguageModelingDataset::from_text_file(path, encode_bytes, 3);
  EXPECT_EQ(ds->size(), 2u);
  EXPECT_EQ(ids_of(ds->get(1).at("input_ids")), (std::vector<int64_t>{'d', 'e', 'f'}));
}

TEST(LoadTextFile, ReadsAndRejectsMissingOrEmpty) {
  EXPECT_EQ(load_text_file(write_file("t.txt", "one\ntwo\n")), "one\ntwo\n");
  EXPECT_TRUE(has(error_of([] { load_text_file("/nonexistent/x.txt"); }),
                  "/nonexistent/x.txt: cannot open (No such file or directory)"));
  auto empty = write_file("empty.txt", "");
  EXPECT_TRUE(has(error_of([&] { load_text_file(empty); }), empty + ": empty file"));
}

TEST(ClassificationDatasetCsv, ReadsRfc4180WithColumnsByName) {
  auto path = write_file("quoted.csv",
                         "id,label,text\r\n"
                         "1,0,plain\r\n"
                         "2,1,\"a, \"\"quoted\"\"\nfield\"\r\n"
                         "\r\n"
                         "3,1,\"\"\r\n");
  auto ds = ClassificationDataset::from_csv(path, "text", "label", encode_bytes, 64);
  ASSERT_EQ(ds->size(), 3u);
  EXPECT_EQ(ids_of(ds->get(0).at("input_ids")), encode_bytes("plain"));
  EXPECT_EQ(ids_of(ds->get(1).at("input_ids")), encode_bytes("a, \"quoted\"\nfield"));
  EXPECT_EQ(ds->get(2).at("input_ids").numel(), 0);
  EXPECT_EQ(ds->get(1).at("labels").item<int64_t>(), 1);
  EXPECT_EQ(ds->get(1).at("labels").dim(), 0);
  EXPECT_TRUE(ds->label_names().empty());
  EXPECT_EQ(ds->num_labels(), 2);
}

TEST(ClassificationDatasetCsv, SkipsAByteOrderMarkAndReadsAFinalLineWithoutNewline) {
  auto path = write_file("bom.csv", "\xEF\xBB\xBFtext,label\na,2\nb,0");
  auto ds = ClassificationDataset::from_csv(path, "text", "label", encode_bytes, 8);
  ASSERT_EQ(ds->size(), 2u);
  EXPECT_EQ(ds->get(1).at("labels").item<int64_t>(), 0);
  EXPECT_EQ(ds->num_labels(), 3);
}

TEST(ClassificationDatasetCsv, StringLabelsGetIdsInFirstSeenOrderAndTextIsTruncated) {
  auto path = write_file("names.csv", "text,sentiment\nhello world,pos\nbad,neg\nfine,pos\n");
  auto ds = ClassificationDataset::from_csv(path, "text", "sentiment", encode_bytes, 4);
  EXPECT_EQ(ds->label_names(), (std::vector<std::string>{"pos", "neg"}));
  EXPECT_EQ(ds->label_to_id(), (std::map<std::string, int64_t>{{"pos", 0}, {"neg", 1}}));
  EXPECT_EQ(ds->num_labels(), 2);
  EXPECT_EQ(ds->get(1).at("labels").item<int64_t>(), 1);
  EXPECT_EQ(ds->get(2).at("labels").item<int64_t>(), 0);
  EXPECT_EQ(ids_of(ds->get(0).at("input_ids")), encode_bytes("hell"));
}

TEST(ClassificationDatasetCsv, BadInputNamesFileLineAndProblem) {
  auto load = [](const std::string& path, std::optional<int64_t> num_labels = std::nullopt) {
    return [=] {
      ClassificationDataset::from_csv(path, "text", "label", encode_bytes, 8, num_labels);
    };
  };
  EXPECT_TRUE(has(error_of(load("/nonexistent/a.csv")),
                  "/nonexistent/a.csv: cannot open (No such file or directory)"));
  auto empty = write_file("empty.csv", "\n\n");
  EXPECT_TRUE(has(error_of(load(empty)), empty + ": empty file"));
  auto header_only = write_file("header.csv", "text,label\n");
  EXPECT_TRUE(has(error_of(load(header_only)), header_only + ": no data rows"));
  auto missing = write_file("missing.csv", "review,stars\nx,1\n");
  EXPECT_TRUE(has(error_of(load(missing)),
                  missing + ": no column 'text' in the header; columns found: review, stars"));
  auto ragged = write_file("ragged.csv", "text,label\na,1\n\"b\nc\",1\nd\n");
  EXPECT_TRUE(
      has(error_of(load(ragged)), ragged + ":5: expected 2 columns (as in the header), got 1"));
  auto non_int = write_file("nonint.csv", "text,label\na,1\nb,pos\n");
  EXPECT_TRUE(has(error_of(load(non_int)),
                  non_int + ":3: label column 'label': expected an integer class id (as on line "
                            "2), got pos"));
  auto negative = write_file("negative.csv", "text,label\na,-1\n");
  EXPECT_TRUE(has(error_of(load(negative)),
                  negative + ":2: label column 'label': class id -1 is out of range"));
  auto too_big = write_file("toobig.csv", "text,label\na,1\nb,3\n");
  EXPECT_TRUE(has(error_of(load(too_big, 3)),
                  too_big + ":3: label column 'label': class id 3 is out of range [0, 3)"));
  auto too_many = write_file("toomany.csv", "text,label\na,x\nb,y\nc,z\n");
  EXPECT_TRUE(has(error_of(load(too_many, 2)), too_many + ":4: label column 'label': class name z "
                                                          "is class #3 but num_labels is 2"));
  auto unterminated = write_file("unterminated.csv", "text,label\n\"abc,1\n");
  EXPECT_TRUE(has(error_of(load(unterminated)), unterminated + ":2: unterminated quoted field"));
  auto stray = write_file("stray.csv", "text,label\n\"abc\"x,1\n");
  EXPECT_TRUE(has(error_of(load(stray)),
                  stray + ":2: expected a comma or the end of the line after a closing quote"));
}

TEST(ClassificationDatasetJsonl, ReadsObjectsByKey) {
  auto path = write_file("data.jsonl",
                         "{\"text\": \"hi\", \"label\": \"b\", \"extra\": 1}\n"
                         "\n"
                         "{\"label\": \"a\", \"text\": \"yo\\n\"}\r\n"
                         "{\"text\": \"x\", \"label\": \"b\"}\n");
  auto ds = ClassificationDataset::from_jsonl(path, "text", "label", encode_bytes, 16);
  ASSERT_EQ(ds->size(), 3u);
  EXPECT_EQ(ds->label_names(), (std::vector<std::string>{"b", "a"}));
  EXPECT_EQ(ids_of(ds->get(1).at("input_ids")), encode_bytes("yo\n"));
  EXPECT_EQ(ds->get(2).at("labels").item<int64_t>(), 0);

  auto ints = write_file("ints.jsonl", "{\"t\": \"a\", \"y\": 2}\n{\"t\": \"b\", \"y\": 0}\n");
  auto ds2 = ClassificationDataset::from_jsonl(ints, "t", "y", encode_bytes, 16);
  EXPECT_EQ(ds2->num_labels(), 3);
  EXPECT_EQ(ds2->get(0).at("labels").item<int64_t>(), 2);
}

TEST(ClassificationDatasetJsonl, BadInputNamesFileLineAndProblem) {
  auto load = [](const std::string& path) {
    return [=] { ClassificationDataset::from_jsonl(path, "text", "label", encode_bytes, 8); };
  };
  EXPECT_TRUE(has(error_of(load("/nonexistent/a.jsonl")),
                  "/nonexistent/a.jsonl: cannot open (No such file or directory)"));
  auto empty = write_file("empty.jsonl", "");
  EXPECT_TRUE(has(error_of(load(empty)), empty + ": empty file"));
  auto malformed = write_file("malformed.jsonl", "{\"text\": \"a\", \"label\": 1}\n{\"text\": \n");
  EXPECT_TRUE(has(error_of(load(malformed)), malformed + ":2: malformed JSON ("));
  auto array = write_file("array.jsonl", "[1, 2]\n");
  EXPECT_TRUE(has(error_of(load(array)), array + ":1: expected a JSON object, got array"));
  auto missing = write_file("missingkey.jsonl", "{\"sentence\": \"a\", \"label\": 1}\n");
  EXPECT_TRUE(
      has(error_of(load(missing)), missing + ":1: no key 'text'; keys found: label, sentence"));
  auto fractional = write_file("float.jsonl", "{\"text\": \"a\", \"label\": 1.5}\n");
  EXPECT_TRUE(has(error_of(load(fractional)),
                  fractional + ":1: label key 'label' must be an integer class id or a string "
                               "class name, got 1.5"));
  auto mixed = write_file("mixed.jsonl",
                          "{\"text\": \"a\", \"label\": 1}\n{\"text\": \"b\", \"label\": \"1\"}\n");
  EXPECT_TRUE(has(error_of(load(mixed)),
                  mixed + ":2: label key 'label': expected an integer class id (as on line 1), "
                          "got \"1\""));
  auto mixed2 = write_file(
      "mixed2.jsonl", "{\"text\": \"a\", \"label\": \"x\"}\n{\"text\": \"b\", \"label\": 0}\n");
  EXPECT_TRUE(has(error_of(load(mixed2)), mixed2 + ":2: label key 'label': expected a string "
                                                   "class name (as on line 1), got 0"));
  auto text_type = write_file("texttype.jsonl", "{\"text\": 5, \"label\": 0}\n");
  EXPECT_TRUE(has(error_of(load(text_type)), text_type + ":1: key 'text' must be a string, got 5"));
  // Found while writing fuzz/fuzz_dataset.cpp: a number too large for a double escaped as
  // a raw JSON error; the largest class id + 1 overflowed.
  auto overflow = write_file("overflow.jsonl", "{\"text\": \"a\", \"label\": 1e400}\n");
  EXPECT_TRUE(has(error_of(load(overflow)), overflow + ":1: malformed JSON (") &&
              has(error_of(load(overflow)), "number overflow"));
  auto huge = write_file("huge.jsonl", "{\"text\": \"a\", \"label\": 9223372036854775807}\n");
  EXPECT_TRUE(has(error_of(load(huge)), huge + ":1: label key 'label': class id "
                                               "9223372036854775807 is out of range (expected < "
                                               "2147483647; or pass num_labels)"));
  EXPECT_TRUE(has(error_of([&] {
                    ClassificationDataset::from_jsonl(huge, "text", "label", encode_bytes, 8, 4);
                  }),
                  "class id 9223372036854775807 is out of range [0, 4)"));
}

}  // namespace
