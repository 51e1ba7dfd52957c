#include "mixprec/io/checkpoint.h"
#include "mixprec/optim/adamw.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

namespace {

namespace fs = std::filesystem;
using mixprec::testing::error_of;

// Steps `a` twice, copies its state into `b` (on a copy of the parameters)
// through OptimizerState, then steps both once more: they must agree bitwise.
template <typename Make>
void expect_state_round_trip(Make make, const char* name) {
  torch::manual_seed(0);
  auto pa = torch::randn({4, 3}, torch::requires_grad());
  auto pb = pa.detach().clone().requires_grad_();
  auto a = make(pa);
  auto b = make(pb);
  auto step = [](torch::optim::Optimizer& opt, const at::Tensor& p, int seed) {
    opt.zero_grad();
    (p * torch::full({4, 3}, seed * 0.1)).pow(2).sum().backward();
    opt.step();
  };
  step(*a, pa, 1);
  step(*a, pa, 2);
  {
    torch::NoGradGuard no_grad;
    pb.copy_(pa);
  }
  mixprec::io::load_optimizer_state(*b, mixprec::io::optimizer_state(*a), "test");
  step(*a, pa, 3);
  step(*b, pb, 3);
  EXPECT_TRUE(torch::equal(pa, pb)) << name;
}

TEST(OptimizerState, RoundTripsEverySupportedOptimizer) {
  expect_state_round_trip(
      [](at::Tensor p) {
        return std::make_unique<torch::optim::SGD>(std::vector<at::Tensor>{p},
                                                   torch::optim::SGDOptions(0.1).momentum(0.9));
      },
      "SGD");
  expect_state_round_trip(
      [](at::Tensor p) {
        return std::make_unique<torch::optim::Adam>(std::vector<at::Tensor>{p},
                                                    torch::optim::AdamOptions(0.1).amsgrad(true));
      },
      "Adam");
  expect_state_round_trip(
      [](at::Tensor p) {
        return std::make_unique<torch::optim::AdamW>(std::vector<at::Tensor>{p},
                                                     torch::optim::AdamWOptions(0.1));
      },
      "torch AdamW");
  expect_state_round_trip(
      [](at::Tensor p) {
        return std::make_unique<mixprec::optim::AdamW>(
            std::vector<at::Tensor>{p}, mixprec::optim::AdamWOptions(0.1).fused(true));
      },
      "mixprec AdamW");
}

TEST(OptimizerState, UnsupportedOrMismatchedIsAClearError) {
  auto p = torch::ones({2}, torch::requires_grad());
  torch::optim::RMSprop rmsprop({p});
  EXPECT_NE(error_of([&] { mixprec::io::optimizer_state(rmsprop); }).find("is not supported"),
            std::string::npos);
  torch::optim::SGD one({p}, 0.1), two({p, torch::ones({3}, torch::requires_grad())}, 0.1);
  EXPECT_NE(
      error_of([&] {
        mixprec::io::load_optimizer_state(two, mixprec::io::optimizer_state(one), "f.json");
      }).find("f.json: param group 0 holds 1 parameters in the checkpoint, 2 in the optimizer"),
      std::string::npos);
}

TEST(CheckpointWriter, ReplacesAtomicallyAndCleansUp) {
  const auto root = fs::temp_directory_path() / ("mixprec_ckpt_" + std::to_string(getpid()));
  fs::remove_all(root);
  fs::create_directories(root);
  for (const char* text : {"first", "second"}) {
    mixprec::io::CheckpointWriter writer(root / "checkpoint-1");
    writer.write_text("note.txt", text);
    EXPECT_FALSE(fs::exists(root / "checkpoint-1" / "note.txt") &&
                 mixprec::io::read_file(root / "checkpoint-1" / "note.txt") == text);
    writer.commit();
  }
  EXPECT_EQ(mixprec::io::read_file(root / "checkpoint-1" / "note.txt"), "second");
  mixprec::io::verify_checkpoint(root / "checkpoint-1");
  {
    mixprec::io::CheckpointWriter abandoned(root / "checkpoint-2");  // never committed
    abandoned.write_text("note.txt", "partial");
  }
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(root)) names.push_back(entry.path().filename());
  EXPECT_EQ(names, std::vector<std::string>{"checkpoint-1"});
  fs::remove_all(root);
}

}  // namespace
