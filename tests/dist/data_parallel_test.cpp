// Data parallel across processes: run by ctest as
//   torchrun --nproc-per-node 2 --no-python mixprec_dist_tests
// Every rank runs every test, in the same order, so collectives pair up.
#include "mixprec/accelerate/accelerator.h"
#include "mixprec/io/checkpoint.h"
#include "mixprec/log/logging.h"
#include "mixprec/models/gpt2.h"
#include "mixprec/models/mlp_classifier.h"
#include "mixprec/optim/adamw.h"
#include "mixprec/optim/lr_scheduler.h"
#include "mixprec/optim/optimizer_in_backward.h"
#include "mixprec/train/trainer.h"
#include "models/tiny_gpt2.h"
#include "test_util.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

namespace {

using mixprec::Accelerator;
using mixprec::dist::GradientCompression;
using mixprec::testing::error_of;

torch::nn::Sequential make_net() {
  return torch::nn::Sequential(torch::nn::Linear(6, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 3));
}

at::Tensor flat_params(torch::nn::Module& module) {
  std::vector<at::Tensor> flat;
  for (const auto& p : module.parameters()) flat.push_back(p.detach().reshape(-1));
  return torch::cat(flat);
}

// A temporary folder every rank names alike: named after the main process's pid.
std::filesystem::path shared_temp_dir(Accelerator& accelerator, const std::string& stem) {
  const auto main_pid = accelerator.gather(torch::tensor({static_cast<int64_t>(getpid())}))[0];
  return std::filesystem::temp_directory_path() / (stem + std::to_string(main_pid.item<int64_t>()));
}

// Every rank holds the same tensor.
void expect_same_on_every_rank(Accelerator& accelerator, const at::Tensor& t) {
  auto all = accelerator.gather(t.unsqueeze(0));
  for (int64_t r = 1; r < all.size(0); ++r) EXPECT_TRUE(torch::equal(all[r], all[0])) << r;
}

// n samples of 4 random features and one of 3 labels, for the Trainer's tests.
std::shared_ptr<mixprec::data::TensorDataset> pixels_dataset(int64_t n) {
  return std::make_shared<mixprec::data::TensorDataset>(std::map<std::string, at::Tensor>{
      {"pixels", torch::randn({n, 4})}, {"labels", torch::randint(0, 3, {n})}});
}

mixprec::models::MLPClassifier small_classifier() {
  return mixprec::models::MLPClassifier(
      mixprec::models::MLPClassifierOptions{.in_features = 4, .hidden = 8, .num_labels = 3});
}

class DataParallel : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::set_num_threads(1);
    ASSERT_GT(accelerator.num_processes(), 1) << "run under torchrun --nproc-per-node 2";
  }
  // Three updates of 4 samples a process at lr 0.1, nothing saved, in a folder named alike on
  // every rank.
  mixprec::TrainingArguments three_steps_args(const std::string& stem) {
    mixprec::TrainingArguments args;
    args.output_dir = shared_temp_dir(accelerator, stem).string();
    args.max_steps = 3;
    args.learning_rate = 0.1;
    args.save_strategy = "no";
    args.per_device_train_batch_size = 4;
    return args;
  }
  Accelerator accelerator;  // the process group is made once per process
};

TEST_F(DataParallel, ProcessInfoGatherAndReduce) {
  const int64_t rank = accelerator.process_index(), world = accelerator.num_processes();
  EXPECT_EQ(accelerator.is_main_process(), rank == 0);
  auto gathered = accelerator.gather(torch::full({2}, rank));
  EXPECT_TRUE(torch::equal(gathered, torch::arange(world).repeat_interleave(2)));
  auto sum = accelerator.reduce(torch::tensor({static_cast<double>(rank)}), "sum");
  EXPECT_EQ(sum.item<double>(), world * (world - 1) / 2.0);
  EXPECT_EQ(accelerator.reduce(torch::ones({1}), "mean").item<double>(), 1.0);
  EXPECT_EQ(accelerator.reduce(torch::tensor({3.0 - rank}), "max").item<double>(), 3.0);
  EXPECT_EQ(accelerator.reduce(torch::tensor({1.0}), "none").item<double>(), world);
  EXPECT_EQ(accelerator.is_last_process(), rank == world - 1);
  std::vector<int64_t> ran;
  accelerator.on_main_process([&] { ran.push_back(0); });
  accelerator.on_last_process([&] { ran.push_back(world - 1); });
  accelerator.on_process(1, [&] { ran.push_back(1); });
  accelerator.on_local_process(1, [&] { ran.push_back(-1); });
  std::vector<int64_t> expected;
  if (rank == 0) expected.push_back(0);
  if (rank == world - 1) expected.push_back(world - 1);
  if (rank == 1) expected.push_back(1);
  if (accelerator.local_process_index() == 1) expected.push_back(-1);
  EXPECT_EQ(ran, expected);
  accelerator.wait_for_everyone();
}

