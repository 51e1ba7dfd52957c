// The Accelerator's utilities beside the training loop, in one process: automatic checkpoint
// naming, skip_first_batches, save_model (against HF Accelerate's files) and the collectives'
// one-process behaviour. tests/dist/data_parallel_test.cpp runs them on two processes.
#include "mixprec/accelerate/accelerator.h"
#include "mixprec/io/checkpoint.h"
#include "mixprec/io/safetensors.h"
#include "mixprec/models/gpt2.h"
#include "models/tiny_gpt2.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>

namespace {

namespace fs = std::filesystem;
using mixprec::Accelerator;
using mixprec::AcceleratorOptions;
using mixprec::testing::error_of;

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

class AcceleratorUtils : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("mixprec_utils_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename());
  std::ranges::sort(names);
  return names;
}

// save_state() without a folder names them checkpoint_0, _1, ... under project_dir/checkpoints,
// keeps total_limit, and load_state() without one takes the newest.
TEST_F(AcceleratorUtils, AutomaticCheckpointNamingKeepsTheNewestAndResumesFromIt) {
  const AcceleratorOptions options{
      .project_dir = dir_.string(),
      .project_config = {.automatic_checkpoint_naming = true, .total_limit = 2}};
  auto net = torch::nn::Linear(3, 2);
  Accelerator accelerator(options);
  auto model = accelerator.prepare(net);
  fs::create_directories(dir_ / "checkpoints" / "notes");  // not a checkpoint: kept
  for (int i = 0; i < 3; ++i) {
    {
      torch::NoGradGuard no_grad;
      net->weight.fill_(i);
    }
    EXPECT_EQ(accelerator.save_state(), dir_ / "checkpoints" / ("checkpoint_" + std::to_string(i)));
  }
  EXPECT_EQ(accelerator.save_iteration(), 3);
  EXPECT_EQ(names_in(dir_ / "checkpoints"),
            (std::vector<std::string>{"checkpoint_1", "checkpoint_2", "notes"}));

  auto fresh_net = torch::nn::Linear(3, 2);
  Accelerator resumed(options);
  auto fresh = resumed.prepare(fresh_net);
  resumed.load_state();
  EXPECT_TRUE(torch::equal(fresh_net->weight, torch::full({2, 3}, 2.0)));
  EXPECT_EQ(resumed.save_iteration(), 3);  // goes on after checkpoint_2 (Accelerate: 0)

  // A damaged newest one: the one before it, and still no clash with the damaged folder.
  std::ofstream(dir_ / "checkpoints" / "checkpoint_2" / "model.safetensors") << "garbage";
  Accelerator after_damage(options);
  auto third = after_damage.prepare(torch::nn::Linear(3, 2));
  after_damage.load_state();
  EXPECT_TRUE(torch::equal(third->weight, torch::full({2, 3}, 1.0)));
  EXPECT_EQ(after_damage.save_iteration(), 3);

  resumed.project_configuration().total_limit = 0;  // after the constructor checked it
  EXPECT_TRUE(has(error_of([&] { resumed.save_state(); }),
                  "Accelerator::save_state: project_config.total_limit must be >= 1, got 0"));
  resumed.project_configuration().total_limit = 2;
  resumed.project_configuration().iteration = 1;
  EXPECT_TRUE(
      has(error_of([&] { resumed.save_state(); }), "checkpoint_1 (iteration 1) already exists"));
}

TEST_F(AcceleratorUtils, SaveAndLoadWithoutAFolderNeedAutomaticNaming) {
  Accelerator plain({.project_dir = dir_.string()});
  EXPECT_TRUE(has(error_of([&] { plain.save_state(); }),
                  "no folder given, and project_config.automatic_checkpoint_naming is off"));
  EXPECT_TRUE(has(error_of([&] { plain.load_state(); }),
                  "no folder given, and project_config.automatic_checkpoint_naming is off"));
  EXPECT_TRUE(has(
      error_of([&] {
        Accelerator({.project_config = {.automatic_checkpoint_naming = true, .total_limit = 0}});
      }),
      "project_config.total_limit must be >= 1, got 0"));
  Accelerator automatic(
      {.project_dir = dir_.string(), .project_config = {.automatic_checkpoint_naming = true}});
  EXPECT_TRUE(has(error_of([&] { automatic.load_state(); }),
                  "no checkpoint_N folder in " + (dir_ / "checkpoints").string()));
  // A folder given is used, and counts as a save.
  EXPECT_EQ(automatic.save_state((dir_ / "mine").string()), dir_ / "mine");
  EXPECT_EQ(automatic.save_iteration(), 1);
}

std::shared_ptr<mixprec::data::TensorDataset> numbers(int64_t n) {
  return std::make_shared<mixprec::data::TensorDataset>(
      std::map<std::string, at::Tensor>{{"x", torch::arange(n)}});
}

std::vector<int64_t> firsts(
    mixprec::accelerate::PreparedDataLoader loader) {  // a copy: the same loader
  std::vector<int64_t> out;
  for (const auto& batch : loader) out.push_back(batch.at("x")[0].item<int64_t>());
  return out;
}

// A shuffled loader grouped by length, prepared without a seed (the default RandomSampler
// otherwise): it takes torch's seed, as a seedable sampler would, and a pass holds every sample
// once, the longest first (LengthGroupedSampler's).
TEST_F(AcceleratorUtils, PreparedLengthGroupedLoaderNeedsNoSeed) {
  Accelerator accelerator;
  std::vector<int64_t> lengths;
  for (int64_t i = 0; i < 12; ++i) lengths.push_back((i * 7) % 12);
  auto loader = accelerator.prepare_data_loader(
      numbers(12), {.batch_size = 3,
                    .shuffle = true,
                    .group_by_length = mixprec::data::LengthGrouping{lengths, 6}});
  std::vector<int64_t> seen;
  for (const auto& batch : loader) {
    const auto x = batch.at("x");
    for (int64_t i = 0; i < x.size(0); ++i) seen.push_back(x[i].item<int64_t>());
  }
  ASSERT_EQ(seen.size(), 12u);
  EXPECT_EQ(seen[0], 5);  // length 11
  std::ranges::sort(seen);
  for (int64_t i = 0; i < 12; ++i) EXPECT_EQ(seen[static_cast<size_t>(i)], i);
}

// As Accelerate's: every pass of the skipping loader starts further in, the last batch still
// ends the data, and the loader it came from is untouched.
TEST_F(AcceleratorUtils, SkipFirstBatchesStartsEachPassFurtherIn) {
  Accelerator accelerator;
  auto loader = accelerator.prepare_data_loader(numbers(10), {.batch_size = 2});
  auto skipping = accelerator.skip_first_batches(loader, 2);
  EXPECT_EQ(skipping.size(), 3u);
  std::vector<int64_t> seen;
  std::vector<bool> ends;
  for (const auto& batch : skipping) {
    seen.push_back(batch.at("x")[0].item<int64_t>());
    ends.push_back(accelerator.gradient_state().end_of_dataloader);
  }
  EXPECT_EQ(seen, (std::vector<int64_t>{4, 6, 8}));
  EXPECT_EQ(ends, (std::vector<bool>{false, false, true}));
  EXPECT_EQ(firsts(skipping), (std::vector<int64_t>{4, 6, 8}));
  EXPECT_EQ(firsts(loader), (std::vector<int64_t>{0, 2, 4, 6, 8}));
  EXPECT_TRUE(firsts(accelerator.skip_first_batches(loader, 5)).empty());
  EXPECT_TRUE(has(error_of([&] { accelerator.skip_first_batches(loader, 6); }),
                  "6 batches to skip, but a pass has 5"));
}

// load_state() restores the position itself: skipping as many batches as were done (the
// Accelerate recipe) does not skip them twice, and a larger restored position wins.
TEST_F(AcceleratorUtils, SkipFirstBatchesAfterLoadStateDoesNotSkipTwice) {
  Accelerator accelerator;
  auto loader = accelerator.prepare_data_loader(numbers(10), {.batch_size = 2});
  int64_t done = 0;
  for (const auto& batch : loader) {
    (void)batch;
    if (++done == 3) break;
  }
  accelerator.save_state(dir_.string());
  for (size_t skip : {3, 1}) {
    Accelerator resumed;
    auto again = resumed.prepare_data_loader(numbers(10), {.batch_size = 2});
    resumed.load_state(dir_.string());
    auto skipping = resumed.skip_first_batches(again, skip);
    EXPECT_EQ(firsts(skipping), (std::vector<int64_t>{6, 8})) << skip;
  }
}

// The C++ twin of tests/reference/save_model.py's TiedNet, with its values.
struct TiedNet : torch::nn::Module {
  TiedNet() {
    steps = register_buffer("steps", torch::zeros({3}));
    embed = register_module("embed", torch::nn::Embedding(10, 4));
    hidden = register_module("hidden", torch::nn::Linear(4, 4));
    head = register_module("head", std::make_shared<torch::nn::Module>());
    head->register_parameter("weight", embed->weight);
    torch::NoGradGuard no_grad;
    auto fill = [](at::Tensor t, double i) {
      t.copy_((torch::arange(t.numel()) * 0.01 + i).reshape(t.sizes()));
    };
    fill(steps, 0);
    fill(hidden->weight, 2);
    fill(hidden->bias, 3);
    fill(embed->weight,
         4);  // Python's state_dict writes it as embed.weight (1), then head.weight (4)
  }
  at::Tensor steps;
  torch::nn::Embedding embed{nullptr};
  torch::nn::Linear hidden{nullptr};
  std::shared_ptr<torch::nn::Module> head;
};

// Every parameter and buffer of `a` equals `b`'s.
void expect_same_state(torch::nn::Module& a, torch::nn::Module& b) {
  const auto x = a.named_parameters(), y = b.named_parameters();
  ASSERT_EQ(x.size(), y.size());
  for (const auto& item : x) EXPECT_TRUE(torch::equal(item.value(), y[item.key()])) << item.key();
  for (const auto& item : a.named_buffers())
    EXPECT_TRUE(torch::equal(item.value(), b.named_buffers()[item.key()])) << item.key();
}

// Sharded or not, the same files as Accelerate's save_model: names, index (to the byte) and
// tensors; the tied head is saved once, as embed.weight. Both load back, tie included.
TEST_F(AcceleratorUtils, SaveModelWritesTheFilesAccelerateWrites) {
  Accelerator accelerator;
  auto net = std::make_shared<TiedNet>();
  for (const std::string size : {"0.1KB", "10GB"}) {
    const auto ours = dir_ / ("ours_" + size), theirs = dir_ / ("theirs_" + size);
    accelerator.save_model(net, ours.string(), size);
    int status = -1;
    mixprec::testing::run_command(std::string(MIXPREC_PYTHON) + " " + MIXPREC_REFERENCE_DIR +
                                      "/../save_model.py " + theirs.string() + " " + size +
                                      " 2>/dev/null",
                                  &status);
    ASSERT_EQ(status, 0) << "tests/reference/save_model.py failed";
    const auto names = names_in(theirs);
    ASSERT_EQ(names_in(ours), names) << size;
    EXPECT_EQ(names.size(), size == "10GB" ? 1u : 3u);
    for (const auto& name : names) {
      if (name.ends_with(".json")) {
        EXPECT_EQ(mixprec::io::read_file(ours / name), mixprec::io::read_file(theirs / name));
        continue;
      }
      std::map<std::string, std::string> our_metadata, their_metadata;
      const auto a = mixprec::io::load_safetensors(ours / name, &our_metadata);
      const auto b = mixprec::io::load_safetensors(theirs / name, &their_metadata);
      EXPECT_EQ(our_metadata, their_metadata);
      ASSERT_EQ(a.size(), b.size()) << name;
      for (const auto& [key, tensor] : b) {
        ASSERT_TRUE(a.count(key)) << name << ": " << key;
        EXPECT_TRUE(torch::equal(a.at(key), tensor)) << key;
      }
    }
    for (const auto& folder : {ours, theirs}) {
      auto loaded = std::make_shared<TiedNet>();
      for (auto& p : loaded->parameters()) p.detach().zero_();
      mixprec::accelerate::load_checkpoint_in_model(loaded, folder.string());
      expect_same_state(*loaded, *net);
    }
  }
}

// A sharded GPT-2 folder loads with from_pretrained; a shard the index names but that is
// gone, or that lacks a tensor the index places in it, is an error naming both.
TEST_F(AcceleratorUtils, ShardedModelsLoadBackAndBrokenShardsAreErrors) {
  Accelerator accelerator;
  mixprec::models::GPT2LMHeadModel gpt2(models_test::tiny_gpt2_config());
  gpt2->save_pretrained(dir_);  // config.json and model.safetensors
  accelerator.save_model(gpt2, dir_.string(), "20KB");
  ASSERT_FALSE(fs::exists(dir_ / "model.safetensors"));
  auto loaded = mixprec::models::GPT2LMHeadModel::from_pretrained(dir_);
  expect_same_state(*loaded, *gpt2);

  auto net = std::make_shared<TiedNet>();
  const auto shards = dir_ / "tied";
  accelerator.save_model(net, shards.string(), "0.1KB");
  auto from_index = std::make_shared<TiedNet>();  // the index's path also does
  for (auto& p : from_index->parameters()) p.detach().zero_();
  mixprec::accelerate::load_checkpoint_in_model(from_index,
                                                (shards / "model.safetensors.index.json").string());
  expect_same_state(*from_index, *net);
  // Both names of a tied weight in a file, with different values: which one would win?
  const auto conflicting = dir_ / "conflicting.safetensors";
  mixprec::io::save_safetensors(conflicting, {{"steps", net->steps},
                                              {"embed.weight", net->embed->weight},
                                              {"head.weight", net->embed->weight + 1},
                                              {"hidden.weight", net->hidden->weight},
                                              {"hidden.bias", net->hidden->bias}});
  EXPECT_TRUE(has(
      error_of([&] { mixprec::accelerate::load_checkpoint_in_model(net, conflicting.string()); }),
      "'head.weight' and 'embed.weight' are one tensor in the model (tied), but the "
      "file holds different values"));
  std::ofstream(dir_ / "outside.json")
      << R"({"weight_map": {"embed.weight": "../model-00001-of-00002.safetensors"}})";
  EXPECT_TRUE(has(error_of([&] {
                    mixprec::accelerate::load_checkpoint_in_model(net,
                                                                  (dir_ / "outside.json").string());
                  }),
                  "shard '../model-00001-of-00002.safetensors' of 'embed.weight' is not a path "
                  "inside"));
  fs::remove(shards / "model-00001-of-00002.safetensors");
  EXPECT_TRUE(
      has(error_of([&] { mixprec::accelerate::load_checkpoint_in_model(net, shards.string()); }),
          "model-00001-of-00002.safetensors"));
  std::ofstream(shards / "model.safetensors.index.json")
      << R"({"weight_map": {"embed.weight": "model-00002-of-00002.safetensors"}})";
  EXPECT_TRUE(
      has(error_of([&] { mixprec::accelerate::load_checkpoint_in_model(net, shards.string()); }),
          "places 'embed.weight' in model-00002-of-00002.safetensors, which does not hold it"));
}

// strict = false, Accelerate's load_checkpoint_in_model default: a tensor the model lacks is
// skipped with Accelerate's warning, and one the file lacks keeps its value; and
// load_state(dir, models_only, strict = false), torch's load_state_dict(strict=False).
TEST_F(AcceleratorUtils, NonStrictLoadingSkipsWhatOneSideLacks) {
  torch::manual_seed(0);
  torch::nn::Linear saved(3, 2);
  const auto file = dir_ / "linear.safetensors";
  fs::create_directories(dir_);
  mixprec::io::save_safetensors(
      file, {{"weight", saved->weight}, {"extra", torch::ones({2})}});  // no bias
  torch::nn::Linear loaded(3, 2);
  EXPECT_TRUE(
      has(error_of([&] { mixprec::accelerate::load_checkpoint_in_model(loaded, file.string()); }),
          "missing 'bias'"));
  auto reset = [](torch::nn::Module& module) {  // what a failed load may have copied already
    torch::NoGradGuard no_grad;
    for (auto& p : module.parameters()) p.fill_(-3);
  };
  reset(*loaded);
  const auto bias = loaded->bias.detach().clone();
  {
    mixprec::testing::CapturedWarnings warnings;
    mixprec::accelerate::load_checkpoint_in_model(loaded, file.string(), /*strict=*/false);
    ASSERT_EQ(warnings.messages.size(), 1u);
    EXPECT_TRUE(has(warnings.messages[0], "Some weights of the model checkpoint at " +
                                              file.string() + " were not used when initializing "))
        << warnings.messages[0];
    EXPECT_TRUE(has(warnings.messages[0],
                    "initializing Linear: {'extra'}. This may or may not be an issue"));
  }
  EXPECT_TRUE(torch::equal(loaded->weight, saved->weight));
  EXPECT_TRUE(torch::equal(loaded->bias, bias));
  const auto skipped = mixprec::io::load_module_state(*loaded, mixprec::io::load_safetensors(file),
                                                      "linear", /*strict=*/false);
  EXPECT_EQ(skipped.missing_keys, std::vector<std::string>{"bias"});
  EXPECT_EQ(skipped.unexpected_keys, std::vector<std::string>{"extra"});

  // A state saved with one model more in the layer than the one loading it.
  torch::nn::Sequential two(torch::nn::Linear(3, 2), torch::nn::Linear(2, 2));
  Accelerator saving;
  auto prepared = saving.prepare(two);
  saving.save_state((dir_ / "state").string());
  torch::nn::Sequential one(torch::nn::Linear(3, 2));
  Accelerator loading;
  auto again = loading.prepare(one);
  EXPECT_TRUE(
      has(error_of([&] { loading.load_state((dir_ / "state").string()); }), "unexpected '1.bias'"));
  reset(*one);
  loading.load_state((dir_ / "state").string(), false, /*strict=*/false);
  EXPECT_TRUE(torch::equal(one[0]->as<torch::nn::Linear>()->weight,
                           two[0]->as<torch::nn::Linear>()->weight));
}

// A save into a folder that held another save's shards leaves only its own files.
TEST_F(AcceleratorUtils, SaveModelRemovesStaleShardsAndRefusesBadInput) {
  Accelerator accelerator;
  auto net = std::make_shared<TiedNet>();
  fs::create_directories(dir_);
  std::ofstream(dir_ / "config.json") << "{}";
  accelerator.save_model(net, dir_.string());
  accelerator.save_model(net, dir_.string(), "0.1KB");
  EXPECT_EQ(names_in(dir_),
            (std::vector<std::string>{"config.json", "model-00001-of-00002.safetensors",
                                      "model-00002-of-00002.safetensors",
                                      "model.safetensors.index.json"}));
  accelerator.save_model(net, dir_.string());
  EXPECT_EQ(names_in(dir_), (std::vector<std::string>{"config.json", "model.safetensors"}));
  EXPECT_TRUE(has(error_of([&] { accelerator.save_model(net, dir_.string(), "10XB"); }),
                  "size '10XB': expected a number and a unit of KB, MB, GB or TB"));
  EXPECT_TRUE(has(error_of([&] { accelerator.save_model(net, (dir_ / "config.json").string()); }),
                  "config.json should be a folder, not a file"));
}

// In one process the collectives give back their input, and the trigger is this process's.
TEST_F(AcceleratorUtils, CollectivesInOneProcess) {
  Accelerator accelerator;
  const auto t = torch::arange(5);
  EXPECT_TRUE(accelerator.pad_across_processes(t).is_same(t));
  EXPECT_EQ(accelerator.gather_object({"a", "", "c"}), (std::vector<std::string>{"a", "", "c"}));
  EXPECT_EQ(accelerator.split_between_processes(std::vector<int>{1, 2, 3}, true),
            (std::vector<int>{1, 2, 3}));
  EXPECT_TRUE(torch::equal(accelerator.split_between_processes(t), t));
  EXPECT_FALSE(accelerator.check_trigger());
  accelerator.set_trigger();
  EXPECT_TRUE(accelerator.check_trigger());
  EXPECT_FALSE(accelerator.check_trigger());  // lowered by the check
  {
    auto first = accelerator.main_process_first();
    auto no_sync = accelerator.no_sync(accelerator.prepare(torch::nn::Linear(2, 2)));
  }
}

}  // namespace
