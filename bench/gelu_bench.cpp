// Milliseconds of GPT-2's GELU (tanh approximation) on a 2048 x 2048 activation, forward and
// backward: mixprec::models::gelu_tanh against LibTorch's at::gelu(x, "tanh"), per dtype,
// median of --reps timed calls after one warm-up. Prints a Markdown table.
//
//   build/bench/gelu_bench [--reps 15] [--threads 2]
#include <mixprec/models/gelu.h>

#include <torch/torch.h>
#include <CLI/CLI.hpp>
#include "timed_steps.h"

#include <cstdio>

int main(int argc, char** argv) {
  CLI::App app{"GELU (tanh) forward and backward: mixprec's CPU kernel against LibTorch's"};
  int reps = 15, threads = 2;
  app.add_option("--reps", reps)->check(CLI::PositiveNumber);
  app.add_option("--threads", threads)->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(threads);
  torch::manual_seed(0);
  const auto x32 = 3 * torch::randn({2048, 2048}), dy32 = torch::randn({2048, 2048});

  std::printf(
      "| dtype (ms, %d threads, median of %d; mixprec kernel: %s) | forward: mixprec | "
      "LibTorch | backward: mixprec | LibTorch |\n|---|---|---|---|---|\n",
      threads, reps, mixprec::models::gelu_tanh_cpu_kernel());
  for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
    const auto x = x32.to(dtype), dy = dy32.to(dtype);
    auto forward_ms = [&](auto gelu) {
      torch::NoGradGuard no_grad;
      return 1e3 * median_seconds([&] { gelu(x); }, reps);
    };
    auto backward_ms = [&](auto gelu) {  // the graph of one forward, run backward again and again
      const auto input = x.detach().requires_grad_();
      const auto y = gelu(input);
      return 1e3 *
             median_seconds(
                 [&] { torch::autograd::grad({y}, {input}, {dy}, /*retain_graph=*/true); }, reps);
    };
    const auto ours = [](const at::Tensor& t) { return mixprec::models::gelu_tanh(t); };
    const auto libtorch = [](const at::Tensor& t) { return at::gelu(t, "tanh"); };
    std::printf("| %s | %.2f | %.2f | %.2f | %.2f |\n", c10::toString(dtype), forward_ms(ours),
                forward_ms(libtorch), backward_ms(ours), backward_ms(libtorch));
  }
  return 0;
}
