// Data-parallel training of the small GPT-2 of bench/gpt2_bench.cpp (2 x 128,
// 4 heads, T 128, B 8 per process, V 4096; fp32, fused AdamW) with the
// gradients all-reduced in fp32, fp16 or bf16, for bench/run.py --workload dp.
// Rank 0 prints one JSON line: global tokens/s, bytes this process handed to
// all-reduce per step, and the loss of every step (mean over the processes).
//
//   build/bench/dp_bench --threads 1                       # one process, no all-reduce
//   torchrun --standalone --nproc-per-node 2 --no-python build/bench/dp_bench --compression bf16
#include <mixprec/dist/process_group.h>
#include <mixprec/models/gpt2.h>
#include <mixprec/optim/adamw.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include "timed_steps.h"

#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  CLI::App app{"tokens/s and all-reduce bytes of data-parallel GPT-2 training"};
  std::string compression = "none";
  int steps = 20, warmup = 2, threads = 1;
  app.add_option("--compression", compression, "dtype of the gradient all-reduce")
      ->check(CLI::IsMember({"none", "fp16", "bf16"}));
  app.add_option("--steps", steps)->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup)->check(CLI::NonNegativeNumber);
  app.add_option("--threads", threads, "OpenMP threads per process")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(threads);

  using mixprec::dist::GradientCompression;
  const std::map<std::string, GradientCompression> compressions{
      {"none", GradientCompression::kNone},
      {"fp16", GradientCompression::kFp16},
      {"bf16", GradientCompression::kBf16}};
  auto group = mixprec::dist::ProcessGroup::from_environment();  // null in one process
  const int64_t rank = group ? group->rank() : 0, world = group ? group->world_size() : 1;

  const int64_t batch = 8, seq = 128;
  mixprec::models::GPT2Config config{.vocab_size = 4096,
                                     .n_positions = seq,
                                     .n_embd = 128,
                                     .n_layer = 2,
                                     .n_head = 4,
                                     .resid_pdrop = 0.0,
                                     .embd_pdrop = 0.0,
                                     .attn_pdrop = 0.0};
  torch::manual_seed(0);  // the same initial weights on every rank
  mixprec::models::GPT2LMHeadModel model(config);
  // Each rank its own 4 batches, which the model learns by heart: a falling loss.
  auto generator = at::make_generator<at::CPUGeneratorImpl>(1000 + rank);
  const auto data = at::randint(config.vocab_size, {4, batch, seq}, generator);  // (4, B, T)
  mixprec::optim::AdamW optimizer(model->parameters(),
                                  mixprec::optim::AdamWOptions(1e-3).fused(true));
  std::unique_ptr<mixprec::dist::GradientReducer> reducer;
  if (group)
    reducer = std::make_unique<mixprec::dist::GradientReducer>(
        model->parameters(), group,
        mixprec::dist::GradientReducerOptions{.compression = compressions.at(compression)});

  std::vector<torch::Tensor> losses;
  auto step = [&](int64_t i) {
    const auto ids = data[i % data.size(0)];
    if (reducer) reducer->before_forward();  // as DDP's forward (its buckets rebuilt once)
    auto loss = model->forward(ids, /*labels=*/ids).loss;
    if (reducer) reducer->after_forward(/*sync_gradients=*/true, {loss});
    loss.backward();
    optimizer.step();
    optimizer.zero_grad();
    losses.push_back(loss.detach());
    return loss;
  };
  for (int i = 0; i < warmup; ++i) step(i);
  const int64_t bytes_before = reducer ? reducer->bytes_all_reduced() : 0;
  const double seconds = time_steps(step, warmup, steps).seconds;
  const int64_t bytes = (reducer ? reducer->bytes_all_reduced() : 0) - bytes_before;

  // The curve after the timing: one all-reduce of every step's loss (warm-up included).
  auto mean_losses = torch::stack(losses);
  if (group) {
    group->all_reduce_(mean_losses);
    mean_losses /= static_cast<double>(world);
  }
  if (rank != 0) return 0;
  std::string curve;
  for (int64_t i = 0; i < mean_losses.size(0); ++i)
    curve += (i ? ", " : "") + std::to_string(mean_losses[i].item<double>());
  std::printf(
      "{\"processes\": %lld, \"threads\": %d, \"compression\": \"%s\", \"steps\": %d, "
      "\"tokens_per_s\": %.1f, \"bytes_per_step\": %lld, \"final_loss\": %.6f, "
      "\"losses\": [%s]}\n",
      static_cast<long long>(world), threads, compression.c_str(), steps,
      static_cast<double>(world * steps * batch * seq) / seconds,
      static_cast<long long>(bytes / steps), mean_losses[-1].item<double>(), curve.c_str());
  return 0;
}
