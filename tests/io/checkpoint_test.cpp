#include "mixprec/io/checkpoint.h"
#include "mixprec/optim/adamw.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

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

// As PyTorch's load_state_dict: every state is read before the optimizer changes. mixprec's
// AdamW gets its step count back in float32, the dtype its steps make, on the CPU unless fused.
TEST(OptimizerState, ABadStateLeavesTheOptimizerAsItWas) {
  auto p = torch::ones({2}, torch::requires_grad()), q = torch::ones({3}, torch::requires_grad());
  mixprec::optim::AdamW adamw({p, q}, mixprec::optim::AdamWOptions(0.1));
  (p.sum() + q.sum()).backward();
  adamw.step();
  auto state_of = [&](const at::Tensor& t) -> const mixprec::optim::AdamWParamState& {
    return static_cast<const mixprec::optim::AdamWParamState&>(
        *adamw.state().at(t.unsafeGetTensorImpl()));
  };
  auto state = mixprec::io::optimizer_state(adamw);
  state.tensors["state.0.step"] = torch::tensor(1.0, torch::kDouble);
  mixprec::io::load_optimizer_state(adamw, state, "optimizer.json");
  EXPECT_EQ(state_of(p).step().scalar_type(), torch::kFloat);
  EXPECT_EQ(state_of(p).step().device(), torch::Device(torch::kCPU));
  EXPECT_EQ(state_of(p).step().item<float>(), 1.0f);

  const at::Tensor p_exp_avg = state_of(p).exp_avg();
  state.tensors["state.1.exp_avg"] = torch::zeros({5});
  state.groups_json = R"({"param_groups": [{"lr": 0.5, "params": 2}]})";
  EXPECT_NE(error_of([&] { mixprec::io::load_optimizer_state(adamw, state, "optimizer.json"); })
                .find("optimizer.json: optimizer state 'state.1.exp_avg' has shape [5], the "
                      "parameter [3]"),
            std::string::npos);
  EXPECT_DOUBLE_EQ(adamw.param_groups()[0].options().get_lr(), 0.1);
  EXPECT_TRUE(state_of(p).exp_avg().is_same(p_exp_avg));  // the first param's state untouched
}

