// Data parallel across processes: run by ctest as
//   torchrun --nproc-per-node 2 --no-python mixprec_dist_tests
// Every rank runs every test, in the same order, so collectives pair up.
#include "mixprec/accelerate/accelerator.h"
#include "mixprec/optim/lr_scheduler.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>

namespace {

using mixprec::Accelerator;

torch::nn::Sequential make_net() {
  return torch::nn::Sequential(torch::nn::Linear(6, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 3));
}

at::Tensor flat_params(torch::nn::Module& module) {
  std::vector<at::Tensor> flat;
  for (const auto& p : module.parameters()) flat.push_back(p.detach().reshape(-1));
  return torch::cat(flat);
}

// Every rank holds the same tensor.
void expect_same_on_every_rank(Accelerator& accelerator, const at::Tensor& t) {
  auto all = accelerator.gather(t.unsqueeze(0));
  for (int64_t r = 1; r < all.size(0); ++r) EXPECT_TRUE(torch::equal(all[r], all[0])) << r;
}

class DataParallel : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::set_num_threads(1);
    ASSERT_GT(accelerator.num_processes(), 1) << "run under torchrun --nproc-per-node 2";
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

TEST_F(DataParallel, GradientsAllReduceOnlyOnSyncSteps) {
  Accelerator accumulating({.gradient_accumulation_steps = 2});
  const int64_t rank = accumulating.process_index();
  auto net = make_net();
  torch::optim::SGD sgd(net->parameters(), 0.1);
  auto [model, optimizer] = accumulating.prepare(net, sgd);
  torch::manual_seed(1 + rank);  // different data on each rank
  auto first_grad = [&] { return net->parameters()[0].grad().clone(); };
  {
    auto guard = accumulating.accumulate();
    accumulating.backward(model(torch::randn({4, 6})).sum());
  }
  auto local = accumulating.gather(first_grad().unsqueeze(0));
  EXPECT_FALSE(torch::equal(local[0], local[1]));  // no all-reduce: each rank's own
  {
    auto guard = accumulating.accumulate();
    accumulating.backward(model(torch::randn({4, 6})).sum());
  }
  expect_same_on_every_rank(accumulating, first_grad());  // averaged over the ranks
  optimizer.step();
  optimizer.zero_grad();
  expect_same_on_every_rank(accumulating, flat_params(*net));
}

// 9 samples on 2 processes: the sampler pads to 10, and gather_for_metrics
// gives back each sample exactly once.
TEST_F(DataParallel, PreparedLoaderShardsAndGatherForMetricsDropsThePadding) {
  auto data = std::make_shared<mixprec::data::TensorDataset>(
      std::map<std::string, at::Tensor>{{"x", torch::arange(9)}});
  auto loader = accelerator.prepare_data_loader(data, {.batch_size = 2});
  std::vector<at::Tensor> seen, local;
  for (const auto& batch : loader) {
    local.push_back(batch.at("x"));
    seen.push_back(accelerator.gather_for_metrics(batch.at("x")));
  }
  EXPECT_EQ(torch::cat(local).size(0), 5);  // this rank's half of the padded 10
  EXPECT_TRUE(torch::equal(std::get<0>(torch::sort(torch::cat(seen))), torch::arange(9)));
}

}  // namespace