// Each rank trains on its shard of a global batch; the result equals one
// process on the whole batch (DDP averages the gradients of equal shards).
// Tolerance rtol 1e-5: the all-reduce sums in another order than one backward.
TEST_F(DataParallel, MatchesOneProcessOnTheGlobalBatch) {
  const int64_t rank = accelerator.process_index(), world = accelerator.num_processes();
  torch::manual_seed(100 + rank);  // different on purpose: prepare() broadcasts rank 0's
  auto net = make_net();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto [model, optimizer] = accelerator.prepare(net, sgd);
  auto reference = make_net();
  {
    torch::NoGradGuard no_grad;
    auto src = net->parameters(), dst = reference->parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  torch::optim::SGD reference_sgd(reference->parameters(),
                                  torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::manual_seed(0);  // the same global batches on every rank
  for (int step = 0; step < 5; ++step) {
    auto x = torch::randn({4 * world, 6});
    auto y = torch::randint(0, 3, {4 * world});
    auto loss = torch::nn::functional::cross_entropy(model(x.slice(0, 4 * rank, 4 * rank + 4)),
                                                     y.slice(0, 4 * rank, 4 * rank + 4));
    accelerator.backward(loss);
    optimizer.step();
    optimizer.zero_grad();
    torch::nn::functional::cross_entropy(reference->forward(x), y).backward();
    reference_sgd.step();
    reference_sgd.zero_grad();
  }
  expect_same_on_every_rank(accelerator, flat_params(*net));
  EXPECT_TRUE(torch::allclose(flat_params(*net), flat_params(*reference), 1e-5, 1e-6))
      << (flat_params(*net) - flat_params(*reference)).abs().max().item<double>();
  // A model with nothing to train (a frozen teacher) is prepared without a reducer (c10d's
  // refuses an empty list), as Accelerate leaves it unwrapped; rank 0's weights all the same.
  torch::manual_seed(200 + rank);
  auto frozen = make_net();
  for (auto& p : frozen->parameters()) p.requires_grad_(false);
  auto teacher = accelerator.prepare(frozen);
  expect_same_on_every_rank(accelerator, flat_params(*frozen));
  EXPECT_EQ(teacher(torch::randn({2, 6})).size(0), 2);
}

TEST_F(DataParallel, AnInfOnOneRankSkipsTheStepOnEveryRank) {
  Accelerator fp16({.mixed_precision = "fp16", .scaler = {.init_scale = 512.0}});
  const int64_t rank = fp16.process_index();
  torch::manual_seed(0);
  auto net = make_net();
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto linear = mixprec::optim::get_scheduler("linear", sgd, {.num_training_steps = 100});
  auto [model, optimizer, scheduler] = fp16.prepare(net, sgd, linear);
  for (int step = 0; step < 4; ++step) {
    const auto before = flat_params(*net);
    auto loss = torch::nn::functional::cross_entropy(model(torch::randn({4, 6})),
                                                     torch::randint(0, 3, {4}));
    if (step == 2 && rank == 1) loss = loss * std::numeric_limits<float>::infinity();
    fp16.backward(loss);
    optimizer.step();
    scheduler.step();
    optimizer.zero_grad();
    EXPECT_EQ(fp16.optimizer_step_was_skipped(), step == 2) << "rank " << rank << " step " << step;
    if (step == 2) {
      EXPECT_TRUE(torch::equal(flat_params(*net), before));
    }
    expect_same_on_every_rank(fp16, flat_params(*net));
  }
  EXPECT_EQ(fp16.scaler()->get_scale(), 256.0);
  // Not split_batches: the schedule advances once per process per optimizer
  // step, and not at all on the skipped one.
  EXPECT_DOUBLE_EQ(scheduler.get_last_lr()[0], 0.1 * (100 - 3 * fp16.num_processes()) / 100.0);
}

// As Accelerate's accumulate(*models): the models passed keep their gradients on each rank
// until the sync step; a model not passed all-reduces every backward.
TEST_F(DataParallel, AccumulateKeepsThePassedModelsGradientsLocalUntilTheSyncStep) {
  Accelerator accumulating({.gradient_accumulation_steps = 2});
  auto net = make_net(), other_net = make_net();
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, other, optimizer] = accumulating.prepare(net, other_net, sgd);
  torch::manual_seed(1 + accumulating.process_index());  // different data on each rank
  auto first_grad = [](const torch::nn::Sequential& m) {
    return m->parameters()[0].grad().clone();
  };
  {
    auto guard = accumulating.accumulate(model);
    accumulating.backward(model(torch::randn({4, 6})).sum() + other(torch::randn({4, 6})).sum());
  }
  auto local = accumulating.gather(first_grad(net).unsqueeze(0));
  EXPECT_FALSE(torch::equal(local[0], local[1]));  // no all-reduce: each rank's own
  expect_same_on_every_rank(accumulating, first_grad(other_net));
  {
    auto guard = accumulating.accumulate(model);
    accumulating.backward(model(torch::randn({4, 6})).sum());
  }
  expect_same_on_every_rank(accumulating, first_grad(net));  // averaged over the ranks
  optimizer.step();
  optimizer.zero_grad();
  expect_same_on_every_rank(accumulating, flat_params(*net));
  {  // accumulate() with no model: an accumulation step that all-reduces
    auto guard = accumulating.accumulate();
    ASSERT_FALSE(accumulating.sync_gradients());
    accumulating.backward(model(torch::randn({4, 6})).sum());
  }
  expect_same_on_every_rank(accumulating, first_grad(net));
}

// Accelerate's sync_each_batch: every micro-step all-reduces (after the first, the gradients are
// the same on every rank), the optimizer still steps on sync steps only, and the update is the
// default's up to rounding.
TEST_F(DataParallel, SyncEachBatchAllReducesEveryMicroStep) {
  const auto run = [&](bool each_batch) {
    Accelerator acc({.gradient_accumulation_steps = 2, .sync_each_batch = each_batch});
    torch::manual_seed(0);
    auto net = make_net();
    torch::optim::SGD sgd(net->parameters(), 0.1);
    auto [model, optimizer] = acc.prepare(net, sgd);
    torch::manual_seed(1 + acc.process_index());  // different data on each rank
    const auto before = flat_params(*net).clone();
    for (int step = 0; step < 2; ++step) {
      auto guard = acc.accumulate(model);
      acc.backward(model(torch::randn({4, 6})).sum());
      optimizer.step();
      optimizer.zero_grad();
      if (step == 0) {
        EXPECT_TRUE(torch::equal(flat_params(*net), before));  // not a sync step
        const auto grads = acc.gather(net->parameters()[0].grad().unsqueeze(0));
        EXPECT_EQ(torch::equal(grads[0], grads[1]), each_batch);
      }
    }
    expect_same_on_every_rank(acc, flat_params(*net));
    return flat_params(*net);
  };
  const auto synced_once = run(false);
  const auto each_batch = run(true);
  {  // an explicit no_sync still keeps each rank's own gradients
    Accelerator acc({.gradient_accumulation_steps = 2, .sync_each_batch = true});
    auto net = make_net();
    auto model = acc.prepare(net);
    torch::manual_seed(1 + acc.process_index());
    auto guard = acc.accumulate(model);
    {
      auto local = acc.no_sync(model);
      acc.backward(model(torch::randn({4, 6})).sum());
    }
    const auto grads = acc.gather(net->parameters()[0].grad().unsqueeze(0));
    EXPECT_FALSE(torch::equal(grads[0], grads[1]));
  }
  torch::manual_seed(0);
  EXPECT_FALSE(torch::equal(each_batch, flat_params(*make_net())));  // it did step
  EXPECT_TRUE(torch::allclose(each_batch, synced_once, 1e-6, 1e-7));
}

// 9 samples on 2 processes: the sampler pads to 10, and gather_for_metrics
// gives back each sample exactly once.
TEST_F(DataParallel, PreparedLoaderShardsAndGatherForMetricsDropsThePadding) {
  auto data = std::make_shared<mixprec::data::TensorDataset>(
      std::map<std::string, at::Tensor>{{"x", torch::arange(9)}});
  auto loader = accelerator.prepare_data_loader(data, {.batch_size = 2});
  std::vector<at::Tensor> seen, local;
  int64_t last_batches = 0;
  for (const auto& batch : loader) {
    local.push_back(batch.at("x"));
    seen.push_back(accelerator.gather_for_metrics(batch.at("x")));
    // A 0-dim value gathers to one per process, also on the last batch, which has padding.
    EXPECT_EQ(accelerator.gather_for_metrics(torch::tensor(1.5)).sizes(),
              at::IntArrayRef({accelerator.num_processes()}));
    last_batches += accelerator.gradient_state().end_of_dataloader;
  }
  EXPECT_EQ(last_batches, 1);
  EXPECT_EQ(torch::cat(local).size(0), 6);  // this rank's 3 batches of the 12 padded ones
  EXPECT_TRUE(torch::equal(std::get<0>(torch::sort(torch::cat(seen))), torch::arange(9)));
}

// Without a seed, a shuffled prepared loader takes the main process's draw: the ranks' shards
// stay disjoint though their generators differ, and each pass has a new order. So does a
// RandomSampler asked for by hand (with a seed, which it does not use).
TEST_F(DataParallel, PreparedShuffleTakesTheMainProcessSeed) {
  auto data = std::make_shared<mixprec::data::TensorDataset>(
      std::map<std::string, at::Tensor>{{"x", torch::arange(16)}});
  for (const auto& options : std::vector<mixprec::data::DataLoaderOptions>{
           {.batch_size = 2, .shuffle = true},
           {.batch_size = 2,
           .shuffle = true,
           .seed = 5,
           .shuffle_order = mixprec::data::ShuffleOrder::kRandomSampler}}) {
    torch::manual_seed(100 + static_cast<uint64_t>(accelerator.process_index()));
    auto loader = accelerator.prepare_data_loader(data, options);
    auto pass = [&] {
      std::vector<at::Tensor> gathered;
      for (const auto& batch : loader) gathered.push_back(accelerator.gather(batch.at("x")));
      return torch::cat(gathered);
    };
    const auto first = pass(), second = pass();
    EXPECT_TRUE(torch::equal(std::get<0>(torch::sort(first)), torch::arange(16)));
    EXPECT_TRUE(torch::equal(std::get<0>(torch::sort(second)), torch::arange(16)));
    EXPECT_FALSE(torch::equal(first, second));
  }
}

// rng_types "torch": each pass of a prepared loader starts from the main process's torch
// generator on every process (so that dropout draws alike); by default, each keeps its own.
TEST_F(DataParallel, RngTypesTorchSynchronizesTheGeneratorAsEachPassStarts) {
  auto data = std::make_shared<mixprec::data::TensorDataset>(
      std::map<std::string, at::Tensor>{{"x", torch::arange(8)}});
  for (const bool synchronized : {false, true}) {
    Accelerator prepared({.rng_types = synchronized ? std::vector<std::string>{"torch", "generator"}
                                                    : std::vector<std::string>{"generator"}});
    auto loader = prepared.prepare_data_loader(data, {.batch_size = 2});
    torch::manual_seed(100 + static_cast<uint64_t>(accelerator.process_index()));
    for (const auto& batch : loader) {
      const auto draws = accelerator.gather(torch::rand({1, 4}));
      EXPECT_EQ(torch::equal(draws[0], draws[1]), synchronized) << batch.at("x");
    }
  }
}

// Accelerate's default prepared loader on two processes: each rank's batches, pass after pass,
// and what torch's generator draws between passes, are those of Accelerate's rank.
TEST_F(DataParallel, PreparedShuffleEqualsAcceleratesDefaultOverPasses) {
  const auto cases = mixprec::testing::load_reference("data_loader_order.json");
  const auto rank = static_cast<size_t>(accelerator.process_index());
  int64_t checked = 0;
  for (const auto& c : cases["accelerate_random_sampler"]) {
    if (c["num_replicas"] != 2) continue;
    SCOPED_TRACE(c.dump().substr(0, 120));
    const bool split = c["split_batches"];
    mixprec::accelerate::set_seed(c["seed"].get<uint64_t>());
    Accelerator prepared({.split_batches = split});
    auto data = std::make_shared<mixprec::data::TensorDataset>(
        std::map<std::string, at::Tensor>{{"x", torch::arange(c["n"].get<int64_t>())}});
    auto loader = prepared.prepare_data_loader(
        data, {.batch_size = c["batch_size"].get<size_t>() * (split ? 2 : 1),
               .shuffle = c["shuffle"],
               .drop_last = c["drop_last"],
               .num_workers = c["num_workers"]});
    const auto got = mixprec::testing::random_sampler_passes(loader, "x");
    EXPECT_EQ(got["passes"], c["ranks"][rank]["passes"]);
    EXPECT_EQ(got["draws"], c["ranks"][rank]["draws"]);
    ++checked;
  }
  EXPECT_GE(checked, 4);
}

// split_batches: batch_size is the batch of all processes; step k sees batch k of the
// one-process loader (shuffled alike), in contiguous slices; the schedule steps once.
TEST_F(DataParallel, SplitBatchesDividesEachBatchAmongTheProcesses) {
  Accelerator split({.split_batches = true});
  const auto n = static_cast<size_t>(split.num_processes());
  auto data = std::make_shared<mixprec::data::TensorDataset>(
      std::map<std::string, at::Tensor>{{"x", torch::arange(12)}});
  const mixprec::data::DataLoaderOptions options{.batch_size = 2 * n, .shuffle = true, .seed = 3};
  auto loader = split.prepare_data_loader(data, options);
  mixprec::data::DataLoader one_process(data, options);
  ASSERT_EQ(loader.size(), one_process.size());
  auto whole = one_process.begin();
  for (const auto& batch : loader) {
    EXPECT_EQ(batch.at("x").size(0), 2);
    EXPECT_TRUE(torch::equal(split.gather(batch.at("x")), (*whole).at("x")));
    ++whole;
  }
  const auto error = error_of([&] { split.prepare_data_loader(data, {.batch_size = 2 * n + 1}); });
  EXPECT_NE(error.find("Accelerator: to use a DataLoader in split_batches mode, the batch size (" +
                       std::to_string(2 * n + 1) +
                       ") needs to be a round multiple of the number of processes (" +
                       std::to_string(split.num_processes()) + ")."),
            std::string::npos)
      << error;

  auto net = make_net();
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto linear = mixprec::optim::get_scheduler("linear", sgd, {.num_training_steps = 100});
  auto [model, optimizer, scheduler] = split.prepare(net, sgd, linear);
  split.backward(model(torch::randn({2, 6})).sum());
  optimizer.step();
  scheduler.step();
  EXPECT_DOUBLE_EQ(scheduler.get_last_lr()[0], 0.1 * 99 / 100.0);
}

// The Trainer's schedule counts this process's updates (max_steps), as in HF's Trainer:
// it steps once per update on every rank, not once per process.
TEST_F(DataParallel, TrainerStepsItsScheduleOncePerUpdate) {
  torch::manual_seed(0);
  auto data = pixels_dataset(32);
  auto model = small_classifier();
  mixprec::TrainingArguments args;
  args.output_dir =
      (std::filesystem::temp_directory_path() / ("mixprec_dp_trainer_" + std::to_string(getpid())))
          .string();
  args.max_steps = 4;
  args.learning_rate = 0.1;
  args.logging_steps = 1;
  args.save_strategy = "no";
  args.per_device_train_batch_size = 4;
  mixprec::Trainer trainer(model, args, data);
  trainer.train();
  std::vector<double> lrs;
  for (const auto& entry : trainer.state().log_history)
    if (entry.count("learning_rate")) lrs.push_back(entry.at("learning_rate"));
  ASSERT_EQ(lrs.size(), 4u);  // each step's lr, linear from 0.1 to 0 over the 4 steps
  for (size_t i = 0; i < lrs.size(); ++i) EXPECT_NEAR(lrs[i], 0.1 * (4.0 - i) / 4, 1e-12) << i;
  std::filesystem::remove_all(args.output_dir);
}

// A net whose second layer only rank 0 uses (or no rank), with a buffer each forward adds
// rank + 1 to, as a batch norm's running statistics change with each rank's data.
struct PartlyUsedNet : torch::nn::Module {
  PartlyUsedNet(int64_t rank, bool rank0_uses_second) : rank(rank), uses_second(rank0_uses_second) {
    torch::manual_seed(0);
    first = register_module("first", torch::nn::Linear(4, 3));
    second = register_module("second", torch::nn::Linear(4, 3));
    count = register_buffer("count", torch::zeros({1}));
  }
  at::Tensor forward(const at::Tensor& x) {
    count.add_(rank + 1);
    auto y = first->forward(x);
    return uses_second && rank == 0 ? y + second->forward(x) : y;
  }
  int64_t rank;
  bool uses_second;
  torch::nn::Linear first{nullptr}, second{nullptr};
  at::Tensor count;
};

// DDP's find_unused_parameters: a parameter rank 1 does not use gets rank 0's gradient over 2 on
// both; one no rank uses keeps no gradient. Without it, c10d's reducer would never all-reduce
// the bucket that waits for it: the next forward is an error that says what to set.
TEST_F(DataParallel, FindUnusedParametersAllReducesWhatSomeRanksDoNotUse) {
  const int64_t rank = accelerator.process_index();
  torch::manual_seed(20 + rank);
  const auto x = torch::randn({5, 4});
  for (const bool rank0_uses_second : {true, false}) {
    SCOPED_TRACE(rank0_uses_second ? "rank 0 uses the second layer" : "no rank uses it");
    Accelerator finding({.ddp = {.find_unused_parameters = true}});
    auto net = std::make_shared<PartlyUsedNet>(rank, rank0_uses_second);
    auto model = finding.prepare(net);
    for (int step = 0; step < 2; ++step) {
      net->zero_grad();
      model(x).pow(2).sum().backward();
    }
    EXPECT_NE(error_of([&] {
                (void)finding.trigger_sync_in_backward(model);
              }).find("not with ddp.find_unused_parameters"),
              std::string::npos);
    expect_same_on_every_rank(accelerator, net->first->weight.grad());
    if (rank0_uses_second) {
      expect_same_on_every_rank(accelerator, net->second->weight.grad());
      at::Tensor local = torch::zeros_like(net->second->weight);
      if (rank == 0) {  // rank 0's own gradient of the second layer
        auto copy = std::make_shared<PartlyUsedNet>(0, true);
        copy->forward(x).pow(2).sum().backward();
        local = copy->second->weight.grad();
      }
      local = accelerator.reduce(local, "sum");
      EXPECT_TRUE(torch::allclose(net->second->weight.grad(), local / 2, 1e-5, 1e-7));
    } else {
      EXPECT_FALSE(net->second->weight.grad().defined());
    }
  }
  Accelerator plain;  // DDP's default: off
  auto net = std::make_shared<PartlyUsedNet>(rank, false);
  auto model = plain.prepare(net);
  model(x).pow(2).sum().backward();
  std::string error;
  {
    auto local = plain.no_sync(model);  // DDP checks every forward with gradients
    error = error_of([&] { model(x); });
  }
  EXPECT_NE(error.find("Expected to have finished reduction in the prior iteration"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("ddp_find_unused_parameters"), std::string::npos) << error;
}

// DDP's broadcast_buffers: before a forward that follows a synced one (the first included), the
// buffers become rank 0's; a forward without gradients or under no_sync is not synced,
// so the next does not. (Rank 0's values are the same either way; rank 1's tell.)
TEST_F(DataParallel, BroadcastBuffersSetsThemToRankZerosBeforeASyncedForward) {
  const int64_t rank = accelerator.process_index();
  const auto x = torch::randn({2, 4});
  for (const bool broadcast : {true, false}) {
    SCOPED_TRACE(broadcast ? "broadcast_buffers" : "without");
    Accelerator acc({.ddp = {.find_unused_parameters = true, .broadcast_buffers = broadcast}});
    auto net = std::make_shared<PartlyUsedNet>(rank, false);
    auto model = acc.prepare(net);
    const double add = static_cast<double>(rank + 1);
    for (int step = 0; step < 3; ++step) model(x).sum().backward();
    EXPECT_EQ(net->count.item<double>(), broadcast ? 2 + add : 3 * add);
    {
      at::NoGradGuard no_grad;  // synced before (the last forward was), not after
      model(x);
    }
    EXPECT_EQ(net->count.item<double>(), broadcast ? 3 + add : 4 * add);
    model(x).sum().backward();
    EXPECT_EQ(net->count.item<double>(), broadcast ? 3 + 2 * add : 5 * add);
    {
      auto local = acc.no_sync(model);  // an accumulation step: synced before, not after
      model(x).sum().backward();
    }
    EXPECT_EQ(net->count.item<double>(), broadcast ? 5 + add : 6 * add);
    model(x).sum().backward();
    EXPECT_EQ(net->count.item<double>(), broadcast ? 5 + 2 * add : 7 * add);
  }
}

// The Trainer's ddp_* arguments: find_unused_parameters is on by default (HF's, without
// activation checkpointing), so a model with a parameter its forward never uses trains; off,
// the second step fails, unless ddp_static_graph says to find them as DDP's static graph does.
// ddp_comm_hook "bf16" rounds the all-reduced gradients.
TEST_F(DataParallel, TrainerTakesHfsDdpArguments) {
  struct WithUnusedHead : torch::nn::Module {
    WithUnusedHead() {
      torch::manual_seed(0);
      body = register_module("body", torch::nn::Linear(4, 3));
      unused = register_module("unused", torch::nn::Linear(4, 3));
    }
    mixprec::models::ModelOutput forward(const mixprec::data::Batch& b) {
      auto logits = body->forward(b.at("pixels"));
      return {torch::nn::functional::cross_entropy(logits, b.at("labels")), logits};
    }
    torch::nn::Linear body{nullptr}, unused{nullptr};
  };
  torch::manual_seed(0);
  auto data = pixels_dataset(32);
  auto train = [&](std::optional<bool> find_unused, const std::string& hook,
                   std::optional<bool> static_graph = std::nullopt) {
    auto model = std::make_shared<WithUnusedHead>();
    auto args = three_steps_args("mixprec_dp_ddp_args_");
    args.ddp_find_unused_parameters = find_unused;
    args.ddp_static_graph = static_graph;
    args.ddp_comm_hook = hook;
    args.ddp_bucket_cap_mb = 1;
    mixprec::Trainer trainer(model, args, data);
    trainer.train();
    expect_same_on_every_rank(accelerator, flat_params(*model));
    EXPECT_FALSE(model->unused->weight.grad().defined());
    return flat_params(*model);
  };
  const auto fp32 = train(std::nullopt, "no");
  const auto bf16 = train(true, "bf16");
  EXPECT_FALSE(torch::equal(fp32, bf16));
  EXPECT_TRUE(torch::allclose(fp32, bf16, 1e-2, 1e-3));
  const auto error = error_of([&] { train(false, "no"); });
  EXPECT_NE(error.find("ddp_find_unused_parameters"), std::string::npos) << error;
  EXPECT_TRUE(torch::equal(train(false, "no", true), fp32));
}

// accelerator_config's split_batches: per_device_train_batch_size is the batch of both
// processes, cut in two; the same batches, losses and weights as half of it on each. Also
// the epoch's evaluation, whose batch is split too.
TEST_F(DataParallel, TrainerSplitBatchesCutsEachBatchAmongTheProcesses) {
  torch::manual_seed(0);
  auto data = pixels_dataset(36);
  auto train = [&](int64_t batch_size, bool split) {
    torch::manual_seed(1);
    auto model = small_classifier();
    auto args = three_steps_args("mixprec_dp_split_");
    args.max_steps = 10;  // two passes: 36 samples in batches of 8, the last padded
    args.logging_steps = 1;
    args.eval_strategy = "epoch";
    args.per_device_train_batch_size = batch_size;
    args.per_device_eval_batch_size = batch_size;
    args.accelerator_config.split_batches = split;
    mixprec::Trainer trainer(model, args, data, data);
    const auto output = trainer.train();
    std::vector<double> losses;
    for (const auto& entry : trainer.state().log_history)
      for (const char* key : {"loss", "eval_loss"})
        if (entry.count(key)) losses.push_back(entry.at(key));
    return std::tuple(
        flat_params(*model), losses, trainer.state().global_step,
        output.metrics.at("train_samples_per_second") * output.metrics.at("train_runtime"));
  };
  const auto [halves, halves_losses, halves_steps, halves_samples] = train(4, false);
  const auto [split, split_losses, split_steps, split_samples] = train(8, true);
  expect_same_on_every_rank(accelerator, split);
  EXPECT_TRUE(torch::allclose(split, halves, 1e-5, 1e-7));
  EXPECT_EQ(split_steps, 10);
  EXPECT_EQ(halves_steps, 10);
  ASSERT_EQ(split_losses.size(), 12u);  // 10 steps, 2 evaluations
  ASSERT_EQ(halves_losses.size(), 12u);
  for (size_t i = 0; i < split_losses.size(); ++i)
    EXPECT_NEAR(split_losses[i], halves_losses[i], 1e-6) << i;
  EXPECT_NEAR(split_samples, 80, 1e-6);  // 10 steps of 8 samples, not counted twice
  EXPECT_NEAR(split_samples, halves_samples, 1e-6);
  EXPECT_EQ(error_of([&] { train(3, true); }),
            "Accelerator: to use a DataLoader in split_batches mode, the batch size (3) needs to "
            "be a round multiple of the number of processes (2).");
  std::filesystem::remove_all(shared_temp_dir(accelerator, "mixprec_dp_split_"));
}

// accelerator_config's use_seedable_sampler = false: torch's RandomSampler, one order for every
// process (each pass covers each sample once), another each pass.
TEST_F(DataParallel, TrainerRandomSamplerSharesEachPassOrder) {
  struct Recording : mixprec::data::Dataset {
    explicit Recording(mixprec::data::DatasetPtr inner) : inner(std::move(inner)) {}
    size_t size() const override { return inner->size(); }
    mixprec::data::Example get(size_t index) const override {
      seen.push_back(static_cast<int64_t>(index));
      return inner->get(index);
    }
    mixprec::data::DatasetPtr inner;
    mutable std::vector<int64_t> seen;
  };
  torch::manual_seed(0);
  auto data = std::make_shared<Recording>(pixels_dataset(16));
  auto args = three_steps_args("mixprec_dp_random_");
  args.max_steps = 4;  // two passes of 2 batches of 4 on each process
  args.accelerator_config.use_seedable_sampler = false;
  mixprec::Trainer trainer(small_classifier(), args, data);
  trainer.train();
  EXPECT_GE(data->seen.size(), 16u);
  data->seen.resize(16, -1);  // the same shape on both processes, whatever happened
  const auto seen = accelerator.gather(torch::tensor(data->seen)).view({2, 2, 8});
  // Accelerate's: a generator seeded by the first draw after the seed, shared by the
  // processes; RandomSampler's two randperms a pass, the first one the order.
  torch::manual_seed(static_cast<uint64_t>(args.seed));
  auto generator = at::make_generator<at::CPUGeneratorImpl>(
      static_cast<uint64_t>(at::empty({1}, at::kLong).random_().item<int64_t>()));
  for (int64_t pass = 0; pass < 2; ++pass) {
    const auto order = at::randperm(16, generator, at::kLong);
    at::randperm(16, generator, at::kLong);
    for (int64_t rank = 0; rank < 2; ++rank)  // batches of 4 to the processes in turn
      EXPECT_TRUE(
          torch::equal(seen[rank][pass], torch::cat({order.slice(0, 4 * rank, 4 * rank + 4),
                                                     order.slice(0, 8 + 4 * rank, 12 + 4 * rank)})))
          << "pass " << pass << " rank " << rank << ": " << seen[rank][pass] << " order " << order;
  }
  EXPECT_FALSE(torch::equal(seen[0][0], seen[0][1]));
  std::filesystem::remove_all(args.output_dir);
}

// use_seedable_sampler = false on 2 processes: a run resumed mid-epoch (the shared generator's
// state at the pass's start) or at an epoch's end (its state then) ends as the uninterrupted one.
TEST_F(DataParallel, TrainerRandomSamplerResumesInTheSameOrder) {
  torch::manual_seed(0);
  auto data = pixels_dataset(32);  // 4 steps an epoch: batches of 4 on each process
  auto args = three_steps_args("mixprec_dp_random_resume_");
  args.max_steps = 8;
  args.save_strategy = "steps";
  args.save_steps = 2;
  args.accelerator_config.use_seedable_sampler = false;
  auto train = [&](const std::string& output_dir, std::optional<std::string> checkpoint) {
    torch::manual_seed(1 + static_cast<uint64_t>(checkpoint.has_value()));
    auto model = small_classifier();
    auto a = args;
    a.output_dir = output_dir;
    mixprec::Trainer(model, a, data).train(checkpoint);
    return flat_params(*model);
  };
  const auto whole = train(args.output_dir, std::nullopt);
  for (const char* checkpoint : {"checkpoint-4", "checkpoint-6"}) {
    const auto resumed = train(args.output_dir + "_resumed",
                               (std::filesystem::path(args.output_dir) / checkpoint).string());
    EXPECT_TRUE(torch::equal(resumed, whole)) << checkpoint;
  }
  accelerator.wait_for_everyone();
  if (accelerator.is_main_process()) {
    std::filesystem::remove_all(args.output_dir);
    std::filesystem::remove_all(args.output_dir + "_resumed");
  }
}

// HF's accelerator_config.gradient_accumulation_kwargs.sync_each_batch: the micro-steps before
// each window's last all-reduce too (after them, the gradients are the same on both ranks), and
// training ends where it does without, up to rounding.
TEST_F(DataParallel, TrainerSyncEachBatchAllReducesEveryMicroStep) {
  struct SameGradients : mixprec::train::TrainerCallback {
    Accelerator* accelerator = nullptr;
    std::vector<bool> same;  // after each micro-step but a window's last
    void on_substep_end(const mixprec::TrainingArguments&, mixprec::train::TrainerState&,
                        mixprec::train::TrainerControl&) override {
      const auto all = accelerator->gather(kwargs().model->parameters()[0].grad().unsqueeze(0));
      same.push_back(torch::equal(all[0], all[1]));
    }
  };
  torch::manual_seed(0);
  auto data = pixels_dataset(64);
  const auto train = [&](bool each_batch) {
    auto callback = std::make_shared<SameGradients>();
    callback->accelerator = &accelerator;
    torch::manual_seed(0);
    auto model = small_classifier();
    auto args = three_steps_args("mixprec_dp_sync_each_batch_");
    args.gradient_accumulation_steps = 2;
    args.disable_tqdm = true;
    if (each_batch)
      args.accelerator_config.gradient_accumulation_kwargs = {{.sync_each_batch = true}};
    mixprec::Trainer trainer(model, args, data, nullptr, {}, {callback});
    trainer.train();
    EXPECT_EQ(callback->same, std::vector<bool>(3, each_batch));
    expect_same_on_every_rank(accelerator, flat_params(*model));
    return flat_params(*model);
  };
  const auto once = train(false);
  EXPECT_TRUE(torch::allclose(train(true), once, 1e-5, 1e-7));
}

// HF's log levels: log_level on the main process, log_level_replica on the others.
TEST_F(DataParallel, TrainerSetsTheMainAndReplicaLogLevels) {
  mixprec::testing::VerbosityGuard guard;
  auto data = pixels_dataset(8);
  auto model = small_classifier();
  mixprec::TrainingArguments args;
  args.output_dir = shared_temp_dir(accelerator, "mixprec_dp_log_level_").string();
  args.save_strategy = "no";
  args.log_level = "info";
  args.log_level_replica = "error";
  mixprec::Trainer trainer(model, args, data);
  EXPECT_EQ(mixprec::log::get_verbosity(), accelerator.is_main_process()
                                               ? mixprec::log::Level::kInfo
                                               : mixprec::log::Level::kError);
}

// One backward with each compression, from the same weights and data: the
// bytes sent halve, and the averaged gradients are fp32's within two roundings
// to the wire dtype (the cast of g/2, the sum), elementwise relative to the
// ranks' local gradients: 2^-10 for fp16 (plus its subnormal step), 2^-7 for bf16.
TEST_F(DataParallel, CompressedAllReduceHalvesTheBytesWithinRounding) {
  const int64_t rank = accelerator.process_index();
  auto group = mixprec::dist::ProcessGroup::from_environment();
  // 268k parameters: more than the Reducer's 1 MB first bucket, so two buckets.
  auto make_wide_net = [] {
    torch::manual_seed(0);
    return torch::nn::Sequential(torch::nn::Linear(6, 512), torch::nn::Tanh(),
                                 torch::nn::Linear(512, 512), torch::nn::Tanh(),
                                 torch::nn::Linear(512, 3));
  };
  torch::manual_seed(10 + rank);  // different data on each rank
  const auto x = torch::randn({8, 6});
  const auto y = torch::randint(0, 3, {8});
  struct Result {
    at::Tensor grad;
    int64_t bytes;
  };
  auto backward_with = [&](GradientCompression compression) {
    auto net = make_wide_net();
    mixprec::dist::GradientReducer reducer(net->parameters(), group, {.compression = compression});
    reducer.prepare_for_backward();
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    std::vector<at::Tensor> grads;
    for (const auto& p : net->parameters()) grads.push_back(p.grad().reshape(-1));
    return Result{torch::cat(grads), reducer.bytes_all_reduced()};
  };
  auto local_net = make_wide_net();  // each rank's own gradient, not reduced
  torch::nn::functional::cross_entropy(local_net->forward(x), y).backward();
  std::vector<at::Tensor> local_grads;
  for (const auto& p : local_net->parameters()) local_grads.push_back(p.grad().reshape(-1));
  const auto local = accelerator.gather(torch::cat(local_grads).unsqueeze(0));  // (world, P)
  const auto scale = local.abs().mean(0);                                       // (|g0| + |g1|) / 2

  const auto fp32 = backward_with(GradientCompression::kNone);
  const int64_t numel = fp32.grad.numel();
  EXPECT_EQ(fp32.bytes, 4 * numel);
  expect_same_on_every_rank(accelerator, fp32.grad);
  EXPECT_TRUE(torch::allclose(fp32.grad, local.mean(0), 1e-6, 1e-9));
  struct Case {
    GradientCompression compression;
    at::ScalarType wire;
    double rtol, atol;
  };
  for (const auto& [compression, wire, rtol, atol] :
       {Case{GradientCompression::kFp16, at::kHalf, 0x1p-10, 0x1p-24},
        Case{GradientCompression::kBf16, at::kBFloat16, 0x1p-7, 0.0}}) {
    const auto compressed = backward_with(compression);
    SCOPED_TRACE(c10::toString(wire));
    EXPECT_EQ(compressed.bytes, 2 * numel);  // half of fp32's
    expect_same_on_every_rank(accelerator, compressed.grad);
    const auto error = (compressed.grad - fp32.grad).abs();
    EXPECT_TRUE((error <= rtol * scale + atol).all().item<bool>())
        << "worst excess " << (error - rtol * scale - atol).max().item<double>();
    // The sum travelled in the wire dtype: every value is one of its values, not fp32's.
    EXPECT_TRUE(torch::equal(compressed.grad.to(wire).to(at::kFloat), compressed.grad));
    EXPECT_FALSE(torch::equal(compressed.grad, fp32.grad));
  }
}

// 30 SGD steps from the same weights on the same per-rank data, through the
// Accelerator: the mean loss over the ranks with fp16 or bf16 compression stays
// within a relative 2e-4 (fp16) or 2e-3 (bf16) of the fp32 all-reduce's at
// every step (seen: at most 1.9e-5 and 2.1e-4), yet is not the same curve.
// Activation checkpointing: the recomputed blocks' gradients reach the all-reduce (c10d's hooks
// after gradient accumulation) as the plain model's do, so every rank ends the same.
TEST_F(DataParallel, ActivationCheckpointingAllReducesTheSame) {
  const int64_t rank = accelerator.process_index();
  torch::manual_seed(0);
  const auto ids = torch::randint(256, {2 * accelerator.num_processes(), 32});
  const auto local = ids.slice(0, 2 * rank, 2 * rank + 2);  // different on each rank
  const auto train = [&](bool checkpointing, bool find_unused = false) {
    torch::manual_seed(0);
    mixprec::models::GPT2LMHeadModel net(models_test::tiny_gpt2_config());
    if (checkpointing) net->activation_checkpointing_enable();
    mixprec::optim::AdamW adamw(net->parameters(), mixprec::optim::AdamWOptions(1e-3));
    Accelerator acc({.ddp = {.find_unused_parameters = find_unused}});
    auto [model, optimizer] = acc.prepare(net, adamw);
    for (int step = 0; step < 3; ++step) {
      acc.backward(model(local, local).loss);
      optimizer.step();
      optimizer.zero_grad();
    }
    return flat_params(*net);
  };
  const auto plain = train(false);
  // find_unused_parameters too: the recomputed blocks' parameters are inputs of the checkpoint's
  // node, so the search finds them used (HF turns it off for its reentrant checkpointing).
  for (const bool find_unused : {false, true}) {
    const auto checkpointed = train(true, find_unused);
    expect_same_on_every_rank(accelerator, checkpointed);
    EXPECT_TRUE(torch::allclose(checkpointed, plain, 1e-5, 1e-6))
        << find_unused << " " << (checkpointed - plain).abs().max().item<double>();
  }
}

// Updates in the backward would run before the all-reduce: an error, in either order.
TEST_F(DataParallel, OptimizerInBackwardIsAnError) {
  auto group = mixprec::dist::ProcessGroup::from_environment();
  auto net = make_net();
  {
    mixprec::optim::AdamW optimizer(net->parameters());
    mixprec::optim::OptimizerInBackward updates(optimizer);
    EXPECT_NE(error_of([&] {
                mixprec::dist::GradientReducer reducer(net->parameters(), group);
              }).find("OptimizerInBackward"),
              std::string::npos);
  }
  mixprec::dist::GradientReducer reducer(net->parameters(), group);
  mixprec::optim::AdamW optimizer(net->parameters());
  EXPECT_NE(error_of([&] {
              mixprec::optim::OptimizerInBackward updates(optimizer);
            }).find("GradientReducer"),
            std::string::npos);
}

TEST_F(DataParallel, CompressedLossCurveFollowsFp32) {
  const int64_t rank = accelerator.process_index();
  torch::manual_seed(20 + rank);
  const auto x = torch::randn({4, 16, 6});    // (batches, B, features), this rank's
  const auto y = x.slice(2, 0, 3).argmax(2);  // a class to learn: the largest of 3 features
  auto curve = [&](GradientCompression compression) {
    Accelerator dp({.ddp = {.compression = compression}});
    torch::manual_seed(0);
    auto net = make_net();
    torch::optim::SGD sgd(net->parameters(), 0.2);
    auto [model, optimizer] = dp.prepare(net, sgd);
    std::vector<double> losses;
    for (int step = 0; step < 30; ++step) {
      auto loss = torch::nn::functional::cross_entropy(model(x[step % 4]), y[step % 4]);
      dp.backward(loss);
      optimizer.step();
      optimizer.zero_grad();
      losses.push_back(dp.reduce(loss.detach(), "mean").item<double>());
    }
    expect_same_on_every_rank(dp, flat_params(*net));
    return losses;
  };
  const auto fp32 = curve(GradientCompression::kNone);
  EXPECT_LT(fp32.back(), 0.8 * fp32.front());  // it learns
  for (const auto& [compression, rtol] :
       {std::pair{GradientCompression::kFp16, 2e-4}, std::pair{GradientCompression::kBf16, 2e-3}}) {
    const auto compressed = curve(compression);
    EXPECT_NE(compressed, fp32);
    for (size_t i = 0; i < fp32.size(); ++i)
      EXPECT_NEAR(compressed[i], fp32[i], rtol * fp32[i]) << "step " << i;
  }
}

// Sample i: 3 + i tokens, so that the ranks' padded batches differ in length.
struct VaryingLengths : mixprec::data::Dataset {
  size_t size() const override { return 6; }
  mixprec::data::Example get(size_t i) const override {
    const auto ids = torch::arange(static_cast<int64_t>(3 + i));
    return {{"input_ids", ids}, {"labels", ids}};
  }
};

// As HF's evaluation loop, the Trainer pads each batch's logits and labels across the ranks
// before gathering them: every sample once, in order, padded with -100.
TEST_F(DataParallel, TrainerGathersBatchesOfDifferentLengths) {
  mixprec::models::GPT2LMHeadModel model(models_test::tiny_gpt2_config());
  mixprec::TrainingArguments args;
  args.output_dir =
      (std::filesystem::temp_directory_path() / ("mixprec_dp_lengths_" + std::to_string(getpid())))
          .string();
  args.per_device_eval_batch_size = 2;
  const auto data = std::make_shared<VaryingLengths>();
  mixprec::Trainer trainer(model, args, data, data);
  const auto out = trainer.predict(data);
  ASSERT_EQ(out.label_ids.sizes(), at::IntArrayRef({6, 8}));
  EXPECT_EQ(out.predictions.size(0), 6);
  for (int64_t i = 0; i < 6; ++i) {
    const auto ids = torch::arange(3 + i);
    EXPECT_TRUE(torch::equal(out.label_ids[i].slice(0, 0, 3 + i), ids)) << i;
    EXPECT_TRUE((out.label_ids[i].slice(0, 3 + i) == -100).all().item<bool>()) << i;
  }
  EXPECT_TRUE(std::isfinite(out.metrics.at("test_loss")));
  std::filesystem::remove_all(args.output_dir);
}

// Under no_sync the backward keeps each rank's gradient; the next synced backward averages
// what each rank accumulated, as DDP's no_sync does.
TEST_F(DataParallel, NoSyncKeepsGradientsOnEachProcessUntilTheNextSync) {
  auto net = make_net();
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = accelerator.prepare(net, sgd);
  auto local = make_net();  // the same weights, never all-reduced
  {
    torch::NoGradGuard no_grad;
    auto src = net->parameters(), dst = local->parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  torch::manual_seed(1 + accelerator.process_index());  // different data on each rank
  const auto x1 = torch::randn({4, 6}), x2 = torch::randn({4, 6});
  auto first_grad = [&] { return net->parameters()[0].grad().clone(); };
  {
    auto no_sync = accelerator.no_sync(model);
    accelerator.backward(model(x1).sum());
  }
  local->forward(x1).sum().backward();
  const auto all = accelerator.gather(first_grad().unsqueeze(0));
  EXPECT_FALSE(torch::equal(all[0], all[1]));
  EXPECT_TRUE(torch::equal(first_grad(), local->parameters()[0].grad()));
  accelerator.backward(model(x2).sum());
  local->forward(x2).sum().backward();
  expect_same_on_every_rank(accelerator, first_grad());
  EXPECT_TRUE(torch::allclose(
      first_grad(), accelerator.reduce(local->parameters()[0].grad(), "mean"), 1e-6, 1e-6));
}

// An accumulation step keeps its gradients local, unless its backward is triggered to sync.
TEST_F(DataParallel, TriggerSyncInBackwardSyncsAnAccumulationStep) {
  Accelerator accumulating({.gradient_accumulation_steps = 2});
  auto net = make_net();
  auto model = accumulating.prepare(net);
  torch::manual_seed(1 + accumulating.process_index());  // different data on each rank
  {
    auto step = accumulating.accumulate(model);  // micro-step 1 of 2
    ASSERT_FALSE(accumulating.sync_gradients());
    auto loss = model(torch::randn({4, 6})).sum();
    auto sync = accumulating.trigger_sync_in_backward(model);
    accumulating.backward(loss);
  }
  expect_same_on_every_rank(accumulating, net->parameters()[0].grad());
}

// Accelerate's profile(): each process writes its own trace, and none returns before all did.
TEST_F(DataParallel, ProfileWritesATracePerProcess) {
  const auto dir = shared_temp_dir(accelerator, "mixprec_dp_profile_");
  if (accelerator.is_main_process()) std::filesystem::remove_all(dir);
  accelerator.wait_for_everyone();
  const at::Tensor x = torch::ones({8, 8});
  auto profiler = accelerator.profile(
      [&](mixprec::accelerate::Profiler&) {
        for (int64_t i = 0; i <= accelerator.process_index(); ++i) torch::mm(x, x);
      },
      mixprec::accelerate::ProfileKwargs{.activities = {"cpu"}, .output_trace_dir = dir.string()});
  EXPECT_EQ(profiler.key_averages().at(0).count, accelerator.process_index() + 1);
  for (int rank = 0; rank < 2; ++rank) {
    const auto file = dir / ("profile_" + std::to_string(rank) + ".json");
    EXPECT_EQ(mixprec::testing::trace_events_named(file, "aten::mm"), rank + 1) << rank;
  }
  accelerator.wait_for_everyone();
  if (accelerator.is_main_process()) std::filesystem::remove_all(dir);
}

// Accelerate's utilities beside gather, on 2 processes.
TEST_F(DataParallel, PadGatherObjectSplitTriggerAndGoingFirst) {
  const int64_t rank = accelerator.process_index(), world = accelerator.num_processes();
  ASSERT_EQ(world, 2);
  // Rank r holds r + 1 values: padded to 2, after them or before.
  const auto mine = torch::arange(rank + 1);
  EXPECT_TRUE(torch::equal(accelerator.gather(accelerator.pad_across_processes(mine, 0, -1)),
                           torch::tensor({0, -1, 0, 1})));
  EXPECT_TRUE(torch::equal(
      accelerator.gather(accelerator.pad_across_processes(mine, 0, -1, /*pad_first=*/true)),
      torch::tensor({-1, 0, 0, 1})));
  EXPECT_EQ(accelerator.pad_across_processes(torch::ones({3, rank + 1}), 1).sizes(),
            at::IntArrayRef({3, 2}));
  EXPECT_TRUE(torch::equal(accelerator.gather(accelerator.pad_across_processes(mine, -1, 7)),
                           torch::tensor({0, 7, 0, 1})));
  EXPECT_TRUE(accelerator.pad_across_processes(mine, 1).is_same(mine));  // beyond its dims
  EXPECT_NE(error_of([&] {
              accelerator.pad_across_processes(torch::zeros(std::vector<int64_t>(rank + 1, 1)));
            }).find("different numbers of dimensions"),
            std::string::npos);

  const std::vector<std::string> objects =
      rank == 0 ? std::vector<std::string>{"zero", ""} : std::vector<std::string>{"one"};
  EXPECT_EQ(accelerator.gather_object(objects), (std::vector<std::string>{"zero", "", "one"}));
  EXPECT_TRUE(accelerator.gather_object({}).empty());
  EXPECT_EQ(accelerator.gather_object({""}), (std::vector<std::string>{"", ""}));

  const std::vector<int> five{0, 1, 2, 3, 4};
  const std::vector<int> share = rank == 0 ? std::vector<int>{0, 1, 2} : std::vector<int>{3, 4};
  const std::vector<int> padded = rank == 0 ? std::vector<int>{0, 1, 2} : std::vector<int>{3, 4, 4};
  EXPECT_EQ(accelerator.split_between_processes(five), share);
  EXPECT_EQ(accelerator.split_between_processes(five, true), padded);
  // Fewer than the processes: the last gets nothing, or a copy of the last with padding.
  EXPECT_EQ(accelerator.split_between_processes(std::vector<int>{9}),
            rank == 0 ? std::vector<int>{9} : std::vector<int>{});
  EXPECT_EQ(accelerator.split_between_processes(std::vector<int>{9}, true), std::vector<int>{9});
  EXPECT_TRUE(
      torch::equal(accelerator.split_between_processes(torch::arange(5).reshape({5, 1}), true),
                   rank == 0 ? torch::tensor({{0}, {1}, {2}}) : torch::tensor({{3}, {4}, {4}})));

  if (rank == 1) accelerator.set_trigger();
  EXPECT_TRUE(accelerator.check_trigger());
  EXPECT_FALSE(accelerator.check_trigger());

  // Rank 0's folder, for both.
  const auto dir = shared_temp_dir(accelerator, "mixprec_dp_first_");
  {
    auto first = accelerator.main_process_first();
    if (rank == 0) {  // late: the others must still wait for it
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      std::filesystem::create_directories(dir / "made_by_main");
    }
    EXPECT_TRUE(std::filesystem::exists(dir / "made_by_main"));
  }
  // Automatic checkpoint naming: the main process writes and rotates, every rank counts.
  Accelerator saving({.project_dir = dir.string(),
                      .project_config = {.automatic_checkpoint_naming = true, .total_limit = 1}});
  auto net = make_net();
  auto model = saving.prepare(net);
  saving.save_state();
  saving.save_state();
  EXPECT_EQ(saving.save_iteration(), 2);
  EXPECT_EQ(mixprec::io::checkpoints(dir / "checkpoints", "checkpoint_").size(), 1u);
  saving.load_state();
  saving.wait_for_everyone();
  if (rank == 0) std::filesystem::remove_all(dir);
}

// Only the main process writes; when that fails, every process gets the error (before, the
// others waited at a barrier for the process group's 30-minute timeout).
TEST_F(DataParallel, AFailedWriteOnTheMainProcessIsAnErrorOnEveryProcess) {
  const int64_t rank = accelerator.process_index();
  const auto dir = shared_temp_dir(accelerator, "mixprec_dp_fail_");
  if (rank == 0) {
    // A folder where save_model's file goes, and a file where save_state's folder's parent goes.
    std::filesystem::create_directories(dir / "model.safetensors" / "in_the_way");
    std::ofstream(dir / "a_file") << "x";
  }
  accelerator.wait_for_everyone();
  auto net = make_net();
  auto expect_failure_everywhere = [&](const std::function<void()>& save) {
    std::string error = "<no error>";
    try {
      save();
    } catch (const std::exception& e) {  // on the main process, std::filesystem's own
      error = e.what();
    } catch (...) {  // on the main process, what the object below throws
      error = "not a std::exception";
    }
    EXPECT_NE(error, "<no error>");
    if (rank != 0) {
      EXPECT_NE(error.find("the main process failed: "), std::string::npos) << error;
    }
    // The processes are still in step.
    EXPECT_EQ(accelerator.gather(torch::ones({1})).size(0), 2);
  };
  expect_failure_everywhere([&] { accelerator.save_model(*net, dir.string()); });
  expect_failure_everywhere([&] { accelerator.save_state((dir / "a_file" / "ckpt").string()); });
  struct ThrowsOnSave : mixprec::accelerate::Checkpointable {
    std::string state_dict() const override { throw 42; }
    void load_state_dict(const std::string&) override {}
  } throws;
  Accelerator with_object;
  with_object.register_for_checkpointing(throws);
  expect_failure_everywhere([&] { with_object.save_state((dir / "ckpt").string()); });
  accelerator.wait_for_everyone();
  if (rank == 0) std::filesystem::remove_all(dir);
}

// A state saved by fewer processes has no random-state file for the others: they warn and go
// on, as Accelerate's (an error on them alone would leave the main process waiting).
TEST_F(DataParallel, AStateFromFewerProcessesLoadsWithAWarning) {
  const int64_t rank = accelerator.process_index();
  const auto dir = shared_temp_dir(accelerator, "mixprec_dp_fewer_");
  accelerator.save_state((dir / "two").string());
  if (rank == 0) {  // the same state without rank 1's file, as one process would have saved it
    mixprec::io::CheckpointWriter writer(dir / "one");
    for (const auto& entry : std::filesystem::directory_iterator(dir / "two")) {
      const auto name = entry.path().filename().string();
      if (name != "checksums.json" && name != "random_states_1.safetensors")
        writer.write_text(name, mixprec::io::read_file(entry.path()));
    }
    writer.commit();
  }
  accelerator.wait_for_everyone();
  std::vector<std::string> messages;
  {
    mixprec::testing::CapturedWarnings capture;
    accelerator.load_state((dir / "one").string());
    messages = capture.messages;
  }
  if (rank == 0) {
    EXPECT_TRUE(messages.empty());
  } else {
    ASSERT_EQ(messages.size(), 1u);
    EXPECT_NE(messages[0].find("random_states_1.safetensors (saved with fewer processes)"),
              std::string::npos)
        << messages[0];
  }
  EXPECT_EQ(accelerator.gather(torch::ones({1})).size(0), 2);  // still in step
  accelerator.wait_for_everyone();
  if (rank == 0) std::filesystem::remove_all(dir);
}

// SIGTERM reaching one process: both stop at that step and save one checkpoint together.
TEST_F(DataParallel, TrainerStopsEveryProcessOnASignalToOne) {
  struct SignalAtStep : mixprec::train::TrainerCallback {
    int64_t rank = 0;
    void on_step_end(const mixprec::TrainingArguments&, mixprec::train::TrainerState& state,
                     mixprec::train::TrainerControl&) override {
      if (rank == 0 && state.global_step == 3) std::raise(SIGTERM);
    }
  };
  auto callback = std::make_shared<SignalAtStep>();
  callback->rank = accelerator.process_index();
  torch::manual_seed(0);
  auto data = pixels_dataset(64);
  auto model = small_classifier();
  mixprec::TrainingArguments args;
  args.output_dir = shared_temp_dir(accelerator, "mixprec_dp_signal_").string();
  args.max_steps = 8;
  args.save_strategy = "no";
  args.per_device_train_batch_size = 4;
  args.disable_tqdm = true;
  mixprec::Trainer trainer(model, args, data, nullptr, {}, {callback});
  const auto output = trainer.train();
  EXPECT_EQ(output.stopped_by_signal, SIGTERM);
  EXPECT_EQ(trainer.state().global_step, 3);
  EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(args.output_dir) / "checkpoint-3"));
  accelerator.wait_for_everyone();
  if (accelerator.is_main_process()) std::filesystem::remove_all(args.output_dir);
}

// As HF's Trainer with average_tokens_across_devices: GPT-2's loss in data parallel is the sum
// over the label tokens of both processes divided by their number, so an update weighs every
// token of the global batch the same, as one process on that batch would. Without it, each
// process divides by its own tokens: the mean of the processes' means.
TEST_F(DataParallel, TrainerWeighsEveryTokenOfTheGlobalBatch) {
  auto make_model = [] {
    torch::manual_seed(0);
    return mixprec::models::GPT2LMHeadModel(models_test::tiny_gpt2_config());
  };
  auto model = make_model();
  const auto ids = torch::randint(0, 256, {8, 8});
  const auto lengths = torch::tensor({2, 8, 3, 7, 2, 8, 4, 6}).unsqueeze(1);
  const auto data =
      std::make_shared<mixprec::data::TensorDataset>(std::map<std::string, at::Tensor>{
          {"input_ids", ids}, {"labels", ids.masked_fill(torch::arange(8) >= lengths, -100)}});
  // One process's first batch of 4 holds both processes' first batches of 2.
  mixprec::data::DataLoader one_process(data, {.batch_size = 4, .shuffle = true, .seed = 42});
  const auto global = *one_process.begin();
  const auto loss = model->forward(global.at("input_ids"), global.at("labels")).loss;
  loss.backward();
  double norm_sq = 0;
  for (auto& p : model->parameters()) norm_sq += p.grad().pow(2).sum().item<double>();
  double mean_of_means = 0;
  for (int64_t half : {0, 1}) {
    const auto rows = torch::arange(2 * half, 2 * half + 2);
    mean_of_means += model
                         ->forward(global.at("input_ids").index_select(0, rows),
                                   global.at("labels").index_select(0, rows))
                         .loss.item<double>() /
                     2;
  }
  ASSERT_GT(std::abs(mean_of_means - loss.item<double>()), 1e-3);
  auto make_args = [&](bool across) {
    mixprec::TrainingArguments args;
    args.output_dir = shared_temp_dir(accelerator, "mixprec_dp_tokens_").string();
    args.per_device_train_batch_size = 2;
    args.max_steps = 1;
    args.logging_steps = 1;
    args.save_strategy = "no";
    args.disable_tqdm = true;
    args.average_tokens_across_devices = across;
    args.per_device_eval_batch_size = 4;
    args.include_num_input_tokens_seen = "all";
    return args;
  };

  for (const bool across : {true, false}) {
    SCOPED_TRACE(across ? "average_tokens_across_devices" : "each process's tokens");
    const auto args = make_args(across);
    auto trained = make_model();
    mixprec::Trainer trainer(trained, args, data);
    trainer.train();
    // Both processes' tokens (4 sequences of 8), and 6 x those x the non-embedding parameters.
    EXPECT_EQ(trainer.state().num_input_tokens_seen, 32);
    const auto& transformer = trained->transformer;
    const int64_t non_embedding = flat_params(*trained).numel() - transformer->wte->weight.numel() -
                                  transformer->wpe->weight.numel();
    EXPECT_EQ(trainer.state().total_flos, 6.0 * 32 * static_cast<double>(non_embedding));
    const auto& logged = trainer.state().log_history.at(0);
    const double expected = across ? loss.item<double>() : mean_of_means;
    EXPECT_NEAR(logged.at("loss"), expected, 1e-5 * expected);
    if (across) {
      EXPECT_NEAR(logged.at("grad_norm"), std::sqrt(norm_sq), 1e-4 * std::sqrt(norm_sq));
    }
    // Evaluation as HF's prediction_step: one batch of 4 on each process, the loss over the
    // tokens of all 8 sequences, or the mean of the two halves' means.
    const double eval_loss = trainer.evaluate(data).at("eval_loss");
    at::NoGradGuard no_grad;
    auto loss_of = [&](int64_t from, int64_t to) {
      return trained
          ->forward(data->tensors().at("input_ids").slice(0, from, to),
                    data->tensors().at("labels").slice(0, from, to))
          .loss.item<double>();
    };
    const double expected_eval = across ? loss_of(0, 8) : (loss_of(0, 4) + loss_of(4, 8)) / 2;
    EXPECT_NEAR(eval_loss, expected_eval, 1e-5 * expected_eval);
    accelerator.wait_for_everyone();
    if (accelerator.is_main_process()) std::filesystem::remove_all(args.output_dir);
  }

  // Label smoothing (HF's LabelSmoother with num_items_in_batch): also over the tokens of the
  // global batch.
  model->zero_grad();
  const auto smoothed = mixprec::train::label_smoothed_loss(
      model->forward(global.at("input_ids"), at::Tensor()).logits, global.at("labels"), 0.1,
      /*shift_labels=*/true);
  smoothed.backward();
  double smoothed_norm_sq = 0;
  for (auto& p : model->parameters()) smoothed_norm_sq += p.grad().pow(2).sum().item<double>();
  auto args = make_args(true);
  args.label_smoothing_factor = 0.1;
  auto trained = make_model();
  mixprec::Trainer trainer(trained, args, data);
  trainer.train();
  const auto& logged = trainer.state().log_history.at(0);
  EXPECT_NEAR(logged.at("loss"), smoothed.item<double>(), 1e-5 * smoothed.item<double>());
  EXPECT_NEAR(logged.at("grad_norm"), std::sqrt(smoothed_norm_sq),
              1e-4 * std::sqrt(smoothed_norm_sq));
  accelerator.wait_for_everyone();
  if (accelerator.is_main_process()) std::filesystem::remove_all(args.output_dir);
}

// save_on_each_node, on two "nodes" of one process each (tests/CMakeLists.txt launches them),
// with a folder per node as nodes without a shared file system: each node's main process
// writes the checkpoint with it, only process 0 without.
using DataParallelTwoNodes = DataParallel;
TEST_F(DataParallelTwoNodes, SaveOnEachNodeWritesOnEveryNodesMainProcess) {
  ASSERT_EQ(accelerator.local_process_index(), 0) << "run as two nodes of one process each";
  const char* node = std::getenv("GROUP_RANK");
  ASSERT_NE(node, nullptr) << "run under torchrun --nnodes 2";
  auto data = pixels_dataset(32);
  for (const bool each_node : {false, true}) {
    auto args = three_steps_args(each_node ? "mixprec_dp_each_node_" : "mixprec_dp_main_only_");
    args.output_dir += std::string("_node") + node;
    args.save_strategy = "steps";
    args.save_steps = 3;
    args.save_on_each_node = each_node;
    mixprec::Trainer trainer(small_classifier(), args, data);
    trainer.train();
    trainer.accelerator().wait_for_everyone();
    const auto checkpoint = std::filesystem::path(args.output_dir) / "checkpoint-3";
    EXPECT_EQ(std::filesystem::exists(checkpoint / "trainer_state.json"),
              each_node || std::string(node) == "0")
        << checkpoint;
    EXPECT_EQ(std::filesystem::exists(checkpoint / "model.safetensors"),
              each_node || std::string(node) == "0");
    std::filesystem::remove_all(args.output_dir);
  }
}

// ddp_timeout: a collective that a process never joins fails after it, not after 30 minutes.
// Run alone (tests/CMakeLists.txt): the timed-out group is not used again.
using DataParallelTimeout = DataParallel;
TEST_F(DataParallelTimeout, TrainerDdpTimeoutEndsAWaitForAProcessThatNeverComes) {
  auto data = pixels_dataset(8);
  mixprec::TrainingArguments args;
  args.output_dir = shared_temp_dir(accelerator, "mixprec_dp_timeout_").string();
  args.save_strategy = "no";
  args.ddp_timeout = 2;
  mixprec::Trainer trainer(small_classifier(), args, data);
  const auto done = std::filesystem::path(args.output_dir + ".done");
  if (accelerator.is_main_process()) {
    const auto start = std::chrono::steady_clock::now();
    std::string error = "<no error>";
    try {
      trainer.accelerator().wait_for_everyone();
    } catch (const std::exception& e) {  // gloo's, not a c10::Error
      error = e.what();
    }
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::ofstream(done) << "done";
    EXPECT_NE(error.find("Timed out waiting 2000ms"), std::string::npos) << error;
    EXPECT_LT(waited, 60.0);
  } else {  // stays (so that the wait times out, not its connection) but never joins
    for (int i = 0; i < 1200 && !std::filesystem::exists(done); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::filesystem::remove(done);
  }
}

}  // namespace
