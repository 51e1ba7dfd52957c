#include "mixprec/data/dataloader.h"

#include "data/test_util.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <set>

namespace {

using namespace mixprec::data;
using data_test::error_of;
using data_test::has;
using data_test::reference;

std::shared_ptr<TensorDataset> range_dataset(int64_t n) {
  return std::make_shared<TensorDataset>(std::map<std::string, at::Tensor>{
      {"index", torch::arange(n)}, {"x", torch::arange(n, torch::kFloat).unsqueeze(1)}});
}

// The sample indices of every batch of one pass.
std::vector<std::vector<int64_t>> pass(DataLoader& loader) {
  std::vector<std::vector<int64_t>> batches;
  for (const Batch& batch : loader) {
    const auto& index = batch.at("index");
    batches.emplace_back(index.data_ptr<int64_t>(), index.data_ptr<int64_t>() + index.numel());
  }
  return batches;
}

TEST(DataLoader, BatchOrderEqualsPythonsDistributedSampler) {
  ASSERT_FALSE(reference()["loader"].empty());
  for (const auto& c : reference()["loader"]) {
    const auto num_replicas = c["num_replicas"].get<size_t>();
    for (size_t rank = 0; rank < num_replicas; ++rank) {
      SCOPED_TRACE("n=" + c["n"].dump() + " batch_size=" + c["batch_size"].dump() +
                   " shuffle=" + c["shuffle"].dump() + " seed=" + c["seed"].dump() +
                   " epoch=" + c["epoch"].dump() + " drop_last=" + c["drop_last"].dump() +
                   " rank " + std::to_string(rank) + "/" + std::to_string(num_replicas));
      DataLoader loader(range_dataset(c["n"]), {.batch_size = c["batch_size"],
                                                .shuffle = c["shuffle"],
                                                .seed = c["seed"].get<uint64_t>(),
                                                .drop_last = c["drop_last"],
                                                .num_replicas = num_replicas,
                                                .rank = rank});
      loader.set_epoch(c["epoch"]);
      const auto expected = c["batches_per_rank"][rank].get<std::vector<std::vector<int64_t>>>();
      EXPECT_EQ(loader.size(), expected.size());
      EXPECT_EQ(pass(loader), expected);
    }
  }
}

// Accelerate's prepared loaders: whole batches to the ranks in turn, padded from the start so
// that every batch is full; less each rank's padding, every sample once.
TEST(DataLoader, BatchSamplerShardEqualsAcceleratesPreparedLoader) {
  ASSERT_FALSE(reference()["accelerate_loader"].empty());
  for (const auto& c : reference()["accelerate_loader"]) {
    const auto num_replicas = c["num_replicas"].get<size_t>();
    const auto n = c["n"].get<int64_t>();
    std::multiset<int64_t> kept;
    size_t padding = 0, samples = 0;
    for (size_t rank = 0; rank < num_replicas; ++rank) {
      SCOPED_TRACE(c.dump().substr(0, 200) + " rank " + std::to_string(rank));
      DataLoader loader(range_dataset(n),
                        {.batch_size = c["batch_size"],
                         .shuffle = c["shuffle"],
                         .seed = c["seed"].get<uint64_t>(),
                         .drop_last = c["drop_last"],
                         .num_replicas = num_replicas,
                         .rank = rank,
                         .sharding = mixprec::data::Sharding::kBatchSamplerShard});
      loader.set_epoch(c["epoch"]);
      const auto expected = c["batches_per_rank"][rank].get<std::vector<std::vector<int64_t>>>();
      EXPECT_EQ(loader.size(), expected.size());
      auto batches = pass(loader);
      EXPECT_EQ(batches, expected);
      if (batches.empty()) continue;
      batches.back().resize(batches.back().size() - loader.num_padding_samples());
      for (const auto& b : batches) kept.insert(b.begin(), b.end());
      padding += loader.num_padding_samples();
      samples += loader.num_samples();
    }
    if (c["drop_last"]) continue;
    EXPECT_EQ(padding, samples - static_cast<size_t>(n));
    EXPECT_EQ(kept.size(), static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(kept.count(i), 1u) << i;
  }
}

TEST(DataLoader, LengthGroupedIndicesEqualTransformers) {
  ASSERT_FALSE(reference()["length_grouped_indices"].empty());
  for (const auto& c : reference()["length_grouped_indices"]) {
    SCOPED_TRACE(c.dump().substr(0, 120));
    const auto lengths = c["lengths"].get<std::vector<int64_t>>();
    const std::optional<size_t> mult =
        c["mega_batch_mult"].is_null() ? std::nullopt
                                       : std::optional<size_t>(c["mega_batch_mult"].get<size_t>());
    EXPECT_EQ(get_length_grouped_indices(
                  lengths, c["batch_size"], mult,
                  at::make_generator<at::CPUGeneratorImpl>(c["seed"].get<uint64_t>())),
              c["indices"].get<std::vector<size_t>>());
  }
  // Without a generator, torch's default one: the same after the same manual_seed.
  const std::vector<int64_t> lengths{5, 1, 4, 2, 3, 9, 9, 1};
  torch::manual_seed(3);
  const auto first = get_length_grouped_indices(lengths, 2);
  torch::manual_seed(3);
  EXPECT_EQ(get_length_grouped_indices(lengths, 2), first);
  EXPECT_EQ(lengths[first[0]], 9);  // the longest first
  EXPECT_TRUE(get_length_grouped_indices({}, 4).empty());
  EXPECT_TRUE(has(error_of([&] { get_length_grouped_indices(lengths, 0); }),
                  "get_length_grouped_indices: invalid batch_size 0 (expected > 0)"));
}

// group_by_length: transformers' LengthGroupedSampler (its generator seeded with seed + epoch)
// in a loader prepared by Accelerate, on one rank or several; a pass resumed mid-way yields
// the rest of the same order.
TEST(DataLoader, GroupByLengthEqualsLengthGroupedSamplerThroughAccelerate) {
  ASSERT_FALSE(reference()["length_grouped_loader"].empty());
  for (const auto& c : reference()["length_grouped_loader"]) {
    const auto num_replicas = c["num_replicas"].get<size_t>();
    const auto lengths = c["lengths"].get<std::vector<int64_t>>();
    for (size_t rank = 0; rank < num_replicas; ++rank) {
      SCOPED_TRACE(c.dump().substr(0, 200) + " rank " + std::to_string(rank));
      const DataLoaderOptions options{
          .batch_size = c["batch_size"],
          .shuffle = true,
          .seed = c["seed"].get<uint64_t>(),
          .drop_last = c["drop_last"],
          .num_replicas = num_replicas,
          .rank = rank,
          .sharding = Sharding::kBatchSamplerShard,
          .group_by_length = LengthGrouping{lengths, c["group_batch_size"].get<size_t>()}};
      DataLoader loader(range_dataset(static_cast<int64_t>(lengths.size())), options);
      loader.set_epoch(c["epoch"]);
      const auto expected = c["batches_per_rank"][rank].get<std::vector<std::vector<int64_t>>>();
      EXPECT_EQ(loader.size(), expected.size());
      EXPECT_EQ(pass(loader), expected);

      DataLoader resumed(range_dataset(static_cast<int64_t>(lengths.size())), options);
      resumed.load_state({c["epoch"].get<int64_t>(), 2});
      EXPECT_EQ(pass(resumed), decltype(expected)(expected.begin() + 2, expected.end()));
    }
  }
}

// Without a batch size of its own, the grouping takes the loader's; with DistributedSampler's
// sharding, the ranks share the grouped order as transformers' DistributedLengthGroupedSampler
// did: padded by repeating it from its start, then indices[rank::num_replicas].
TEST(DataLoader, GroupByLengthWithTheLoadersBatchSizeAndDistributedSampler) {
  const std::vector<int64_t> lengths{4, 9, 1, 7, 7, 3, 12, 5, 2, 8, 6, 10, 11};
  const auto order = get_length_grouped_indices(lengths, 3, std::nullopt,
                                                at::make_generator<at::CPUGeneratorImpl>(5 + 1));
  for (size_t rank = 0; rank < 2; ++rank) {
    DataLoader loader(range_dataset(13), {.batch_size = 3,
                                          .shuffle = true,
                                          .seed = 5,
                                          .num_replicas = 2,
                                          .rank = rank,
                                          .group_by_length = LengthGrouping{lengths}});
    loader.set_epoch(1);
    std::vector<int64_t> expected, got;
    for (size_t j = 0; j < 7; ++j)
      expected.push_back(static_cast<int64_t>(order[(rank + 2 * j) % 13]));
    for (const auto& batch : pass(loader)) got.insert(got.end(), batch.begin(), batch.end());
    EXPECT_EQ(got, expected) << "rank " << rank;
  }
}

// ShuffleOrder::kRandomSampler: each rank as Accelerate's default prepared loader in its own
// process: a new order each pass (from torch's generator with one process; from a generator
// seeded at prepare with several), and torch's generator drawn as Python's DataLoader draws it.
TEST(DataLoader, RandomSamplerEqualsAcceleratesDefaultOverPasses) {
  ASSERT_FALSE(reference()["accelerate_random_sampler"].empty());
  for (const auto& c : reference()["accelerate_random_sampler"]) {
    const auto num_replicas = c["num_replicas"].get<size_t>();
    for (size_t rank = 0; rank < num_replicas; ++rank) {
      SCOPED_TRACE(c.dump().substr(0, 120) + " rank " + std::to_string(rank));
      torch::manual_seed(c["seed"].get<uint64_t>());
      std::optional<at::Generator> generator;
      if (num_replicas > 1 && c["shuffle"])  // as Accelerator::prepare_data_loader seeds it
        generator = at::make_generator<at::CPUGeneratorImpl>(
            at::empty({}, at::kLong).random_().item<int64_t>());
      DataLoader loader(range_dataset(c["n"]), {.batch_size = c["batch_size"],
                                                .shuffle = c["shuffle"],
                                                .drop_last = c["drop_last"],
                                                .num_workers = c["num_workers"],
                                                .num_replicas = num_replicas,
                                                .rank = rank,
                                                .sharding = Sharding::kBatchSamplerShard,
                                                .shuffle_order = ShuffleOrder::kRandomSampler,
                                                .generator = generator});
      const auto got = mixprec::testing::random_sampler_passes(loader, "index");
      EXPECT_EQ(got["passes"], c["ranks"][rank]["passes"]);
      EXPECT_EQ(got["draws"], c["ranks"][rank]["draws"]);
    }
  }
}

// A pass stopped mid-way resumes from its state with the same order and the same generator
// afterwards, with or without a generator, and between passes the generator's state is kept.
// state_at names a position in a pass already read to its end.
TEST(DataLoader, RandomSamplerResumesMidPass) {
  for (const bool with_generator : {false, true}) {
    SCOPED_TRACE(with_generator ? "generator" : "torch's generator");
    auto make = [&] {
      return DataLoaderOptions{
          .batch_size = 3,
          .shuffle = true,
          .shuffle_order = ShuffleOrder::kRandomSampler,
          .generator = with_generator ? std::optional(at::make_generator<at::CPUGeneratorImpl>(5))
                                      : std::nullopt};
    };
    torch::manual_seed(1);
    DataLoader loader(range_dataset(10), make());
    const auto first = pass(loader);
    DataLoaderState state;
    std::vector<std::vector<int64_t>> whole;
    for (const Batch& batch : loader) {
      const auto& index = batch.at("index");
      whole.emplace_back(index.data_ptr<int64_t>(), index.data_ptr<int64_t>() + index.numel());
      if (whole.size() == 2) state = loader.state();
    }
    // Read to its end, the pass is still there to name a position in (a checkpoint behind the
    // batches read), until the next one begins.
    EXPECT_EQ(loader.state().batches_yielded, 0);
    EXPECT_EQ(loader.state_at(state.epoch, 2), state);
    const auto rng = at::detail::getDefaultCPUGenerator().get_state();
    const auto after = pass(loader);
    EXPECT_NE(whole, first);
    EXPECT_EQ(state.batches_yielded, 2);
    EXPECT_EQ(state.pass_seed.has_value(), !with_generator);
    EXPECT_EQ(state.generator_state.has_value(), with_generator);

    // Through JSON, as a checkpoint keeps it.
    const auto restored = nlohmann::json(state).get<DataLoaderState>();
    EXPECT_EQ(restored, state);
    torch::manual_seed(2);  // another stream: the resumed pass must not depend on it
    DataLoader resumed(range_dataset(10), make());
    resumed.load_state(restored);
    EXPECT_EQ(resumed.state_at(restored.epoch, 2), restored);  // before the pass begins
    const auto rest = pass(resumed);
    EXPECT_EQ(resumed.state_at(restored.epoch, 2), restored);  // after it is read
    EXPECT_EQ(rest, std::vector(whole.begin() + 2, whole.end()));
    at::Generator default_generator = at::detail::getDefaultCPUGenerator();
    default_generator.set_state(rng);
    EXPECT_EQ(pass(resumed), after);
  }
  DataLoader no_seed(
      range_dataset(10),
      {.batch_size = 3, .shuffle = true, .shuffle_order = ShuffleOrder::kRandomSampler});
  EXPECT_TRUE(has(error_of([&] { no_seed.load_state({0, 2}); }), "without the pass_seed"));
  // A RandomSampler's position loaded into a loader that shuffles by seed + epoch: the rest of
  // that epoch is another order, which a warning says.
  {
    mixprec::testing::CapturedWarnings warnings;
    DataLoader seeded(range_dataset(10), {.batch_size = 3, .shuffle = true, .seed = 0});
    seeded.load_state({.epoch = 0, .batches_yielded = 2, .pass_seed = 7});
    ASSERT_EQ(warnings.messages.size(), 1u);
    EXPECT_TRUE(has(warnings.messages[0], "saved by a RandomSampler's shuffle"));
  }
  // No pass has begun to name a position in, with or without a generator.
  EXPECT_TRUE(has(error_of([&] { no_seed.state_at(0, 2); }), "before any pass began"));
  DataLoader with_generator(range_dataset(10),
                            {.batch_size = 3,
                             .shuffle = true,
                             .shuffle_order = ShuffleOrder::kRandomSampler,
                             .generator = at::make_generator<at::CPUGeneratorImpl>(1)});
  EXPECT_TRUE(has(error_of([&] { with_generator.state_at(0, 2); }), "before any pass began"));
  EXPECT_TRUE(has(error_of([&] {
                    DataLoader(range_dataset(10),
                               {.generator = at::make_generator<at::CPUGeneratorImpl>(1)});
                  }),
                  "a generator is for shuffle_order = ShuffleOrder::kRandomSampler"));
}

TEST(DataLoader, TwoReplicasCoverEveryIndexOncePlusPadding) {
  const int64_t n = 23;
  std::multiset<int64_t> seen;
  size_t padding = 0;
  for (size_t rank = 0; rank < 2; ++rank) {
    DataLoader loader(
        range_dataset(n),
        {.batch_size = 5, .shuffle = true, .seed = 9, .num_replicas = 2, .rank = rank});
    loader.set_epoch(1);
    EXPECT_EQ(loader.num_samples(), 12u);
    EXPECT_EQ(loader.size(), 3u);
    auto batches = pass(loader);
    EXPECT_EQ(batches.back().size(), 2u);
    for (const auto& b : batches) seen.insert(b.begin(), b.end());
    padding += loader.num_padding_samples();
    EXPECT_EQ(loader.num_padding_samples(), rank == 1 ? 1u : 0u);
  }
  EXPECT_EQ(seen.size(), 24u);
  EXPECT_EQ(padding, 1u);
  for (int64_t i = 0; i < n; ++i) EXPECT_GE(seen.count(i), 1u) << i;
  EXPECT_EQ(std::set<int64_t>(seen.begin(), seen.end()).size(), static_cast<size_t>(n));

  // drop_last: no padding, 11 samples each, and no index twice.
  std::set<int64_t> unique;
  for (size_t rank = 0; rank < 2; ++rank) {
    DataLoader loader(
        range_dataset(n),
        {.batch_size = 5, .shuffle = true, .drop_last = true, .num_replicas = 2, .rank = rank});
    EXPECT_EQ(loader.num_samples(), 11u);
    EXPECT_EQ(loader.size(), 2u);
    EXPECT_EQ(loader.num_padding_samples(), 0u);
    for (const auto& b : pass(loader)) unique.insert(b.begin(), b.end());
  }
  EXPECT_EQ(unique.size(), 20u);
}

TEST(DataLoader, EpochsChangeTheShuffleOrder) {
  DataLoader loader(range_dataset(20), {.batch_size = 4, .shuffle = true, .seed = 5});
  auto first = pass(loader);
  EXPECT_EQ(pass(loader), first);  // same epoch, same order (PyTorch's rule)
  loader.set_epoch(1);
  EXPECT_NE(pass(loader), first);
  DataLoader plain(range_dataset(5), {.batch_size = 2});
  EXPECT_EQ(pass(plain), (std::vector<std::vector<int64_t>>{{0, 1}, {2, 3}, {4}}));
}

TEST(DataLoader, ResumesMidEpochWithExactlyTheRemainingBatches) {
  const DataLoaderOptions options{.batch_size = 3, .shuffle = true, .seed = 11};
  DataLoader full(range_dataset(20), options);
  full.set_epoch(2);
  const auto all = pass(full);
  ASSERT_EQ(all.size(), 7u);

  DataLoader interrupted(range_dataset(20), options);
  interrupted.set_epoch(2);
  nlohmann::json saved;
  size_t seen = 0;
  for (const Batch& batch : interrupted) {
    (void)batch;
    if (++seen == 3) {
      saved = interrupted.state();  // saved inside the loop body, after the 3rd batch's step
      break;
    }
  }
  EXPECT_EQ(saved, nlohmann::json({{"epoch", 2}, {"batches_yielded", 3}}));

  DataLoader resumed(range_dataset(20), options);
  resumed.load_state(saved.get<DataLoaderState>());
  resumed.set_epoch(2);  // a training loop's usual call keeps the position
  EXPECT_EQ(pass(resumed), std::vector<std::vector<int64_t>>(all.begin() + 3, all.end()));
  EXPECT_EQ(resumed.state(), (DataLoaderState{2, 0}));  // a finished pass restarts the epoch
  EXPECT_EQ(pass(resumed), all);

  // Without load_state a new pass starts the epoch over, as Python's iter() does, also after
  // one that was left early.
  EXPECT_EQ(pass(interrupted), all);

  // Saved after the last batch: nothing left of that epoch.
  DataLoader at_end(range_dataset(20), options);
  at_end.load_state({2, 7});
  EXPECT_TRUE(pass(at_end).empty());
}

TEST(DataLoader, StateErrorsAreClear) {
  DataLoader loader(range_dataset(10), {.batch_size = 4});
  EXPECT_TRUE(has(error_of([&] {
                    loader.load_state({0, 4});
                  }),
                  "DataLoader::load_state: batches_yielded 4 out of range [0, 3]"));
  EXPECT_TRUE(has(error_of([] {
                    nlohmann::json{{"epoch", 1}}.get<DataLoaderState>();
                  }),
                  "DataLoaderState: expected an integer 'batches_yielded' in {\"epoch\":1}"));
}

TEST(DataLoader, WorkersYieldTheSameOrder) {
  auto ds = range_dataset(37);
  DataLoader serial(ds, {.batch_size = 4, .shuffle = true, .seed = 3});
  const auto expected = pass(serial);
  for (size_t workers : {1, 2, 3}) {
    for (size_t prefetch : {1, 2}) {
      SCOPED_TRACE(std::to_string(workers) + " workers, prefetch " + std::to_string(prefetch));
      DataLoader loader(ds, {.batch_size = 4,
                             .shuffle = true,
                             .seed = 3,
                             .num_workers = workers,
                             .prefetch_factor = prefetch});
      EXPECT_EQ(pass(loader), expected);
      EXPECT_EQ(pass(loader), expected);
      // Abandoned after two batches: the workers stop, a new pass starts over, and one from
      // the saved position continues in order.
      size_t taken = 0;
      for (const Batch& batch : loader) {
        (void)batch;
        if (++taken == 2) break;
      }
      const DataLoaderState after_two = loader.state();
      EXPECT_EQ(pass(loader), expected);
      loader.load_state(after_two);
      EXPECT_EQ(pass(loader),
                std::vector<std::vector<int64_t>>(expected.begin() + 2, expected.end()));
    }
  }
}

// Fails on one index, as a corrupt sample would.
class FailingDataset : public Dataset {
 public:
  size_t size() const override { return 10; }
  Example get(size_t index) const override {
    TORCH_CHECK(index != 6, "bad sample ", index);
    return {{"index", torch::tensor(static_cast<int64_t>(index))}};
  }
};

TEST(DataLoader, ErrorsFromWorkersReachTheCaller) {
  for (size_t workers : {0, 2}) {
    SCOPED_TRACE(std::to_string(workers) + " workers");
    DataLoader loader(std::make_shared<FailingDataset>(),
                      {.batch_size = 2, .num_workers = workers});
    size_t batches = 0;
    const auto error = error_of([&] {
      for (const Batch& batch : loader) {
        (void)batch;
        ++batches;
      }
    });
    EXPECT_TRUE(has(error, "bad sample 6")) << error;
    EXPECT_EQ(batches, 3u);
    EXPECT_EQ(loader.state().batches_yielded, 3);
  }
}

TEST(DataLoader, UserCollateAndDefaultCollate) {
  DataLoader loader(range_dataset(6), {.batch_size = 4}, [](const std::vector<Example>& examples) {
    Batch batch = collate(examples);
    batch["count"] = torch::tensor(static_cast<int64_t>(examples.size()));
    return batch;
  });
  std::vector<int64_t> counts;
  for (const Batch& batch : loader) {
    counts.push_back(batch.at("count").item<int64_t>());
    EXPECT_EQ(batch.at("x").dim(), 2);  // (B, 1)
  }
  EXPECT_EQ(counts, (std::vector<int64_t>{4, 2}));
}

// A TensorDataset that counts the samples read one by one.
class CountingTensorDataset : public TensorDataset {
 public:
  using TensorDataset::TensorDataset;
  Example get(size_t index) const override {
    ++reads;
    return TensorDataset::get(index);
  }
  mutable int reads = 0;
};

TEST(DataLoader, TensorDatasetsGatherBatchesAtOnceAsCollateWould) {
  torch::manual_seed(0);
  auto full = std::make_shared<CountingTensorDataset>(
      std::map<std::string, at::Tensor>{{"features", torch::randn({10, 3, 2})},
                                        {"labels", torch::arange(10) * 7},
                                        {"mask", torch::rand({10}) > 0.5},
                                        {"strided", torch::randn({4, 10}).t()}});
  auto subset = std::make_shared<Subset>(full, std::vector<size_t>{9, 2, 4, 0, 7, 5, 1});
  for (size_t workers : {0, 2}) {
    SCOPED_TRACE(std::to_string(workers) + " workers");
    const DataLoaderOptions options{
        .batch_size = 3, .shuffle = true, .seed = 5, .num_workers = workers};
    DataLoader one_by_one(subset, options,
                          [](const std::vector<Example>& examples) { return collate(examples); });
    std::vector<Batch> expected;
    for (const Batch& batch : one_by_one) expected.push_back(batch);
    ASSERT_EQ(expected.size(), 3u);
    full->reads = 0;
    DataLoader gathered(subset, options);
    size_t b = 0;
    for (const Batch& batch : gathered) {
      ASSERT_LT(b, expected.size());
      ASSERT_EQ(batch.size(), expected[b].size());
      for (const auto& [key, t] : expected[b]) {
        EXPECT_EQ(batch.at(key).scalar_type(), t.scalar_type()) << key;
        EXPECT_EQ(batch.at(key).sizes(), t.sizes()) << key;
        EXPECT_TRUE(torch::equal(batch.at(key), t)) << key;
      }
      ++b;
    }
    EXPECT_EQ(b, expected.size());
    EXPECT_EQ(full->reads, 0);  // gathered by get_batch, not read sample by sample
  }
  // Row copies and index_select (for a large batch, rows of 0 bytes, a strided, conjugated,
  // negated or grad-requiring tensor) give index_select's rows, in a tensor of their own.
  const auto wide = torch::randn({10, 70000});  // 280 KB a row
  const auto offset = torch::randn({12, 2}).narrow(0, 2, 10);
  const auto learned = torch::randn({10, 2}, torch::requires_grad());
  const auto conj = torch::randn({10, 2}, torch::kComplexFloat).conj();
  const auto negated = at::_neg_view(torch::randn({10, 2}));
  ASSERT_TRUE(conj.is_contiguous() && negated.is_contiguous() && negated.is_neg());
  const TensorDataset kinds({{"features", full->tensors().at("features")},
                             {"labels", full->tensors().at("labels")},
                             {"strided", full->tensors().at("strided")},
                             {"wide", wide},
                             {"offset", offset},
                             {"learned", learned},
                             {"conj", conj},
                             {"negated", negated},
                             {"no_columns", torch::zeros({10, 0})}});
  const std::vector<size_t> rows{7, 2, 2, 9};
  const Batch batch = *kinds.get_batch(rows);
  const auto index = torch::tensor({7, 2, 2, 9});
  for (const auto& [key, t] : kinds.tensors()) {
    EXPECT_TRUE(torch::equal(batch.at(key), t.index_select(0, index))) << key;
    EXPECT_TRUE(batch.at(key).is_contiguous()) << key;
    if (t.numel() > 0) {
      EXPECT_NE(batch.at(key).const_data_ptr(), t.const_data_ptr()) << key;
    }
  }
  EXPECT_TRUE(batch.at("learned").requires_grad());
  EXPECT_FALSE(batch.at("features").requires_grad());
  batch.at("features").zero_();
  EXPECT_TRUE(torch::equal(batch.at("labels"), torch::tensor({49, 14, 14, 63})));
  EXPECT_NE(full->tensors().at("features")[7].abs().sum().item<float>(), 0.0f);
  EXPECT_EQ(kinds.get_batch({})->at("features").sizes(), (std::vector<int64_t>{0, 3, 2}));

  EXPECT_TRUE(has(error_of([&] {
                    full->get_batch({3, 10});
                  }),
                  "TensorDataset: index 10 out of range for size 10"));
  EXPECT_TRUE(
      has(error_of([&] { subset->get_batch({7}); }), "Subset: index 7 out of range for size 7"));
}

TEST(DataLoader, BadOptionsAreAClearError) {
  EXPECT_TRUE(has(error_of([] { DataLoader(range_dataset(4), {.batch_size = 0}); }),
                  "DataLoader: invalid batch_size 0 (expected > 0)"));
  EXPECT_TRUE(has(error_of([] { DataLoader(range_dataset(4), {.num_replicas = 2, .rank = 2}); }),
                  "DataLoader: invalid rank 2, rank should be in the interval [0, 1]"));
  EXPECT_TRUE(has(error_of([] { DataLoader(nullptr); }), "DataLoader: no dataset given"));
  EXPECT_TRUE(has(error_of([] {
                    DataLoader(range_dataset(4), {.group_by_length = LengthGrouping{{1, 2, 3, 4}}});
                  }),
                  "DataLoader: group_by_length groups a shuffled order of seed + epoch; set "
                  "shuffle = true (with ShuffleOrder::kSeedPlusEpoch)"));
  EXPECT_TRUE(has(error_of([] {
                    DataLoader(range_dataset(4), {.shuffle = true,
                                                  .shuffle_order = ShuffleOrder::kRandomSampler,
                                                  .group_by_length = LengthGrouping{{1, 2, 3, 4}}});
                  }),
                  "set shuffle = true (with ShuffleOrder::kSeedPlusEpoch)"));
  EXPECT_TRUE(has(error_of([] {
                    DataLoader(range_dataset(4),
                               {.shuffle = true, .group_by_length = LengthGrouping{{1, 2, 3}}});
                  }),
                  "DataLoader: group_by_length has 3 lengths for a dataset of 4 samples"));
}

}  // namespace
