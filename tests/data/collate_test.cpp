#include "mixprec/data/collate.h"

#include "data/test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

using namespace mixprec::data;
using data_test::error_of;
using data_test::has;

TEST(Collate, StacksSameShapeTensors) {
  std::vector<Example> examples;
  for (int64_t i = 0; i < 3; ++i)
    examples.push_back(
        {{"pixels", torch::full({64}, static_cast<float>(i))}, {"labels", torch::tensor(i)}});
  auto batch = collate(examples);
  EXPECT_EQ(batch.size(), 2u);
  EXPECT_EQ(batch.at("pixels").sizes(), (std::vector<int64_t>{3, 64}));
  EXPECT_TRUE(torch::equal(batch.at("labels"), torch::tensor({0, 1, 2})));
}

TEST(Collate, PadsSequencesAndAddsAnAttentionMask) {
  std::vector<Example> examples = {
      {{"input_ids", torch::tensor({5, 6, 7})}, {"labels", torch::tensor({5, 6, 7})}},
      {{"input_ids", torch::tensor({8})}, {"labels", torch::tensor({8})}},
  };
  auto batch = collate(examples);
  EXPECT_TRUE(torch::equal(batch.at("input_ids"), torch::tensor({{5, 6, 7}, {8, 0, 0}})));
  EXPECT_TRUE(torch::equal(batch.at("labels"), torch::tensor({{5, 6, 7}, {8, -100, -100}})));
  EXPECT_TRUE(torch::equal(batch.at("attention_mask"), torch::tensor({{1, 1, 1}, {1, 0, 0}})));
  EXPECT_EQ(batch.at("attention_mask").scalar_type(), torch::kLong);

  auto custom = collate(examples, {.pad_token_id = 50256, .label_pad_token_id = -1});
  EXPECT_EQ(custom.at("input_ids")[1][2].item<int64_t>(), 50256);
  EXPECT_EQ(custom.at("labels")[1][2].item<int64_t>(), -1);
}

TEST(Collate, NoMaskWithoutPaddingAndAGivenMaskIsPaddedWithZeros) {
  std::vector<Example> same = {{{"input_ids", torch::tensor({1, 2})}},
                               {{"input_ids", torch::tensor({3, 4})}}};
  EXPECT_EQ(collate(same).count("attention_mask"), 0u);
  std::vector<Example> with_mask = {
      {{"input_ids", torch::tensor({1, 2})}, {"attention_mask", torch::tensor({1, 1})}},
      {{"input_ids", torch::tensor({3})}, {"attention_mask", torch::tensor({1})}}};
  auto batch = collate(with_mask);
  EXPECT_TRUE(torch::equal(batch.at("attention_mask"), torch::tensor({{1, 1}, {1, 0}})));
}

TEST(Collate, BadInputIsAClearError) {
  EXPECT_TRUE(has(error_of([] { collate({}); }), "collate: no examples given"));
  EXPECT_TRUE(has(error_of([] {
                    collate({{{"x", torch::zeros({2, 3})}}, {{"x", torch::zeros({2, 4})}}});
                  }),
                  "collate: key 'x' has shape [2, 3] in example 0 but [2, 4] in example 1; only "
                  "1-D integer sequences can be padded"));
  EXPECT_TRUE(has(error_of([] {
                    collate({{{"x", torch::zeros({2})}}, {{"x", torch::zeros({3})}}});
                  }),
                  "only 1-D integer sequences can be padded (got 1-D Float)"));
  EXPECT_TRUE(has(
      error_of([] {
        collate({{{"x", torch::zeros({2})}, {"y", torch::zeros({1})}}, {{"x", torch::zeros({2})}}});
      }),
      "collate: example 1 has no key 'y' (example 0 has it)"));
  EXPECT_TRUE(has(
      error_of([] {
        collate({{{"x", torch::zeros({2})}}, {{"x", torch::zeros({2})}, {"y", torch::zeros({1})}}});
      }),
      "collate: example 1 has 2 keys but example 0 has 1"));
}

}  // namespace