// As PyTorch's load_state_dict: the saved hyperparameters replace the optimizer's, so a resumed
// run keeps the betas, eps, weight decay... it was saved with. A group that holds only lr (as
// checkpoints did before the others were saved) leaves them as they are. Unlike PyTorch, what the
// optimizers' constructors refuse is refused.
TEST(OptimizerState, HyperparametersComeBackAndAreChecked) {
  using mixprec::optim::AdamWOptions;
  auto p = torch::ones({2}, torch::requires_grad());
  mixprec::optim::AdamW saved({p}, AdamWOptions(0.1)
                                       .betas({0.8, 0.95})
                                       .eps(1e-6)
                                       .weight_decay(0.2)
                                       .amsgrad(true)
                                       .maximize(true));
  mixprec::optim::AdamW adamw({p}, AdamWOptions(0.5));
  mixprec::io::load_optimizer_state(adamw, mixprec::io::optimizer_state(saved), "optimizer.json");
  const auto& o = static_cast<const AdamWOptions&>(adamw.param_groups()[0].options());
  EXPECT_EQ(o.lr(), 0.1);
  EXPECT_EQ(o.betas(), std::make_tuple(0.8, 0.95));
  EXPECT_EQ(o.eps(), 1e-6);
  EXPECT_EQ(o.weight_decay(), 0.2);
  EXPECT_TRUE(o.amsgrad());
  EXPECT_TRUE(o.maximize());

  torch::optim::SGD sgd_saved(
      {p}, torch::optim::SGDOptions(0.1).momentum(0.9).dampening(0.1).weight_decay(0.01));
  torch::optim::SGD sgd({p}, torch::optim::SGDOptions(0.3).nesterov(true).momentum(0.5));
  const auto state = mixprec::io::optimizer_state(sgd_saved);
  EXPECT_EQ(nlohmann::json::parse(state.groups_json)["param_groups"][0],
            nlohmann::json::parse(R"({"lr": 0.1, "momentum": 0.9, "dampening": 0.1,
                                      "weight_decay": 0.01, "nesterov": false, "params": 1})"));
  mixprec::io::load_optimizer_state(sgd, state, "optimizer.json");
  const auto& s = static_cast<const torch::optim::SGDOptions&>(sgd.param_groups()[0].options());
  EXPECT_EQ(std::make_tuple(s.lr(), s.momentum(), s.dampening(), s.weight_decay(), s.nesterov()),
            std::make_tuple(0.1, 0.9, 0.1, 0.01, false));

  mixprec::io::load_optimizer_state(adamw, {{}, R"({"param_groups": [{"lr": 0.3, "params": 1}]})"},
                                    "old.json");
  EXPECT_EQ(o.lr(), 0.3);
  EXPECT_EQ(o.weight_decay(), 0.2);
  // One group of lr 0.7 with `extra`, loaded from bad.json.
  auto error = [](torch::optim::Optimizer& optimizer, const std::string& extra) {
    const std::string groups = R"({"param_groups": [{"lr": 0.7, "params": 1, )" + extra + "}]}";
    return error_of([&] {
      mixprec::io::load_optimizer_state(optimizer, {{}, groups}, "bad.json");
    });
  };
  EXPECT_EQ(error(adamw, R"("betas": [0.9])"),
            "bad.json: param group 0: 'betas' expects two numbers, got [0.9]");
  EXPECT_EQ(error(adamw, R"("amsgrad": 1)"),
            "bad.json: param group 0: 'amsgrad' expects a boolean, got 1");
  // What the optimizers' constructors refuse: a first step would divide by 1 - 1^t = 0.
  EXPECT_EQ(error(adamw, R"("betas": [1, 0.9])"),
            "bad.json: param group 0: invalid betas [1, 0.9], expected each in [0, 1)");
  EXPECT_EQ(error(sgd, R"("nesterov": true)"),
            "bad.json: param group 0: Nesterov momentum requires a momentum and zero dampening");
  // A bad group changes nothing.
  EXPECT_EQ(std::make_tuple(o.lr(), o.betas(), o.weight_decay()),
            std::make_tuple(0.3, std::make_tuple(0.8, 0.95), 0.2));

  // amsgrad on, from a state stepped without it: the next step would need max_exp_avg_sq.
  torch::optim::Adam adam({p}, torch::optim::AdamOptions(0.1));
  p.mutable_grad() = torch::ones({2});
  adam.step();
  auto stepped = mixprec::io::optimizer_state(adam);
  stepped.groups_json = R"({"param_groups": [{"lr": 0.1, "params": 1, "amsgrad": true}]})";
  EXPECT_EQ(error_of([&] { mixprec::io::load_optimizer_state(adam, stepped, "adam.json"); }),
            "adam.json: missing optimizer state 'state.0.max_exp_avg_sq': param group 0 uses "
            "amsgrad");
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

// As Accelerate's save_state (which writes its files into the folder): what else the folder
// holds stays, a subfolder and a symlink included, and a file still open for writing (a
// tracker's log) keeps what is appended after the save. The checkpoint's own files are
// replaced, and only they are in its checksums; an earlier save's that this one does not write
// (in that save's checksums: an optimizer, say) go, lest they be loaded with the new ones.
TEST(CheckpointWriter, KeepsWhatTheFolderHoldsBesideTheCheckpoint) {
  const auto root = fs::temp_directory_path() / ("mixprec_ckpt_keep_" + std::to_string(getpid()));
  fs::remove_all(root);
  const auto dir = root / "state";
  fs::create_directories(dir / "runs");
  std::ofstream(dir / "config.json") << "{}";
  std::ofstream log(dir / "runs" / "events", std::ios::binary);
  log << "before" << std::flush;
  fs::create_symlink("config.json", dir / "link");
  for (const std::string text : {"first", "second"}) {
    mixprec::io::CheckpointWriter writer(dir);
    writer.write_text("note.txt", text);
    writer.write_text("config.json", "{\"new\": 1}");
    if (text == "first") writer.write_text("optimizer.json", "{}");
    writer.commit();
    EXPECT_EQ(fs::exists(dir / "optimizer.json"), text == "first");
  }
  log << " after" << std::flush;
  EXPECT_EQ(mixprec::io::read_file(dir / "note.txt"), "second");
  EXPECT_EQ(mixprec::io::read_file(dir / "config.json"), "{\"new\": 1}");
  EXPECT_EQ(mixprec::io::read_file(dir / "runs" / "events"), "before after");
  EXPECT_EQ(fs::read_symlink(dir / "link"), "config.json");
  mixprec::io::verify_checkpoint(dir);
  const auto sums = nlohmann::json::parse(mixprec::io::read_file(dir / "checksums.json"));
  EXPECT_EQ(sums.size(), 2u) << sums.dump();  // note.txt, config.json
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(root)) names.push_back(entry.path().filename());
  EXPECT_EQ(names, std::vector<std::string>{"state"});
  // A folder that would hold its own temporary one is refused (its carry-over would copy into
  // itself); "state/." is "state".
  EXPECT_EQ(mixprec::testing::error_of([] { mixprec::io::CheckpointWriter writer("."); }),
            "CheckpointWriter: cannot replace '.', which holds its own temporary folder; name a "
            "folder inside it");
  mixprec::io::CheckpointWriter(dir / ".").commit();  // an empty checkpoint
  EXPECT_FALSE(fs::exists(dir / "note.txt"));
  EXPECT_EQ(mixprec::io::read_file(dir / "runs" / "events"), "before after");
  // A manifest that cannot be read no longer tells the checkpoint's files from the user's: the
  // save is refused and the folder left as it was.
  for (const std::string manifest : {"{not json", "[]"}) {
    std::ofstream(dir / "checksums.json") << manifest;
    mixprec::io::CheckpointWriter writer(dir);
    writer.write_text("note.txt", "third");
    const auto error = mixprec::testing::error_of([&] { writer.commit(); });
    EXPECT_NE(error.find("so the earlier checkpoint's files cannot be told from the rest of"),
              std::string::npos)
        << error;
    EXPECT_EQ(mixprec::io::read_file(dir / "checksums.json"), manifest);
    EXPECT_TRUE(fs::exists(dir / "runs" / "events"));
  }
  fs::remove_all(root);
}

