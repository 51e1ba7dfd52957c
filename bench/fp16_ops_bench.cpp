// GFLOP/s of each op that mixprec's fp16 CPU fast path covers: fp32, bf16,
// LibTorch's fp16 kernels and the fast path, forward only, median of --reps
// timed calls after one warm-up. Prints a Markdown table.
//
//   build/bench/fp16_ops_bench [--reps 7] [--threads 2]
#include <mixprec/amp/fp16_cpu.h>

#include <torch/torch.h>
#include <CLI/CLI.hpp>
#include "timed_steps.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>

namespace {

using mixprec::amp::Fp16CpuPath;

struct Op {
  const char* name;
  double flops;
  // Converts the inputs to a dtype (untimed) and returns the timed call.
  std::function<std::function<void()>(at::ScalarType)> prepare;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"GFLOP/s of the fp16 CPU fast path's ops"};
  int reps = 7, threads = 2;
  app.add_option("--reps", reps)->check(CLI::PositiveNumber);
  app.add_option("--threads", threads)->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(threads);
  torch::manual_seed(0);
  torch::NoGradGuard no_grad;

  auto a = torch::randn({1024, 1024}), b = torch::randn({1024, 1024});
  auto x = torch::randn({1024, 512}), w = torch::randn({2048, 512}), bias = torch::randn({2048});
  auto p = torch::randn({32, 128, 64}), q = torch::randn({32, 64, 128});
  auto img = torch::randn({16, 64, 32, 32}), kernel = torch::randn({64, 64, 3, 3});
  auto qkv = torch::randn({8, 8, 256, 64});
  const std::vector<Op> ops = {
      {"mm 1024x1024x1024", 2.0 * 1024 * 1024 * 1024,
       [&](at::ScalarType t) -> std::function<void()> {
         return [a = a.to(t), b = b.to(t)] { at::mm(a, b); };
       }},
      {"linear 1024x512 -> 2048", 2.0 * 1024 * 512 * 2048,
       [&](at::ScalarType t) -> std::function<void()> {
         return
             [x = x.to(t), w = w.to(t), b = bias.to(t)] { torch::nn::functional::linear(x, w, b); };
       }},
      {"bmm 32x(128x64)(64x128)", 2.0 * 32 * 128 * 64 * 128,
       [&](at::ScalarType t) -> std::function<void()> {
         return [p = p.to(t), q = q.to(t)] { at::bmm(p, q); };
       }},
      {"conv2d 16x64x32x32, 3x3", 2.0 * 16 * 64 * 64 * 9 * 32 * 32,
       [&](at::ScalarType t) -> std::function<void()> {
         return [x = img.to(t), k = kernel.to(t)] { at::conv2d(x, k, {}, 1, 1); };
       }},
      // Causal: about half of the 4*B*H*T*T*D of full attention.
      {"sdpa causal 8x8x256x64", 2.0 * 8 * 8 * 256 * 256 * 64,
       [&](at::ScalarType t) -> std::function<void()> {
         return [v = qkv.to(t)] { at::scaled_dot_product_attention(v, v, v, {}, 0.0, true); };
       }},
  };
  std::printf(
      "| op (GFLOP/s, %d threads, median of %d) | fp32 | bf16 | fp16 LibTorch | fp16 fast path |\n",
      threads, reps);
  std::printf("|---|---|---|---|---|\n");
  for (const auto& op : ops) {
    auto gflops = [&](at::ScalarType t, Fp16CpuPath path) {
      mixprec::amp::set_fp16_cpu_path(path);
      return op.flops / median_seconds(op.prepare(t), reps) / 1e9;
    };
    const double f32 = gflops(at::kFloat, Fp16CpuPath::kNever);
    const double bf16 = gflops(at::kBFloat16, Fp16CpuPath::kNever);
    const double f16 = gflops(at::kHalf, Fp16CpuPath::kNever);
    const double fast = gflops(at::kHalf, Fp16CpuPath::kAlways);
    std::printf("| %s | %.0f | %.0f | %.1f | %.0f |\n", op.name, f32, bf16, f16, fast);
  }
  std::printf("\nThis CPU has native FP16 arithmetic: %s (fast path on by default: %s)\n",
              mixprec::amp::cpu_has_native_fp16() ? "yes" : "no",
              mixprec::amp::cpu_has_native_fp16() ? "no" : "yes");
  return 0;
}
