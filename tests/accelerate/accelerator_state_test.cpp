// save_state / load_state: a run stopped and resumed from a state ends with
// the same parameters, bit for bit, as one never stopped.
#include "mixprec/accelerate/accelerator.h"
#include "mixprec/io/checkpoint.h"
#include "mixprec/io/safetensors.h"
#include "mixprec/optim/adamw.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <limits>

namespace {

namespace fs = std::filesystem;
using mixprec::Accelerator;
using mixprec::testing::error_of;

// Dropout makes the run depend on the random number generator's state.
torch::nn::Sequential make_net() {
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Dropout(0.2),
                               torch::nn::Linear(16, 3));
}

struct Counter : mixprec::accelerate::Checkpointable {
  int64_t value = 0;
  std::string state_dict() const override { return "{\"value\": " + std::to_string(value) + "}"; }
  void load_state_dict(const std::string& json) override {
    value = std::stoll(json.substr(json.find(':') + 1));
  }
};

// One run: builds everything afresh, optionally loads a state first, trains
// steps [from, to), optionally saves at `save_at`.
struct TrainingRun {
  std::string precision;
  fs::path dir;
  at::Tensor params{};
  double scale = 0, lr = 0;
  int64_t counted = 0;

  void train(int from, int to, std::optional<int> save_at, bool load, uint64_t init_seed) {
    torch::manual_seed(init_seed);
    auto net = make_net();
    mixprec::optim::AdamW adamw(net->parameters(), mixprec::optim::AdamWOptions(1e-2).fused(true));
    auto schedule = mixprec::optim::get_scheduler(
        "cosine", adamw, {.num_warmup_steps = 2, .num_training_steps = 12});
    Accelerator accelerator(
        {.mixed_precision = precision, .scaler = {.init_scale = 1024.0, .growth_interval = 2}});
    auto [model, optimizer, scheduler] = accelerator.prepare(net, adamw, schedule);
    Counter counter;
    accelerator.register_for_checkpointing(counter);
    if (load) accelerator.load_state(dir.string());
    for (int step = from; step < to; ++step) {
      auto g = at::make_generator<at::CPUGeneratorImpl>(1000 + step);  // data by step, not by RNG
      auto x = at::randn({6, 8}, g), y = at::randint(0, 3, {6}, g);
      auto loss = torch::nn::functional::cross_entropy(model(x), y);
      // An overflow, so that the scaler state matters (fp16 skips the step).
      if (step == 3 && precision == "fp16") loss = loss * std::numeric_limits<float>::infinity();
      accelerator.backward(loss);
      optimizer.step();
      scheduler.step();
      optimizer.zero_grad();
      ++counter.value;
      if (save_at && step + 1 == *save_at) accelerator.save_state(dir.string());
    }
    std::vector<at::Tensor> flat;
    for (const auto& p : net->parameters()) flat.push_back(p.detach().reshape(-1).clone());
    params = torch::cat(flat);
    scale = accelerator.scaler() ? accelerator.scaler()->get_scale() : 1.0;
    lr = scheduler.get_last_lr()[0];
    counted = counter.value;
  }
};

class AcceleratorState : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("mixprec_state_" + std::to_string(getpid()));
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_P(AcceleratorState, ResumingGivesTheSameParametersBitwise) {
  TrainingRun whole{GetParam(), dir_ / "state"};
  whole.train(0, 12, /*save_at=*/6, /*load=*/false, /*init_seed=*/1);
  TrainingRun resumed{GetParam(), dir_ / "state"};
  resumed.train(6, 12, std::nullopt, /*load=*/true, /*init_seed=*/2);  // other weights until loaded
  EXPECT_TRUE(torch::equal(resumed.params, whole.params))
      << (resumed.params - whole.params).abs().max().item<double>();
  EXPECT_EQ(resumed.scale, whole.scale);
  EXPECT_EQ(resumed.lr, whole.lr);
  EXPECT_EQ(resumed.counted, 12);  // the registered object came back at 6
  for (const auto* name : {"model.safetensors", "optimizer.safetensors", "optimizer.json",
                           "scheduler.json", "random_states_0.safetensors",
                           "custom_checkpoint.json", "accelerator.json", "checksums.json"})
    EXPECT_TRUE(fs::exists(dir_ / "state" / name)) << name;
  EXPECT_EQ(fs::exists(dir_ / "state" / "scaler.json"), GetParam() == "fp16");
  // The model file holds the module's names, as HF's and Accelerate's do.
  const auto model = mixprec::io::load_safetensors(dir_ / "state" / "model.safetensors");
  EXPECT_TRUE(model.count("0.weight") && model.count("3.bias"));
}

INSTANTIATE_TEST_SUITE_P(Precisions, AcceleratorState, ::testing::Values("no", "bf16", "fp16"));

class AcceleratorStateErrors : public AcceleratorState {};

