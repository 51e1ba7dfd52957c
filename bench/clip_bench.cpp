// Microseconds of clip_grad_norm_ on the gradients of the benchmark models (the digits MLP,
// GPT-2 small and large as bench/gpt2_bench builds them): mixprec::optim::clip_grad_norm_
// against LibTorch's torch::nn::utils::clip_grad_norm_ and the same math in foreach ops (what
// mixprec's Accelerator ran before), median of --reps timed calls after one warm-up, each
// of which clips (in brackets: mixprec where nothing needs clipping), the four taking turns.
// Prints a Markdown table.
//
//   build/bench/clip_bench [--reps 201] [--threads 2]
#include <mixprec/optim/clip_grad.h>

#include <torch/nn/utils/clip_grad.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>
#include "digits.h"
#include "gpt2_config.h"
#include "timed_steps.h"

#include <cstdio>
#include <functional>
#include <vector>

namespace {

double foreach_clip(const std::vector<torch::Tensor>& parameters, double max_norm) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : parameters) grads.push_back(p.grad());
  const auto norm = at::linalg_vector_norm(at::stack(at::_foreach_norm(grads, 2.0)), 2.0);
  at::_foreach_mul_(grads, at::clamp_max(max_norm / (norm + 1e-6), 1.0));
  return norm.item<double>();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"clip_grad_norm_: mixprec's one-pass kernels against LibTorch's"};
  int reps = 201, threads = 2;
  app.add_option("--reps", reps)->check(CLI::PositiveNumber);
  app.add_option("--threads", threads)->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(threads);
  torch::manual_seed(0);
  const std::vector<std::pair<const char*, std::vector<torch::Tensor>>> models{
      {"digits MLP (hidden 256)", digits::MLP(256)->parameters()},
      {"GPT-2 small (2 x 128)",
       mixprec::models::GPT2LMHeadModel(bench_gpt2_config(false))->parameters()},
      {"GPT-2 large (6 x 512)",
       mixprec::models::GPT2LMHeadModel(bench_gpt2_config(true))->parameters()}};

  std::printf(
      "| fp32 gradients (us, %d threads, median of %d) | tensors | elements | mixprec (not "
      "clipping) | LibTorch | foreach ops |\n|---|---|---|---|---|---|\n",
      threads, reps);
  for (const auto& [name, params] : models) {
    int64_t elements = 0;
    for (const auto& p : params) elements += p.numel();
    // Every clipping call's max_norm is 0.999 of the norm the last one left, so each one
    // clips. The methods take turns, so that the machine's drift reaches all of them alike.
    for (const auto& p : params) p.mutable_grad() = torch::randn_like(p);
    double norm = mixprec::optim::clip_grad_norm_(params, 1e30);
    using Clip = std::function<void(const std::vector<torch::Tensor>&, double)>;
    const std::vector<std::pair<Clip, bool>> methods{
        // (method, clips)
        {[](const auto& p, double m) { mixprec::optim::clip_grad_norm_(p, m); }, true},
        {[](const auto& p, double m) { mixprec::optim::clip_grad_norm_(p, m); }, false},
        {[](const auto& p, double m) { torch::nn::utils::clip_grad_norm_(p, m); }, true},
        {[](const auto& p, double m) { foreach_clip(p, m); }, true}};
    std::vector<std::vector<double>> times(methods.size());
    for (int rep = -1; rep < reps; ++rep)  // rep -1: warm-up
      for (size_t m = 0; m < methods.size(); ++m) {
        const double max_norm = methods[m].second ? norm * 0.999 : 1e30;
        const double us = 1e6 * seconds([&] { methods[m].first(params, max_norm); });
        if (rep >= 0) times[m].push_back(us);
        if (methods[m].second) norm = max_norm;
      }
    std::vector<double> us;
    for (const auto& t : times) us.push_back(median(t));
    std::printf("| %s | %zu | %lld | %.1f (%.1f) | %.1f | %.1f |\n", name, params.size(),
                static_cast<long long>(elements), us[0], us[1], us[2], us[3]);
  }
  return 0;
}