// A writer that replaces a folder without the file system's atomic swap moves the old one aside
// first: killed between its two renames, it leaves no final folder, and the next run's cleanup
// puts the old one back rather than deleting both. An old folder a writer could not delete
// goes, even once its final folder is gone. A trailing separator names the folder.
TEST(CheckpointWriter, AReplacementCutOffHalfWayIsPutBack) {
  const auto root = fs::temp_directory_path() / ("mixprec_ckpt_cut_" + std::to_string(getpid()));
  fs::remove_all(root);
  {
    mixprec::io::CheckpointWriter writer(root / "checkpoint-1");
    writer.write_text("note.txt", "old");
    writer.commit();
  }
  fs::rename(root / "checkpoint-1", root / "checkpoint-1.old-4242");
  fs::create_directories(root / "checkpoint-1.tmp-4242");
  std::ofstream(root / "checkpoint-1.tmp-4242" / "note.txt") << "new, unfinished";
  fs::create_directories(root / "checkpoint-1.old-77");  // beside a final folder
  fs::create_directories(root / "checkpoint-3.old-88");  // its final folder rotated away
  EXPECT_EQ(mixprec::io::remove_unfinished_checkpoints(root), 3);
  EXPECT_EQ(mixprec::io::read_file(root / "checkpoint-1" / "note.txt"), "old");
  mixprec::io::verify_checkpoint(root / "checkpoint-1");
  for (const char* text : {"first", "second"}) {
    mixprec::io::CheckpointWriter writer(root.string() + "/checkpoint-2/");
    writer.write_text("note.txt", text);
    writer.commit();
  }
  EXPECT_EQ(mixprec::io::read_file(root / "checkpoint-2" / "note.txt"), "second");
  EXPECT_EQ(mixprec::testing::checkpoint_names(root),
            (std::vector<std::string>{"checkpoint-1", "checkpoint-2"}));
  fs::remove_all(root);
}