TEST_F(AcceleratorStateErrors, DamagedOrMismatchedStatesAreClearErrors) {
  TrainingRun run{"no", dir_ / "state"};
  run.train(0, 2, /*save_at=*/2, false, 1);
  const auto state = (dir_ / "state").string();
  for (const auto& entry : fs::directory_iterator(dir_))  // no temporary folder left
    EXPECT_EQ(entry.path().filename(), "state");

  // Another model shape: the error names the file and the tensor.
  auto other = torch::nn::Sequential(torch::nn::Linear(8, 4), torch::nn::ReLU(),
                                     torch::nn::Dropout(0.2), torch::nn::Linear(4, 3));
  Accelerator accelerator;
  auto model = accelerator.prepare(other);
  const std::string mismatch = error_of([&] { accelerator.load_state(state); });
  EXPECT_NE(
      mismatch.find("model.safetensors: '0.weight' has shape [16, 8], the model expects [4, 8]"),
      std::string::npos)
      << mismatch;

  // A damaged file is caught by its checksum before anything is loaded.
  {
    std::fstream file(dir_ / "state" / "scheduler.json", std::ios::in | std::ios::out);
    file.seekp(2);
    file << "#";
  }
  Accelerator fresh;
  const std::string damaged = error_of([&] { fresh.load_state(state); });
  EXPECT_NE(damaged.find("scheduler.json: checksum mismatch: the file is damaged"),
            std::string::npos)
      << damaged;
  EXPECT_NE(error_of([&] {
              fresh.load_state((dir_ / "nothing").string());
            }).find("no checksums.json: not a complete checkpoint"),
            std::string::npos);
}

// models_only: the models and the extra files alone; loading it whole is an error that says so,
// before any model changes.
TEST_F(AcceleratorStateErrors, ModelsOnlyStateLoadsOnlyModels) {
  torch::manual_seed(1);
  auto net = make_net();
  mixprec::optim::AdamW adamw(net->parameters(), mixprec::optim::AdamWOptions(1e-2));
  Accelerator saver;
  auto [model, optimizer] = saver.prepare(net, adamw);
  const auto dir = dir_ / "models";
  saver.save_state(dir.string(), {{"notes.txt", "kept"}}, /*models_only=*/true);
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(dir))
    files.push_back(entry.path().filename().string());
  std::ranges::sort(files);
  EXPECT_EQ(files, (std::vector<std::string>{"checksums.json", "model.safetensors", "notes.txt"}));

  torch::manual_seed(2);
  auto other = make_net();
  mixprec::optim::AdamW other_adamw(other->parameters(), mixprec::optim::AdamWOptions(1e-2));
  Accelerator loader;
  auto [other_model, other_optimizer] = loader.prepare(other, other_adamw);
  const auto before = other->parameters()[0].detach().clone();
  EXPECT_NE(error_of([&] { loader.load_state(dir.string()); })
                .find("holds the models only (saved with models_only, the Trainer's "
                      "save_only_model); load_state(dir, /*models_only=*/true) loads them"),
            std::string::npos);
  EXPECT_TRUE(torch::equal(other->parameters()[0], before));
  loader.load_state(dir.string(), /*models_only=*/true);
  for (size_t i = 0; i < net->parameters().size(); ++i)
    EXPECT_TRUE(torch::equal(other->parameters()[i], net->parameters()[i]));
}

// Accelerate's save and load pre-hooks: a hook that saves a model its own way drops its weights
// (the models left are numbered in their order) and writes its file into the checkpoint; a load
// hook that loads it itself removes it. A removed hook runs no more.
TEST_F(AcceleratorStateErrors, SaveAndLoadHooksAsAccelerates) {
  torch::manual_seed(0);
  torch::nn::Linear own(2, 2), plain(3, 1);
  Accelerator accelerator;
  auto [own_model, plain_model] = accelerator.prepare(own, plain);
  int saves = 0, loads = 0;
  auto save_hook = accelerator.register_save_state_pre_hook(
      [&](const auto& models, auto& weights, const fs::path& output_dir) {
        ++saves;
        ASSERT_EQ(models.size(), 2u);
        ASSERT_EQ(weights.size(), 2u);
        EXPECT_EQ(models[0].get(), own.ptr().get());
        EXPECT_NO_THROW(weights[1].at("weight").add_(0));  // detached, as state_dict()'s
        weights.erase(weights.begin());
        std::ofstream(output_dir / "own.txt") << "saved its own way";
      });
  auto load_hook =
      accelerator.register_load_state_pre_hook([&](auto& models, const fs::path& input_dir) {
        ++loads;
        EXPECT_TRUE(fs::exists(input_dir / "own.txt"));
        models.erase(models.begin());
      });
  const auto first = dir_ / "hooked";
  accelerator.save_state(first.string());
  EXPECT_NO_THROW(mixprec::io::verify_checkpoint(first));
  EXPECT_NE(mixprec::io::read_file(first / "checksums.json").find("\"own.txt\""),
            std::string::npos);  // checksummed too
  EXPECT_FALSE(fs::exists(first / "model_1.safetensors"));
  const auto saved = mixprec::io::load_safetensors(first / "model.safetensors");
  EXPECT_TRUE(torch::equal(saved.at("weight"), plain->weight));  // the model left, as model 0

  const auto own_before = own->weight.detach().clone(),
             plain_before = plain->weight.detach().clone();
  {
    torch::NoGradGuard no_grad;
    own->weight.add_(1);
    plain->weight.add_(1);
  }
  accelerator.load_state(first.string());
  EXPECT_TRUE(torch::equal(plain->weight, plain_before));
  EXPECT_TRUE(torch::equal(own->weight, own_before + 1));  // the hook's to load, which it did not
  EXPECT_EQ(saves, 1);
  EXPECT_EQ(loads, 1);

  save_hook.remove();
  save_hook.remove();  // nothing more
  load_hook.remove();
  const auto second = dir_ / "plain";
  accelerator.save_state(second.string());
  EXPECT_TRUE(fs::exists(second / "model_1.safetensors"));
  EXPECT_FALSE(fs::exists(second / "own.txt"));
  accelerator.load_state(second.string());
  EXPECT_TRUE(torch::equal(own->weight, own_before + 1));
  EXPECT_EQ(saves, 1);
  EXPECT_EQ(loads, 1);
}

}  // namespace