// Known-bad optimizer.json files (found while writing fuzz/fuzz_checkpoint.cpp): a
// clear error naming the file and the problem, and nothing half-loaded.
TEST(OptimizerState, BadGroupsJsonIsAClearError) {
  auto p = torch::ones({2}, torch::requires_grad());
  torch::optim::SGD sgd({p}, torch::optim::SGDOptions(0.1).momentum(0.9));
  auto error = [&](const std::string& groups) {
    return error_of([&] {
      mixprec::io::load_optimizer_state(sgd, {{}, groups}, "optimizer.json");
    });
  };
  EXPECT_NE(error("[1]").find("optimizer.json: malformed optimizer state: expected "
                              "{\"param_groups\": [...]}"),
            std::string::npos);
  EXPECT_NE(error(R"({"param_groups": [5]})")
                .find("optimizer.json: param group 0: expected {\"lr\": number, \"params\": "
                      "count}, got 5"),
            std::string::npos);
  EXPECT_NE(error(R"({"param_groups": [{"params": 1}]})").find("param group 0: expected"),
            std::string::npos);
  EXPECT_NE(error(R"({"param_groups": [{"lr": 0.5, "params": "1"}]})").find("got {"),
            std::string::npos);
  EXPECT_NE(error(R"({"param_groups": [{"lr": 0.5, "params": 3}]})")
                .find("param group 0 holds 3 parameters in the checkpoint, 1 in the optimizer"),
            std::string::npos);
  EXPECT_DOUBLE_EQ(sgd.param_groups()[0].options().get_lr(), 0.1);  // untouched
  // LibTorch's Adam counts steps in an int64: a NaN or huge step is refused.
  torch::optim::Adam adam({p});
  for (double step : {std::nan(""), 1e300, -1.0}) {
    mixprec::io::OptimizerState state{{{"state.0.exp_avg", torch::zeros({2})},
                                       {"state.0.exp_avg_sq", torch::zeros({2})},
                                       {"state.0.step", torch::tensor(step, torch::kDouble)}},
                                      R"({"param_groups": [{"lr": 0.001, "params": 1}]})"};
    EXPECT_NE(error_of([&] {
                mixprec::io::load_optimizer_state(adam, state, "adam.json");
              }).find("adam.json: optimizer state 'state.0.step' is"),
              std::string::npos)
        << step;
  }
}

TEST(VerifyCheckpoint, ChecksumsJsonNamesOnlyFilesOfTheFolder) {
  const auto dir = fs::temp_directory_path() / ("mixprec_verify_" + std::to_string(getpid()));
  fs::remove_all(dir);
  {
    mixprec::io::CheckpointWriter writer(dir);
    writer.write_text("note.txt", "text");
    writer.commit();
  }
  mixprec::io::verify_checkpoint(dir);
  auto error = [&](const std::string& manifest) {
    std::ofstream(dir / "checksums.json", std::ios::trunc) << manifest;
    return error_of([&] { mixprec::io::verify_checkpoint(dir); });
  };
  // A name outside the folder would read any file: /dev/zero never ends.
  for (const char* name : {"/dev/zero", "../note.txt", "", ".", "..", "sub/x"})
    EXPECT_NE(
        error(nlohmann::json{{name, "0"}}.dump()).find("is not a file name in the checkpoint"),
        std::string::npos)
        << name;
  EXPECT_NE(error("[\"note.txt\"]").find("expected an object of {file: checksum}, got array"),
            std::string::npos);
  EXPECT_NE(error("{\"note.txt\": 5}").find("note.txt: checksum mismatch"), std::string::npos);
  EXPECT_NE(error("{\"missing.txt\": \"0\"}").find("missing.txt: missing from the checkpoint"),
            std::string::npos);
  EXPECT_NE(error("{\"note.txt\"").find("checksums.json: malformed"), std::string::npos);
  fs::remove_all(dir);
}

}  // namespace
